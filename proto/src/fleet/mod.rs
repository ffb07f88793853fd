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

use crate::int::{Int, Real};
use serde::{Deserialize, Serialize};
use serde_yaml_ng::{Mapping, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

pub mod schedule;
#[cfg(test)]
mod tests;

pub use schedule::Overlap;

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

// ---------------------------------------------------------------------------------------
// The validated definition.

/// A validated `fleet.yaml`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fleet {
    /// 1–64 chars of `a-z 0-9 - _` ([`is_valid_fleet_name`]).
    pub name: String,
    /// The standing goal: used when no job is queued and no job is given. Default empty.
    pub goal: String,
    /// Capsule names on the cluster, in order, without duplicates. Default empty (a run
    /// refuses an empty list, see [`Fleet::check_runnable`]).
    pub members: Vec<String>,
    /// A capsule that plans (and judges DONE, and writes the marker synthesis). Absent: a
    /// single member gets every job, and several members each get it ([`Fleet::plan_kind`]).
    pub router: Option<String>,
    /// The `loop:` block.
    pub r#loop: Loop,
    /// The `limits:` block.
    pub limits: LimitsBlock,
    /// The `fanout:` key: a positive cap on delegated steps at once; see [`resolve_fanout`].
    pub fanout: Option<u32>,
    /// The `hitl:` approval policy.
    pub hitl: Hitl,
    /// A fixed step graph; when non-empty the fleet runs it with no router call.
    pub procedure: Vec<Step>,
    /// Speculative or partitioned parallel tracks.
    pub parallel: Option<Parallel>,
    /// Tools the work needs, passed to each delegated step for its preflight.
    pub needs: Vec<String>,
    /// One line per value read but not used as written (`path: what happened`): an ignored
    /// `loop.max_iterations`, and in [`Fleet::load_stored`] every value an older version
    /// accepted that the strict loader refuses.
    pub notices: Vec<String>,
}

/// The `loop:` block (§Three ways a loop ends; reference §1 FleetLoop). Every field
/// defaults, so a block with only `trigger` is complete.
#[derive(Clone, Debug, PartialEq)]
pub struct Loop {
    /// When unattended runs start. Default [`Trigger::Manual`].
    pub trigger: Trigger,
    /// When a loop has converged. Default [`DoneWhen::Router`].
    pub done_when: DoneWhen,
    /// Legacy spelling of `limits.deadline`, used only when `limits:` is absent.
    pub deadline: Option<DurationText>,
    /// Legacy spelling of `limits.cost_usd` (0 = none), used only when `limits:` is absent.
    pub budget_usd: f64,
    /// Ignored since iteration caps went away; a non-zero value only adds a notice.
    pub max_iterations: u64,
    /// The zone a cron trigger's fields are read in (issue #36). Default UTC.
    pub timezone: chrono_tz::Tz,
    /// What an occurrence does when a run of the fleet is still going. Default skip.
    pub overlap: Overlap,
    /// How long after its time a missed occurrence still runs (at most one run for all
    /// those missed); `None`: [`schedule::DEFAULT_CATCHUP`].
    pub catchup: Option<DurationText>,
    /// The trigger pauses itself after this many failed runs in a row; 0: never.
    pub pause_after_failures: u32,
}

impl Loop {
    /// The catch-up window in force.
    pub fn catchup_window(&self) -> Duration {
        self.catchup.as_ref().map_or(schedule::DEFAULT_CATCHUP, |c| c.duration)
    }
}

impl Default for Loop {
    fn default() -> Self {
        Loop {
            trigger: Trigger::Manual,
            done_when: DoneWhen::Router,
            deadline: None,
            budget_usd: 0.0,
            max_iterations: 0,
            timezone: chrono_tz::Tz::UTC,
            overlap: Overlap::Skip,
            catchup: None,
            pause_after_failures: 0,
        }
    }
}

/// A duration kept with the text it was written as (`1h30m`), for display.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DurationText {
    /// The text, trimmed.
    pub text: String,
    /// Its length.
    pub duration: Duration,
}

impl DurationText {
    /// Parses `text` with [`parse_duration`], keeping the trimmed text.
    ///
    /// # Errors
    /// The rule broken, as [`parse_duration`] gives it.
    pub fn parse(text: &str) -> Result<DurationText, String> {
        parse_duration(text).map(|duration| DurationText { text: text.trim().to_string(), duration })
    }

    /// Parses a loop's deadline with [`parse_duration`] and refuses zero: a zero deadline
    /// stops a run before its first iteration, which no one means (`0` is not "no
    /// deadline": leave the key out for the built-in 1h). [`Stuck::parse`] refuses a zero
    /// window likewise (`off` turns it off).
    ///
    /// # Errors
    /// The rule broken, as [`parse_duration`] gives it, or that it must be longer than zero.
    pub fn parse_bound(text: &str) -> Result<DurationText, String> {
        let d = DurationText::parse(text)?;
        if d.duration.is_zero() {
            return Err(format!("must be longer than zero (leave it out for the built-in), got {:?}", d.text));
        }
        Ok(d)
    }
}

impl fmt::Display for DurationText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// `loop.trigger`: `manual` | `interval:<duration>` | `cron:<5-field expression>`.
#[derive(Clone, Debug, PartialEq)]
pub enum Trigger {
    /// Runs only when asked (default; an empty value means the same).
    Manual,
    /// Due when never run or when the duration has passed since the last run.
    Interval(DurationText),
    /// Due at the expression's boundaries (local time).
    Cron(Box<Cron>),
    /// A stored value that no longer parses (for example an unfirable cron); never fires.
    /// Only [`Fleet::load_stored`] produces it.
    Never(String),
}

impl Trigger {
    /// Parses a trigger value (trimmed).
    ///
    /// # Errors
    /// The rule broken, without the field path.
    pub fn parse(text: &str) -> Result<Trigger, String> {
        let t = text.trim();
        if t.is_empty() || t == "manual" {
            return Ok(Trigger::Manual);
        }
        if let Some(d) = t.strip_prefix("interval:") {
            let d = DurationText::parse(d).map_err(|rule| format!("interval: {rule}"))?;
            if d.duration.is_zero() {
                return Err(format!("interval: must be longer than zero, got {:?}", d.text));
            }
            return Ok(Trigger::Interval(d));
        }
        if let Some(expr) = t.strip_prefix("cron:") {
            return Cron::parse(expr).map(|c| Trigger::Cron(Box::new(c))).map_err(|rule| format!("cron: {rule}"));
        }
        Err(format!(
            "must be manual, interval:<duration> or cron:<minute hour day-of-month month day-of-week>, got {t:?}"
        ))
    }

    /// The value as written in `fleet.yaml`.
    pub fn as_text(&self) -> String {
        match self {
            Trigger::Manual => "manual".to_string(),
            Trigger::Interval(d) => format!("interval:{}", d.text),
            Trigger::Cron(c) => format!("cron:{}", c.text),
            Trigger::Never(t) => t.clone(),
        }
    }
}

/// `loop.done_when` (§Three ways a loop ends).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DoneWhen {
    /// Empty: the router judges DONE each iteration (one model call per iteration).
    Router,
    /// `queue-empty`: an iteration that finds nothing queued ends the loop, before any
    /// model call.
    QueueEmpty,
    /// `marker:<TEXT>`: a member emits TEXT alone on a line ([`marker_matches`]).
    Marker(String),
}

impl DoneWhen {
    /// Parses a `done_when` value (trimmed).
    ///
    /// # Errors
    /// A value that is none of the three forms; a bare word is refused with the
    /// `marker:` spelling it probably meant (§Settings that used to mean something else).
    pub fn parse(text: &str) -> Result<DoneWhen, String> {
        let t = text.trim();
        if t.is_empty() {
            return Ok(DoneWhen::Router);
        }
        if t == "queue-empty" {
            return Ok(DoneWhen::QueueEmpty);
        }
        if let Some(m) = t.strip_prefix("marker:") {
            let m = m.trim();
            if m.is_empty() {
                return Err("marker: needs the text a member emits alone on a line, got \"marker:\"".to_string());
            }
            if m.contains('\n') {
                return Err(format!("marker: must be one line, got {m:?}"));
            }
            return Ok(DoneWhen::Marker(m.to_string()));
        }
        Err(format!(
            "must be empty (the router judges), queue-empty or marker:<TEXT>; the marker: prefix is required \
             (marker:{t}), got {t:?}"
        ))
    }

