//! Where fleets live on the cluster, and the `mur.api.fleet.*` API's records: the names of
//! the `mur_fleets` and `mur_jobs` buckets and of the `MUR_FLEET` stream, their keys and
//! subjects, the kill-switch sentinel, the fleet channel's events, and the requests and
//! replies of `mur fleet …`.
//!
//! The seed keeps fleets as files under `~/.mur/fleets/<name>/`; the cluster keeps the same
//! things in JetStream so every coordinator and every client sees one state (issue #10):
//!
//! | seed file | here |
//! |---|---|
//! | `fleet.yaml` | `mur_fleets` key `def.<fleet>`: the YAML text as stored |
//! | `.stopped` | `mur_fleets` key `stopped.<fleet>`: a [`Sentinel`] (JSON) |
//! | `.last_run` | `mur_fleets` key `lastrun.<fleet>`: the trigger's state, JSON (issue #36; a bare unix ms before it) ([`last_run_key`]) |
//! | (none) | `mur_fleets` key `cancel.<run id>`: a run asked to stop at its next iteration ([`cancel_key`]) |
//! | `jobs/<uuid>.yaml` | `mur_jobs` key `<fleet>.<uuid>`: a [`crate::fleet::Job`] (JSON); every change a compare-and-set |
//! | the fleet's channel | stream `MUR_FLEET`, subject `mur.fleet.<fleet>.channel`: [`ChannelEvent`]s |
//! | (none) | `mur_fleets` key `removing.<fleet>`: a [`Removing`] (JSON) while `mur fleet rm` runs |
//!
//! Loop settings (`mur fleet set-loop`) are kept in the definition's `loop:` block
//! ([`crate::fleet::apply_loop_edit`]), so there is one source for what a run reads.
//!
//! Pure: no IO, no clock (callers pass unix milliseconds in).

use crate::cost::Spend;
use crate::fleet::{Job, JobStatus};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// KV bucket of fleet definitions and kill-switch sentinels ([`def_key`], [`stopped_key`]).
pub const FLEETS_BUCKET: &str = "mur_fleets";
/// KV bucket of fleet jobs ([`job_key`]).
pub const JOBS_BUCKET: &str = "mur_jobs";
/// Revisions kept per key of [`FLEETS_BUCKET`]: earlier definitions stay readable.
pub const FLEETS_HISTORY: u8 = 5;
/// Revisions kept per key of [`JOBS_BUCKET`].
pub const JOBS_HISTORY: u8 = 5;
/// The stream of every fleet's channel ([`channel_subject`]).
pub const FLEET_STREAM: &str = "MUR_FLEET";
/// The subjects of [`FLEET_STREAM`].
pub const FLEET_SUBJECTS: &str = "mur.fleet.>";
/// The longest job text `mur fleet send` takes, in bytes (as a task's text).
pub const MAX_JOB_BYTES: usize = 1 << 20;
/// The most events one `fleet.log` answer holds (the oldest after `since`).
pub const MAX_LOG_EVENTS: usize = 10_000;
/// The most bytes of events one `fleet.log` reply carries (well under NATS' default 1 MiB
/// payload): a reply cut short ends where the next page starts; clients ask again from the
/// last `seq` until a page comes back empty.
pub const MAX_LOG_BYTES: usize = 512 * 1024;

/// The key of a fleet's definition: `def.<fleet>`.
pub fn def_key(fleet: &str) -> String {
    format!("def.{fleet}")
}

/// The key of a fleet's kill-switch sentinel: `stopped.<fleet>`.
pub fn stopped_key(fleet: &str) -> String {
    format!("stopped.{fleet}")
}

/// The key written while `mur fleet rm` removes a fleet: `removing.<fleet>` ([`Removing`]).
pub fn removing_key(fleet: &str) -> String {
    format!("removing.{fleet}")
}

/// A removal under way. `mur fleet rm` writes it *before* it looks for a run going and
/// deletes it last; a run writes its record *before* it looks for this key. Both keys are
/// in one bucket (one stream, one order), so of a removal and a run starting at once one
/// sees the other: the removal is refused, or the run is (it removes its record and
/// starts nothing). Without it a run starting between rm's check and its purge went on in
/// a fleet that was gone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removing {
    /// The definition's revision being removed: a marker of an earlier definition of the
    /// same name (a removal that died half-way) does not apply to a fleet created since.
    pub revision: u64,
    /// When the removal started, unix ms.
    pub at: u64,
}

