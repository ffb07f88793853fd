//! Capsule bundles: a capsule folder packed into one deterministic archive, addressed by
//! name and SHA-256 digest, kept in the cluster's object store (issue #7: `mur capsule
//! push DIR`, `mur capsule ls`; a worker loads a bundle by digest, cached on disk).
//!
//! - [`pack`] reads a folder (manifest, prompts, hook programs, scripts), validates its
//!   `murmur.yaml` and the files it names (the scripted driver's replies, the system
//!   prompt file: packed from the folder, and usable), and writes a tar archive whose
//!   bytes depend only on the files' paths, contents and executable bits: entries sorted
//!   by path, mtime 0, uid/gid 0, mode 0755 or 0644. Same folder, same digest.
//! - [`push`] stores the archive as object `<name>/<digest>` in `mur_capsules` and points
//!   key `<name>` of `mur_capsule_index` at it. Objects are never overwritten, so every
//!   pushed digest stays fetchable, and a task that names a digest keeps it whatever is
//!   pushed later; the key's revision history lists earlier pushes ([`history`]).
//! - [`list`] / [`latest`] read the index; [`fetch`] unpacks a bundle into
//!   `<cache>/<name>/<digest>/` once, atomically (unpack into a temporary folder beside
//!   it, then rename), after checking the digest.

use async_nats::jetstream::{kv, object_store};
use mur_nats::bundle as capsule_index;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::Manifest;
use mur_proto::cluster::{CapsuleIndexEntry, bundle_object, is_valid_digest};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use tokio::io::AsyncReadExt;

/// The manifest's file name, at the folder's top.
pub const MANIFEST_FILE: &str = "murmur.yaml";
/// The largest file a bundle may hold, in bytes (8 MiB).
pub const MAX_FILE_BYTES: u64 = 8 << 20;
/// The most file bytes a bundle may hold, all files together (32 MiB).
pub const MAX_BUNDLE_BYTES: u64 = 32 << 20;
/// The largest archive [`fetch`] accepts: the file bytes plus tar headers and padding.
pub const MAX_ARCHIVE_BYTES: u64 = 2 * MAX_BUNDLE_BYTES;
/// Folders left out of a bundle at the top of the capsule folder: sessions' working
/// folders (`workdir/`) and session files kept beside a capsule (`.murmur/`).
pub const SKIPPED_TOP_DIRS: [&str; 2] = ["workdir", ".murmur"];
/// Folders left out of a bundle at any depth.
pub const SKIPPED_DIRS: [&str; 1] = [".git"];
/// What `${VAR}` in the manifest resolves to while packing: the environment belongs to the
/// worker that runs the capsule, not to the machine that pushes it.
const UNRESOLVED: &str = "${unresolved}";

/// A packed capsule folder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bundle {
    /// The manifest's `name`.
    pub name: String,
    /// The manifest's `version`.
    pub version: String,
    /// SHA-256 of `archive`, 64 lowercase hex digits.
    pub digest: String,
    /// Whether the manifest says `lifecycle.task_acceptance: queue` (recorded in the index
    /// so the coordinator runs one task of the capsule at a time).
    pub queue: bool,
    /// The manifest's `inference.model` (recorded in the index for pricing, issue #11).
    pub model: Option<String>,
    /// The manifest's `description` (recorded in the index for the cluster's agent card).
    pub description: Option<String>,
    /// The tar archive.
    pub archive: Vec<u8>,
    /// The packed paths, relative, `/`-separated, sorted; folders end with `/`.
    pub paths: Vec<String>,
}

/// What [`push`] stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushReceipt {
    /// The capsule's name.
    pub name: String,
    /// The manifest's `version`.
    pub version: String,
    /// The bundle's digest.
    pub digest: String,
    /// The archive's size in bytes.
    pub bytes: u64,
}

