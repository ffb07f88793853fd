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