impl Removing {
    /// A marker older than this is of a removal that died (a removal takes well under a
    /// second): it no longer refuses runs, ms.
    pub const STALE_MS: u64 = 60_000;

    /// Whether this marker refuses a run of the definition at `revision`, at `now` (unix ms).
    pub fn applies(&self, revision: u64, now: u64) -> bool {
        self.revision == revision && now.saturating_sub(self.at) < Self::STALE_MS
    }
}

/// The fleet a [`FLEETS_BUCKET`] key defines, when it is a `def.` key.
pub fn fleet_of_def_key(key: &str) -> Option<&str> {
    key.strip_prefix("def.")
}

/// The key of a job: `<fleet>.<job id>`. Fleet names have no dot, so the fleet is the part
/// before the first one.
pub fn job_key(fleet: &str, job_id: &str) -> String {
    format!("{fleet}.{job_id}")
}

/// The fleet and job id of a [`JOBS_BUCKET`] key.
pub fn split_job_key(key: &str) -> Option<(&str, &str)> {
    key.split_once('.')
}

/// The subject of a fleet's channel: `mur.fleet.<fleet>.channel`.
pub fn channel_subject(fleet: &str) -> String {
    format!("mur.fleet.{fleet}.channel")
}

/// The API subjects of `mur fleet …` (endpoints of the `mur` micro service, like
/// [`crate::cluster::api`]). Each takes a JSON request and answers JSON, or an
/// [`crate::cluster::ApiError`].
pub mod api {
    /// [`super::DefineRequest`] → [`super::DefineReply`]; refused when the fleet exists.
    pub const CREATE: &str = "mur.api.fleet.create";
    /// [`super::DefineRequest`] → [`super::DefineReply`]: create or replace.
    pub const APPLY: &str = "mur.api.fleet.apply";
    /// Empty → a JSON array of [`super::FleetSummary`], by name.
    pub const LIST: &str = "mur.api.fleet.ls";
    /// [`super::FleetRef`] → [`super::FleetInfo`].
    pub const SHOW: &str = "mur.api.fleet.show";
    /// [`super::FleetRef`] → [`super::FleetRef`]: the definition, sentinel, jobs and channel go.
    pub const REMOVE: &str = "mur.api.fleet.rm";
    /// [`super::SendRequest`] → the queued [`crate::fleet::Job`].
    pub const SEND: &str = "mur.api.fleet.send";
    /// [`super::JobsRequest`] → a [`crate::page::Page`] of [`crate::fleet::Job`]s, oldest
    /// first, fitted into one message.
    pub const JOBS: &str = "mur.api.fleet.jobs";
    /// [`super::CancelRequest`] → the canceled [`crate::fleet::Job`].
    pub const CANCEL: &str = "mur.api.fleet.cancel";
    /// [`super::SetLoopRequest`] → [`super::FleetInfo`] after the edit.
    pub const SET_LOOP: &str = "mur.api.fleet.set_loop";
    /// [`super::StopRequest`] → [`super::FleetInfo`]: writes the sentinel.
    pub const STOP: &str = "mur.api.fleet.stop";
    /// [`super::FleetRef`] → [`super::FleetInfo`]: clears the sentinel.
    pub const START: &str = "mur.api.fleet.start";
    /// [`super::LogRequest`] → a JSON array of [`super::ChannelEvent`], oldest first.
    pub const LOG: &str = "mur.api.fleet.log";
    /// [`super::AnswerRequest`] → the [`crate::fleet::Job`]: approves the steps its last
    /// run parked; the next run of the fleet takes the job and runs them.
    pub const APPROVE: &str = "mur.api.fleet.approve";
    /// [`super::AnswerRequest`] → the [`crate::fleet::Job`]: denies them; the next run
    /// fails them (their `on_failure` applies).
    pub const DENY: &str = "mur.api.fleet.deny";
    /// [`super::FleetRef`] → [`super::FleetInfo`]: asks the leading coordinator's trigger
    /// for one occurrence now (`mur fleet trigger`, issue #36).
    pub const TRIGGER: &str = "mur.api.fleet.trigger";
}

// ---------------------------------------------------------------------------------------
// The kill-switch.