/// Why a bundle could not be packed, pushed, listed or fetched.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written. (The cause is part of the message, not a
    /// separate source, so an error chain does not print it twice.)
    #[error("{path}: {reason}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The IO error.
        reason: std::io::Error,
    },
    /// The folder has no `murmur.yaml`.
    #[error("{0}: no murmur.yaml: a capsule folder needs its manifest")]
    NoManifest(PathBuf),
    /// `murmur.yaml` broke a rule; nothing was packed.
    #[error("{path}: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// Every broken rule, with the field path.
        reason: mur_proto::manifest::Error,
    },
    /// A file cannot go into a bundle (a symlink leaving the folder, a symlinked folder, a
    /// socket, a name that is not UTF-8).
    #[error("{path}: {reason}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A file the manifest names (`field`) is not a file of the folder, or cannot be used
    /// as that field says; nothing was packed.
    #[error("{path}: {field}: {reason}")]
    Reference {
        /// The manifest file.
        path: PathBuf,
        /// The manifest field naming the file, e.g. `inference.script`, `tools[0].command`.
        field: String,
        /// The rule it breaks.
        reason: String,
    },
    /// A file is larger than [`MAX_FILE_BYTES`].
    #[error("{path}: file is {size} bytes, over the {limit}-byte limit for one capsule file")]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// [`MAX_FILE_BYTES`].
        limit: u64,
    },
    /// The files together are larger than [`MAX_BUNDLE_BYTES`].
    #[error("{dir}: files hold {size} bytes, over the {limit}-byte limit for a capsule bundle")]
    BundleTooLarge {
        /// The capsule folder.
        dir: PathBuf,
        /// The files' total size.
        size: u64,
        /// [`MAX_BUNDLE_BYTES`].
        limit: u64,
    },
    /// A capsule name or digest is malformed (it would also be a path in the cache).
    #[error("{0}")]
    Invalid(String),
    /// No bundle `<name>/<digest>` is stored, or no capsule of that name was pushed.
    #[error("capsule bundle {0} not found")]
    NotFound(String),
    /// The stored archive does not hash to the digest it is stored under.
    #[error("capsule bundle {object}: content has digest {got}")]
    DigestMismatch {
        /// `<name>/<digest>`.
        object: String,
        /// The digest of what was read.
        got: String,
    },
    /// The stored archive is not a bundle [`pack`] could have made.
    #[error("capsule bundle {object}: {reason}")]
    Malformed {
        /// `<name>/<digest>`.
        object: String,
        /// What is wrong.
        reason: String,
    },
    /// A JetStream request failed.
    #[error("{what}: {source}")]
    Nats {
        /// The request, with the object or key.
        what: String,
        /// The client's error.
        source: async_nats::Error,
    },
}

impl Error {
    /// Whether the error may pass by itself: a JetStream request that failed (a timeout, a
    /// broker restarting) rather than anything stored or packed being wrong. A worker hands
    /// a dispatch back on such an error instead of failing its task.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Nats { .. })
    }
}

/// The index's errors keep their variant and message: it is read and written in
/// [`mur_nats::bundle`], shared with the coordinator.
impl From<capsule_index::Error> for Error {
    fn from(e: capsule_index::Error) -> Self {
        match e {
            capsule_index::Error::Invalid(reason) => Error::Invalid(reason),
            capsule_index::Error::Malformed { object, reason } => Error::Malformed { object, reason },
            capsule_index::Error::Nats { what, source } => Error::Nats { what, source },
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |reason| Error::Io { path: path.to_path_buf(), reason }
}

fn nats(what: impl Into<String>) -> impl FnOnce(async_nats::Error) -> Error {
    let what = what.into();
    move |source| Error::Nats { what, source }
}

/// The index reads ([`list`], [`latest`], [`history`]) live in [`mur_nats::bundle`].
pub use capsule_index::{history, latest, list};

// ---------------------------------------------------------------------------------------
// Packing.

/// One thing to pack: a folder, or a file with its bytes.
enum Item {
    Dir,
    File { data: Vec<u8>, executable: bool },
}

/// Packs the capsule folder `dir` into a deterministic archive.
///
/// The manifest is validated for shape and rules with `${VAR}` left unresolved (a
/// placeholder stands in: the variables belong to the worker's environment). Left out:
/// `workdir/` and `.murmur/` at the top, `.git/` anywhere. A symlink is packed as the file
/// it points to when that file is inside the folder.
///
/// # Errors
/// [`Error::NoManifest`], [`Error::Manifest`] naming the broken fields,
/// [`Error::Reference`] for a file the manifest names that is missing, outside the folder
/// or unusable,
/// [`Error::Unsupported`] for a symlink leaving the folder (or to a folder, or dangling),
/// a special file or a non-UTF-8 name, [`Error::FileTooLarge`], [`Error::BundleTooLarge`],
/// [`Error::Io`].
pub fn pack(dir: &Path) -> Result<Bundle, Error> {
    let root = dir.canonicalize().map_err(io(dir))?;
    let manifest_path = root.join(MANIFEST_FILE);
    let text = match std::fs::read_to_string(&manifest_path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Error::NoManifest(dir.to_path_buf())),
        Err(e) => return Err(Error::Io { path: manifest_path, reason: e }),
    };
    let manifest = Manifest::from_yaml(&text, &|_| Some(UNRESOLVED.to_string()))
        .map_err(|reason| Error::Manifest { path: dir.join(MANIFEST_FILE), reason })?;

    let mut items = Vec::new();
    walk(&root, &root, "", &mut items)?;
    let total: u64 = items
        .iter()
        .map(|(_, item)| match item {
            Item::File { data, .. } => data.len() as u64,
            Item::Dir => 0,
        })
        .sum();
    if total > MAX_BUNDLE_BYTES {
        return Err(Error::BundleTooLarge { dir: dir.to_path_buf(), size: total, limit: MAX_BUNDLE_BYTES });
    }
    items.sort_by(|a, b| a.0.cmp(&b.0));
    check_references(&dir.join(MANIFEST_FILE), &manifest, &items)?;

    let mut builder = tar::Builder::new(Vec::new());
    let mut paths = Vec::with_capacity(items.len());
    for (path, item) in &items {
        let mut header = tar::Header::new_gnu();
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        let written = match item {
            Item::Dir => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                paths.push(format!("{path}/"));
                builder.append_data(&mut header, path, std::io::empty())
            }
            Item::File { data, executable } => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(if *executable { 0o755 } else { 0o644 });
                header.set_size(data.len() as u64);
                paths.push(path.clone());
                builder.append_data(&mut header, path, data.as_slice())
            }
        };
        written.map_err(io(&root.join(path)))?;
    }
    let archive = builder.into_inner().map_err(io(&root))?;
    Ok(Bundle {
        queue: manifest.lifecycle.task_acceptance == mur_proto::manifest::TaskAcceptance::Queue,
        model: manifest.inference.model.clone(),
        description: manifest.description.clone(),
        name: manifest.name,
        version: manifest.version,
        digest: hex::encode(Sha256::digest(&archive)),
        archive,
        paths,
    })
}

