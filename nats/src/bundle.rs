//! The capsule index (`mur_capsule_index`): key `<name>` holds the [`CapsuleIndexEntry`] of
//! the capsule's latest bundle, and the key's revision history its earlier pushes (issue #7:
//! `mur capsule push DIR`, `mur capsule ls`). Packing, storing and fetching bundles is the
//! worker's (`mur_worker::bundle`); the coordinator only reads the index.

use async_nats::jetstream::kv;
use futures::TryStreamExt;
use mur_proto::cluster::{CapsuleEntry, CapsuleIndexEntry};
use mur_proto::manifest::is_valid_name;

/// How often [`set_latest`] retries its compare-and-set on the index when pushes race.
const INDEX_CAS_ATTEMPTS: usize = 10;

/// Why the index could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A capsule name is malformed (it would also be a path in a worker's cache).
    #[error("{0}")]
    Invalid(String),
    /// An index entry is not a [`CapsuleIndexEntry`].
    #[error("capsule bundle {object}: {reason}")]
    Malformed {
        /// `index entry <name>`.
        object: String,
        /// What is wrong.
        reason: String,
    },
    /// The capsule's version was pushed already with other content (issue #31: a push must
    /// not silently replace what running fleets use); nothing was stored.
    #[error(
        "capsule {name} version {version} was pushed already with other content (sha256 {existing}): versions \
         are immutable; raise `version:` in murmur.yaml to push the change"
    )]
    VersionTaken {
        /// The capsule.
        name: String,
        /// The version pushed.
        version: String,
        /// The digest that version has in the index.
        existing: String,
    },
    /// A JetStream request failed.
    #[error("{what}: {source}")]
    Nats {
        /// The request, with the key.
        what: String,
        /// The client's error.
        source: async_nats::Error,
    },
}

fn nats(what: impl Into<String>) -> impl FnOnce(async_nats::Error) -> Error {
    let what = what.into();
    move |source| Error::Nats { what, source }
}

/// Checks that `version` of capsule `name` is new, or already names `digest`: versions are
/// immutable (issue #31). Looks at the key's history, which the bucket keeps for its last
/// `capsule_history` pushes (64 by default): a version older than that is not checked.
///
/// # Errors
/// [`Error::VersionTaken`] naming the digest the version has; [`Error::Nats`],
/// [`Error::Malformed`] as [`history`].
pub async fn check_version(index: &kv::Store, name: &str, version: &str, digest: &str) -> Result<(), Error> {
    let taken = history(index, name).await?.into_iter().rev().find(|e| e.version == version && e.digest != digest);
    match taken {
        Some(e) => Err(Error::VersionTaken { name: name.into(), version: version.into(), existing: e.digest }),
        None => Ok(()),
    }
}

/// Points key `name` of `index` at `value`, with compare-and-set so racing pushes never
/// lose one another's write: the last to land is the latest, and every push stays in the
/// key's history. A key that already names `value.digest` is left as it is. A latest entry
/// of the same version with another digest (a push that raced this one) is refused.
///
/// # Errors
/// [`Error::VersionTaken`] as said;
/// [`Error::Nats`] when the index refuses, or when [`INDEX_CAS_ATTEMPTS`] pushes raced
/// and this one lost each time.
pub async fn set_latest(index: &kv::Store, name: &str, value: &CapsuleIndexEntry) -> Result<(), Error> {
    let (digest, version) = (&value.digest, &value.version);
    let value = bytes::Bytes::from(serde_json::to_vec(value).expect("index entry serializes"));
    let what = || format!("index {name}");
    for _ in 0..INDEX_CAS_ATTEMPTS {
        let current = index.entry(name).await.map_err(|e| nats(what())(e.into()))?;
        match current.filter(|e| e.operation == kv::Operation::Put) {
            Some(entry) => {
                if let Ok(latest) = serde_json::from_slice::<CapsuleIndexEntry>(&entry.value) {
                    if &latest.digest == digest {
                        return Ok(());
                    }
                    if &latest.version == version {
                        return Err(Error::VersionTaken {
                            name: name.into(),
                            version: latest.version,
                            existing: latest.digest,
                        });
                    }
                }
                match index.update(name, value.clone(), entry.revision).await {
                    Ok(_) => return Ok(()),
                    // Another push won the race: read again.
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {}
                    Err(e) => return Err(nats(what())(e.into())),
                }
            }
            None => match index.create(name, value.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                Err(e) => return Err(nats(what())(e.into())),
            },
        }
    }
    Err(Error::Nats {
        what: what(),
        source: format!("{INDEX_CAS_ATTEMPTS} pushes raced and this one lost each time").into(),
    })
}

/// Every capsule's latest bundle, sorted by name.
///
/// # Errors
/// [`Error::Nats`] when the index cannot be read; [`Error::Malformed`] for an entry that
/// is not a [`CapsuleIndexEntry`].
pub async fn list(index: &kv::Store) -> Result<Vec<CapsuleEntry>, Error> {
    let mut names = crate::read::keys(index, ">").await.map_err(|e| nats("index keys")(e.into()))?;
    names.sort();
    let mut entries = Vec::with_capacity(names.len());
    for name in names {
        if let Some(e) = latest(index, &name).await? {
            entries.push(CapsuleEntry {
                name,
                digest: e.digest,
                version: e.version,
                pushed_at: e.pushed_at,
                bytes: e.bytes,
            });
        }
    }
    Ok(entries)
}

/// The latest bundle of capsule `name`, or `None` if it was never pushed.
///
/// # Errors
/// As [`list`].
pub async fn latest(index: &kv::Store, name: &str) -> Result<Option<CapsuleIndexEntry>, Error> {
    check_name(name)?;
    let value = index.get(name).await.map_err(|e| nats(format!("index {name}"))(e.into()))?;
    value.map(|v| parse_entry(name, &v)).transpose()
}

/// The pushes of capsule `name` the index still remembers (up to its history setting),
/// oldest first.
///
/// # Errors
/// As [`list`].
pub async fn history(index: &kv::Store, name: &str) -> Result<Vec<CapsuleIndexEntry>, Error> {
    check_name(name)?;
    let entries: Vec<kv::Entry> = index
        .history(name)
        .await
        .map_err(|e| nats(format!("index history {name}"))(e.into()))?
        .try_collect()
        .await
        .map_err(|e| nats(format!("index history {name}"))(e.into()))?;
    entries.iter().filter(|e| e.operation == kv::Operation::Put).map(|e| parse_entry(name, &e.value)).collect()
}

fn parse_entry(name: &str, value: &[u8]) -> Result<CapsuleIndexEntry, Error> {
    serde_json::from_slice(value).map_err(|e| Error::Malformed {
        object: format!("index entry {name}"),
        reason: format!("not an index entry: {e}"),
    })
}

/// Checks a capsule name against the manifest's rule.
///
/// # Errors
/// [`Error::Invalid`] naming it.
pub fn check_name(name: &str) -> Result<(), Error> {
    if is_valid_name(name) { Ok(()) } else { Err(Error::Invalid(format!("capsule name {name:?} is not valid"))) }
}