/// The kill-switch sentinel (`mur fleet stop`): who set it, when (unix ms), and whether
/// the steps already running may finish.
///
/// A run in flight reads it too (issue #29 item 4): from the moment it is set no
/// iteration or step starts; without `drain` the running steps are canceled (their tasks
/// end `canceled`, their commands killed as `mur task cancel` kills them), with it they
/// finish. Either way the run ends `stopped`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sentinel {
    /// When it was written.
    pub at: u64,
    /// Who wrote it (`user@host`, or what `--by` said).
    pub by: String,
    /// `--drain`: running steps finish; nothing new starts. Absent in sentinels written
    /// before it existed, which cancel.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain: bool,
}

/// Whether a fleet may start work, as its sentinel says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum StopState {
    /// No sentinel: runs, the loop and the scheduler may start work.
    Started,
    /// The sentinel is set.
    Stopped {
        /// The sentinel.
        sentinel: Sentinel,
    },
    /// The sentinel could not be read (a read error, or a value that does not parse): the
    /// fleet counts as stopped (fail closed, the design's invariant 6).
    Unreadable {
        /// Why.
        error: String,
    },
}

impl StopState {
    /// The state a sentinel key's value gives: absent → started; a [`Sentinel`] →
    /// stopped; anything else → unreadable.
    pub fn from_value(value: Option<&[u8]>) -> StopState {
        match value {
            None => StopState::Started,
            Some(bytes) => match serde_json::from_slice::<Sentinel>(bytes) {
                Ok(sentinel) => StopState::Stopped { sentinel },
                Err(e) => StopState::Unreadable { error: format!("sentinel: {e}") },
            },
        }
    }

    /// Whether work must not start: stopped, or unreadable (fail closed).
    pub fn is_stopped(&self) -> bool {
        !matches!(self, StopState::Started)
    }

    /// `started`, `stopped` or `stopped (sentinel unreadable)`, as `mur fleet ls` shows it.
    pub fn label(&self) -> &'static str {
        match self {
            StopState::Started => "started",
            StopState::Stopped { .. } => "stopped",
            StopState::Unreadable { .. } => "stopped (sentinel unreadable)",
        }
    }
}

// ---------------------------------------------------------------------------------------
// The channel.

/// Who wrote a channel event.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Author {
    /// The coordinator: state changes, stop reasons, jobs queued and canceled.
    System,
    /// The fleet's router: plans, decisions, the marker synthesis.
    Router,
    /// A member capsule, by name: its replies.
    Member(String),
}

impl Author {
    /// Whether the event is agent-authored progress for stuck detection and marker matching:
    /// a member's (a router-only iteration is not progress, §The bounds).
    pub fn is_member(&self) -> bool {
        matches!(self, Author::Member(_))
    }
}

impl fmt::Display for Author {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Author::System => f.write_str("system"),
            Author::Router => f.write_str("router"),
            Author::Member(m) => write!(f, "member:{m}"),
        }
    }
}

/// What a channel event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum EventKind {
    /// A step handed to a member.
    Delegation,
    /// A member's reply.
    Reply,
    /// A router decision (a plan, DONE or CONTINUE).
    Decision,
    /// A change of state: of the fleet (stopped, started), of a loop, or of a job.
    StateChange,
    /// Why a loop stopped.
    Stop,
    /// Anything else worth reading.
    Note,
    /// A kind this version does not know.
    #[serde(other)]
    Unknown,
}

impl EventKind {
    /// The wire spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            EventKind::Delegation => "delegation",
            EventKind::Reply => "reply",
            EventKind::Decision => "decision",
            EventKind::StateChange => "state-change",
            EventKind::Stop => "stop",
            EventKind::Note => "note",
            EventKind::Unknown => "unknown",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event of a fleet's channel. Published as JSON on [`channel_subject`] with the
/// JetStream publish ack; `seq` is the stream sequence, filled in when read (0 in what is
/// published).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChannelEvent {
    /// The stream sequence: increasing within the channel (not dense: channels share a
    /// stream).
    #[serde(default)]
    pub seq: u64,
    /// When it was written, unix ms.
    pub at: u64,
    /// Who wrote it.
    pub author: Author,
    /// What it is.
    pub kind: EventKind,
    /// The text: a delegated task, a reply, a decision, a stop reason.
    pub text: String,
    /// The run it belongs to (a loop iteration's `<id>-<n>`).
    #[serde(default)]
    pub run_id: Option<String>,
    /// The job it is about.
    #[serde(default)]
    pub job_id: Option<String>,
    /// On the one event that ends a run: how it ended, for scripts (reference §3
    /// Teardown: `from`, `to`, `stop_reason`, `remedy`, `iterations`, `spent_usd`, `run_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopReport>,
}

