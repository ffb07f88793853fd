//! The dispatch-time preflight of a task's `needs` (the fleet reference, §1: a
//! fleet's `needs:` is "passed to each delegate for dispatch-time preflight"): before a
//! worker starts a session for a task, every program the task needs must be on its `PATH`.
//! Pure apart from reading file metadata.

use std::ffi::OsStr;
use std::path::Path;

/// The programs of `needs` that are not found: a name with a `/` must be an executable
/// file at that path; any other name must be an executable file in one of the `path`
/// directories (the `PATH` value, `:`-separated).
pub fn missing(needs: &[String], path: Option<&OsStr>) -> Vec<String> {
    let dirs: Vec<_> = path.map(|p| std::env::split_paths(p).collect()).unwrap_or_default();
    needs
        .iter()
        .filter(|need| {
            if need.contains('/') {
                !is_executable(Path::new(need.as_str()))
            } else {
                !dirs.iter().any(|d| is_executable(&d.join(need.as_str())))
            }
        })
        .cloned()
        .collect()
}

/// The result of a task whose needs are not met:
/// `needs: cargo, rg not on this worker's PATH; the task did not start`.
pub fn refusal(missing: &[String]) -> String {
    format!("needs: {} not on this worker's PATH; the task did not start", missing.join(", "))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_executable_files_on_the_path_or_at_the_given_path_count() {
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("tool");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "").unwrap();
        let path = std::env::join_paths(["/nonexistent", dir.path().to_str().unwrap()]).unwrap();
        let needs: Vec<String> =
            ["tool", "plain", "ghost", tool.to_str().unwrap(), "/no/such/x"].iter().map(|s| s.to_string()).collect();
        assert_eq!(missing(&needs, Some(&path)), ["plain", "ghost", "/no/such/x"]);
        assert_eq!(missing(&needs[..1], None), ["tool"]);
        assert_eq!(
            refusal(&["cargo".into(), "rg".into()]),
            "needs: cargo, rg not on this worker's PATH; the task did not start"
        );
    }
}