    /// The value as written in `fleet.yaml` (`""` for the router).
    pub fn as_text(&self) -> String {
        match self {
            DoneWhen::Router => String::new(),
            DoneWhen::QueueEmpty => "queue-empty".to_string(),
            DoneWhen::Marker(m) => format!("marker:{m}"),
        }
    }
}

/// A `limits:` block, from `fleet.yaml` or the cluster's `config.yaml`.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum LimitsBlock {
    /// No `limits:` key (a fleet's legacy `loop.deadline` / `loop.budget_usd` then apply).
    #[default]
    Absent,
    /// A block that parsed; an empty block (`limits: {}`) still suppresses the legacy keys.
    Set(Limits),
    /// A stored block that does not parse: the fleet loads, but its bounds do not resolve,
    /// so it never auto-runs and a run refuses (§Unattended runs). One `path: rule` each.
    Invalid(Vec<String>),
}

impl LimitsBlock {
    /// Reads the cluster config's `limits:` block (`config.yaml`, the third scope of
    /// §The bounds): absent or null is [`LimitsBlock::Absent`].
    ///
    /// # Errors
    /// Every broken rule as `limits.<key>: rule` (an unknown key, a bad duration, a
    /// negative cost), so the coordinator refuses to start with a config it would misread.
    pub fn from_config(value: Option<serde_yaml_ng::Value>) -> Result<LimitsBlock, Vec<String>> {
        match value.map(serde_yaml_ng::from_value::<Option<RawLimits>>) {
            None | Some(Ok(None)) => Ok(LimitsBlock::Absent),
            Some(Err(e)) => Err(vec![format!("limits: {e}")]),
            Some(Ok(Some(raw))) => {
                let mut errors = Vec::new();
                let limits = validate_limits(raw, &mut errors);
                if errors.is_empty() { Ok(LimitsBlock::Set(limits)) } else { Err(errors) }
            }
        }
    }
}

/// The three knobs of Execution Limits (§The bounds; reference §2).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Limits {
    /// Wall clock for the whole loop, relative to its start.
    pub deadline: Option<DurationText>,
    /// Window without agent-authored progress, or off.
    pub stuck: Option<Stuck>,
    /// Spend ceiling in USD (metered models only); 0 means no ceiling.
    pub cost_usd: Option<f64>,
}

/// `limits.stuck`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stuck {
    /// `off` (any case): no stuck detection.
    Off,
    /// Stop when no agent-authored channel event arrived for this long.
    After(DurationText),
}

impl Stuck {
    /// Parses `off` or a duration.
    ///
    /// # Errors
    /// The rule broken.
    pub fn parse(text: &str) -> Result<Stuck, String> {
        if text.trim().eq_ignore_ascii_case("off") {
            return Ok(Stuck::Off);
        }
        // Not a duration at all: the rule with `off` in it; a duration past the bound or a
        // calendar date: that rule, as a deadline's.
        let d = DurationText::parse(text).map_err(|rule| {
            if rule.starts_with(DURATION_RULE) {
                format!("{DURATION_RULE}, or off, got {:?}", text.trim())
            } else {
                rule
            }
        })?;
        if d.duration.is_zero() {
            return Err(format!("must be longer than zero, or off, got {:?}", d.text));
        }
        Ok(Stuck::After(d))
    }

    /// `off` or the duration's text.
    pub fn as_text(&self) -> &str {
        match self {
            Stuck::Off => "off",
            Stuck::After(d) => &d.text,
        }
    }

    /// The window, `None` when off.
    pub fn window(&self) -> Option<Duration> {
        match self {
            Stuck::Off => None,
            Stuck::After(d) => Some(d.duration),
        }
    }
}

impl Limits {
    /// Parses a `limits:` block given alone (the value of the `limits:` key of a
    /// `config.yaml`), strictly: unknown keys refused, every rule at once.
    ///
    /// # Errors
    /// [`Error::Parse`] or [`Error::Invalid`], paths starting `limits.`.
    pub fn from_yaml(text: &str) -> Result<Limits, Error> {
        let raw: RawLimits = serde_yaml_ng::from_str(text).map_err(|e| Error::Parse(format!("limits: {e}")))?;
        let mut errors = Vec::new();
        let limits = validate_limits(raw, &mut errors);
        if errors.is_empty() { Ok(limits) } else { Err(Error::Invalid(errors)) }
    }
}

/// The `hitl:` block (reference §1 FleetHitl, §7).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Hitl {
    /// Absent: wait on a terminal, defer without one (decided at run time).
    pub mode: Option<HitlMode>,
    /// Risk tiers approved without asking (recorded on the channel); only `read` and
    /// `write` are permitted.
    pub auto_approve_tiers: Vec<RiskTier>,
}

/// `hitl.mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HitlMode {
    /// Park the request; the step is reported blocked and the loop stops awaiting-approval.
    Defer,
    /// Block until someone answers.
    Wait,
    /// Refuse every request.
    Deny,
}

/// A tool call's risk tier, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RiskTier {
    /// Reads only.
    Read,
    /// Writes files in granted places: the highest tier a fleet may auto-approve.
    Write,
    /// Reaches the network.
    NetworkEgress,
    /// Spends money.
    Spend,
    /// Deletes or overwrites beyond recovery.
    Destructive,
    /// Needs elevated rights.
    Privileged,
}

impl RiskTier {
    /// The highest tier `hitl.auto_approve_tiers` may name.
    pub const AUTO_APPROVE_CEILING: RiskTier = RiskTier::Write;

    /// The `fleet.yaml` spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            RiskTier::Read => "read",
            RiskTier::Write => "write",
            RiskTier::NetworkEgress => "network-egress",
            RiskTier::Spend => "spend",
            RiskTier::Destructive => "destructive",
            RiskTier::Privileged => "privileged",
        }
    }
}

/// One step of a `procedure:` (§A fixed step graph).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Unique, non-empty; the only label later steps see on its output.
    pub id: String,
    /// A name in `members:`.
    pub member: String,
    /// The step's own task, given with the full goal. Default empty.
    pub task: String,
    /// Ids of steps whose output this step receives and waits for.
    pub depends_on: Vec<String>,
    /// What a failure of this step does to the run (reference §6). Default abort.
    pub on_failure: OnFailure,
    /// With `on_failure: retry`, how many times the step runs again before the run aborts.
    /// Default [`DEFAULT_MAX_RETRIES`]; ignored otherwise.
    pub max_retries: u32,
    /// The risk tier of what the step does. A step with a tier needs approval before it
    /// runs unless `hitl.auto_approve_tiers` lists it (the fleet-loops seed, §Unattended
    /// runs; reference §7); a step without one needs none.
    pub tier: Option<RiskTier>,
}

/// A procedure step's `on_failure` (reference §6, "Failure").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// The run ends failed once the step's rank is over; later ranks do not start.
    #[default]
    Abort,
    /// The failure is recorded and the run goes on; dependents run without its output.
    Skip,
    /// The step runs again, up to `max_retries` times, then the run aborts.
    Retry,
}

/// `parallel.mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParallelMode {
    /// Several tracks attempt the same goal by different approaches; a judge picks.
    Speculative,
    /// The work is split into regions, one per track.
    Partition,
}

/// The `parallel:` block (reference §1: carried for the executor, not interpreted here).
#[derive(Clone, Debug, PartialEq)]
pub struct Parallel {
    /// Speculative or partition.
    pub mode: ParallelMode,
    /// The tracks, members assigned round-robin.
    pub tracks: Vec<Track>,
    /// Who picks the winning track.
    pub judge: Option<Judge>,
    /// A filter applied before judging, passed through as written.
    pub pre_filter: Option<String>,
    /// Partition mode: what is split.
    pub partition: Option<Partition>,
}

/// One `parallel.tracks[]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Track {
    /// Unique track name.
    pub name: String,
    /// Appended to the goal as "Approach:".
    #[serde(default)]
    pub approach: String,
    /// A model for this track.
    #[serde(default)]
    pub model: Option<String>,
}

