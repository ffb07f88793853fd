//! When a fleet's trigger fires (issue #36): the `loop.timezone`, `loop.overlap`,
//! `loop.catchup` and `loop.pause_after_failures` keys, and a cron's occurrences in a time
//! zone across daylight saving.
//!
//! Zones are IANA names from the `chrono-tz` crate (its tz database). The daylight-saving
//! rules are issue #36's: at fall-back a local time that occurs twice fires once, the
//! first time; at spring-forward a local time that does not exist fires once, at the first
//! instant after the gap (every occurrence inside one gap maps to that instant, so they
//! fire once between them) — never twice, never skipped. `croner` finds the matching local
//! (wall-clock) times; this module maps them to instants by those rules.
//!
//! Pure: no IO, no clock reads.

use super::{Cron, DurationText, Trigger};
use chrono::{DateTime, LocalResult, NaiveDateTime, TimeZone, Timelike, Utc};
pub use chrono_tz::Tz;
use std::time::Duration;

/// The catch-up window when `loop.catchup` is absent: an occurrence whose time passed at
/// most this long ago still runs (the window of the versions before issue #36), so a
/// coordinator down longer loses what it missed.
pub const DEFAULT_CATCHUP: Duration = Duration::from_secs(90);

/// The rule a `loop.timezone` value follows, for error messages.
const TIMEZONE_RULE: &str = "must be an IANA time zone name (UTC, Europe/Berlin, America/New_York)";

/// `loop.timezone`: parses an IANA zone name (trimmed; exact case, as the tz database
/// spells it; empty is UTC).
///
/// # Errors
/// The rule and the value, when the tz database has no such zone (`Berlin`, `CEST`,
/// `+02:00`).
pub fn parse_timezone(text: &str) -> Result<Tz, String> {
    let t = text.trim();
    if t.is_empty() {
        return Ok(Tz::UTC);
    }
    t.parse::<Tz>().map_err(|_| format!("{TIMEZONE_RULE}, got {t:?}"))
}

/// `loop.overlap`: what an occurrence does when it finds a run of the fleet still going.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlap {
    /// `skip` (default): the occurrence is skipped (a channel event and a counter).
    #[default]
    Skip,
    /// `queue_one`: one occurrence waits and starts as soon as the run ends; further
    /// occurrences meanwhile are skipped.
    QueueOne,
    /// `cancel_previous`: the run going is stopped at its next iteration boundary and the
    /// occurrence starts once it has ended.
    CancelPrevious,
}

impl Overlap {
    /// Parses a value (trimmed).
    ///
    /// # Errors
    /// The rule and the value.
    pub fn parse(text: &str) -> Result<Overlap, String> {
        match text.trim() {
            "" | "skip" => Ok(Overlap::Skip),
            "queue_one" => Ok(Overlap::QueueOne),
            "cancel_previous" => Ok(Overlap::CancelPrevious),
            t => Err(format!("must be skip, queue_one or cancel_previous, got {t:?}")),
        }
    }

    /// The value as written in `fleet.yaml`.
    pub fn as_text(self) -> &'static str {
        match self {
            Overlap::Skip => "skip",
            Overlap::QueueOne => "queue_one",
            Overlap::CancelPrevious => "cancel_previous",
        }
    }
}

/// `loop.catchup`: a duration longer than zero (`1h`), or empty for [`DEFAULT_CATCHUP`].
///
/// # Errors
/// The rule broken, as [`DurationText::parse_bound`] gives it.
pub fn parse_catchup(text: &str) -> Result<Option<DurationText>, String> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    DurationText::parse_bound(text).map(Some).map_err(|rule| rule.replace("the built-in", "the built-in 90s"))
}

/// `loop.pause_after_failures`: a whole number, 0 (the default) for never; at most 1000.
///
/// # Errors
/// The rule and the value.
pub fn parse_pause_after_failures(text: &str) -> Result<u32, String> {
    let t = text.trim();
    match t.parse::<u32>() {
        Ok(n) if n <= 1000 => Ok(n),
        _ => Err(format!("must be a whole number of failed runs in a row from 0 (never pause) to 1000, got {t:?}")),
    }
}