impl ChannelEvent {
    /// A system event (`seq` 0 until read back).
    pub fn system(kind: EventKind, text: impl Into<String>, at: u64) -> ChannelEvent {
        ChannelEvent {
            seq: 0,
            at,
            author: Author::System,
            kind,
            text: text.into(),
            run_id: None,
            job_id: None,
            stop: None,
        }
    }
}

/// How a run ended, on its last channel event (`mur-fleet` reference §3 Teardown and the
/// stop table; §9 Stop reporting).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StopReport {
    /// The state the run left: always `working`.
    pub from: String,
    /// The channel state it ended in: `completed` (converged, queue drained),
    /// `input-required` (awaiting approval), `canceled` (stopped) or `failed` (the rest).
    pub to: String,
    /// The stop's label (`converged`, `deadline`, …).
    pub stop_reason: String,
    /// A one-line remedy naming the fleet; absent for `converged` and `queue-drained`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remedy: Option<String>,
    /// Iterations the run made.
    pub iterations: u64,
    /// What the run spent, USD (0 on models with no price).
    pub spent_usd: f64,
    /// The run.
    pub run_id: String,
}

impl StopReport {
    /// The report of `stop` ending run `run_id` of `fleet` after `iterations` iterations
    /// that spent `spent_usd`; `blocked_job`: the job an `awaiting-approval` stop left
    /// blocked, which its remedy names.
    pub fn new(
        stop: crate::fleet::Stop,
        fleet: &str,
        run_id: &str,
        iterations: u64,
        spent_usd: f64,
        blocked_job: Option<&str>,
    ) -> StopReport {
        StopReport {
            from: "working".into(),
            to: stop.channel_state().into(),
            stop_reason: stop.label().into(),
            remedy: stop.remedy(fleet, blocked_job),
            iterations,
            spent_usd,
            run_id: run_id.into(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Requests and replies.

/// Names a fleet: `{"fleet": "builder"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetRef {
    /// The fleet's name.
    pub fleet: String,
}

/// `fleet.create` / `fleet.apply`: the `fleet.yaml` text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DefineRequest {
    /// The text, stored as given once it validates strictly.
    pub yaml: String,
}

/// What `fleet.create` / `fleet.apply` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DefineAction {
    /// There was no such fleet.
    Created,
    /// The stored definition was replaced.
    Replaced,
    /// The stored definition was the same text; nothing was written.
    Unchanged,
}

impl DefineAction {
    /// `created`, `replaced` or `unchanged`.
    pub const fn as_str(self) -> &'static str {
        match self {
            DefineAction::Created => "created",
            DefineAction::Replaced => "replaced",
            DefineAction::Unchanged => "unchanged",
        }
    }
}

/// The answer of `fleet.create` / `fleet.apply`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefineReply {
    /// The fleet.
    pub fleet: String,
    /// What was done.
    pub action: DefineAction,
    /// Notices of the definition (an ignored `loop.max_iterations`).
    #[serde(default)]
    pub notices: Vec<String>,
}

/// A row of `mur fleet ls`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetSummary {
    /// The fleet.
    pub name: String,
    /// Its members, in order (empty when the stored definition does not load).
    pub members: Vec<String>,
    /// The kill-switch.
    pub stop: StopState,
    /// Jobs per status: queued, running, blocked (terminal ones are not counted).
    pub queued: u64,
    /// See `queued`.
    pub running: u64,
    /// See `queued`.
    pub blocked: u64,
    /// `loop.trigger` as written (`manual` by default).
    pub trigger: String,
    /// `loop.done_when` as written (empty: the router judges).
    pub done_when: String,
    /// Why the stored definition does not load, if it does not.
    #[serde(default)]
    pub error: Option<String>,
}