/// `parallel.judge`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Judge {
    /// The judging model.
    #[serde(default)]
    pub model: Option<String>,
    /// What the judge scores against.
    #[serde(default)]
    pub rubric: Option<String>,
}

/// `parallel.partition`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Partition {
    /// The file whose regions are split between tracks.
    pub target_file: String,
}

/// How a run turns its goal into steps ([`Fleet::plan_kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanKind {
    /// The fleet's `procedure:`, with no router call; never replaced by anything else.
    Procedure,
    /// The router plans (it is set and there are several members).
    Router,
    /// Every member gets the goal (one member: it gets every job).
    Broadcast,
}

/// Why a fleet definition (or a flag, or an edit) was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Error {
    /// Not YAML of the fleet's shape (an unknown key, a wrong type, an enum value outside
    /// its set); the message names the field path.
    #[error("{0}")]
    Parse(String),
    /// The shape is right but values break rules; one `path: rule` line per broken rule.
    #[error("{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

// ---------------------------------------------------------------------------------------
// Names, durations, cron.

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

/// A 5-field POSIX cron expression (`minute hour day-of-month month day-of-week`), parsed
/// and evaluated by the `croner` crate (POSIX/Vixie semantics: names, ranges, steps,
/// day-of-week 7 = Sunday, either day field matching when both are restricted). An
/// expression that can never fire is refused (§Settings that used to mean something
/// else: `cron:0 9 31 2 *` — "February has no 31st").
#[derive(Clone, Debug)]
pub struct Cron {
    /// The expression, trimmed, fields separated by single spaces.
    pub text: String,
    schedule: croner::Cron,
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

// ---------------------------------------------------------------------------------------
// Raw shape: every field optional, unknown keys refused (strict) or stripped with a notice
// (stored).

const TOP_KEYS: &[&str] =
    &["name", "goal", "members", "router", "loop", "limits", "fanout", "hitl", "procedure", "parallel", "needs"];
const LOOP_KEYS: &[&str] = &[
    "trigger",
    "done_when",
    "deadline",
    "budget_usd",
    "max_iterations",
    "timezone",
    "overlap",
    "catchup",
    "pause_after_failures",
];
const LIMITS_KEYS: &[&str] = &["deadline", "stuck", "cost_usd"];
const HITL_KEYS: &[&str] = &["mode", "auto_approve_tiers"];
const STEP_KEYS: &[&str] = &["id", "member", "task", "depends_on", "on_failure", "max_retries", "tier"];
const PARALLEL_KEYS: &[&str] = &["mode", "tracks", "judge", "pre_filter", "partition"];
const TRACK_KEYS: &[&str] = &["name", "approach", "model"];
const JUDGE_KEYS: &[&str] = &["model", "rubric"];
const PARTITION_KEYS: &[&str] = &["target_file"];

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct Raw {
    name: Option<String>,
    goal: Option<String>,
    members: Option<Vec<String>>,
    router: Option<String>,
    r#loop: Option<RawLoop>,
    limits: Option<RawLimits>,
    fanout: Option<Int>,
    hitl: Option<RawHitl>,
    procedure: Option<Vec<RawStep>>,
    parallel: Option<RawParallel>,
    needs: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawLoop {
    trigger: Option<String>,
    done_when: Option<String>,
    deadline: Option<Text>,
    budget_usd: Option<Real>,
    max_iterations: Option<Int>,
    timezone: Option<String>,
    overlap: Option<String>,
    catchup: Option<Text>,
    pause_after_failures: Option<Int>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawLimits {
    deadline: Option<Text>,
    stuck: Option<Text>,
    cost_usd: Option<Real>,
}

/// A duration as written: text, or an unquoted number (`deadline: 90`, seconds) kept as
/// its digits, so that [`parse_duration`] judges every spelling and its error names the
/// field's rule (`-5`, `1.5` and integers past 64 bits included).
struct Text(String);

impl Text {
    fn into_string(self) -> String {
        self.0
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Text, D::Error> {
        struct Written;
        impl serde::de::Visitor<'_> for Written {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(DURATION_RULE.trim_start_matches("must be "))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
        }
        deserializer.deserialize_any(Written)
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawHitl {
    mode: Option<Value>,
    auto_approve_tiers: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawStep {
    id: Option<String>,
    member: Option<String>,
    task: Option<String>,
    depends_on: Option<Vec<String>>,
    on_failure: Option<Value>,
    max_retries: Option<Int>,
    tier: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawParallel {
    mode: Value,
    tracks: Option<Vec<Track>>,
    judge: Option<Judge>,
    pre_filter: Option<String>,
    partition: Option<Partition>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Strict,
    Stored,
}

/// Collects broken rules; in stored mode the softened ones become notices.
struct Rules {
    mode: Mode,
    errors: Vec<String>,
    notices: Vec<String>,
}

impl Rules {
    fn fail(&mut self, path: &str, rule: impl fmt::Display) {
        self.errors.push(format!("{path}: {rule}"));
    }

    /// One of an enum's values (`hitl.mode`, `parallel.mode`, a step's `on_failure` and
    /// `tier`), read from what the text holds there; anything else is a broken rule in
    /// serde's words (`unknown variant `sometimes`, expected one of …`), reported with the
    /// others rather than stopping the parse.
    fn choice<T: serde::de::DeserializeOwned>(&mut self, path: &str, value: Value) -> Option<T> {
        if value.is_string() {
            return serde_yaml_ng::from_value(value).map_err(|e| self.fail(path, e)).ok();
        }
        // Not text at all: serde's words for it name YAML internals; the values allowed are
        // the ones an unknown one is told.
        let allowed = serde_yaml_ng::from_value::<T>(Value::String(String::new()))
            .err()
            .and_then(|e| e.to_string().split_once("expected ").map(|(_, list)| list.to_string()))
            .unwrap_or_else(|| "text".into());
        let shown = serde_json::to_string(&value).unwrap_or_default();
        self.fail(path, format_args!("must be {allowed}, got {shown}"));
        None
    }

    /// A rule older versions did not apply: refused when strict, a notice (saying what is
    /// used instead) when stored.
    fn soft(&mut self, path: &str, rule: impl fmt::Display, instead: &str) {
        match self.mode {
            Mode::Strict => self.fail(path, rule),
            Mode::Stored => self.notices.push(format!("{path}: {rule} (stored by an older version; {instead})")),
        }
    }
}

impl Fleet {
    /// Parses and validates `fleet.yaml` text strictly, as `mur fleet create` and `apply`
    /// do.
    ///
    /// # Errors
    /// [`Error::Parse`] for text that does not fit the shape (an unknown key, a wrong type),
    /// naming the field path; with unknown keys, one line each, followed by what the rest
    /// breaks (its shape or its rules). [`Error::Invalid`] listing every broken rule, one
    /// `path: rule` line each — a value outside its set (`hitl.mode`, `parallel.mode`, a
    /// step's `on_failure` or `tier`) among them.
    pub fn parse(text: &str) -> Result<Fleet, Error> {
        let text = crate::without_bom(text);
        // Every unknown key at once (serde stops at the first), in serde's words, and then
        // what the rest breaks: one answer names everything there is to mend.
        if let Ok(Value::Mapping(mut map)) = serde_yaml_ng::from_str::<Value>(text) {
            let unknown = remove_unknown(&mut map, |_| true);
            if !unknown.is_empty() {
                let mut lines: Vec<String> = unknown.iter().map(Unknown::refused).collect();
                match serde_yaml_ng::from_value::<Raw>(Value::Mapping(map)) {
                    Err(e) => lines.push(e.to_string()),
                    Ok(raw) => match validate(raw, None, Mode::Strict) {
                        Err(Error::Invalid(rules)) => lines.extend(rules),
                        Err(Error::Parse(line)) => lines.push(line),
                        Ok(_) => {}
                    },
                }
                return Err(Error::Parse(lines.join("\n")));
            }
        }
        let raw: Raw = serde_yaml_ng::from_str(text).map_err(|e| Error::Parse(e.to_string()))?;
        validate(raw, None, Mode::Strict)
    }

    /// Loads a definition already stored, accepting what older versions accepted (see the
    /// module header); every such value is recorded in [`Fleet::notices`].
    ///
    /// # Errors
    /// Text that is not a YAML mapping, a wrong type outside `limits:`, or a rule that
    /// applies when any fleet loads (the name, the `procedure:` rules).
    pub fn load_stored(text: &str) -> Result<Fleet, Error> {
        let mut value: Value =
            serde_yaml_ng::from_str(crate::without_bom(text)).map_err(|e| Error::Parse(e.to_string()))?;
        let Some(map) = value.as_mapping_mut() else {
            return Err(Error::Parse("fleet.yaml must be a mapping of keys".to_string()));
        };
        // `limits:` keeps its unknown keys: a block that does not parse is reported below.
        let mut notices: Vec<String> =
            remove_unknown(map, |path| path != "limits").iter().map(Unknown::ignored).collect();
        // The limits block is read on its own: one that does not parse leaves the fleet
        // loadable but unbounded-by-choice, so it never resolves (§Unattended runs).
        let stored_limits = map.remove("limits").map(|v| match serde_yaml_ng::from_value::<Option<RawLimits>>(v) {
            Ok(None) => LimitsBlock::Absent,
            Err(e) => LimitsBlock::Invalid(vec![format!("limits: {e}")]),
            Ok(Some(raw)) => {
                let mut errors = Vec::new();
                let limits = validate_limits(raw, &mut errors);
                if errors.is_empty() { LimitsBlock::Set(limits) } else { LimitsBlock::Invalid(errors) }
            }
        });
        let raw: Raw = serde_yaml_ng::from_value(value).map_err(|e| Error::Parse(e.to_string()))?;
        let mut fleet = validate(raw, stored_limits, Mode::Stored)?;
        if let LimitsBlock::Invalid(errors) = &fleet.limits {
            for e in errors {
                fleet.notices.push(format!("{e} (stored by an older version; the fleet's bounds do not resolve)"));
            }
        }
        notices.append(&mut fleet.notices);
        fleet.notices = notices;
        Ok(fleet)
    }

    /// How a run plans (§A fixed step graph; issue #10 `router`): the procedure if there is
    /// one, else the router when set and there are several members, else every member.
    pub fn plan_kind(&self) -> PlanKind {
        if !self.procedure.is_empty() {
            PlanKind::Procedure
        } else if self.router.is_some() && self.members.len() > 1 {
            PlanKind::Router
        } else {
            PlanKind::Broadcast
        }
    }

    /// What a run needs that loading does not: at least one member.
    ///
    /// # Errors
    /// A line naming the fleet and the missing piece.
    pub fn check_runnable(&self) -> Result<(), String> {
        if self.members.is_empty() {
            return Err(format!("fleet '{}': members: is empty; add capsule names to run it", self.name));
        }
        Ok(())
    }

    /// The fleet's channel id, `fleet-<name>`.
    pub fn channel_id(&self) -> String {
        channel_id(&self.name)
    }

    /// The limits the fleet contributes to bounds resolution: its `limits:` block, or when
    /// that is absent the legacy `loop.deadline` / `loop.budget_usd` (> 0).
    fn fleet_scope(&self) -> Result<(Limits, Source), Vec<String>> {
        match &self.limits {
            LimitsBlock::Set(l) => Ok((l.clone(), Source::FleetLimits)),
            LimitsBlock::Invalid(errors) => Err(errors.clone()),
            LimitsBlock::Absent => Ok((
                Limits {
                    deadline: self.r#loop.deadline.clone(),
                    stuck: None,
                    cost_usd: (self.r#loop.budget_usd > 0.0).then_some(self.r#loop.budget_usd),
                },
                Source::FleetLoop,
            )),
        }
    }
}

/// A key outside the closed set of keys of its mapping.
struct Unknown {
    /// The mapping's path: `""` for the top, `loop`, `procedure[0]`, `parallel.tracks[1]`.
    path: String,
    key: String,
    allowed: &'static [&'static str],
}

impl Unknown {
    /// As strict parsing refuses it, in serde's words (serde reports only the first):
    /// ``loop: unknown field `max_iteration`, expected one of `trigger`, …``.
    fn refused(&self) -> String {
        let prefix = if self.path.is_empty() { String::new() } else { format!("{}: ", self.path) };
        let expected = self.allowed.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", ");
        format!("{prefix}unknown field `{}`, expected one of {expected}", self.key)
    }

    /// As loading a stored definition notes it: `loop.max_iteration: unknown key (…; ignored)`.
    fn ignored(&self) -> String {
        let prefix = if self.path.is_empty() { String::new() } else { format!("{}.", self.path) };
        format!("{prefix}{}: unknown key (stored by an older version; ignored)", self.key)
    }
}

/// Removes every unknown key of a fleet's mapping and of its `loop:`, `limits:`, `hitl:`,
/// `parallel:` (its tracks, judge and partition) and `procedure[i]` mappings, of those
/// whose path `within` accepts, and returns them in document order.
fn remove_unknown(map: &mut Mapping, within: impl Fn(&str) -> bool) -> Vec<Unknown> {
    let mut out = Vec::new();
    let mut check = |map: &mut Mapping, allowed: &'static [&'static str], path: String| {
        if !within(&path) {
            return;
        }
        let unknown: Vec<Value> =
            map.keys().filter(|k| !k.as_str().is_some_and(|k| allowed.contains(&k))).cloned().collect();
        for k in unknown {
            map.remove(&k);
            let key = k.as_str().map_or_else(|| format!("{k:?}"), str::to_string);
            out.push(Unknown { path: path.clone(), key, allowed });
        }
    };
    check(map, TOP_KEYS, String::new());
    for (key, allowed) in
        [("loop", LOOP_KEYS), ("limits", LIMITS_KEYS), ("hitl", HITL_KEYS), ("parallel", PARALLEL_KEYS)]
    {
        if let Some(Value::Mapping(m)) = map.get_mut(key) {
            check(m, allowed, key.to_string());
        }
    }
    if let Some(Value::Sequence(steps)) = map.get_mut("procedure") {
        for (i, step) in steps.iter_mut().enumerate() {
            if let Value::Mapping(m) = step {
                check(m, STEP_KEYS, format!("procedure[{i}]"));
            }
        }
    }
    if let Some(Value::Mapping(parallel)) = map.get_mut("parallel") {
        if let Some(Value::Sequence(tracks)) = parallel.get_mut("tracks") {
            for (i, track) in tracks.iter_mut().enumerate() {
                if let Value::Mapping(m) = track {
                    check(m, TRACK_KEYS, format!("parallel.tracks[{i}]"));
                }
            }
        }
        for (key, allowed) in [("judge", JUDGE_KEYS), ("partition", PARTITION_KEYS)] {
            if let Some(Value::Mapping(m)) = parallel.get_mut(key) {
                check(m, allowed, format!("parallel.{key}"));
            }
        }
    }
    out
}

fn validate_limits(raw: RawLimits, errors: &mut Vec<String>) -> Limits {
    let deadline = raw.deadline.map(Text::into_string).and_then(|d| {
        DurationText::parse_bound(&d).map_err(|rule| errors.push(format!("limits.deadline: {rule}"))).ok()
    });
    let stuck = raw
        .stuck
        .map(Text::into_string)
        .and_then(|s| Stuck::parse(&s).map_err(|rule| errors.push(format!("limits.stuck: {rule}"))).ok());
    let cost_usd = raw.cost_usd.and_then(|c| match c.number() {
        Some(v) if v.is_finite() && v >= 0.0 => Some(v),
        _ => {
            errors.push(format!("limits.cost_usd: must be a non-negative number (0 for no ceiling), got {c}"));
            None
        }
    });
    Limits { deadline, stuck, cost_usd }
}

fn validate(raw: Raw, stored_limits: Option<LimitsBlock>, mode: Mode) -> Result<Fleet, Error> {
    let mut r = Rules { mode, errors: Vec::new(), notices: Vec::new() };

    let name = match raw.name {
        None => {
            r.fail("name", "required");
            String::new()
        }
        Some(n) => {
            if !is_valid_fleet_name(&n) {
                r.fail("name", format_args!("{NAME_RULE}, got {n:?}"));
            }
            n
        }
    };

    let members = raw.members.unwrap_or_default();
    let mut seen = BTreeSet::new();
    for (i, m) in members.iter().enumerate() {
        let path = format!("members[{i}]");
        if !crate::manifest::is_valid_name(m) {
            r.fail(&path, format_args!("{CAPSULE_NAME_RULE}, got {m:?}"));
        } else if !seen.insert(m.as_str()) {
            r.fail(&path, format_args!("duplicate member {m:?}"));
        }
    }
    if let Some(router) = &raw.router
        && !crate::manifest::is_valid_name(router)
    {
        r.fail("router", format_args!("{CAPSULE_NAME_RULE}, got {router:?}"));
    }

    let r#loop = validate_loop(raw.r#loop.unwrap_or_default(), &mut r);

    let limits = match stored_limits {
        Some(block) => block,
        None => match raw.limits {
            None => LimitsBlock::Absent,
            Some(l) => {
                let mut errors = Vec::new();
                let limits = validate_limits(l, &mut errors);
                r.errors.append(&mut errors);
                LimitsBlock::Set(limits)
            }
        },
    };

    // A whole number past the cap's range is refused by the range, anything else that is
    // not a positive whole number by the key's rule, never in serde's words.
    let fanout = raw.fanout.and_then(|v| {
        let rule = match &v {
            Int::Whole(n) if *n <= 0 => format!("must be a positive integer, got {n}"),
            Int::Other(shown) => format!("must be a positive integer, got {shown}"),
            _ => match v.within(1, u32::MAX) {
                Ok(n) => return Some(n),
                Err(rule) => rule,
            },
        };
        r.soft("fanout", rule, "the default of 3 applies");
        None
    });

    let hitl = validate_hitl(raw.hitl.unwrap_or_default(), &mut r);
    let procedure = validate_procedure(raw.procedure.unwrap_or_default(), &members, &mut r);

    let parallel = raw.parallel.map(|p| Parallel {
        // A wrong mode is a broken rule: no fleet comes of it, the stand-in is never seen.
        mode: r.choice("parallel.mode", p.mode).unwrap_or(ParallelMode::Speculative),
        tracks: p.tracks.unwrap_or_default(),
        judge: p.judge,
        pre_filter: p.pre_filter,
        partition: p.partition,
    });
    if let Some(p) = &parallel {
        if !procedure.is_empty() {
            r.fail("procedure", "cannot be used together with parallel: (remove one)");
        }
        let mut names = BTreeSet::new();
        for (i, t) in p.tracks.iter().enumerate() {
            if t.name.trim().is_empty() {
                r.fail(&format!("parallel.tracks[{i}].name"), "must not be empty");
            } else if !names.insert(t.name.as_str()) {
                r.fail(&format!("parallel.tracks[{i}].name"), format_args!("duplicate track {:?}", t.name));
            }
        }
        if p.mode == ParallelMode::Partition && p.partition.is_none() {
            r.fail("parallel.partition", "required when parallel.mode is partition");
        }
    }

    let needs = raw.needs.unwrap_or_default();
    for (i, n) in needs.iter().enumerate() {
        if n.trim().is_empty() {
            r.fail(&format!("needs[{i}]"), "must not be empty");
        }
    }

    if !r.errors.is_empty() {
        return Err(Error::Invalid(r.errors));
    }
    Ok(Fleet {
        name,
        goal: raw.goal.unwrap_or_default(),
        members,
        router: raw.router,
        r#loop,
        limits,
        fanout,
        hitl,
        procedure,
        parallel,
        needs,
        notices: r.notices,
    })
}

fn validate_loop(l: RawLoop, r: &mut Rules) -> Loop {
    let mut out = Loop::default();
    if let Some(t) = l.trigger {
        match Trigger::parse(&t) {
            Ok(trigger) => out.trigger = trigger,
            Err(rule) => {
                r.soft("loop.trigger", rule, "it never fires");
                out.trigger = Trigger::Never(t.trim().to_string());
            }
        }
    }
    if let Some(d) = l.done_when {
        match DoneWhen::parse(&d) {
            Ok(p) => out.done_when = p,
            Err(rule) => r.soft("loop.done_when", rule, "the router judges DONE"),
        }
    }
    if let Some(d) = l.deadline.map(Text::into_string)
        && !d.trim().is_empty()
    {
        match DurationText::parse_bound(&d) {
            Ok(d) => out.deadline = Some(d),
            Err(rule) => r.soft("loop.deadline", rule, "ignored; the loop is bounded by its other limits"),
        }
    }
    if let Some(b) = l.budget_usd {
        if let Some(v) = b.number().filter(|v| v.is_finite() && *v >= 0.0) {
            out.budget_usd = v;
        } else {
            r.soft(
                "loop.budget_usd",
                format_args!("must be a non-negative number (0 for no ceiling), got {b}"),
                "ignored",
            );
        }
    }
    if let Some(n) = l.max_iterations {
        match n.within(0, u64::MAX) {
            Ok(n) => {
                out.max_iterations = n;
                if n != 0 {
                    r.notices.push(format!("loop.max_iterations: {MAX_ITERATIONS_NOTICE}"));
                }
            }
            Err(rule) => r.fail("loop.max_iterations", rule),
        }
    }
    if let Some(z) = l.timezone {
        match schedule::parse_timezone(&z) {
            Ok(tz) => out.timezone = tz,
            Err(rule) => {
                // Fail closed: a cron read in the wrong zone would fire at the wrong hour.
                r.soft("loop.timezone", rule, "the trigger never fires");
                if !matches!(out.trigger, Trigger::Manual | Trigger::Never(_)) {
                    out.trigger = Trigger::Never(out.trigger.as_text());
                }
            }
        }
    }
    if let Some(o) = l.overlap {
        match Overlap::parse(&o) {
            Ok(o) => out.overlap = o,
            Err(rule) => r.soft("loop.overlap", rule, "skip"),
        }
    }
    if let Some(c) = l.catchup.map(Text::into_string) {
        match schedule::parse_catchup(&c) {
            Ok(c) => out.catchup = c,
            Err(rule) => r.soft("loop.catchup", rule, "the built-in 90s"),
        }
    }
    if let Some(n) = l.pause_after_failures {
        match n.within(0, 1000) {
            Ok(n) => out.pause_after_failures = n,
            Err(rule) => r.soft("loop.pause_after_failures", rule, "never pauses"),
        }
    }
    out
}

fn validate_hitl(h: RawHitl, r: &mut Rules) -> Hitl {
    let mut tiers = Vec::new();
    for (i, t) in h.auto_approve_tiers.unwrap_or_default().iter().enumerate() {
        let path = format!("hitl.auto_approve_tiers[{i}]");
        let tier: Option<RiskTier> = serde_yaml_ng::from_value(Value::String(t.trim().to_string())).ok();
        match tier {
            None => r.fail(
                &path,
                format_args!("unknown risk tier {t:?} (read, write, network-egress, spend, destructive, privileged)"),
            ),
            Some(tier) if tier > RiskTier::AUTO_APPROVE_CEILING => r.soft(
                &path,
                format_args!(
                    "{:?} is above the auto-approve ceiling write: only read and write may be auto-approved",
                    tier.as_str()
                ),
                "not auto-approved",
            ),
            Some(tier) => {
                if !tiers.contains(&tier) {
                    tiers.push(tier);
                }
            }
        }
    }
    let mode = h.mode.and_then(|v| r.choice("hitl.mode", v));
    Hitl { mode, auto_approve_tiers: tiers }
}

fn validate_procedure(raw: Vec<RawStep>, members: &[String], r: &mut Rules) -> Vec<Step> {
    if raw.len() > MAX_PROCEDURE_STEPS {
        r.fail("procedure", format_args!("at most {MAX_PROCEDURE_STEPS} steps, got {}", raw.len()));
    }
    let steps: Vec<Step> = raw
        .into_iter()
        .enumerate()
        .map(|(i, s)| Step {
            id: s.id.unwrap_or_default().trim().to_string(),
            member: s.member.unwrap_or_default().trim().to_string(),
            task: s.task.unwrap_or_default(),
            depends_on: s.depends_on.unwrap_or_default().into_iter().map(|d| d.trim().to_string()).collect(),
            on_failure: s
                .on_failure
                .and_then(|v| r.choice(&format!("procedure[{i}].on_failure"), v))
                .unwrap_or_default(),
            max_retries: s.max_retries.map_or(DEFAULT_MAX_RETRIES, |n| {
                n.within(0, u32::MAX).unwrap_or_else(|rule| {
                    r.fail(&format!("procedure[{i}].max_retries"), rule);
                    DEFAULT_MAX_RETRIES
                })
            }),
            tier: s.tier.and_then(|v| r.choice(&format!("procedure[{i}].tier"), v)),
        })
        .collect();
    let ids: BTreeSet<&str> = steps.iter().map(|s| s.id.as_str()).collect();
    let mut seen = BTreeSet::new();
    for (i, s) in steps.iter().enumerate() {
        if s.id.is_empty() {
            r.fail(&format!("procedure[{i}].id"), "must not be empty");
        } else if !seen.insert(s.id.as_str()) {
            r.fail(&format!("procedure[{i}].id"), format_args!("duplicate step id {:?}", s.id));
        }
        if s.member.is_empty() {
            r.fail(&format!("procedure[{i}].member"), "required");
        } else if !members.contains(&s.member) {
            r.fail(&format!("procedure[{i}].member"), format_args!("{:?} is not in members:", s.member));
        }
        for (j, d) in s.depends_on.iter().enumerate() {
            if !ids.contains(d.as_str()) || d.is_empty() {
                r.fail(&format!("procedure[{i}].depends_on[{j}]"), format_args!("names no step: {d:?}"));
            }
        }
    }
    steps
}

/// The procedure's steps grouped into ranks (a step's rank is its longest dependency
/// chain), each rank in declaration order. A cycle is refused when the run starts
/// (§A fixed step graph).
///
/// # Errors
/// `procedure: dependency cycle among steps "a", "b"` naming every step that cannot run.
pub fn procedure_ranks(steps: &[Step]) -> Result<Vec<Vec<&Step>>, String> {
    let mut rank: BTreeMap<&str, usize> = BTreeMap::new();
    let mut left: Vec<&Step> = steps.iter().collect();
    while !left.is_empty() {
        let before = left.len();
        left.retain(|s| {
            let deps: Option<Vec<usize>> = s.depends_on.iter().map(|d| rank.get(d.as_str()).copied()).collect();
            match deps {
                Some(deps) => {
                    rank.insert(&s.id, deps.iter().map(|r| r + 1).max().unwrap_or(0));
                    false
                }
                None => true,
            }
        });
        if left.len() == before {
            let names: Vec<String> = left.iter().map(|s| format!("{:?}", s.id)).collect();
            return Err(format!("procedure: dependency cycle among steps {}", names.join(", ")));
        }
    }
    let depth = rank.values().max().map_or(0, |m| m + 1);
    let mut ranks = vec![Vec::new(); depth];
    for s in steps {
        ranks[rank[s.id.as_str()]].push(s);
    }
    Ok(ranks)
}

// ---------------------------------------------------------------------------------------
// Editing a stored fleet's loop settings (§Settings that used to mean something else).

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

// ---------------------------------------------------------------------------------------
// Bounds (§The bounds).

/// Where a bound's value came from, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A `mur fleet run` flag; the flag's spelling.
    Flag(&'static str),
    /// The fleet's `limits:` block.
    FleetLimits,
    /// The fleet's legacy `loop.deadline` / `loop.budget_usd` (only without `limits:`).
    FleetLoop,
    /// The cluster's `config.yaml` `limits:` block.
    Config,
    /// The built-in default.
    BuiltIn,
}

impl Source {
    /// The label printed after `←`.
    pub const fn label(self) -> &'static str {
        match self {
            Source::Flag(f) => f,
            Source::FleetLimits => "fleet.yaml",
            Source::FleetLoop => "fleet.yaml loop",
            Source::Config => "config.yaml",
            Source::BuiltIn => "built-in",
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One resolved bound: its value, its text as given, and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound<T> {
    /// The value.
    pub value: T,
    /// The text as given (`2m`, `off`, `5`), for display.
    pub text: String,
    /// Where it came from.
    pub source: Source,
}

/// The flags of `mur fleet run NAME [JOB] [--loop] [--deadline D] [--budget-usd N]
/// [--run-id ID]`, plus the ignored `--max-iterations`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunFlags {
    /// `--loop`.
    pub r#loop: bool,
    /// `--deadline D`.
    pub deadline: Option<String>,
    /// `--budget-usd N` (0: no ceiling).
    pub budget_usd: Option<f64>,
    /// `--run-id ID`.
    pub run_id: Option<String>,
    /// `--max-iterations N`: ignored with a notice.
    pub max_iterations: Option<u64>,
}

/// A run's resolved bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Bounds {
    /// Wall clock for the loop, from its start.
    pub deadline: Bound<Duration>,
    /// No-progress window; `None` when off.
    pub stuck: Bound<Option<Duration>>,
    /// Spend ceiling in USD; `None` when there is none (absent or 0).
    pub cost_usd: Bound<Option<f64>>,
    /// Notices to print before the run (ignored iteration caps).
    pub notices: Vec<String>,
}

impl Bounds {
    /// The line printed at start: `bounds: deadline 2m ← --deadline; stuck 10m ← built-in`.
    pub fn line(&self) -> String {
        format!(
            "bounds: deadline {} ← {}; stuck {} ← {}",
            self.deadline.text, self.deadline.source, self.stuck.text, self.stuck.source
        )
    }
}

/// Resolves a run's bounds per key, narrowest first: flag → the fleet's `limits:` (or its
/// legacy `loop.*` keys when `limits:` is absent) → the cluster's `config.yaml` `limits:` →
/// built-in (deadline 1h, stuck 10m, no cost ceiling). Scopes replace a key, they never
/// combine. Every scope is validated first and every error reported.
///
/// # Errors
/// [`Error::Invalid`], one line per broken value, each starting `fleet '<name>': ` and the
/// scope (`--deadline: `, `fleet.yaml: limits.stuck: `, `config.yaml: limits.deadline: `).
pub fn resolve_bounds(fleet: &Fleet, flags: &RunFlags, config: &LimitsBlock) -> Result<Bounds, Error> {
    let prefix = format!("fleet '{}': ", fleet.name);
    let mut errors = Vec::new();
    let mut notices = Vec::new();

    let flag_deadline = flags.deadline.as_deref().and_then(|d| {
        DurationText::parse_bound(d).map_err(|rule| errors.push(format!("{prefix}--deadline: {rule}"))).ok()
    });
    let flag_cost = flags.budget_usd.and_then(|b| {
        if b.is_finite() && b >= 0.0 {
            Some(b)
        } else {
            errors.push(format!("{prefix}--budget-usd: must be a non-negative number (0 for no ceiling), got {b}"));
            None
        }
    });
    let fleet_scope = fleet.fleet_scope().map_err(|e| {
        errors.extend(e.into_iter().map(|e| format!("{prefix}fleet.yaml: {e}")));
    });
    let config_scope = match config {
        LimitsBlock::Absent => Some(Limits::default()),
        LimitsBlock::Set(l) => Some(l.clone()),
        LimitsBlock::Invalid(e) => {
            errors.extend(e.iter().map(|e| format!("{prefix}config.yaml: {e}")));
            None
        }
    };
    if flags.max_iterations.is_some() {
        notices.push(format!("--max-iterations {MAX_ITERATIONS_NOTICE}"));
    }
    if fleet.r#loop.max_iterations != 0 {
        notices.push(format!("loop.max_iterations {MAX_ITERATIONS_NOTICE}"));
    }
    let (Ok((fleet_limits, fleet_source)), Some(config_limits)) = (fleet_scope, config_scope) else {
        return Err(Error::Invalid(errors));
    };
    if !errors.is_empty() {
        return Err(Error::Invalid(errors));
    }

    let builtin_deadline = DurationText::parse(BUILTIN_DEADLINE).expect("built-in deadline parses");
    let (d, source) = [
        (flag_deadline, Source::Flag("--deadline")),
        (fleet_limits.deadline, fleet_source),
        (config_limits.deadline, Source::Config),
    ]
    .into_iter()
    .find_map(|(d, s)| d.map(|d| (d, s)))
    .unwrap_or((builtin_deadline, Source::BuiltIn));
    let deadline = Bound { value: d.duration, text: d.text, source };

    let builtin_stuck = Stuck::After(DurationText::parse(BUILTIN_STUCK).expect("built-in stuck parses"));
    let (s, source) = [(fleet_limits.stuck, fleet_source), (config_limits.stuck, Source::Config)]
        .into_iter()
        .find_map(|(s, src)| s.map(|s| (s, src)))
        .unwrap_or((builtin_stuck, Source::BuiltIn));
    let stuck = Bound { value: s.window(), text: s.as_text().to_string(), source };

    let (c, source) = [
        (flag_cost, Source::Flag("--budget-usd")),
        (fleet_limits.cost_usd, fleet_source),
        (config_limits.cost_usd, Source::Config),
    ]
    .into_iter()
    .find_map(|(c, s)| c.map(|c| (c, s)))
    .map_or((None, Source::BuiltIn), |(c, s)| (Some(c), s));
    let cost_usd =
        Bound { value: c.filter(|&c| c > 0.0), text: c.map_or_else(|| "none".to_string(), |c| c.to_string()), source };

    Ok(Bounds { deadline, stuck, cost_usd, notices })
}

/// The fan-out cap: how many delegated steps may run at once, cluster-wide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fanout {
    /// At least 1.
    pub cap: u32,
    /// Where it came from.
    pub source: FanoutSource,
    /// Set when `MUR_FLEET_FANOUT` was given but not used because it is not a positive
    /// integer.
    pub notice: Option<String>,
}

/// Where the fan-out cap came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FanoutSource {
    /// The fleet's `fanout:` key.
    Fleet,
    /// `MUR_FLEET_FANOUT`.
    Env,
    /// The default, 3.
    BuiltIn,
}

impl Fanout {
    /// Steps to run at once for a rank of `steps` steps: the cap, but never more than
    /// there are steps and never below 1.
    pub fn for_steps(&self, steps: usize) -> usize {
        (self.cap as usize).min(steps).max(1)
    }
}

/// Resolves the fan-out cap (§The bounds, fan-out bound; issue #10): the fleet's
/// `fanout:` key, else `MUR_FLEET_FANOUT` (read through `env`), else 3. A value that is 0
/// or not a positive integer falls back to the default, never to unbounded.
pub fn resolve_fanout(fleet_fanout: Option<u32>, env: &dyn Fn(&str) -> Option<String>) -> Fanout {
    if let Some(cap) = fleet_fanout.filter(|&c| c > 0) {
        return Fanout { cap, source: FanoutSource::Fleet, notice: None };
    }
    match env(FANOUT_ENV) {
        None => Fanout { cap: DEFAULT_FANOUT, source: FanoutSource::BuiltIn, notice: None },
        Some(v) => match v.trim().parse::<u32>() {
            Ok(cap) if cap > 0 => Fanout { cap, source: FanoutSource::Env, notice: None },
            _ => Fanout {
                cap: DEFAULT_FANOUT,
                source: FanoutSource::BuiltIn,
                notice: Some(format!(
                    "{FANOUT_ENV}={v:?} is not a positive integer; at most {DEFAULT_FANOUT} delegated steps run at once"
                )),
            },
        },
    }
}

/// Whether unattended runs may start (§Unattended runs): `MUR_FLEET_AUTORUN` is `1`,
/// `true` or `yes` (any case), or the cluster config's `fleet.autorun` is true.
pub fn autorun_enabled(env: &dyn Fn(&str) -> Option<String>, config_autorun: bool) -> bool {
    config_autorun
        || env(AUTORUN_ENV).is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}

// ---------------------------------------------------------------------------------------
// Run ids (§Watching a run).

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

// ---------------------------------------------------------------------------------------
// Jobs (reference §4; issue #10).

/// A job's status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    /// Waiting to be claimed.
    Queued,
    /// Claimed by a run.
    Running,
    /// Paused awaiting approval; approval resumes it (not terminal).
    Blocked,
    /// Finished with a result.
    Done,
    /// Finished with an error.
    Failed,
    /// Canceled before it finished.
    Canceled,
}

impl JobStatus {
    /// The stored spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Blocked => "blocked",
            JobStatus::Done => "done",
            JobStatus::Failed => "failed",
            JobStatus::Canceled => "canceled",
        }
    }

    /// Done, failed and canceled are terminal.
    pub const fn is_terminal(self) -> bool {
        matches!(self, JobStatus::Done | JobStatus::Failed | JobStatus::Canceled)
    }

    /// Whether `self → next` is a legal transition: queued → running | canceled;
    /// running → done | failed | canceled | blocked; blocked → running | canceled.
    /// Nothing leaves a terminal status.
    pub const fn can_become(self, next: JobStatus) -> bool {
        use JobStatus::*;
        matches!(
            (self, next),
            (Queued, Running | Canceled)
                | (Running, Done | Failed | Canceled | Blocked)
                | (Blocked, Running | Canceled)
        )
    }

    /// The A2A task state: submitted, working, input-required, completed, failed, canceled.
    pub const fn a2a_state(self) -> &'static str {
        match self {
            JobStatus::Queued => "submitted",
            JobStatus::Running => "working",
            JobStatus::Blocked => "input-required",
            JobStatus::Done => "completed",
            JobStatus::Failed => "failed",
            JobStatus::Canceled => "canceled",
        }
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused job transition.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("job {id}: cannot go from {from} to {to}")]
pub struct TransitionError {
    /// The job.
    pub id: String,
    /// Its status.
    pub from: JobStatus,
    /// The status asked for.
    pub to: JobStatus,
}

