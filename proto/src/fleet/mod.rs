//! Fleets: the `fleet.yaml` definition, its validation, the loop's bounds and fan-out cap,
//! jobs and their statuses, run ids, stop reasons and the pure rules a loop applies.
//!
//! The behaviour comes from the fleet-loops seed (the specification: §Three ways a loop
//! ends, §The bounds, §Settings that used to mean something else, §A fixed step graph,
//! §Unattended runs, §Watching a run) and, where the seed is silent, from
//! the fleet reference (§1 schema, §2 limits, §3 loop, §4 jobs); the keys follow
//! issue #10. `docs/fleet.md` is the user-facing reference.
//!
//! Two loaders share one validator:
//! - [`Fleet::parse`] is strict (`mur fleet create` / `apply`): unknown keys, wrong types and
//!   every broken rule are refused, each as `path: rule`, all at once.
//! - [`Fleet::load_stored`] reads a definition already stored. Values an older version
//!   accepted (a calendar-date deadline, an unfirable cron, a negative budget, a bare
//!   `done_when`, an unknown key, a bad `fanout:`, a `limits:` block that does not parse)
//!   load, each with a notice in [`Fleet::notices`], so the fleet still accepts an unrelated
//!   edit ([`apply_loop_edit`]). Rules the seed applies "when the fleet loads" (the name, the
//!   `procedure:` rules) are refused by both.
//!
//! Pure: no IO, no clock reads (callers pass unix milliseconds and the environment in).
//!
//! One file per concern, each re-exported here (paths stay `fleet::…`): `definition` (the
//! validated shape), `validate` (the raw shape and its rules), `names` (names, durations),
//! `cron`, `schedule`, `edit` (loop edits), `bounds`, `run_id`, `jobs`, `rules` (the loop's).

use crate::int::{Int, Real};
use serde::{Deserialize, Serialize};
use serde_yaml_ng::{Mapping, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

mod bounds;
mod cron;
mod definition;
mod edit;
mod jobs;
mod names;
mod rules;
mod run_id;
pub mod schedule;
#[cfg(test)]
mod tests;
mod validate;

pub use bounds::*;
pub use cron::*;
pub use definition::*;
pub use edit::*;
pub use jobs::*;
pub use names::*;
pub use rules::*;
pub use run_id::*;
pub use schedule::Overlap;
pub use validate::*;

/// Built-in loop deadline (the fleet-loops seed, §The bounds: "built-in 1h").
pub const BUILTIN_DEADLINE: &str = "1h";
/// Built-in stuck window (§The bounds: "built-in 10m").
pub const BUILTIN_STUCK: &str = "10m";
/// Delegated steps in flight at once by default (§The bounds, fan-out bound).
pub const DEFAULT_FANOUT: u32 = 3;
/// The environment variable that raises the fan-out cap.
pub const FANOUT_ENV: &str = "MUR_FLEET_FANOUT";
/// The environment variable that lets unattended (triggered) runs start (§Unattended runs).
pub const AUTORUN_ENV: &str = "MUR_FLEET_AUTORUN";
/// A retried procedure step's extra attempts when `max_retries` is not given (reference §6).
pub const DEFAULT_MAX_RETRIES: u32 = 1;
/// Most steps a `procedure:` may have (§A fixed step graph).
pub const MAX_PROCEDURE_STEPS: usize = 32;
/// The diagnostic iteration ceiling that replaced the iteration cap (§The bounds).
pub const ITERATION_CEILING: u64 = 10_000;
/// Longest `--run-id` (reference §3, setup step 7).
pub const MAX_RUN_ID_LEN: usize = 96;
/// The prefix of a fleet's channel id: `fleet-<name>`.
pub const CHANNEL_PREFIX: &str = "fleet-";
/// A job created by `mur fleet send` or a job argument of `mur fleet run`.
pub const SOURCE_CLI: &str = "cli";
/// A job a run made for its standing goal when a procedure step of it was parked for
/// approval (the fleet-loops seed, §Unattended runs): the handle to approve it by.
pub const SOURCE_GOAL: &str = "goal";

/// The notice printed when an iteration cap is given (§The bounds: "Iteration cap — gone").
pub const MAX_ITERATIONS_NOTICE: &str = "is ignored: loops are bounded by deadline, stuck and cost \
     (a 10000-iteration diagnostic ceiling remains)";

const DURATION_RULE: &str = "must be a duration such as 30s, 5m, 2h, 1d or 1h30m";

/// The longest duration a fleet takes (a deadline, a stuck window, a trigger's interval):
/// 365 days. Longer is no bound a loop could meet, and a clock reading plus a few hundred
/// thousand years of milliseconds overflows.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);
const NAME_RULE: &str = "must be 1-64 characters of a-z, 0-9, '-' or '_'";
const CAPSULE_NAME_RULE: &str =
    "must be a capsule name (1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit)";
