//! What the shell tools and command tools share about their child processes: reading an
//! output stream while keeping only its head (and spilling the rest to a file when asked),
//! cutting that head on a UTF-8 character boundary, exit codes, and killing a whole process
//! group. Children run in their own process group (`process_group(0)`), so the group id is
//! the child's pid.

use super::lifeline;
use crate::sandbox::Confinement;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// One output stream, read to its end.
#[derive(Debug)]
pub(crate) struct Captured {
    /// The first bytes of the stream: all of it when it fits in the limit, else the limit
    /// plus one byte (the extra byte tells whether the cut splits a character).
    head: Vec<u8>,
    /// Bytes the stream carried in all.
    pub total: u64,
    /// The limit the head was kept for.
    limit: usize,
    /// Where the whole stream went once it outgrew the limit, if spilling was asked for.
    pub spill: Spill,
}

/// The fate of a stream's bytes beyond the kept head.
#[derive(Debug)]
pub(crate) enum Spill {
    /// Nothing spilled: the stream fit, or no spill file was asked for.
    None,
    /// The whole stream is in this file.
    File(PathBuf),
    /// The spill file could not be written; the message says why.
    Failed(String),
}

impl Captured {
    /// Whether the stream was longer than the limit.
    pub fn truncated(&self) -> bool {
        self.total > self.limit as u64
    }

    /// The kept text, decoded lossily as UTF-8: the whole stream when it fits, else the
    /// longest prefix of at most `limit` bytes that does not end inside a character.
    pub fn kept_text(&self) -> String {
        if !self.truncated() {
            return String::from_utf8_lossy(&self.head).into_owned();
        }
        let cut = char_boundary_cut(&self.head, self.limit);
        String::from_utf8_lossy(&self.head[..cut]).into_owned()
    }

    /// The head bytes, which are the whole stream when it was not truncated.
    pub fn head(&self) -> &[u8] {
        &self.head
    }
}

/// Where `bytes` (at least `limit + 1` long, or shorter when it all fits) may be cut so that
/// the kept prefix is at most `limit` bytes and no UTF-8 character is split. When the byte at
/// the cut continues a character whose lead byte sits before the cut, the cut moves back to
/// that lead byte; stray bytes that start no character are cut like any other byte.
pub(crate) fn char_boundary_cut(bytes: &[u8], limit: usize) -> usize {
    if bytes.len() <= limit {
        return bytes.len();
    }
    let mut start = limit;
    while start > 0 && limit - start < 3 && is_continuation(bytes[start]) {
        start -= 1;
    }
    if start == limit {
        return limit;
    }
    match utf8_width(bytes[start]) {
        Some(width) if start + width > limit => start,
        _ => limit,
    }
}

fn is_continuation(b: u8) -> bool {
    b & 0b1100_0000 == 0b1000_0000
}

/// The length of the UTF-8 sequence `lead` starts, `None` when it starts none.
fn utf8_width(lead: u8) -> Option<usize> {
    match lead {
        0x00..=0x7f => Some(1),
        0xc0..=0xdf => Some(2),
        0xe0..=0xef => Some(3),
        0xf0..=0xf7 => Some(4),
        _ => None,
    }
}

/// Reads `reader` to its end, keeping the first `limit + 1` bytes. When `spill_to` is given
/// and the stream outgrows `limit`, the whole stream (head included) is also written to that
/// file, created new (its directory too). The stream is always drained, even when the spill
/// fails, so the child never blocks on a full pipe. A read error ends the stream early.
pub(crate) async fn capture<R: AsyncRead + Unpin>(mut reader: R, limit: usize, spill_to: Option<PathBuf>) -> Captured {
    let mut capture = Capture::new(limit, spill_to);
    let mut buf = vec![0u8; 64 * 1024];
    while let Some(n) = read_chunk(&mut reader, &mut buf).await {
        capture.push(&buf[..n]).await;
    }
    capture.finish().await
}

/// Reads the next chunk into `buf`: `Some(n)` with `n > 0`, or `None` at the end of the
/// stream. Retries on `Interrupted`; any other read error ends the stream (logged). Cancel
/// safe: dropped before it completes, it has consumed nothing.
pub(crate) async fn read_chunk<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> Option<usize> {
    loop {
        match reader.read(buf).await {
            Ok(0) => return None,
            Ok(n) => return Some(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "reading a tool's output failed; treating it as ended");
                return None;
            }
        }
    }
}

/// A stream being captured chunk by chunk (what [`capture`] does, for callers that read the
/// stream themselves): keeps the first `limit + 1` bytes and spills the whole stream to a
/// file once it outgrows `limit`, when a spill file was asked for.
pub(crate) struct Capture {
    head: Vec<u8>,
    total: u64,
    limit: usize,
    spill: Spill,
    spill_to: Option<PathBuf>,
    file: Option<tokio::fs::File>,
}