/// One unit of work queued on a fleet. Times are unix milliseconds. Serialized as JSON
/// with every field present (`null` when unset), as `mur fleet jobs --json` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// A UUIDv7 (hyphenated): lexical order is creation order.
    pub id: String,
    /// Queued, running, blocked, done, failed or canceled.
    pub status: JobStatus,
    /// The work, as sent.
    pub text: String,
    /// The output of the run that finished it.
    #[serde(default)]
    pub result: Option<String>,
    /// Why it failed (or was canceled).
    #[serde(default)]
    pub error: Option<String>,
    /// The run (a loop's iteration run id, `<id>-<n>`) that claimed it.
    #[serde(default)]
    pub run_id: Option<String>,
    /// Who queued it: `cli`, or `a2a:<agent>`.
    pub source: String,
    /// When it was queued.
    pub created_at: u64,
    /// When a run claimed it.
    #[serde(default)]
    pub started_at: Option<u64>,
    /// When it reached a terminal status.
    #[serde(default)]
    pub finished_at: Option<u64>,
    /// The approval its procedure is waiting for, or the answer given (`hitl`,
    /// the fleet-loops seed, §Unattended runs): set when a run parks a step, answered by
    /// `mur fleet approve` / `mur fleet deny`.
    #[serde(default)]
    pub approval: Option<Approval>,
    /// Outputs of the procedure steps already completed for this job, by step id: the run
    /// after an approval continues from there instead of running them again.
    #[serde(default)]
    pub steps_done: BTreeMap<String, String>,
}

