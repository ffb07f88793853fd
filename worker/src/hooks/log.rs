//! `logs/hook-<name>.log`: one line per hook error, per fault, per restart of a persistent
//! hook and per line a hook wrote to its stderr (the runtime reference, §3 "Errors",
//! checklist H4).
//!
//! Every line is `<time> <event> <kind>: <text>`, with `<time>` in RFC 3339 UTC with
//! milliseconds, `<event>` the binding being handled (`on-task-end`) or `drain`, and
//! `<kind>` one of `error`, `queue-overflow`, `timeout`, `restart`, `stderr`, `stray`. Newlines
//! inside `<text>` are written as `\n`, so one entry is one line. A log stops at
//! [`MAX_LOG_BYTES`] with one `<time> - log-full: …` line.

use mur_nats::clock::{Clock, SystemClock};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The log file of one hook. Writing never fails the caller: a file that cannot be written
/// is reported through `tracing` and the line is lost.
#[derive(Clone, Debug)]
pub(crate) struct HookLog {
    path: PathBuf,
    /// Bytes the file may reach ([`MAX_LOG_BYTES`]).
    cap: u64,
    /// Set once the `log-full` line is written (or found): nothing is written after it.
    full: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Bytes a hook log may reach (10 MiB): a hook writing without end to its stderr does not
/// fill the worker's disk. Past it one `log-full` line is written and later lines are
/// dropped.
pub(crate) const MAX_LOG_BYTES: u64 = 10 * 1024 * 1024;

/// How the `log-full` line ends.
const LOG_FULL_END: &str = "; later lines are dropped\n";

impl HookLog {
    /// The log of hook `hook` in `logs_dir` (created on the first write).
    pub fn new(logs_dir: &Path, hook: &str) -> Self {
        HookLog { path: logs_dir.join(format!("hook-{hook}.log")), cap: MAX_LOG_BYTES, full: Default::default() }
    }

    /// Appends one `<time> <event> <kind>: <text>` line.
    pub fn write(&self, event: &str, kind: &str, text: &str) {
        self.write_all(event, kind, std::iter::once(text));
    }

    /// Appends one line per item of `texts`, all with the same time, event and kind, in a
    /// single write.
    pub fn write_all<'a>(&self, event: &str, kind: &str, texts: impl IntoIterator<Item = &'a str>) {
        let time = rfc3339_ms(SystemClock.now_ms());
        let mut out = String::new();
        for text in texts {
            out.push_str(&format!("{time} {event} {kind}: {}\n", one_line(text)));
        }
        if out.is_empty() {
            return;
        }
        if let Err(e) = self.append(out.as_bytes()) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot write a hook log");
        }
    }

    fn append(&self, bytes: &[u8]) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        use std::sync::atomic::Ordering;
        if self.full.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut f = std::fs::OpenOptions::new().read(true).create(true).append(true).open(&self.path)?;
        let len = f.metadata()?.len();
        // A log another run of the hook filled ends with the line.
        let mut tail = Vec::new();
        f.seek(std::io::SeekFrom::Start(len.saturating_sub(LOG_FULL_END.len() as u64)))?;
        f.read_to_end(&mut tail)?;
        if tail.ends_with(LOG_FULL_END.as_bytes()) {
            self.full.store(true, Ordering::Relaxed);
            return Ok(());
        }
        if len + bytes.len() as u64 <= self.cap {
            return f.write_all(bytes);
        }
        // Full: said once, at the end of the file; this write and every later one dropped.
        self.full.store(true, Ordering::Relaxed);
        let full = format!(
            "{} - log-full: this log reached {} bytes{LOG_FULL_END}",
            rfc3339_ms(SystemClock.now_ms()),
            self.cap
        );
        f.write_all(full.as_bytes())
    }
}

/// `text` with line breaks written as `\n`, a carriage return dropped, and every other
/// control character but a tab escaped as Rust writes it (`\u{1b}`): a hook's colours or
/// cursor moves stay text in the log instead of acting on the terminal that reads it.
fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.trim_end_matches(['\n', '\r']).chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => {}
            '\t' => out.push('\t'),
            c if c.is_control() => out.extend(c.escape_debug()),
            c => out.push(c),
        }
    }
    out
}

/// `ms` Unix milliseconds as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub(crate) fn rfc3339_ms(ms: u64) -> String {
    let secs = ms / 1000;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem / 60 % 60, rem % 60, ms % 1000)
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_stops_at_its_cap_with_one_log_full_line() {
        let dir = tempfile::tempdir().unwrap();
        let log = HookLog { cap: 300, ..HookLog::new(dir.path(), "noisy") };
        for i in 0..20 {
            log.write("on-tool-call", "stderr", &format!("line {i}"));
        }
        // A write larger than all the room, then small ones that would fit: all dropped.
        let fresh = HookLog { cap: 300, ..HookLog::new(dir.path(), "burst") };
        fresh.write("on-tool-call", "stderr", &"x".repeat(1000));
        fresh.write("on-tool-call", "stray", "small");
        let again = HookLog { cap: 300, ..HookLog::new(dir.path(), "burst") };
        again.write("on-tool-call", "stray", "small too");
        let burst = std::fs::read_to_string(dir.path().join("hook-burst.log")).unwrap();
        assert_eq!(burst.lines().count(), 1, "{burst}");
        assert!(burst.ends_with(" - log-full: this log reached 300 bytes; later lines are dropped\n"), "{burst}");
        let text = std::fs::read_to_string(dir.path().join("hook-noisy.log")).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with(" on-tool-call stderr: line 0"), "{text}");
        assert!(
            lines.last().unwrap().ends_with(" - log-full: this log reached 300 bytes; later lines are dropped"),
            "{text}"
        );
        assert_eq!(lines.iter().filter(|l| l.contains("log-full")).count(), 1, "{text}");
        assert!(lines.len() < 10, "{text}");
        assert!(!text.contains('\0') && text.len() < 300 + 100, "{text:?}");
    }

    #[test]
    fn times_are_rfc3339_utc_with_milliseconds() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_000_000_000_123), "2001-09-09T01:46:40.123Z");
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_798_761_599_999), "2026-12-31T23:59:59.999Z");
    }

    #[test]
    fn a_multi_line_text_is_one_log_line() {
        let dir = tempfile::tempdir().unwrap();
        let log = HookLog::new(&dir.path().join("logs"), "gate");
        log.write("on-task-end", "error", "first\nsecond\n");
        log.write_all("on-task-end", "stderr", ["a", "b"]);
        let text = std::fs::read_to_string(dir.path().join("logs/hook-gate.log")).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].ends_with(" on-task-end error: first\\nsecond"), "{}", lines[0]);
        assert!(lines[1].ends_with(" on-task-end stderr: a"), "{}", lines[1]);
        assert!(lines[2].ends_with(" on-task-end stderr: b"), "{}", lines[2]);
    }

    #[test]
    fn control_characters_are_escaped_and_a_tab_is_kept() {
        assert_eq!(one_line("\u{1b}[31mred\u{1b}[0m\tok\r\n"), "\\u{1b}[31mred\\u{1b}[0m\tok");
        assert_eq!(one_line("a\u{7}b\u{0}c\u{9b}d"), "a\\u{7}b\\0c\\u{9b}d");
    }
}