impl Cron {
    /// The first occurrence after `unix_ms` (strictly) in zone `tz`, unix ms; `None` when
    /// it never fires. Daylight saving as the module docs say.
    pub fn next_in(&self, tz: Tz, unix_ms: u64) -> Option<u64> {
        let from = DateTime::<Utc>::from_timestamp_millis(i64::try_from(unix_ms).ok()?)?;
        // The wall clock at `from`. In the repeated hour of a fall-back the wall clock
        // runs again over times already passed: their instants (the first of each pair)
        // are not after `from`, and the search goes past them.
        // Whole seconds: croner carries a fraction through to what it finds.
        let mut local = from.with_timezone(&tz).naive_local().with_nanosecond(0)?;
        // A gap holds at most a day of matches at one per minute; a repeat likewise.
        for _ in 0..(2 * 24 * 60) {
            let next = self.next_local(local)?;
            let at = instant_of(tz, next)?;
            if at > unix_ms {
                return Some(at);
            }
            local = next;
        }
        None
    }

    /// The next wall-clock time after `local` (strictly) that the expression matches,
    /// found by croner on a calendar without daylight saving.
    fn next_local(&self, local: NaiveDateTime) -> Option<NaiveDateTime> {
        let as_utc = Utc.from_utc_datetime(&local);
        self.schedule.find_next_occurrence(&as_utc, false).ok().map(|t| t.naive_utc())
    }
}

/// The instant a matching wall-clock time fires at in `tz`, unix ms: itself when it occurs
/// once, the first when it occurs twice (fall-back), the first instant after the gap when
/// it does not occur (spring-forward).
fn instant_of(tz: Tz, local: NaiveDateTime) -> Option<u64> {
    let at = match tz.from_local_datetime(&local) {
        LocalResult::Single(t) | LocalResult::Ambiguous(t, _) => t,
        LocalResult::None => after_gap(tz, local)?,
    };
    u64::try_from(at.timestamp_millis()).ok()
}

/// The first instant after the gap `local` falls in: the earliest wall-clock time after
/// `local` that exists (found to the minute, then to the second).
fn after_gap(tz: Tz, local: NaiveDateTime) -> Option<DateTime<Tz>> {
    let exists = |t: NaiveDateTime| tz.from_local_datetime(&t).earliest();
    let minute = chrono::Duration::minutes(1);
    let second = chrono::Duration::seconds(1);
    let mut t = local;
    // Gaps in the tz database are at most a day long.
    for _ in 0..(24 * 60) {
        t += minute;
        if let Some(mut first) = exists(t) {
            let mut s = t - second;
            while s > local {
                match exists(s) {
                    Some(earlier) => first = earlier,
                    None => break,
                }
                s -= second;
            }
            return Some(first);
        }
    }
    None
}

/// The next `n` occurrences of `trigger` after `unix_ms` in `tz` (unix ms, ascending):
/// a cron's boundaries; empty for `manual`, an interval (its times hang on when it last
/// ran) and a trigger that never fires.
pub fn next_occurrences(trigger: &Trigger, tz: Tz, unix_ms: u64, n: usize) -> Vec<u64> {
    let Trigger::Cron(cron) = trigger else { return Vec::new() };
    let mut out = Vec::with_capacity(n);
    let mut from = unix_ms;
    while out.len() < n {
        match cron.next_in(tz, from) {
            Some(t) => {
                out.push(t);
                from = t;
            }
            None => break,
        }
    }
    out
}