/// A parked approval request of a job (one per blocked run; it covers every step that run
/// parked).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    /// The parked steps' ids, in procedure order.
    pub steps: Vec<String>,
    /// `None` while waiting.
    #[serde(default)]
    pub decision: Option<Decision>,
    /// Who answered.
    #[serde(default)]
    pub by: Option<String>,
    /// When it was answered, unix ms.
    #[serde(default)]
    pub at: Option<u64>,
}

/// The answer to an approval request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    /// The parked steps run when the job runs next.
    Approved,
    /// The parked steps fail ("denied") when the job runs next; their `on_failure` applies.
    Denied,
}

impl Decision {
    /// `approved` or `denied`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Decision::Approved => "approved",
            Decision::Denied => "denied",
        }
    }
}

impl Job {
    /// A queued job with a fresh UUIDv7 id.
    pub fn new(text: impl Into<String>, source: impl Into<String>, now_ms: u64) -> Job {
        Job::with_id(uuid::Uuid::now_v7(), text, source, now_ms)
    }

    /// A queued job with the given id.
    pub fn with_id(id: uuid::Uuid, text: impl Into<String>, source: impl Into<String>, now_ms: u64) -> Job {
        Job {
            id: id.hyphenated().to_string(),
            status: JobStatus::Queued,
            text: text.into(),
            result: None,
            error: None,
            run_id: None,
            source: source.into(),
            created_at: now_ms,
            started_at: None,
            finished_at: None,
            approval: None,
            steps_done: BTreeMap::new(),
        }
    }

