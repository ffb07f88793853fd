//! Editing a stored fleet's loop settings (§Settings that used to mean something else).

use super::*;

/// A `mur fleet set-loop` edit: only the fields given are judged and changed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoopEdit {
    /// `--trigger`.
    pub trigger: Option<String>,
    /// `--done-when` (empty clears it: the router judges).
    pub done_when: Option<String>,
    /// `--deadline` (empty clears it).
    pub deadline: Option<String>,
    /// `--budget-usd` (0: no ceiling).
    pub budget_usd: Option<f64>,
    /// `--timezone` (empty: UTC).
    pub timezone: Option<String>,
    /// `--overlap`.
    pub overlap: Option<String>,
    /// `--catchup` (empty clears it: the built-in 90s).
    pub catchup: Option<String>,
    /// `--pause-after-failures` (0: never).
    pub pause_after_failures: Option<String>,
}

/// Applies `edit` to a stored `fleet.yaml` and returns the new text. Each given value is
/// trimmed and judged by the parser execution uses; values not given are kept as stored,
/// even ones the strict loader would refuse, so a stale bad value never blocks an
/// unrelated edit. Other keys keep their values (comments and key order are not kept).
///
/// # Errors
/// [`Error::Invalid`] with one `--flag: rule` line per refused value; or the stored text
/// does not load ([`Fleet::load_stored`]).
pub fn apply_loop_edit(stored: &str, edit: &LoopEdit) -> Result<String, Error> {
    Fleet::load_stored(stored)?;
    let mut errors = Vec::new();
    let mut set: Vec<(&str, Value)> = Vec::new();
    if let Some(t) = &edit.trigger {
        match Trigger::parse(t) {
            Ok(_) => set.push(("trigger", Value::String(t.trim().to_string()))),
            Err(rule) => errors.push(format!("--trigger: {rule}")),
        }
    }
    if let Some(d) = &edit.done_when {
        match DoneWhen::parse(d) {
            Ok(p) => set.push(("done_when", Value::String(p.as_text()))),
            Err(rule) => errors.push(format!("--done-when: {rule}")),
        }
    }
    if let Some(d) = &edit.deadline {
        if d.trim().is_empty() {
            set.push(("deadline", Value::String(String::new())));
        } else {
            match DurationText::parse_bound(d) {
                Ok(d) => set.push(("deadline", Value::String(d.text))),
                Err(rule) => errors.push(format!("--deadline: {rule}")),
            }
        }
    }
    if let Some(b) = edit.budget_usd {
        if b.is_finite() && b >= 0.0 {
            set.push(("budget_usd", Value::from(b)));
        } else {
            errors.push(format!("--budget-usd: must be a non-negative number (0 for no ceiling), got {b}"));
        }
    }
    if let Some(z) = &edit.timezone {
        match schedule::parse_timezone(z) {
            Ok(tz) => set.push(("timezone", Value::String(tz.name().to_string()))),
            Err(rule) => errors.push(format!("--timezone: {rule}")),
        }
    }
    if let Some(o) = &edit.overlap {
        match Overlap::parse(o) {
            Ok(o) => set.push(("overlap", Value::String(o.as_text().to_string()))),
            Err(rule) => errors.push(format!("--overlap: {rule}")),
        }
    }
    if let Some(c) = &edit.catchup {
        match schedule::parse_catchup(c) {
            Ok(c) => set.push(("catchup", Value::String(c.map(|c| c.text).unwrap_or_default()))),
            Err(rule) => errors.push(format!("--catchup: {rule}")),
        }
    }
    if let Some(n) = &edit.pause_after_failures {
        match schedule::parse_pause_after_failures(n) {
            Ok(n) => set.push(("pause_after_failures", Value::from(n))),
            Err(rule) => errors.push(format!("--pause-after-failures: {rule}")),
        }
    }
    if !errors.is_empty() {
        return Err(Error::Invalid(errors));
    }
    let mut value: Value =
        serde_yaml_ng::from_str(crate::without_bom(stored)).map_err(|e| Error::Parse(e.to_string()))?;
    let map = value.as_mapping_mut().ok_or_else(|| Error::Parse("fleet.yaml must be a mapping of keys".to_string()))?;
    // With a `limits:` block the legacy `loop.deadline` / `loop.budget_usd` are ignored
    // (§The bounds; reference §9 Limits/resolution): write the bounds where they apply,
    // `limits.deadline` and `limits.cost_usd`, so a set-loop value never looks set and
    // does nothing. An empty deadline removes the key.
    if let Some(limits) = map.get_mut(Value::String("limits".to_string())).and_then(Value::as_mapping_mut) {
        set.retain(|(k, v)| {
            let target = match *k {
                "deadline" => "deadline",
                "budget_usd" => "cost_usd",
                _ => return true,
            };
            if v.as_str().is_some_and(str::is_empty) {
                limits.remove(Value::String(target.to_string()));
            } else {
                limits.insert(Value::String(target.to_string()), v.clone());
            }
            false
        });
    }
    let lp = map.entry(Value::String("loop".to_string())).or_insert_with(|| Value::Mapping(Mapping::new()));
    if !lp.is_mapping() {
        *lp = Value::Mapping(Mapping::new());
    }
    let lp = lp.as_mapping_mut().expect("loop is a mapping");
    for (k, v) in set {
        lp.insert(Value::String(k.to_string()), v);
    }
    serde_yaml_ng::to_string(&value).map_err(|e| Error::Parse(e.to_string()))
}