/// `mur fleet show`: a summary, the notices of loading it, and the stored text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetInfo {
    /// As `ls` shows it.
    #[serde(flatten)]
    pub summary: FleetSummary,
    /// Values stored by an older version and read differently now (`path: what happens`).
    pub notices: Vec<String>,
    /// The definition as stored.
    pub yaml: String,
    /// The definition's revision in [`FLEETS_BUCKET`].
    pub revision: u64,
    /// The trigger's schedule and state, for a fleet whose trigger is not `manual`
    /// (issue #36).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleInfo>,
}

/// A fleet's schedule as `mur fleet show`, `set-loop` and `status` print it (issue #36).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleInfo {
    /// `loop.timezone` (IANA name).
    pub timezone: String,
    /// `loop.overlap`.
    pub overlap: String,
    /// The catch-up window in force (`90s` when `loop.catchup` is absent).
    pub catchup: String,
    /// `loop.pause_after_failures` (0: never).
    pub pause_after_failures: u32,
    /// The next occurrences of a cron (none for an interval), from when this was read.
    pub next: Vec<NextFire>,
    /// Failed runs in a row.
    pub failures: u32,
    /// When the trigger paused itself, unix ms.
    pub paused_at: Option<u64>,
    /// Occurrences skipped so far.
    pub skipped: u64,
    /// An occurrence waiting for the run going to end, unix ms.
    pub queued: Option<u64>,
    /// The newest occurrence handled, unix ms.
    pub last: Option<u64>,
    /// The run the trigger started (claimed or going), until it is seen over.
    pub run: Option<String>,
    /// A `mur fleet trigger` not yet taken by the leader, unix ms.
    pub manual: Option<u64>,
}

/// One upcoming occurrence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextFire {
    /// Unix ms.
    pub at: u64,
    /// In the fleet's zone: `2026-10-25 02:30 CEST (+02:00)`.
    pub local: String,
    /// In UTC: `2026-10-25 00:30 UTC`.
    pub utc: String,
}

impl FleetSummary {
    /// Counts the non-terminal jobs by status.
    pub fn count(&mut self, jobs: &[Job]) {
        for j in jobs {
            match j.status {
                JobStatus::Queued => self.queued += 1,
                JobStatus::Running => self.running += 1,
                JobStatus::Blocked => self.blocked += 1,
                _ => {}
            }
        }
    }
}

/// `fleet.send`: queue a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendRequest {
    /// The fleet.
    pub fleet: String,
    /// The work.
    pub text: String,
    /// Who queues it; default [`crate::fleet::SOURCE_CLI`].
    #[serde(default)]
    pub source: Option<String>,
}

/// `fleet.jobs`: which jobs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobsRequest {
    /// The fleet.
    pub fleet: String,
    /// Include terminal jobs.
    #[serde(default)]
    pub all: bool,
    /// Only jobs whose run id starts with this.
    #[serde(default)]
    pub since: Option<String>,
    /// Only jobs in this status (`mur fleet run`'s view asks for its run's blocked ones:
    /// a short reply, where the run's every job may be a long one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<crate::fleet::JobStatus>,
}

/// `fleet.cancel`: a job by id or by a prefix naming one job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// The fleet.
    pub fleet: String,
    /// The job's id, or a prefix of it that names one job.
    pub job: String,
}

/// `fleet.approve` / `fleet.deny`: the answer to a blocked job's approval request
/// (the fleet-loops seed, §Unattended runs: "Approve it whenever you get to it and the next
/// run continues from there").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnswerRequest {
    /// The fleet.
    pub fleet: String,
    /// The job's id, or a prefix of it that names one job.
    pub job: String,
    /// Who answers (recorded on the job and the channel).
    pub by: String,
}

/// `fleet.set_loop`: only the fields given are judged and changed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetLoopRequest {
    /// The fleet.
    pub fleet: String,
    /// `--trigger`.
    #[serde(default)]
    pub trigger: Option<String>,
    /// `--done-when`.
    #[serde(default)]
    pub done_when: Option<String>,
    /// `--deadline`.
    #[serde(default)]
    pub deadline: Option<String>,
    /// `--budget-usd` (any number: the validator judges it).
    #[serde(default)]
    pub budget_usd: Option<f64>,
    /// `--timezone` (issue #36).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// `--overlap`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap: Option<String>,
    /// `--catchup`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catchup: Option<String>,
    /// `--pause-after-failures` (as typed: the validator judges it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_after_failures: Option<String>,
}

