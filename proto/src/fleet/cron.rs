//! Cron expressions for `trigger: cron:…` (§Settings that used to mean something else).

/// A 5-field POSIX cron expression (`minute hour day-of-month month day-of-week`), parsed
/// and evaluated by the `croner` crate (POSIX/Vixie semantics: names, ranges, steps,
/// day-of-week 7 = Sunday, either day field matching when both are restricted). An
/// expression that can never fire is refused (§Settings that used to mean something
/// else: `cron:0 9 31 2 *` — "February has no 31st").
#[derive(Clone, Debug)]
pub struct Cron {
    /// The expression, trimmed, fields separated by single spaces.
    pub text: String,
    pub(super) schedule: croner::Cron,
}

impl PartialEq for Cron {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Cron {}

const FIELD_NAMES: [&str; 5] = ["minute", "hour", "day-of-month", "month", "day-of-week"];
const MONTH_NAMES: [&str; 12] = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];
const MONTH_FULL: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

impl Cron {
    /// Parses an expression.
    ///
    /// # Errors
    /// A wrong field count; a field croner refuses (named: `minute: "60" is not valid
    /// (…)`); an expression that never fires (`0 9 31 2 *`: February has no 31st).
    pub fn parse(expr: &str) -> Result<Cron, String> {
        use std::str::FromStr;
        let fields: Vec<&str> = expr.split_whitespace().collect();
        if fields.len() != 5 {
            return Err(format!(
                "needs 5 fields (minute hour day-of-month month day-of-week), got {} in {:?}",
                fields.len(),
                expr.trim()
            ));
        }
        let text = fields.join(" ");
        let schedule = croner::Cron::from_str(&text).map_err(|e| {
            // Name the field: the first one croner refuses on its own.
            (0..5)
                .find_map(|i| {
                    let mut probe = ["*"; 5];
                    probe[i] = fields[i];
                    croner::Cron::from_str(&probe.join(" "))
                        .err()
                        .map(|e| format!("{}: {:?} is not valid ({e})", FIELD_NAMES[i], fields[i]))
                })
                .unwrap_or_else(|| format!("{e}, got {text:?}"))
        })?;
        let cron = Cron { text, schedule };
        if cron.next_after(0).is_none() {
            return Err(format!("never fires: {}, got {:?}", never_reason(&fields), cron.text));
        }
        Ok(cron)
    }

    /// Whether some date matches.
    pub fn can_fire(&self) -> bool {
        self.next_after(now_unix_ms()).is_some()
    }

    /// The first time after `unix_ms` the expression fires (UTC), unix ms; `None` when it
    /// never does.
    pub fn next_after(&self, unix_ms: u64) -> Option<u64> {
        let from = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(i64::try_from(unix_ms).ok()?)?;
        self.schedule.find_next_occurrence(&from, false).ok().map(|t| t.timestamp_millis().max(0) as u64)
    }
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Why an expression croner finds no date for never fires, in the seed's words when the
/// day and month fields are plain: "February has no 31st".
fn never_reason(fields: &[&str]) -> String {
    let days: Option<Vec<usize>> = fields[2].split(',').map(|d| d.parse().ok()).collect();
    let month = fields[3].split(',').next().and_then(|m| {
        m.parse::<usize>().ok().or_else(|| MONTH_NAMES.iter().position(|n| n.eq_ignore_ascii_case(m)).map(|i| i + 1))
    });
    match (days.and_then(|d| d.into_iter().min()), month) {
        (Some(day), Some(month)) if (1..=12).contains(&month) => {
            format!("{} has no {}", MONTH_FULL[month - 1], ordinal(day))
        }
        _ => "no date matches it".into(),
    }
}

fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}
