//! Fleet names, channel ids and durations (the fleet reference §1, §2).

use super::*;

/// Whether `name` is a valid fleet name (reference §1 `valid_fleet_name`): 1–64 chars, only
/// `a-z`, `0-9`, `-`, `_` — no uppercase, dot, slash or space.
pub fn is_valid_fleet_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// The fleet's channel id, `fleet-<name>`.
pub fn channel_id(name: &str) -> String {
    format!("{CHANNEL_PREFIX}{name}")
}

/// The fleet a channel id belongs to: only when the rest after `fleet-` is a valid name.
pub fn fleet_of_channel(channel: &str) -> Option<&str> {
    channel.strip_prefix(CHANNEL_PREFIX).filter(|n| is_valid_fleet_name(n))
}

/// Parses a relative duration: `30s`, `5m`, `2h`, `1d`, compounds such as `1h30m`, or a
/// bare integer of seconds; surrounding whitespace is trimmed (reference §2). The units are
/// checked here and the arithmetic is `humantime`'s. Refused: empty, `off`, `2 hours`,
/// `1h3`, `h`, `-5m`, `1.5h`, other units, calendar dates (a deadline is relative to when
/// the loop started, §The bounds; an older version read `2026-12-31` as no deadline), and
/// anything over [`MAX_DURATION`].
///
/// # Errors
/// The rule broken, with the value.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if looks_like_date(t) {
        return Err(format!(
            "must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, got {t:?}"
        ));
    }
    let bad = || format!("{DURATION_RULE}, got {t:?}");
    if t.is_empty() {
        return Err(bad());
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        // Digits past 64 bits are past the bound too.
        let d = t.parse::<u64>().map_or(Duration::MAX, Duration::from_secs);
        if d > MAX_DURATION {
            return Err(format!("must be at most 365d, got {t:?}"));
        }
        return Ok(d);
    }
    // Each part is digits followed by exactly one of s, m, h, d.
    let mut digits = 0usize;
    for b in t.bytes() {
        match b {
            b'0'..=b'9' => digits += 1,
            b's' | b'm' | b'h' | b'd' if digits > 0 => digits = 0,
            _ => return Err(bad()),
        }
    }
    if digits > 0 {
        return Err(bad());
    }
    let d = humantime::parse_duration(t).map_err(|_| bad())?;
    if d > MAX_DURATION {
        return Err(format!("must be at most 365d, got {t:?}"));
    }
    Ok(d)
}

fn looks_like_date(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() >= 10
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..7].iter().all(u8::is_ascii_digit)
        && b[7] == b'-'
        && b[8..10].iter().all(u8::is_ascii_digit)
}