/// `fleet.stop`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopRequest {
    /// The fleet.
    pub fleet: String,
    /// Who stops it.
    pub by: String,
    /// `--drain`: let running steps finish instead of canceling them ([`Sentinel::drain`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain: bool,
}

/// `fleet.log`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogRequest {
    /// The fleet.
    pub fleet: String,
    /// Only events with a sequence number above this one.
    #[serde(default)]
    pub since: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_subjects() {
        assert_eq!(def_key("builder"), "def.builder");
        assert_eq!(stopped_key("builder"), "stopped.builder");
        assert_eq!(fleet_of_def_key("def.builder"), Some("builder"));
        assert_eq!(fleet_of_def_key("stopped.builder"), None);
        let key = job_key("dev-team", "0190b6a0-0000-7000-8000-000000000000");
        assert_eq!(split_job_key(&key), Some(("dev-team", "0190b6a0-0000-7000-8000-000000000000")));
        assert_eq!(channel_subject("dev_1"), "mur.fleet.dev_1.channel");
    }

    #[test]
    fn an_unreadable_sentinel_counts_as_stopped() {
        assert_eq!(StopState::from_value(None), StopState::Started);
        assert!(!StopState::Started.is_stopped());
        let set = StopState::from_value(Some(br#"{"at":5,"by":"ann"}"#));
        assert_eq!(set, StopState::Stopped { sentinel: Sentinel { at: 5, by: "ann".into(), drain: false } });
        assert!(set.is_stopped());
        let bad = StopState::from_value(Some(b"stopped"));
        assert!(bad.is_stopped());
        assert_eq!(bad.label(), "stopped (sentinel unreadable)");
        assert_eq!(
            serde_json::to_value(&bad).unwrap(),
            serde_json::json!({"state": "unreadable", "error": "sentinel: expected value at line 1 column 1"})
        );
    }

    #[test]
    fn channel_events_round_trip_and_unknown_kinds_read() {
        let mut e = ChannelEvent::system(EventKind::StateChange, "stopped by ann", 7);
        e.job_id = Some("j".into());
        let text = serde_json::to_string(&e).unwrap();
        assert_eq!(
            text,
            r#"{"seq":0,"at":7,"author":"system","kind":"state-change","text":"stopped by ann","run_id":null,"job_id":"j"}"#
        );
        assert_eq!(serde_json::from_str::<ChannelEvent>(&text).unwrap(), e);
        let member: ChannelEvent =
            serde_json::from_str(r#"{"at":1,"author":{"member":"w"},"kind":"telepathy","text":"x"}"#).unwrap();
        assert_eq!((member.author.to_string(), member.kind), ("member:w".to_string(), EventKind::Unknown));
        assert!(member.author.is_member() && !Author::Router.is_member());
    }
}

// ---------------------------------------------------------------------------------------
// Runs (issue #10 §Runs and loops).

/// The subject only the leading coordinator listens on for `mur fleet run`: the run
/// executes there, not in the client.
pub const RUN_SUBJECT: &str = "mur.leader.fleet.run";

/// The channel text of a run's start, written by the coordinator running it: `run <id>
/// started; <bounds line>`. `mur fleet run` printed that line already, and leaves it out.
pub fn run_started_text(run_id: &str, bounds: &str) -> String {
    format!("run {run_id} started; {bounds}")
}

/// The channel text of one of a run's notices: `notice: <notice>` (printed by `mur fleet
/// run` from the record, and left out of its milestones).
pub fn notice_text(notice: &str) -> String {
    format!("notice: {notice}")
}

/// The [`FLEETS_BUCKET`] key of a run's record: `run.<run id>`.
pub fn run_key(run_id: &str) -> String {
    format!("run.{run_id}")
}

/// `mur fleet run NAME [JOB] [--loop] [--deadline D] [--budget-usd N] [--run-id ID]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    /// The fleet.
    pub fleet: String,
    /// A queued job to run (id or unique prefix), instead of the oldest queued one.
    #[serde(default)]
    pub job: Option<String>,
    /// `--loop`.
    #[serde(default, rename = "loop")]
    pub looping: bool,
    /// `--deadline`.
    #[serde(default)]
    pub deadline: Option<String>,
    /// `--budget-usd`.
    #[serde(default)]
    pub budget_usd: Option<f64>,
    /// `--run-id`.
    #[serde(default)]
    pub run_id: Option<String>,
}

/// A run's record in [`FLEETS_BUCKET`] ([`run_key`]), kept by the coordinator running it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run id.
    pub run_id: String,
    /// The fleet.
    pub fleet: String,
    /// `running`, then the stop's run state (`docs/fleet.md` §Stop reasons, from
    /// the fleet reference, §3): `done` (converged, or the queue drained), `blocked`
    /// (awaiting approval), `stopped` (the kill-switch) or `failed` (any other stop); `ended`
    /// for a one-shot run whose coordinator died. Records of older versions say `completed`
    /// or `ended`.
    pub state: String,
    /// The stop's label (`converged`, `queue-drained`, `deadline`, …), once over.
    #[serde(default)]
    pub stop: Option<String>,
    /// The `bounds:` line, as printed.
    pub bounds: String,
    /// The coordinator running it.
    pub coordinator: String,
    /// Iterations made.
    pub iterations: u64,
    /// When it started, unix ms.
    pub started_at: u64,
    /// When the coordinator last wrote it (at least every few seconds while it runs).
    pub updated_at: u64,
    /// When it ended.
    #[serde(default)]
    pub ended_at: Option<u64>,
    /// What it was started with: a new leader resumes a loop from it (issue #11 §Jobs
    /// that outlive their coordinator). Absent in records of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RunRequest>,
    /// Notices for the person who started it, printed by the client: a fleet on models
    /// with no price is bounded by its deadline, not its budget (issue #11 §Cost).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
    /// The spend ceiling in force, USD (only for a fleet on metered models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_usd: Option<f64>,
    /// The rate of the budget projection, USD per 1,000 tokens (0: not metered).
    #[serde(default)]
    pub guard_rate: f64,
    /// Spend so far, the whole run.
    #[serde(default)]
    pub spend: Spend,
    /// Spend per member capsule (the router's plans and judgments under its name).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub members: BTreeMap<String, Spend>,
    /// Spend per job id (iterations without a job, on the standing goal, are not here).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub jobs: BTreeMap<String, Spend>,
    /// The W3C `traceparent` of the request that started the run (`mur fleet run`'s span,
    /// through the coordinator's span answering it; issue #32 §Fleet runs traced): a
    /// one-shot run's iteration is its child, a loop's iterations link to it. Absent when
    /// nothing traced the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl RunRecord {
    /// Whether the run is over.
    pub fn is_over(&self) -> bool {
        self.state != "running"
    }
}