impl Capture {
    /// An empty capture keeping `limit` bytes, spilling to `spill_to` if given.
    pub fn new(limit: usize, spill_to: Option<PathBuf>) -> Self {
        Capture {
            head: Vec::with_capacity((limit + 1).min(8 * 1024)),
            total: 0,
            limit,
            spill: Spill::None,
            spill_to,
            file: None,
        }
    }

    /// Takes the next chunk of the stream.
    pub async fn push(&mut self, chunk: &[u8]) {
        let n = chunk.len();
        let room = self.limit + 1 - self.head.len();
        self.head.extend_from_slice(&chunk[..n.min(room)]);
        self.total += n as u64;

        if self.total > self.limit as u64
            && matches!(self.spill, Spill::None)
            && let Some(path) = &self.spill_to
        {
            // First overflow: open the spill file and write what came before this chunk.
            match create_new(path).await {
                Ok(mut f) => {
                    let before = &self.head[..self.head.len() - n.min(room)];
                    match f.write_all(before).await {
                        Ok(()) => {
                            self.file = Some(f);
                            self.spill = Spill::File(path.clone());
                        }
                        Err(e) => self.spill = Spill::Failed(format!("{}: {e}", path.display())),
                    }
                }
                Err(e) => self.spill = Spill::Failed(format!("{}: {e}", path.display())),
            }
        }
        if let Some(f) = &mut self.file
            && let Err(e) = f.write_all(chunk).await
        {
            self.spill = Spill::Failed(format!("{}: {e}", spill_path_display(&self.spill_to)));
            self.file = None;
        }
    }

    /// The stream as captured so far, its spill file flushed.
    pub async fn finish(mut self) -> Captured {
        if let Some(mut f) = self.file.take()
            && let Err(e) = f.flush().await
        {
            self.spill = Spill::Failed(format!("{}: {e}", spill_path_display(&self.spill_to)));
        }
        Captured { head: self.head, total: self.total, limit: self.limit, spill: self.spill }
    }
}

fn spill_path_display(p: &Option<PathBuf>) -> String {
    p.as_deref().map(|p| p.display().to_string()).unwrap_or_default()
}

/// Creates `path` (which must not exist yet), creating its directory first.
pub(crate) async fn create_new(path: &Path) -> io::Result<tokio::fs::File> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir).await?;
    }
    tokio::fs::OpenOptions::new().write(true).create_new(true).open(path).await
}

/// The exit code of `status`: its code, or 128 + the signal number when a signal ended it
/// (the shell convention), or -1 when neither is known.
pub(crate) fn exit_code(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(-1)
}

/// Sends SIGKILL to every process in process group `pgid`.
///
/// # Errors
/// The OS error of `kill(2)`; `ESRCH` when the group is already gone.
pub(crate) fn kill_group(pgid: u32) -> io::Result<()> {
    let pgid =
        libc::pid_t::try_from(pgid).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    if pgid <= 1 {
        // kill(0) and kill(-1) would hit our own group or everything we may signal.
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("refusing to signal process group {pgid}")));
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    let rc = unsafe { libc::kill(-pgid, libc::SIGKILL) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// The environment variable whose value marks every process a spawned program starts
/// (they inherit it): those that leave its process group (`setsid`) can still be found and
/// killed ([`kill_marked`]).
pub(crate) const REAP_MARK_VAR: &str = "MURMUR_REAP_MARK";

/// A fresh mark for one spawn (32 hex digits, a UUIDv7: unique within the worker).
pub(crate) fn reap_mark() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

/// Sends SIGKILL to every process of ours, but this one, whose environment holds
/// `MURMUR_REAP_MARK=<mark>`: what a killed program started outside its process group.
/// Returns how many were signalled. Reads `/proc/<pid>/environ` (Linux; the environment a
/// process was started with), which only the processes of our own user let us read.
pub(crate) fn kill_marked(mark: &str) -> usize {
    let needle = format!("{REAP_MARK_VAR}={mark}");
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    let mut killed = 0;
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<libc::pid_t>().ok()) else { continue };
        if pid <= 1 || pid as u32 == me {
            continue;
        }
        let Ok(env) = std::fs::read(entry.path().join("environ")) else { continue };
        if env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) {
            // SAFETY: kill(2) takes plain integers and touches no memory of ours.
            if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
    }
    killed
}

/// Kills a child's process group when dropped, unless disarmed first: a run whose future is
/// dropped (its caller gave up on it) leaves no process behind. While armed, the group is
/// also tied to this process's life ([`lifeline`]): a worker killed with SIGKILL, which
/// drops nothing, still leaves no process behind.
pub(crate) struct GroupGuard {
    pgid: Option<u32>,
    tie: Option<lifeline::Tie>,
    /// The child's [`REAP_MARK_VAR`] value: its processes outside the group die with it.
    mark: Option<String>,
    /// The control groups of a sandboxed child (`sandbox.memory_mb`, `sandbox.pids`),
    /// removed once dropped with the guard (or swept later while processes remain).
    cgroup: Option<crate::sandbox::cgroup::CommandGroup>,
}