    /// Moves the job to `next`, stamping `started_at` on its first claim and `finished_at`
    /// on a terminal status.
    ///
    /// # Errors
    /// A transition [`JobStatus::can_become`] refuses; the job is unchanged.
    pub fn transition(&mut self, next: JobStatus, now_ms: u64) -> Result<(), TransitionError> {
        if !self.status.can_become(next) {
            return Err(TransitionError { id: self.id.clone(), from: self.status, to: next });
        }
        self.status = next;
        if next == JobStatus::Running && self.started_at.is_none() {
            self.started_at = Some(now_ms);
        }
        if next.is_terminal() {
            self.finished_at = Some(now_ms);
        }
        Ok(())
    }

    /// Claims the job for a run: → running, with the run id.
    ///
    /// # Errors
    /// As [`Job::transition`].
    pub fn claim(&mut self, run_id: &str, now_ms: u64) -> Result<(), TransitionError> {
        self.transition(JobStatus::Running, now_ms)?;
        self.run_id = Some(run_id.to_string());
        Ok(())
    }
}

/// Which jobs `mur fleet jobs` lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFilter {
    /// `--all`: include terminal jobs.
    pub all: bool,
    /// `--since <run-id>`: only jobs whose run id starts with it (any status).
    pub since: Option<String>,
    /// `--status S`: only jobs in status S (with `--since`, or among those listed without).
    pub status: Option<JobStatus>,
}