/// The [`FLEETS_BUCKET`] key of a running run's heartbeat: `beat.<run id>` = unix ms,
/// rewritten every [`RUN_BEAT_EVERY_MS`] by the coordinator carrying it out.
pub fn beat_key(run_id: &str) -> String {
    format!("beat.{run_id}")
}

/// The [`FLEETS_BUCKET`] key of a fleet's trigger state: `lastrun.<fleet>` (issue #10
/// §Unattended runs; the seed's `.last_run`): JSON since issue #36, unix ms before.
pub fn last_run_key(fleet: &str) -> String {
    format!("lastrun.{fleet}")
}

/// The [`FLEETS_BUCKET`] key that asks run `run_id` to stop at its next iteration
/// (`loop.overlap: cancel_previous`, issue #36): `cancel.<run id>`; the run removes it.
pub fn cancel_key(run_id: &str) -> String {
    format!("cancel.{run_id}")
}

/// How often a running run's heartbeat is written, ms.
pub const RUN_BEAT_EVERY_MS: u64 = 2_000;

/// A `running` run whose heartbeat is older than this is dead (its coordinator is gone), ms.
pub const RUN_DEAD_AFTER_MS: u64 = 10_000;

/// `mur job status`'s liveness verdict on a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "lowercase")]
pub enum Liveness {
    /// Running, with a fresh heartbeat.
    Alive {
        /// Since the last heartbeat, ms.
        beat_age_ms: u64,
    },
    /// `running` in its record, but no heartbeat for [`RUN_DEAD_AFTER_MS`]: the coordinator
    /// carrying it died.
    Dead {
        /// Since the last heartbeat (or the last record write), ms.
        beat_age_ms: u64,
    },
    /// It ended.
    Over,
}

