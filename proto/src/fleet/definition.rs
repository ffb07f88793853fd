//! The validated fleet definition: [`Fleet`], its loop, limits, HITL, procedure steps and
//! parallel block (the fleet reference §1).

use super::*;

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