impl JobFilter {
    /// Whether `job` is listed: with `--since`, by run-id prefix; otherwise non-terminal
    /// jobs, or every job with `--all`; with `--status`, only those in it.
    pub fn matches(&self, job: &Job) -> bool {
        let listed = match &self.since {
            Some(since) => run_id_matches(job.run_id.as_deref(), since),
            // A status asked for is listed whether or not it is terminal.
            None => self.all || self.status.is_some() || !job.status.is_terminal(),
        };
        listed && self.status.is_none_or(|s| s == job.status)
    }
}

/// Whether a blocked job's approval request has been answered, so the next run takes it.
pub fn is_answered(job: &Job) -> bool {
    job.status == JobStatus::Blocked && job.approval.as_ref().is_some_and(|a| a.decision.is_some())
}

/// The job a run works on next: the oldest blocked job whose approval was answered (it
/// continues from where it was parked, §Unattended runs: "the next run continues from
/// there"), else the oldest queued one ([`next_queued`]).
pub fn next_job(jobs: &[Job]) -> Option<&Job> {
    jobs.iter().filter(|j| is_answered(j)).min_by(|a, b| a.id.cmp(&b.id)).or_else(|| next_queued(jobs))
}

/// The oldest queued job (ids are UUIDv7, so the smallest id is the oldest).
pub fn next_queued(jobs: &[Job]) -> Option<&Job> {
    jobs.iter().filter(|j| j.status == JobStatus::Queued).min_by(|a, b| a.id.cmp(&b.id))
}

