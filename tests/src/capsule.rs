//! Temporary capsule folders: a manifest and its files in a temp dir that is removed on drop.

use std::path::{Path, PathBuf};

/// A capsule folder under a temporary directory.
pub struct TestCapsule {
    dir: tempfile::TempDir,
}

impl TestCapsule {
    /// A capsule whose `murmur.yaml` is `manifest`, with extra `files` (relative path,
    /// content). Files ending in `.sh` are made executable.
    pub fn new(manifest: &str, files: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("murmur.yaml"), manifest).expect("write manifest");
        for (name, content) in files {
            let p = dir.path().join(name);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).expect("mkdir");
            }
            std::fs::write(&p, content).expect("write file");
            if name.ends_with(".sh") || name.ends_with(".py") {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            }
        }
        TestCapsule { dir }
    }

    /// A copy of the example capsule `examples/<name>` of this repository.
    pub fn example(name: &str) -> Self {
        let src = repo_root().join("examples").join(name);
        let dir = tempfile::tempdir().expect("temp dir");
        copy_dir(&src, dir.path());
        TestCapsule { dir }
    }

    /// The capsule folder.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `<capsule>/workdir`, where sessions without `--workdir` go.
    pub fn workdir(&self) -> PathBuf {
        self.dir.path().join("workdir")
    }
}

/// A scripted capsule named `name` whose task's text is run as one shell command (the
/// `sh` tool), then reported as `ran: <text>`.
pub fn shell_capsule(name: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n"
        ),
        &[(
            "r.yaml",
            "replies:\n  - tool_calls: [{ name: sh, input: { command: \"{{task}}\" } }]\n  - text: \"ran: {{task}}\"\n",
        )],
    )
}

/// [`shell_capsule`] whose shell commands are declared idempotent
/// (`capabilities.shell.idempotent`): a command in doubt at a takeover runs again (issue
/// #34), as every command did before the journal.
pub fn idempotent_shell_capsule(name: &str) -> TestCapsule {
    let capsule = shell_capsule(name);
    let manifest = capsule.dir().join("murmur.yaml");
    let text = std::fs::read_to_string(&manifest).expect("read manifest");
    std::fs::write(&manifest, format!("{text}    idempotent: true\n")).expect("write manifest");
    capsule
}

/// The repository's root folder.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

fn copy_dir(src: &Path, dst: &Path) {
    for entry in std::fs::read_dir(src).unwrap_or_else(|e| panic!("{}: {e}", src.display())) {
        let entry = entry.expect("dir entry");
        let name = entry.file_name();
        if name == "workdir" {
            continue;
        }
        let to = dst.join(&name);
        if entry.file_type().expect("file type").is_dir() {
            std::fs::create_dir_all(&to).expect("mkdir");
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).expect("copy");
        }
    }
}