impl RunRecord {
    /// The liveness verdict at `now` (unix ms) given the last heartbeat, if any.
    pub fn liveness(&self, beat: Option<u64>, now: u64) -> Liveness {
        if self.is_over() {
            return Liveness::Over;
        }
        let last = beat.unwrap_or(self.updated_at).max(self.updated_at);
        let beat_age_ms = now.saturating_sub(last);
        if beat_age_ms > RUN_DEAD_AFTER_MS { Liveness::Dead { beat_age_ms } } else { Liveness::Alive { beat_age_ms } }
    }
}

/// `mur job status` / `mur fleet status` as JSON: the run's record and its verdict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunStatus {
    /// The record.
    #[serde(flatten)]
    pub record: RunRecord,
    /// The verdict.
    pub liveness: Liveness,
    /// The fleet's permits in use, holders and waiting steps (issue #11 §The fan-out cap).
    #[serde(default)]
    pub fanout: crate::fanout::FanoutStatus,
}

#[cfg(test)]
mod run_tests {
    use super::*;

    fn record(state: &str, updated_at: u64) -> RunRecord {
        RunRecord {
            run_id: "run-1".into(),
            fleet: "f".into(),
            state: state.into(),
            stop: None,
            bounds: String::new(),
            coordinator: "c1".into(),
            iterations: 0,
            started_at: 0,
            updated_at,
            ended_at: None,
            request: None,
            notices: Vec::new(),
            budget_usd: None,
            guard_rate: 0.0,
            spend: Spend::default(),
            members: BTreeMap::new(),
            jobs: BTreeMap::new(),
            traceparent: None,
        }
    }

    #[test]
    fn a_removal_mark_holds_runs_of_its_revision_back_for_a_minute() {
        let mark = Removing { revision: 7, at: 100_000 };
        assert!(mark.applies(7, 100_000));
        assert!(mark.applies(7, 159_999));
        assert!(!mark.applies(7, 160_000), "a removal that died a minute ago");
        assert!(!mark.applies(8, 100_500), "a definition made since");
        assert_eq!(removing_key("pair"), "removing.pair");
    }

    #[test]
    fn a_running_run_is_alive_while_its_heartbeat_is_fresh_and_dead_after_ten_seconds() {
        let r = record("running", 1_000);
        assert_eq!(r.liveness(Some(50_000), 55_000), Liveness::Alive { beat_age_ms: 5_000 });
        assert_eq!(r.liveness(Some(50_000), 60_000), Liveness::Alive { beat_age_ms: 10_000 });
        assert_eq!(r.liveness(Some(50_000), 60_001), Liveness::Dead { beat_age_ms: 10_001 });
        assert_eq!(r.liveness(None, 20_000), Liveness::Dead { beat_age_ms: 19_000 });
        assert_eq!(record("completed", 1_000).liveness(None, 99_999), Liveness::Over);
        let json = serde_json::to_value(RunStatus {
            record: r,
            liveness: Liveness::Alive { beat_age_ms: 5 },
            fanout: Default::default(),
        })
        .unwrap();
        assert_eq!((json["state"].as_str(), json["liveness"]["verdict"].as_str()), (Some("running"), Some("alive")));
    }
}

#[cfg(test)]
mod stop_report_tests {
    use super::*;
    use crate::fleet::Stop;

    #[test]
    fn a_stop_report_maps_each_stop_to_its_channel_state_and_remedy() {
        let r = StopReport::new(Stop::Deadline, "pair", "fleet-pair-1", 3, 0.25, None);
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"from": "working", "to": "failed", "stop_reason": "deadline",
                "remedy": "raise the deadline: mur fleet run pair --loop --deadline <D>, or limits.deadline",
                "iterations": 3, "spent_usd": 0.25, "run_id": "fleet-pair-1"})
        );
        let to = |s: Stop| StopReport::new(s, "f", "r", 0, 0.0, None).to;
        assert_eq!(
            [Stop::Converged, Stop::QueueDrained, Stop::AwaitingApproval, Stop::Stopped, Stop::Budget].map(to),
            ["completed", "completed", "input-required", "canceled", "failed"]
        );
        assert_eq!(StopReport::new(Stop::QueueDrained, "f", "r", 1, 0.0, None).remedy, None);
        assert!(StopReport::new(Stop::Stopped, "f", "r", 1, 0.0, None).remedy.unwrap().contains("mur fleet start f"));
    }
}
