//! Run ids (§Watching a run).

use super::*;

/// Checks a `--run-id`: 1–96 characters of letters, digits, `-` and `_`.
///
/// # Errors
/// The rule, naming the flag.
pub fn check_run_id(id: &str) -> Result<(), String> {
    let ok = (1..=MAX_RUN_ID_LEN).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!("--run-id: must be 1-{MAX_RUN_ID_LEN} letters, digits, '-' or '_', got {id:?}"))
    }
}

/// Whether `id` names a run: a run id (the [`check_run_id`] rule) or a loop iteration's
/// `<run id>-<n>`.
pub fn is_run_ref(id: &str) -> bool {
    let iteration_of = id.rsplit_once('-').filter(|(_, n)| n.parse::<u64>().is_ok()).map(|(base, _)| base);
    check_run_id(id).is_ok() || iteration_of.is_some_and(|base| check_run_id(base).is_ok())
}

/// A loop's default run id: `fleet-<name>-<uuidv7>`.
pub fn loop_run_id(fleet: &str, uuid: uuid::Uuid) -> String {
    format!("fleet-{fleet}-{}", uuid.hyphenated())
}

/// A one-shot run's default run id: `run-<uuidv7>`.
pub fn one_shot_run_id(uuid: uuid::Uuid) -> String {
    format!("run-{}", uuid.hyphenated())
}

/// The run id of a loop's iteration `n` (from 0): `<run-id>-<n>`.
pub fn iteration_run_id(run_id: &str, n: u64) -> String {
    format!("{run_id}-{n}")
}

/// Whether a job's run id is selected by `--since <run-id>`: a prefix match, so a loop's
/// id also selects every iteration (`<id>-0`, `<id>-1`, …).
pub fn run_id_matches(job_run_id: Option<&str>, since: &str) -> bool {
    job_run_id.is_some_and(|r| r.starts_with(since))
}