/// Refuses a bundle a worker could not run for want of a file its manifest names: the
/// scripted driver's replies file (`inference.script`, which must also parse) and the
/// system prompt file (`inference.system_prompt_file`, UTF-8 text) must be files packed
/// from the folder — no path out of it, no file left behind — and a tool's, a hook's or
/// the process transport's program named by a path in the folder an executable one. These are what `mur run`
/// reads on the same folder before the first turn; a push that skipped them stored a
/// version every task of which failed, in place of one that ran.
fn check_references(manifest_path: &Path, manifest: &Manifest, items: &[(String, Item)]) -> Result<(), Error> {
    use mur_proto::manifest::{DriverKind, SystemPrompt, Transport};
    let inf = &manifest.inference;
    let refused = |field: &str, reason: String| Error::Reference {
        path: manifest_path.to_path_buf(),
        field: field.into(),
        reason,
    };
    let packed = |field, name: &str| -> Result<String, Error> {
        let rel = inside(name)
            .ok_or_else(|| refused(field, format!("must name a file inside the capsule folder, got {name}")))?;
        let data = items
            .iter()
            .find_map(|(path, item)| match item {
                Item::File { data, .. } if *path == rel => Some(data),
                _ => None,
            })
            .ok_or_else(|| refused(field, format!("no file {name} in the capsule folder")))?;
        String::from_utf8(data.clone()).map_err(|_| refused(field, format!("{name} is not UTF-8 text")))
    };
    if inf.transport != Transport::Process
        && inf.driver == Some(DriverKind::Scripted)
        && let Some(script) = &inf.script
    {
        let text = packed("inference.script", script)?;
        crate::driver::scripted::Script::parse(&text)
            .map_err(|e| refused("inference.script", format!("{script}: {e}")))?;
    }
    if let SystemPrompt::File(file) = &inf.system_prompt {
        packed("inference.system_prompt_file", file)?;
    }
    // Programs named by a path in the folder (`./tool.sh`, `bin/gate`) must be packed
    // executable files: a bare name is looked up on the worker's `PATH` and an absolute path
    // is the worker's own, so neither is checked here.
    for (field, program) in path_programs(manifest) {
        let rel = inside(program).ok_or_else(|| {
            refused(&field, format!("must name a program inside the capsule folder (or on PATH), got {program}"))
        })?;
        match items.iter().find(|(path, _)| *path == rel).map(|(_, item)| item) {
            Some(Item::File { executable: true, .. }) => {}
            Some(Item::File { executable: false, .. }) => {
                return Err(refused(&field, format!("{program} is not executable (chmod +x {program})")));
            }
            _ => return Err(refused(&field, format!("no file {program} in the capsule folder"))),
        }
    }
    Ok(())
}

/// The files and programs `manifest` names outside its capsule folder, one
/// `field: name` line each (`inference.script: ../shared/r.yaml`): `mur run` reads them
/// where they are, but a bundle carries only the folder, so [`pack`] refuses them
/// ([`Error::Reference`]). Absolute program paths and bare program names are the worker's
/// own and are not listed.
pub fn named_outside(manifest: &Manifest) -> Vec<String> {
    use mur_proto::manifest::{DriverKind, SystemPrompt, Transport};
    let inf = &manifest.inference;
    let mut out = Vec::new();
    if inf.transport != Transport::Process
        && inf.driver == Some(DriverKind::Scripted)
        && let Some(script) = &inf.script
        && inside(script).is_none()
    {
        out.push(format!("inference.script: {script}"));
    }
    if let SystemPrompt::File(file) = &inf.system_prompt
        && inside(file).is_none()
    {
        out.push(format!("inference.system_prompt_file: {file}"));
    }
    for (field, program) in path_programs(manifest) {
        if inside(program).is_none() {
            out.push(format!("{field}: {program}"));
        }
    }
    out
}

/// The programs `manifest` names by a path inside `dir` that are not executable files
/// there (missing, a folder, no execute bit), one `field: why` line each, worded as
/// [`pack`] refuses them: `mur run` notes them before the session starts, where a hook
/// that cannot start only shows in its log.
pub fn unusable_programs(dir: &Path, manifest: &Manifest) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    for (field, program) in path_programs(manifest) {
        let Some(rel) = inside(program) else { continue };
        match std::fs::metadata(dir.join(&rel)) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
            Ok(m) if m.is_file() => out.push(format!("{field}: {program} is not executable (chmod +x {program})")),
            _ => out.push(format!("{field}: no file {program} in the capsule folder")),
        }
    }
    out
}

