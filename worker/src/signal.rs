//! Sending a signal to a process (or process group) by id with `kill(2)` — never the external
//! `kill` command, which a minimal system (Debian without procps) does not have.

use std::io;

/// Sends `signal` (e.g. `libc::SIGTERM`) to the process `pid`.
///
/// A process that is already gone (`ESRCH`, including a child already reaped) counts as
/// signalled: `Ok(())`.
///
/// # Errors
/// `InvalidInput` for a pid of 0 or 1 or one that does not fit `pid_t` (kill(2) would then
/// hit our own group, init, or everything we may signal); any other OS error of `kill(2)`
/// (`EPERM`, `EINVAL` for an unknown signal).
pub fn signal_pid(pid: u32, signal: i32) -> io::Result<()> {
    kill(checked(pid)?, signal)
}

/// Sends `signal` to every process of process group `pgid` (`kill(-pgid, signal)`).
///
/// A group that is already gone (`ESRCH`) counts as signalled: `Ok(())`.
///
/// # Errors
/// As [`signal_pid`].
pub fn signal_group(pgid: u32, signal: i32) -> io::Result<()> {
    kill(-checked(pgid)?, signal)
}

fn checked(pid: u32) -> io::Result<libc::pid_t> {
    match libc::pid_t::try_from(pid) {
        Ok(p) if p > 1 => Ok(p),
        _ => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("refusing to signal process id {pid}"))),
    }
}

fn kill(target: libc::pid_t, signal: i32) -> io::Result<()> {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(target, signal) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) { Ok(()) } else { Err(err) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Child, Command, ExitStatus};
    use std::time::{Duration, Instant};

    /// Waits for `child` to exit, at most 10 s.
    fn wait_with_deadline(child: &mut Child) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "sleep did not exit within 10 s of the signal");
            // Polling for the exit; the deadline above bounds it.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn signal_pid_terminates_the_process_with_that_signal() {
        let mut child = Command::new("sleep").arg("60").spawn().expect("spawn sleep");
        signal_pid(child.id(), libc::SIGTERM).expect("signal");
        let status = wait_with_deadline(&mut child);
        assert_eq!(status.signal(), Some(libc::SIGTERM));
    }

    #[test]
    fn signal_group_reaches_the_process_group() {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new("sleep").arg("60").process_group(0).spawn().expect("spawn sleep");
        signal_group(child.id(), libc::SIGINT).expect("signal");
        let status = wait_with_deadline(&mut child);
        assert_eq!(status.signal(), Some(libc::SIGINT));
    }

    #[test]
    fn signalling_a_reaped_process_is_ok() {
        let mut child = Command::new("sleep").arg("60").spawn().expect("spawn sleep");
        child.kill().expect("kill");
        child.wait().expect("wait");
        // Signal 0 checks existence only: harmless should the pid already be reused.
        assert!(signal_pid(child.id(), 0).is_ok());
        assert!(signal_group(child.id(), 0).is_ok());
    }

    #[test]
    fn signal_refuses_pids_0_and_1_and_names_them() {
        for pid in [0, 1, u32::MAX] {
            let err = signal_pid(pid, libc::SIGTERM).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
            assert_eq!(err.to_string(), format!("refusing to signal process id {pid}"));
        }
    }

    #[test]
    fn signal_surfaces_errors_other_than_esrch() {
        let child = Command::new("sleep").arg("60").spawn().expect("spawn sleep");
        let err = signal_pid(child.id(), 9999).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
        let mut child = child;
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