// ---------------------------------------------------------------------------------------
// Loop rules (§Three ways a loop ends, §The bounds).

/// Whether `text` converges a `marker:` loop: some line equals the marker after trimming.
/// Whole-line, not substring: prose that mentions the marker does not count.
pub fn marker_matches(text: &str, marker: &str) -> bool {
    let marker = marker.trim();
    !marker.is_empty() && text.lines().any(|l| l.trim() == marker)
}

/// Whether the router's answer to "DONE or CONTINUE?" says done: a standalone word `done`
/// and none of `continue`, `not`, `incomplete` (any case). Anything else keeps going.
pub fn router_says_done(reply: &str) -> bool {
    let words: Vec<String> =
        reply.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_lowercase).collect();
    words.iter().any(|w| w == "done") && !words.iter().any(|w| matches!(w.as_str(), "continue" | "not" | "incomplete"))
}

/// Why a loop stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `done_when` was met (router judgment or marker).
    Converged,
    /// `queue-empty`: an iteration found nothing queued.
    QueueDrained,
    /// A step needs approval; the request is parked and the job is blocked.
    AwaitingApproval,
    /// The kill-switch is set (or could not be read: fail closed).
    Stopped,
    /// The deadline passed.
    Deadline,
    /// No agent-authored progress within the stuck window.
    Stuck,
    /// The next iteration could not be afforded.
    Budget,
    /// The 10 000-iteration diagnostic ceiling.
    MaxIterations,
    /// An iteration's steps failed.
    IterationFailed,
}

impl Stop {
    /// The outcome label (`awaiting-approval`, `queue-drained`, …).
    pub const fn label(self) -> &'static str {
        match self {
            Stop::Converged => "converged",
            Stop::QueueDrained => "queue-drained",
            Stop::AwaitingApproval => "awaiting-approval",
            Stop::Stopped => "stopped",
            Stop::Deadline => "deadline",
            Stop::Stuck => "stuck",
            Stop::Budget => "budget",
            Stop::MaxIterations => "max-iterations",
            Stop::IterationFailed => "iteration-failed",
        }
    }

    /// The channel state the loop ends in: completed, input-required, canceled or failed.
    pub const fn channel_state(self) -> &'static str {
        match self {
            Stop::Converged | Stop::QueueDrained => "completed",
            Stop::AwaitingApproval => "input-required",
            Stop::Stopped => "canceled",
            _ => "failed",
        }
    }

    /// The run record's state: done, blocked, stopped or failed.
    pub const fn run_state(self) -> &'static str {
        match self {
            Stop::Converged | Stop::QueueDrained => "done",
            Stop::AwaitingApproval => "blocked",
            Stop::Stopped => "stopped",
            _ => "failed",
        }
    }

    /// A one-line remedy naming the fleet; none for a loop that finished its work
    /// (`mur-fleet` reference §3 stop table). `blocked_job`: the job an awaiting-approval
    /// stop left blocked, named in the approve command (`<job>` when not known).
    pub fn remedy(self, fleet: &str, blocked_job: Option<&str>) -> Option<String> {
        Some(match self {
            Stop::Converged | Stop::QueueDrained => return None,
            Stop::AwaitingApproval => {
                let job = blocked_job.unwrap_or("<job>");
                format!("approve the parked steps: mur fleet approve {fleet} {job}, then run it again")
            }
            Stop::Stopped => format!("mur fleet start {fleet} clears the kill-switch"),
            Stop::Deadline => {
                format!("raise the deadline: mur fleet run {fleet} --loop --deadline <D>, or limits.deadline")
            }
            Stop::Stuck => format!(
                "no agent progress within the stuck window; check the members, or raise limits.stuck of {fleet}"
            ),
            Stop::Budget => {
                format!("raise the budget: mur fleet run {fleet} --loop --budget-usd <N>, or limits.cost_usd")
            }
            Stop::MaxIterations => {
                format!("fleet {fleet} reached the {ITERATION_CEILING}-iteration diagnostic ceiling; set done_when")
            }
            Stop::IterationFailed => format!("see the failed step in mur fleet jobs {fleet} --all"),
        })
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What the guards see between iterations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardInput {
    /// Time since the loop started.
    pub elapsed: Duration,
    /// The resolved deadline.
    pub deadline: Duration,
    /// The resolved stuck window (`None`: off).
    pub stuck: Option<Duration>,
    /// Time since the last agent-authored channel event (or the loop's start).
    pub since_progress: Duration,
    /// Iterations already run.
    pub iteration: u64,
}

/// The guards checked before each iteration (they never interrupt one): the deadline
/// first, then stuck (never before the first iteration), then the diagnostic ceiling.
pub fn check_guards(g: GuardInput) -> Option<Stop> {
    if g.elapsed >= g.deadline {
        return Some(Stop::Deadline);
    }
    if let Some(window) = g.stuck
        && g.iteration > 0
        && g.since_progress >= window
    {
        return Some(Stop::Stuck);
    }
    if g.iteration >= ITERATION_CEILING {
        return Some(Stop::MaxIterations);
    }
    None
}

/// The time a delegated step inherits: what is left of the loop's deadline, at least 1 s.
pub fn inherited_deadline(deadline: Duration, elapsed: Duration) -> Duration {
    deadline.saturating_sub(elapsed).max(Duration::from_secs(1))
}