/// The programs `manifest` names by a relative path (`./tool.sh`, `bin/gate`, `../x`),
/// with the field naming each: every tool's and hook's `command[0]`, and
/// `inference.command[0]` for the process transport. A bare name (looked up on the
/// worker's `PATH`), an absolute path (the worker's own) and a `builtin:` are left out:
/// only a relative path must be a packed executable of the folder.
fn path_programs(manifest: &Manifest) -> impl Iterator<Item = (String, &String)> {
    use mur_proto::manifest::Transport;
    let inf = &manifest.inference;
    let tools = manifest.tools.iter().enumerate().map(|(i, t)| (format!("tools[{i}].command"), t.command.first()));
    let hooks = manifest.hooks.iter().enumerate().map(|(i, h)| (format!("hooks[{i}].command"), h.command.first()));
    let model = (inf.transport == Transport::Process)
        .then(|| ("inference.command".to_string(), inf.command.as_ref().and_then(|c| c.first())));
    tools.chain(hooks).chain(model).filter_map(|(field, program)| Some((field, program?))).filter(|(_, program)| {
        !program.starts_with("builtin:") && program.contains('/') && !Path::new(program.as_str()).is_absolute()
    })
}

/// `name` (a path in a manifest, relative to the capsule folder) as a bundle path
/// (`a/b.yaml`); `None` when it is absolute or climbs out with `..`.
fn inside(name: &str) -> Option<String> {
    let mut parts = Vec::new();
    for part in Path::new(name).components() {
        match part {
            Component::Normal(p) => parts.push(p.to_str()?),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Collects the items under `dir` (whose path relative to `root` is `rel`, empty at the
/// top) into `out`, as (relative `/`-path, item).
fn walk(root: &Path, dir: &Path, rel: &str, out: &mut Vec<(String, Item)>) -> Result<(), Error> {
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            return Err(Error::Unsupported { path, reason: "file name is not UTF-8".into() });
        };
        let rel_path = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
        let meta = std::fs::symlink_metadata(&path).map_err(io(&path))?;
        let (meta, source) = if meta.file_type().is_symlink() {
            let target = path.canonicalize().map_err(|e| Error::Unsupported {
                path: path.clone(),
                reason: format!("symlink target cannot be read: {e}"),
            })?;
            if !target.starts_with(root) {
                return Err(Error::Unsupported {
                    path: path.clone(),
                    reason: format!("symlink leaves the capsule folder (to {})", target.display()),
                });
            }
            let meta = std::fs::metadata(&target).map_err(io(&target))?;
            if meta.is_dir() {
                return Err(Error::Unsupported {
                    path: path.clone(),
                    reason: "symlinks to folders are not packed; link the files instead".into(),
                });
            }
            (meta, target)
        } else {
            (meta, path.clone())
        };
        if meta.is_dir() {
            let skipped =
                SKIPPED_DIRS.contains(&name.as_str()) || (rel.is_empty() && SKIPPED_TOP_DIRS.contains(&name.as_str()));
            if skipped {
                continue;
            }
            out.push((rel_path.clone(), Item::Dir));
            walk(root, &path, &rel_path, out)?;
        } else if meta.is_file() {
            if meta.len() > MAX_FILE_BYTES {
                return Err(Error::FileTooLarge { path, size: meta.len(), limit: MAX_FILE_BYTES });
            }
            let data = std::fs::read(&source).map_err(io(&source))?;
            if data.len() as u64 > MAX_FILE_BYTES {
                return Err(Error::FileTooLarge { path, size: data.len() as u64, limit: MAX_FILE_BYTES });
            }
            use std::os::unix::fs::PermissionsExt;
            let executable = meta.permissions().mode() & 0o111 != 0;
            out.push((rel_path, Item::File { data, executable }));
        } else {
            return Err(Error::Unsupported { path, reason: "not a regular file or folder".into() });
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The store and the index.

/// Stores `bundle` as object `<name>/<digest>` (unless that object is already there) and
/// makes it the capsule's latest in `index`. Pushing the digest that is already the
/// latest changes nothing.
///
/// # Errors
/// [`Error::Nats`] when the object store or the index refuses; the index is written only
/// after the object is stored, so it never names a missing bundle.
pub async fn push(store: &object_store::ObjectStore, index: &kv::Store, bundle: &Bundle) -> Result<PushReceipt, Error> {
    let object = bundle_object(&bundle.name, &bundle.digest);
    let bytes = bundle.archive.len() as u64;
    let stored = matches!(store.info(&object).await, Ok(info) if !info.deleted && info.size as u64 == bytes);
    if !stored {
        let meta = object_store::ObjectMetadata {
            name: object.clone(),
            description: Some(format!("capsule {} version {}", bundle.name, bundle.version)),
            ..Default::default()
        };
        store.put(meta, &mut bundle.archive.as_slice()).await.map_err(|e| nats(format!("store {object}"))(e.into()))?;
    }
    let receipt = PushReceipt {
        name: bundle.name.clone(),
        version: bundle.version.clone(),
        digest: bundle.digest.clone(),
        bytes,
    };
    let value = CapsuleIndexEntry {
        digest: bundle.digest.clone(),
        version: bundle.version.clone(),
        pushed_at: SystemClock.now_ms(),
        bytes,
        queue: bundle.queue,
        model: bundle.model.clone(),
        description: bundle.description.clone(),
    };
    capsule_index::set_latest(index, &bundle.name, &value).await?;
    Ok(receipt)
}

// ---------------------------------------------------------------------------------------
// Fetching.

/// The folder bundle `<name>/<digest>` unpacks into under `cache_dir`.
pub fn cache_path(cache_dir: &Path, name: &str, digest: &str) -> PathBuf {
    cache_dir.join(name).join(digest)
}

/// Returns the folder holding bundle `<name>/<digest>`, unpacking it from `store` into
/// `<cache_dir>/<name>/<digest>/` unless an earlier fetch already did. The archive's
/// SHA-256 must equal `digest`. The folder appears whole or not at all: the bundle is
/// unpacked into a temporary folder beside it and renamed into place, so a crash or a
/// concurrent fetch never leaves a half-unpacked folder under the final name.
///
/// # Errors
/// [`Error::Invalid`] for a malformed name or digest, [`Error::NotFound`],
/// [`Error::DigestMismatch`], [`Error::Malformed`] (an entry escaping the folder, a link,
/// an oversized archive), [`Error::Nats`], [`Error::Io`].
pub async fn fetch(
    store: &object_store::ObjectStore,
    name: &str,
    digest: &str,
    cache_dir: &Path,
) -> Result<PathBuf, Error> {
    capsule_index::check_name(name)?;
    if !is_valid_digest(digest) {
        return Err(Error::Invalid(format!("bundle digest {digest:?} is not 64 lowercase hex digits")));
    }
    let target = cache_path(cache_dir, name, digest);
    if target.is_dir() {
        return Ok(target);
    }
    let object_name = bundle_object(name, digest);
    let mut object = match store.get(&object_name).await {
        Ok(object) => object,
        Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Err(Error::NotFound(object_name)),
        Err(e) => return Err(nats(format!("get {object_name}"))(e.into())),
    };
    if object.info().size as u64 > MAX_ARCHIVE_BYTES {
        return Err(Error::Malformed {
            object: object_name,
            reason: format!("archive is {} bytes, over the {MAX_ARCHIVE_BYTES}-byte limit", object.info().size),
        });
    }
    let mut archive = Vec::with_capacity(object.info().size);
    object.read_to_end(&mut archive).await.map_err(|e| nats(format!("read {object_name}"))(e.into()))?;
    let got = hex::encode(Sha256::digest(&archive));
    if got != digest {
        return Err(Error::DigestMismatch { object: object_name, got });
    }
    let parent = target.parent().expect("cache path has a parent").to_path_buf();
    tokio::task::spawn_blocking(move || unpack_into_place(&archive, &parent, &target, &object_name))
        .await
        .expect("unpack task does not panic")
}

/// Unpacks `archive` into a temporary folder in `parent`, then renames it to `target`.
fn unpack_into_place(archive: &[u8], parent: &Path, target: &Path, object: &str) -> Result<PathBuf, Error> {
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let tmp = tempfile::Builder::new().prefix(".unpack-").tempdir_in(parent).map_err(io(parent))?;
    unpack(archive, tmp.path(), object)?;
    match std::fs::rename(tmp.path(), target) {
        Ok(()) => {
            // The folder moved; nothing is left for the guard to remove.
            let _ = tmp.keep();
            Ok(target.to_path_buf())
        }
        // Another fetch renamed its copy first: same digest, same files. Ours is dropped.
        Err(_) if target.is_dir() => Ok(target.to_path_buf()),
        Err(e) => Err(Error::Io { path: target.to_path_buf(), reason: e }),
    }
}

/// Writes the folders and files of `archive` under `dest`, refusing anything [`pack`]
/// does not produce: links, devices, absolute paths, `..`.
pub fn unpack(archive: &[u8], dest: &Path, object: &str) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    let malformed = |reason: String| Error::Malformed { object: object.to_string(), reason };
    let mut reader = tar::Archive::new(archive);
    for entry in reader.entries().map_err(|e| malformed(format!("not a tar archive: {e}")))? {
        let mut entry = entry.map_err(|e| malformed(format!("unreadable entry: {e}")))?;
        let rel = entry.path().map_err(|e| malformed(format!("unreadable path: {e}")))?.into_owned();
        if rel.as_os_str().is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(malformed(format!("entry {} leaves the bundle folder", rel.display())));
        }
        let path = dest.join(&rel);
        match entry.header().entry_type() {
            tar::EntryType::Directory => std::fs::create_dir_all(&path).map_err(io(&path))?,
            tar::EntryType::Regular => {
                let mode = entry.header().mode().map_err(|e| malformed(format!("{}: bad mode: {e}", rel.display())))?;
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(io(dir))?;
                }
                let mut data = Vec::new();
                entry.read_to_end(&mut data).map_err(|e| malformed(format!("{}: {e}", rel.display())))?;
                std::fs::write(&path, &data).map_err(io(&path))?;
                let mode = if mode & 0o111 != 0 { 0o755 } else { 0o644 };
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).map_err(io(&path))?;
            }
            other => return Err(malformed(format!("entry {} has unsupported type {other:?}", rel.display()))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A manifest naming no other file: the folders below are about packing.
    const MANIFEST: &str =
        "name: hello\nversion: 1.0.0\ninference:\n  driver: openai\n  model: m\n  endpoint: http://127.0.0.1:9/v1\n";

    fn capsule(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(MANIFEST_FILE), MANIFEST).unwrap();
        for (name, content) in files {
            let p = dir.path().join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, content).unwrap();
            if name.ends_with(".sh") {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
        dir
    }

    #[test]
    fn the_example_manifest_is_valid() {
        Manifest::from_yaml(MANIFEST, &|_| None).unwrap();
    }

    #[test]
    fn packing_is_deterministic_and_follows_content() {
        let a = capsule(&[("hooks/gate.sh", "#!/bin/sh\necho '{}'\n"), ("prompt.md", "be brief")]);
        let b = capsule(&[("prompt.md", "be brief"), ("hooks/gate.sh", "#!/bin/sh\necho '{}'\n")]);
        let first = pack(a.path()).unwrap();
        assert_eq!((first.name.as_str(), first.version.as_str()), ("hello", "1.0.0"));
        assert_eq!(first.paths, ["hooks/", "hooks/gate.sh", "murmur.yaml", "prompt.md"]);
        assert_eq!(first.digest, hex::encode(Sha256::digest(&first.archive)));
        assert_eq!(pack(a.path()).unwrap(), first, "same folder, same bytes");
        assert_eq!(pack(b.path()).unwrap().digest, first.digest, "another folder with the same files");

        std::fs::write(a.path().join("prompt.md"), "be briefer").unwrap();
        let changed = pack(a.path()).unwrap();
        assert_ne!(changed.digest, first.digest, "content is in the digest");
        std::fs::write(a.path().join("prompt.md"), "be brief").unwrap();
        assert_eq!(pack(a.path()).unwrap().digest, first.digest);
        std::fs::set_permissions(a.path().join("prompt.md"), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_ne!(pack(a.path()).unwrap().digest, first.digest, "the executable bit is in the digest");
    }

    #[test]
    fn workdir_session_files_and_git_are_left_out() {
        let dir = capsule(&[
            ("workdir/ses_1/out.txt", "x"),
            (".murmur/ses_1/trace.jsonl", "{}"),
            (".git/HEAD", "ref"),
            ("lib/.git/config", "x"),
            ("lib/workdir/kept.txt", "only the top workdir is skipped"),
        ]);
        assert_eq!(pack(dir.path()).unwrap().paths, ["lib/", "lib/workdir/", "lib/workdir/kept.txt", "murmur.yaml"]);
    }

    #[test]
    fn unpack_restores_files_and_executable_bits() {
        let dir = capsule(&[("hooks/gate.sh", "#!/bin/sh\n"), ("prompt.md", "p"), ("empty/.keep", "")]);
        let bundle = pack(dir.path()).unwrap();
        let out = tempfile::tempdir().unwrap();
        unpack(&bundle.archive, out.path(), "hello/x").unwrap();
        assert_eq!(std::fs::read_to_string(out.path().join("hooks/gate.sh")).unwrap(), "#!/bin/sh\n");
        assert_eq!(std::fs::read_to_string(out.path().join(MANIFEST_FILE)).unwrap(), MANIFEST);
        let mode = |p: &str| std::fs::metadata(out.path().join(p)).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode("hooks/gate.sh"), mode("prompt.md")), (0o755, 0o644));
        assert!(out.path().join("empty/.keep").is_file());
    }

    #[test]
    fn a_malformed_manifest_is_refused_with_the_field_named() {
        let dir = capsule(&[]);
        std::fs::write(
            dir.path().join(MANIFEST_FILE),
            "name: hello\nversion: 1\ninference:\n  driver: scripted\n  script: r.yaml\n  max_turns: 0\n",
        )
        .unwrap();
        let err = pack(dir.path()).unwrap_err().to_string();
        assert!(err.ends_with("murmur.yaml: inference.max_turns: must be at least 1, got 0"), "{err}");
        std::fs::write(dir.path().join(MANIFEST_FILE), "name: hello\nversion: 1\nsurprise: 1\n").unwrap();
        let err = pack(dir.path()).unwrap_err().to_string();
        assert!(err.contains("surprise"), "{err}");
        std::fs::remove_file(dir.path().join(MANIFEST_FILE)).unwrap();
        assert!(matches!(pack(dir.path()), Err(Error::NoManifest(_))));
    }

    #[test]
    fn files_the_manifest_names_must_be_packed_and_usable() {
        let scripted =
            |script: &str| format!("name: quick\nversion: 2.0.0\ninference:\n  driver: scripted\n  script: {script}\n");
        let refused = |manifest: String, files: &[(&str, &str)]| {
            let dir = capsule(files);
            std::fs::write(dir.path().join(MANIFEST_FILE), manifest).unwrap();
            let err = pack(dir.path()).unwrap_err();
            assert!(matches!(err, Error::Reference { .. }), "{err}");
            err.to_string().rsplit_once("murmur.yaml: ").unwrap().1.to_string()
        };
        assert_eq!(
            refused(scripted("missing.yaml"), &[]),
            "inference.script: no file missing.yaml in the capsule folder"
        );
        assert_eq!(
            refused(scripted("../../etc/passwd"), &[]),
            "inference.script: must name a file inside the capsule folder, got ../../etc/passwd"
        );
        assert_eq!(
            refused(scripted("/etc/passwd"), &[]),
            "inference.script: must name a file inside the capsule folder, got /etc/passwd"
        );
        let broken = refused(scripted("r.yaml"), &[("r.yaml", "replies: {nope")]);
        assert!(broken.starts_with("inference.script: r.yaml: "), "{broken}");
        // Left out of every bundle, so not there for a worker either.
        assert_eq!(
            refused(scripted("workdir/r.yaml"), &[("workdir/r.yaml", "replies:\n  - text: hi\n")]),
            "inference.script: no file workdir/r.yaml in the capsule folder"
        );
        let prompt_file = "name: quick\nversion: 2.0.0\ninference:\n  driver: openai\n  model: m\n  endpoint: http://127.0.0.1:9/v1\n  system_prompt_file: prompt.md\n";
        assert_eq!(
            refused(prompt_file.to_string(), &[]),
            "inference.system_prompt_file: no file prompt.md in the capsule folder"
        );

        let dir = capsule(&[("replies/r.yaml", "replies:\n  - text: hi\n"), ("prompt.md", "be brief")]);
        std::fs::write(dir.path().join(MANIFEST_FILE), scripted("./replies/r.yaml")).unwrap();
        assert_eq!(pack(dir.path()).unwrap().name, "quick");
        std::fs::write(dir.path().join(MANIFEST_FILE), prompt_file).unwrap();
        assert_eq!(pack(dir.path()).unwrap().name, "quick");
    }

    #[test]
    fn the_files_named_outside_the_folder_are_listed_for_mur_run() {
        let manifest = |yaml: &str| Manifest::from_yaml(yaml, &|_| None).unwrap();
        let m = manifest(
            "name: quick\nversion: 2.0.0\ninference:\n  driver: scripted\n  script: ../shared/r.yaml\n\
             hooks:\n  - name: gate\n    binding: on-tool-call\n    command: [../hooks/gate.py]\n  \
             - name: log\n    binding: on-shell\n    command: [/usr/bin/logger]\n  \
             - name: own\n    binding: on-task-end\n    command: [./hooks/own.sh]\n",
        );
        assert_eq!(named_outside(&m), ["inference.script: ../shared/r.yaml", "hooks[0].command: ../hooks/gate.py"]);
        let m = manifest(
            "name: quick\nversion: 2.0.0\ninference:\n  driver: openai\n  model: m\n  endpoint: http://127.0.0.1:9/v1\n  \
             system_prompt_file: /etc/prompt.md\n",
        );
        assert_eq!(named_outside(&m), ["inference.system_prompt_file: /etc/prompt.md"]);
        assert!(
            named_outside(&manifest("name: quick\nversion: 2.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n"))
                .is_empty()
        );
    }

    #[test]
    fn programs_that_cannot_run_are_listed_for_mur_run_as_push_words_them() {
        let dir = capsule(&[("hooks/plain.sh", "echo"), ("hooks/ok.sh", "echo")]);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path().join("hooks/ok.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(dir.path().join("hooks/plain.sh"), std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::create_dir(dir.path().join("adir")).unwrap();
        let m = Manifest::from_yaml(
            &format!(
                "{MANIFEST}hooks:\n  - name: a\n    binding: on-shell\n    command: [./hooks/plain.sh]\n  \
                 - name: b\n    binding: on-shell\n    command: [./adir]\n  \
                 - name: c\n    binding: on-shell\n    command: [./hooks/ok.sh]\n  \
                 - name: d\n    binding: on-shell\n    command: [sh, x.sh]\n"
            ),
            &|_| None,
        )
        .unwrap();
        assert_eq!(
            unusable_programs(dir.path(), &m),
            [
                "hooks[0].command: ./hooks/plain.sh is not executable (chmod +x ./hooks/plain.sh)",
                "hooks[1].command: no file ./adir in the capsule folder",
            ]
        );
    }

    #[test]
    fn programs_named_by_a_path_in_the_folder_must_be_packed_executables() {
        let with = |block: &str| format!("{MANIFEST}{block}");
        let refused = |manifest: String, files: &[(&str, &str)]| {
            let dir = capsule(files);
            std::fs::write(dir.path().join(MANIFEST_FILE), manifest).unwrap();
            pack(dir.path()).unwrap_err().to_string().rsplit_once("murmur.yaml: ").unwrap().1.to_string()
        };
        let tool =
            |command: &str| with(&format!("tools:\n  - name: t\n    description: d\n    command: [{command}]\n"));
        let hook = |command: &str| with(&format!("hooks:\n  - name: gate\n    command: [{command}]\n"));
        assert_eq!(refused(tool("./t.sh"), &[]), "tools[0].command: no file ./t.sh in the capsule folder");
        assert_eq!(
            refused(tool("bin/t"), &[("bin/t", "#!/bin/sh\n")]),
            "tools[0].command: bin/t is not executable (chmod +x bin/t)"
        );
        assert_eq!(
            refused(hook("../hooks/gate.py"), &[]),
            "hooks[0].command: must name a program inside the capsule folder (or on PATH), got ../hooks/gate.py"
        );
        // Packed and executable, on PATH, absolute, built in: packed.
        for (manifest, files) in [
            (tool("./t.sh"), &[("t.sh", "#!/bin/sh\n")][..]),
            (hook("hooks/gate.sh"), &[("hooks/gate.sh", "#!/bin/sh\n")][..]),
            (tool("python3"), &[][..]),
            (hook("/usr/bin/env"), &[][..]),
            (hook("builtin:compact"), &[][..]),
        ] {
            let dir = capsule(files);
            std::fs::write(dir.path().join(MANIFEST_FILE), &manifest).unwrap();
            assert!(pack(dir.path()).is_ok(), "{manifest}");
        }
    }

    #[test]
    fn environment_variables_need_not_be_set_at_pack_time() {
        let dir = capsule(&[]);
        let manifest = "name: hosted\nversion: 2\ninference:\n  driver: openai\n  model: m\n  endpoint: https://api.example.com/v1\n  api_key: ${MUR_SURELY_UNSET_KEY}\n";
        std::fs::write(dir.path().join(MANIFEST_FILE), manifest).unwrap();
        let bundle = pack(dir.path()).unwrap();
        assert_eq!(bundle.name, "hosted");
        let out = tempfile::tempdir().unwrap();
        unpack(&bundle.archive, out.path(), "hosted/x").unwrap();
        assert_eq!(std::fs::read_to_string(out.path().join(MANIFEST_FILE)).unwrap(), manifest, "kept unresolved");
    }

    #[test]
    fn symlinks_inside_are_packed_as_files_and_leaving_ones_are_refused() {
        let dir = capsule(&[("shared/run.sh", "#!/bin/sh\n")]);
        std::os::unix::fs::symlink("shared/run.sh", dir.path().join("run.sh")).unwrap();
        let bundle = pack(dir.path()).unwrap();
        assert_eq!(bundle.paths, ["murmur.yaml", "run.sh", "shared/", "shared/run.sh"]);

        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("leak")).unwrap();
        let err = pack(dir.path()).unwrap_err().to_string();
        assert!(err.contains("leak: symlink leaves the capsule folder"), "{err}");
        std::fs::remove_file(dir.path().join("leak")).unwrap();

        std::os::unix::fs::symlink("shared", dir.path().join("alias")).unwrap();
        let err = pack(dir.path()).unwrap_err().to_string();
        assert!(err.contains("alias: symlinks to folders are not packed"), "{err}");
    }

    #[test]
    fn oversized_files_are_refused_with_the_limit() {
        let dir = capsule(&[]);
        let big = dir.path().join("model.bin");
        std::fs::File::create(&big).unwrap().set_len(MAX_FILE_BYTES + 1).unwrap();
        let err = pack(dir.path()).unwrap_err().to_string();
        assert!(
            err.ends_with(&format!(
                "model.bin: file is {} bytes, over the {MAX_FILE_BYTES}-byte limit for one capsule file",
                MAX_FILE_BYTES + 1
            )),
            "{err}"
        );
    }

    #[test]
    fn unpack_refuses_entries_leaving_the_folder() {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        builder.append_link(&mut header, "escape", "/etc/passwd").unwrap();
        let archive = builder.into_inner().unwrap();
        let out = tempfile::tempdir().unwrap();
        let err = unpack(&archive, out.path(), "bad/x").unwrap_err().to_string();
        assert_eq!(err, "capsule bundle bad/x: entry escape has unsupported type Symlink");

        // The tar crate refuses to write `..`, so the name is set byte by byte.
        let mut header = tar::Header::new_gnu();
        header.as_gnu_mut().unwrap().name[..7].copy_from_slice(b"../evil");
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(1);
        header.set_cksum();
        let mut builder = tar::Builder::new(Vec::new());
        builder.append(&header, &b"x"[..]).unwrap();
        let archive = builder.into_inner().unwrap();
        let err = unpack(&archive, out.path(), "bad/x").unwrap_err().to_string();
        assert_eq!(err, "capsule bundle bad/x: entry ../evil leaves the bundle folder");
        assert!(!out.path().parent().unwrap().join("evil").exists());
    }

    /// Only a failed JetStream request is worth a retry: a missing, corrupt or invalid
    /// bundle stays so.
    #[test]
    fn only_a_failed_request_is_a_transient_error() {
        let timeout: async_nats::Error = "timed out".into();
        assert!(Error::Nats { what: "get m/x".into(), source: timeout }.is_transient());
        assert!(!Error::NotFound("m/x".into()).is_transient());
        assert!(!Error::DigestMismatch { object: "m/x".into(), got: "00".into() }.is_transient());
        assert!(!Error::Malformed { object: "m/x".into(), reason: "not a tar".into() }.is_transient());
    }
}