impl GroupGuard {
    /// Starts `cmd` in a process group of its own (`process_group(0)`: the group id is the
    /// child's pid) and guards the group, tied to this process's life from before the
    /// child's exec ([`lifeline::spawn`]). `cmd` is spawned once.
    ///
    /// # Errors
    /// The OS error of the spawn.
    pub fn spawn(cmd: &mut tokio::process::Command) -> io::Result<(tokio::process::Child, Self)> {
        let (child, tie) = lifeline::spawn(cmd.process_group(0))?;
        let guard = GroupGuard { pgid: child.id(), tie, mark: None, cgroup: None };
        Ok((child, guard))
    }

    /// [`GroupGuard::spawn`] with `mark` ([`reap_mark`]) in the child's environment
    /// ([`REAP_MARK_VAR`], which its descendants inherit): the guard also kills the processes
    /// marked so ([`kill_marked`]), those that left the group included. With a `sandbox`,
    /// the child starts confined by it ([`Confinement::confine`]), and the guard keeps
    /// its control groups.
    ///
    /// # Errors
    /// The OS error of the spawn; a sandbox that cannot confine the child (it does not run).
    pub fn spawn_marked(
        cmd: &mut tokio::process::Command,
        mark: &str,
        sandbox: Option<&Confinement>,
    ) -> io::Result<(tokio::process::Child, Self)> {
        let cgroup = match sandbox {
            Some(s) => s.confine(cmd).map_err(|e| io::Error::new(e.kind(), format!("cannot sandbox it: {e}")))?,
            None => None,
        };
        let (child, mut guard) = Self::spawn(cmd.env(REAP_MARK_VAR, mark))?;
        guard.mark = Some(mark.to_string());
        guard.cgroup = cgroup;
        Ok((child, guard))
    }

    /// Leaves the group alone on drop and unties it: call it once the group's leader has
    /// been reaped (after which its id may be reused), or when a detached command's drain
    /// takes the group over (detached commands are not tied, see [`lifeline`]).
    pub fn disarm(&mut self) {
        self.pgid = None;
        self.tie = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid {
            if let Some(mark) = &self.mark {
                kill_marked(mark);
            }
            let _ = kill_group(pgid);
        }
        // `tie` is dropped after this, once the group is killed.
    }
}

/// Whether process `pid` runs: it exists and is neither a zombie nor dead (tests wait on
/// it to see a kill land).
#[cfg(test)]
pub(crate) fn is_running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| !rest.starts_with(['Z', 'X'])))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_steps_back_to_the_start_of_a_split_character() {
        // "é" is two bytes; with a limit of 3, "aaé" would end inside the é.
        let bytes = "aaébb".as_bytes();
        assert_eq!(char_boundary_cut(bytes, 3), 2);
        // "€" is three bytes: limits 2 and 3 inside it both cut before it.
        let bytes = "a€b".as_bytes();
        assert_eq!(char_boundary_cut(bytes, 2), 1);
        assert_eq!(char_boundary_cut(bytes, 3), 1);
        assert_eq!(char_boundary_cut(bytes, 4), 4);
    }

    #[test]
    fn cut_keeps_everything_that_fits() {
        assert_eq!(char_boundary_cut(b"abc", 3), 3);
        assert_eq!(char_boundary_cut(b"ab", 3), 2);
    }

    #[test]
    fn cut_keeps_the_limit_in_a_run_of_stray_continuation_bytes() {
        let bytes = [b'a', 0x80, 0x80, 0x80, 0x80, 0x80, 0x80];
        assert_eq!(char_boundary_cut(&bytes, 5), 5);
    }

    #[test]
    fn signal_exit_is_128_plus_the_signal() {
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
    }

    #[test]
    fn kill_group_refuses_our_own_group_and_everyone() {
        assert!(kill_group(0).is_err());
        assert!(kill_group(1).is_err());
    }

    #[tokio::test]
    async fn capture_spills_the_whole_stream_once_it_outgrows_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/spill");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let c = capture(&data[..], 10, Some(path.clone())).await;
        assert!(c.truncated());
        assert_eq!(c.total, data.len() as u64);
        assert_eq!(c.head(), &data[..11]);
        assert!(matches!(&c.spill, Spill::File(p) if *p == path));
        assert_eq!(std::fs::read(&path).unwrap(), data);
    }

    #[tokio::test]
    async fn capture_writes_no_file_when_the_stream_fits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spill");
        let c = capture(&b"0123456789"[..], 10, Some(path.clone())).await;
        assert!(!c.truncated());
        assert_eq!(c.kept_text(), "0123456789");
        assert!(matches!(c.spill, Spill::None));
        assert!(!path.exists());
    }
}