/// An instant shown in zone `tz`: `2026-10-25 02:30 CEST (+02:00)`; UTC as
/// `2026-10-25 00:30 UTC`.
pub fn show_instant(tz: Tz, unix_ms: u64) -> String {
    let Some(t) = i64::try_from(unix_ms).ok().and_then(DateTime::<Utc>::from_timestamp_millis) else {
        return unix_ms.to_string();
    };
    if tz == Tz::UTC {
        return t.format("%Y-%m-%d %H:%M UTC").to_string();
    }
    t.with_timezone(&tz).format("%Y-%m-%d %H:%M %Z (%:z)").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix ms of an RFC 3339 instant.
    fn at(text: &str) -> u64 {
        DateTime::parse_from_rfc3339(text).unwrap().timestamp_millis() as u64
    }

    fn cron(expr: &str) -> Trigger {
        Trigger::parse(&format!("cron:{expr}")).unwrap()
    }

    fn next3(expr: &str, zone: &str, from: &str) -> Vec<u64> {
        next_occurrences(&cron(expr), parse_timezone(zone).unwrap(), at(from), 3)
    }

    fn instants(texts: &[&str]) -> Vec<u64> {
        texts.iter().map(|t| at(t)).collect()
    }

    #[test]
    fn a_daily_cron_in_berlin_fires_once_after_the_spring_gap_and_once_in_the_repeated_hour() {
        // 29 March 2026: 02:00 CET becomes 03:00 CEST at 01:00Z; 02:30 does not exist.
        assert_eq!(
            next3("30 2 * * *", "Europe/Berlin", "2026-03-28T01:30:00Z"),
            instants(&["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z", "2026-03-31T00:30:00Z"])
        );
        // 25 October 2026: 03:00 CEST becomes 02:00 CET at 01:00Z; 02:30 occurs twice,
        // fires at the first (00:30Z) only.
        assert_eq!(
            next3("30 2 * * *", "Europe/Berlin", "2026-10-24T00:30:00Z"),
            instants(&["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z", "2026-10-27T01:30:00Z"])
        );
        // Asked from inside the repeated hour (02:15 CET, after the first 02:30 passed).
        assert_eq!(next3("30 2 * * *", "Europe/Berlin", "2026-10-25T01:15:00Z")[0], at("2026-10-26T01:30:00Z"));
    }

    #[test]
    fn an_hourly_cron_in_berlin_never_fires_twice_for_one_wall_clock_hour_nor_skips_the_missing_one() {
        // Spring: 02:00 does not exist; it fires at 03:00 CEST (01:00Z), once for both.
        assert_eq!(
            next3("0 * * * *", "Europe/Berlin", "2026-03-28T23:30:00Z"),
            instants(&["2026-03-29T00:00:00Z", "2026-03-29T01:00:00Z", "2026-03-29T02:00:00Z"])
        );
        // Fall: 02:00 CEST (00:00Z) fires; 02:00 CET (01:00Z) is its repeat and does not.
        assert_eq!(
            next3("0 * * * *", "Europe/Berlin", "2026-10-24T23:30:00Z"),
            instants(&["2026-10-25T00:00:00Z", "2026-10-25T02:00:00Z", "2026-10-25T03:00:00Z"])
        );
        assert_eq!(next3("0 * * * *", "Europe/Berlin", "2026-10-25T01:30:00Z")[0], at("2026-10-25T02:00:00Z"));
    }

    #[test]
    fn a_daily_and_an_hourly_cron_in_new_york_across_both_changes() {
        // 8 March 2026: 02:00 EST becomes 03:00 EDT at 07:00Z.
        assert_eq!(
            next3("30 2 * * *", "America/New_York", "2026-03-07T07:30:00Z"),
            instants(&["2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z", "2026-03-10T06:30:00Z"])
        );
        assert_eq!(
            next3("0 * * * *", "America/New_York", "2026-03-08T05:30:00Z"),
            instants(&["2026-03-08T06:00:00Z", "2026-03-08T07:00:00Z", "2026-03-08T08:00:00Z"])
        );
        // 1 November 2026: 02:00 EDT becomes 01:00 EST at 06:00Z; 01:00-02:00 repeats,
        // 02:30 occurs once (EST).
        assert_eq!(
            next3("30 2 * * *", "America/New_York", "2026-10-31T06:30:00Z"),
            instants(&["2026-11-01T07:30:00Z", "2026-11-02T07:30:00Z", "2026-11-03T07:30:00Z"])
        );
        assert_eq!(
            next3("0 * * * *", "America/New_York", "2026-11-01T04:30:00Z"),
            instants(&["2026-11-01T05:00:00Z", "2026-11-01T07:00:00Z", "2026-11-01T08:00:00Z"])
        );
    }

    #[test]
    fn every_occurrence_inside_a_gap_fires_once_at_its_end() {
        // */20 in the Berlin gap: 02:00, 02:20, 02:40 all map to 03:00 CEST, once.
        assert_eq!(
            next3("*/20 * * * *", "Europe/Berlin", "2026-03-29T00:50:00Z"),
            instants(&["2026-03-29T01:00:00Z", "2026-03-29T01:20:00Z", "2026-03-29T01:40:00Z"])
        );
    }

    #[test]
    fn utc_is_the_default_zone_and_reads_the_fields_as_utc() {
        assert_eq!(parse_timezone("").unwrap(), Tz::UTC);
        assert_eq!(
            next3("30 2 * * *", "UTC", "2026-03-29T00:00:00Z"),
            instants(&["2026-03-29T02:30:00Z", "2026-03-30T02:30:00Z", "2026-03-31T02:30:00Z"])
        );
        let Trigger::Cron(c) = cron("30 2 * * *") else { unreachable!() };
        assert_eq!(c.next_in(Tz::UTC, at("2026-03-29T00:00:00Z")), c.next_after(at("2026-03-29T00:00:00Z")));
        // Strictly after: an instant on a boundary gives the next one.
        assert_eq!(c.next_in(Tz::UTC, at("2026-03-29T02:30:00Z")), Some(at("2026-03-30T02:30:00Z")));
        assert_eq!(c.next_in(Tz::UTC, at("2026-03-29T02:30:00.500Z")), Some(at("2026-03-30T02:30:00Z")));
    }

    #[test]
    fn keys_refuse_values_outside_their_rule_naming_the_value() {
        assert_eq!(parse_timezone(" Europe/Berlin ").unwrap(), chrono_tz::Europe::Berlin);
        assert_eq!(
            parse_timezone("Berlin").unwrap_err(),
            "must be an IANA time zone name (UTC, Europe/Berlin, America/New_York), got \"Berlin\""
        );
        assert!(parse_timezone("+02:00").is_err());
        assert_eq!(Overlap::parse("queue_one"), Ok(Overlap::QueueOne));
        assert_eq!(Overlap::parse(" cancel_previous "), Ok(Overlap::CancelPrevious));
        assert_eq!(Overlap::parse(""), Ok(Overlap::Skip));
        assert_eq!(Overlap::parse("queue").unwrap_err(), "must be skip, queue_one or cancel_previous, got \"queue\"");
        assert_eq!(parse_catchup("1h").unwrap().unwrap().duration, Duration::from_secs(3600));
        assert_eq!(parse_catchup(" ").unwrap(), None);
        assert_eq!(
            parse_catchup("0").unwrap_err(),
            "must be longer than zero (leave it out for the built-in 90s), got \"0\""
        );
        assert_eq!(parse_pause_after_failures("3"), Ok(3));
        assert_eq!(parse_pause_after_failures("0"), Ok(0));
        assert_eq!(
            parse_pause_after_failures("-1").unwrap_err(),
            "must be a whole number of failed runs in a row from 0 (never pause) to 1000, got \"-1\""
        );
    }

    #[test]
    fn instants_show_in_the_zone_with_its_offset() {
        let berlin = chrono_tz::Europe::Berlin;
        assert_eq!(show_instant(berlin, at("2026-10-25T00:30:00Z")), "2026-10-25 02:30 CEST (+02:00)");
        assert_eq!(show_instant(berlin, at("2026-10-25T01:30:00Z")), "2026-10-25 02:30 CET (+01:00)");
        assert_eq!(show_instant(Tz::UTC, at("2026-10-25T01:30:00Z")), "2026-10-25 01:30 UTC");
    }
}
