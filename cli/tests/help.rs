//! The `mur` binary starts and documents its commands. (This test also makes
//! `cargo test --workspace` build the binary that the `tests/` crate runs.)

use std::process::Command;

#[test]
fn help_lists_every_command() {
    let out = Command::new(env!("CARGO_BIN_EXE_mur")).arg("--help").output().expect("run mur");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in ["run", "trace", "task", "capsule", "dev", "coordinator", "worker"] {
        assert!(text.contains(cmd), "{cmd} missing from:\n{text}");
    }
}

/// A reader that leaves early (`mur trace steps … | head -1`) ends `mur` by SIGPIPE, as it
/// ends `cat`, not with a panic on the failed print (exit 101).
#[test]
fn a_reader_that_leaves_early_ends_mur_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("ses_pipe");
    std::fs::create_dir_all(&session).unwrap();
    // Enough rows to overflow a pipe's buffer many times over.
    let line = |i: usize| {
        format!(
            r#"{{"event_type":"task_start","session_id":"ses_pipe","task_id":"tsk_{i}","lane":"user","origin":"user"}}"#
        )
    };
    let lines: Vec<String> = (0..20_000).map(line).collect();
    std::fs::write(session.join("trace.jsonl"), lines.join("\n")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mur"))
        .args(["trace", "steps", session.to_str().unwrap()])
        .env_remove("NATS_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run mur");
    let mut first = [0u8; 16];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    drop(child.stdout.take()); // the reader leaves
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
