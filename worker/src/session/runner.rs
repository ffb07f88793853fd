//! The async side of the session loop: performs the [`TaskMachine`]'s actions through the
//! driver, the tools, the hooks and the tracer, and frames tasks with `session_start`,
//! `task_start`, `task_end` and `session_end` (the runtime reference, §1: one
//! session_start / session_end pair per launch, one task_start / task_end pair per task,
//! whatever the reopens).
//!
//! Hook firing order (the session-loop seed diagram; the runtime reference, §3):
//! `on-session-start` once after `session_start`; per task `task_start` → `on-task-start`
//! (seeding) → attempts, `on-task-end` after each (reopening) → `task_end`; after each
//! model reply `on-inference` (and `on-compaction` when the threshold is crossed, before
//! the reply's tools run); after each tool call `on-tool-call`, and `on-shell` for shell
//! commands; `on-session-end` once, then async hooks are drained (15 s shared), their
//! faults written, and `session_end`.
//!
//! Spans follow the OpenTelemetry GenAI conventions (the JetStream patterns reference,
//! §5.1): `invoke_agent {capsule}` around a task, `chat {model}` around a model call,
//! `execute_tool {tool}` around a tool call.

use super::machine::{
    Action, CompactionReply, CompactionRule, Counters, Delta, Outcome, Reopen, TaskMachine, TaskSpec,
};
use super::seed::{self, Plan};
use super::spend::{Position, Spend};
use crate::driver::{Driver, ModelRequest, ToolSpec};
use crate::hooks::{Hooks, Reply};
use crate::tokens::Estimator;
use crate::tools::{CallContext, Outcome as ToolOutcome, Tools};
use crate::trace::{self, Tracer};
use mur_nats::clock::Clock;
use mur_proto::Manifest;
use mur_proto::hook::{Answer, Event as HookEvent};
use mur_proto::manifest::{Binding, CommitPolicy, Transport};
use mur_proto::message::Message;
use mur_proto::task::ExitStatus;
use mur_proto::trace::Event;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How long async hooks may take to drain at session end, all together
/// (the runtime reference, §3, "Async").
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(15);

/// A task taken over from a session that stopped answering for it (issue #8 §Takeover):
/// where its last per-turn checkpoint left it, if it wrote one, and who ran it (for the
/// `task_takeover` line).
#[derive(Clone, Debug)]
pub struct Takeover {
    /// The state at the last checkpoint; `None` when the task made none (it died in its
    /// first turn): the task starts afresh.
    pub checkpoint: Option<Resumed>,
    /// The delivery of the dispatch that brought the task here (2 for the first takeover).
    pub delivery: u64,
    /// The session that wrote the checkpoint.
    pub previous_session_id: String,
    /// The worker that ran it.
    pub previous_worker: String,
    /// The task's tool-call journal as the takeover read it (issue #34): responses and
    /// results reused, calls in doubt.
    pub replay: mur_proto::cluster::Replay,
}

/// The state a checkpoint left.
#[derive(Clone, Debug)]
pub struct Resumed {
    /// The whole conversation at the checkpoint.
    pub history: Vec<Message>,
    /// The task's counters at the checkpoint.
    pub counters: Counters,
    /// The last request's input plus output tokens.
    pub session_tokens: u64,
    /// Reopens granted before the checkpoint, as `(hook, reason)`.
    pub reopens: Vec<(String, String)>,
}

/// One per-turn checkpoint, as the loop hands it to [`Checkpoints::save`].
#[derive(Clone, Debug)]
pub struct TurnCheckpoint {
    /// Turns made so far.
    pub turn: u32,
    /// What the conversation gained since the previous checkpoint.
    pub delta: Delta,
    /// The task's counters.
    pub counters: Counters,
    /// The last request's input plus output tokens.
    pub session_tokens: u64,
    /// Reopens granted so far.
    pub reopens: Vec<(String, String)>,
}

/// Where per-turn checkpoints go (the cluster worker writes them to `mur_sessions`).
#[async_trait::async_trait]
pub trait Checkpoints: Send + Sync {
    /// Stores `checkpoint` durably before the next turn starts.
    ///
    /// # Errors
    /// Why it could not be stored, for the log: the task goes on without it, and a
    /// takeover would resume from the one before.
    async fn save(&self, checkpoint: TurnCheckpoint) -> Result<(), String>;
}

/// Where a task's tool-call journal goes (issue #34; the cluster worker appends to
/// `mur_sessions`): the model's response before any of its calls runs, each call's start
/// before it starts, its result when it ends.
///
/// Entries are sent with [`Journal::post`] and acknowledged together by
/// [`Journal::sync`], so that the appends which need not be awaited one by one share one
/// round trip: the session syncs before every effect (a tool call runs only once its
/// response and its start are acknowledged), and a result's acknowledgement is awaited
/// with the next call's start.
#[async_trait::async_trait]
pub trait Journal: Send + Sync {
    /// The worker writing (entries name it: a takeover tells who died).
    fn worker(&self) -> &str;

    /// Sends `entry` to the store without waiting for its acknowledgement (the next
    /// [`Journal::sync`] waits for it). Entries are sent in the order posted.
    ///
    /// # Errors
    /// Why it could not be sent (it is then not stored): a response not stored runs none
    /// of its calls, a start not stored does not run its call (each is answered with the
    /// reason); a result not stored leaves the call in doubt for a takeover.
    async fn post(&self, entry: mur_proto::cluster::Entry) -> Result<(), String>;

    /// Waits until the store acknowledged every entry posted since the last sync, all
    /// together, and returns those it did not store (none when all are durable).
    async fn sync(&self) -> Vec<Unstored>;
}

/// A journal entry the store did not acknowledge ([`Journal::sync`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unstored {
    /// Its key ([`mur_proto::cluster::Entry::key`]).
    pub key: String,
    /// Why, for the log and the model.
    pub why: String,
}

/// How a cluster task runs ([`Session::run_task_durable`]): checkpointed after every turn,
/// and possibly resumed from a checkpoint.
pub struct Durable {
    /// Resume here instead of starting the task afresh.
    pub takeover: Option<Takeover>,
    /// Where checkpoints go.
    pub checkpoints: Arc<dyn Checkpoints>,
    /// Where the tool-call journal goes; `None` journals nothing (a takeover then asks
    /// the model again and runs the turn's calls again).
    pub journal: Option<Arc<dyn Journal>>,
    /// When the task must be over: the deadline a fleet step inherits. Then the call under
    /// way is dropped, no further turn starts, and the task ends `deadline_exceeded`.
    pub deadline: Option<tokio::time::Instant>,
    /// Fired (before the task's stop) when the task is found to be another session's:
    /// taken over while this one's worker was cut off, or ended elsewhere (issue #33). The
    /// task then stops as on a cancel, but writes `session_superseded` instead of
    /// `task_end` and no result file: `task_end` is its holder's to write, once.
    pub superseded: Option<CancellationToken>,
}

/// What a session needs besides its collaborators.
#[derive(Clone)]
pub struct SessionConfig {
    /// The capsule's manifest.
    pub manifest: Arc<Manifest>,
    /// The model name sent to the provider (empty when the driver needs none).
    pub model: String,
    /// The model label for the trace.
    pub model_label: String,
    /// The full system prompt.
    pub system_prompt: String,
    /// `manifest`, `cli` or `none`.
    pub system_prompt_source: &'static str,
    /// SHA-256 of the capsule's prompt.
    pub system_prompt_sha256: Option<String>,
    /// Where tools run.
    pub call_context: CallContext,
    /// Where each task's result text is written (`out/result.txt`), if anywhere.
    pub result_path: Option<PathBuf>,
    /// The session folder's `logs/` (`bootstrap.log`), if any.
    pub logs_dir: Option<PathBuf>,
    /// The session this one resumes.
    pub resumed_from: Option<String>,
}

/// The collaborators of a session.
pub struct Parts {
    /// The model.
    pub driver: Arc<dyn Driver>,
    /// The tools.
    pub tools: Arc<dyn Tools>,
    /// The hooks.
    pub hooks: Arc<dyn Hooks>,
    /// The trace, shared with the hooks' inference gate.
    pub tracer: Arc<Mutex<Tracer>>,
    /// Wall-clock time.
    pub clock: Arc<dyn Clock>,
    /// Token estimates.
    pub estimator: Arc<dyn Estimator>,
    /// The session's spend, shared with the hooks' inference gate.
    pub spend: Arc<Spend>,
    /// Where the session is, shared with the hooks' inference gate.
    pub position: Arc<Position>,
}

/// A finished task.
#[derive(Clone, Debug)]
pub struct TaskReport {
    /// The task (its text with any reopen feedback).
    pub task: TaskSpec,
    /// How it ended.
    pub outcome: Outcome,
    /// Its counters (all attempts).
    pub counters: Counters,
    /// Reopens granted.
    pub reopen_count: u32,
    /// The conversation at the end (for threaded contexts).
    pub history: Vec<Message>,
    /// The session cannot go on (a compaction hook's error, a spend ceiling hit by one):
    /// no further task may run (the context seed).
    pub fatal: bool,
    /// Tool calls found in doubt at the task's takeovers, this one's and earlier ones'
    /// (issue #34).
    pub tool_calls_in_doubt: u32,
    /// The session was superseded ([`Durable::superseded`]): it wrote no `task_end`, and
    /// the outcome is no end of the task's.
    pub superseded: bool,
}

/// The journal of the task running, with what a takeover read of it (issue #34).
struct Journaling {
    journal: Arc<dyn Journal>,
    replay: mur_proto::cluster::Replay,
    /// Calls found in doubt, earlier takeovers' included.
    in_doubt: u32,
    /// A turn whose response could not be journaled, and why: none of its calls runs.
    unrecorded: Option<(u32, String)>,
}

impl Journaling {
    /// Waits for every entry posted ([`Journal::sync`]): a response among those not
    /// stored makes its turn unrecorded, a result is logged (its call will be in doubt for
    /// a takeover). Returns why `key` was not stored, if it is among them.
    async fn sync(&mut self, task_id: &str, key: Option<&str>) -> Option<String> {
        let mut own = None;
        for u in self.journal.sync().await {
            if key == Some(u.key.as_str()) {
                own = Some(u.why);
            } else if let Some(turn) = response_turn(task_id, &u.key) {
                tracing::warn!(task_id, turn, error = %u.why, "the model's response was not journaled: its tool calls will not run");
                self.unrecorded = Some((turn, u.why));
            } else {
                tracing::warn!(task_id, key = %u.key, error = %u.why, "a journal entry was not stored");
            }
        }
        own
    }
}

/// The turn of a response's journal key (`jrnl.<task>.<turn>.m`), `None` for any other key.
fn response_turn(task_id: &str, key: &str) -> Option<u32> {
    key.strip_prefix(&mur_proto::cluster::journal_prefix(task_id))?.strip_suffix(".m")?.parse().ok()
}

/// Session totals, as `session_end` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Sum of task turns.
    pub turns: u32,
    /// Sum of task input tokens.
    pub input_tokens: u64,
    /// Sum of task output tokens.
    pub output_tokens: u64,
    /// Sum of task tool calls.
    pub tool_calls: u32,
    /// Sum of task shell calls.
    pub shell_calls: u32,
}

/// Why a session could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// An MCP server of the capsule's could not be started (issue #35).
    #[error(transparent)]
    Tools(#[from] crate::tools::mcp::StartError),
    /// The trace could not be written.
    #[error(transparent)]
    Trace(#[from] trace::Error),
}

/// One launch of a capsule.
pub struct Session {
    cfg: SessionConfig,
    parts: Parts,
    policies: HashMap<String, CommitPolicy>,
    fixed_tokens: u64,
    totals: Totals,
    last_exit: ExitStatus,
    started: Instant,
    ended: bool,
    /// The stop of the task running, fired by its cancel or its inherited deadline (a
    /// token never fired between tasks; [`Session::end_until`] sets the session end's).
    /// Blocking hooks are dispatched under it, so a cancelled task's hook under way is
    /// killed and none starts after it (issue #8 §Cancel).
    task_stop: CancellationToken,
}

/// The warning due when the part of the context every request carries (the system prompt
/// and the tool specs, `fixed_tokens`) alone reaches the compaction threshold, so no
/// compaction can get the count under it (issue #28 item 4); `None` otherwise or when
/// compaction is off.
pub fn fixed_part_warning(m: &mur_proto::manifest::Manifest, fixed_tokens: u64) -> Option<String> {
    let max_tokens = m.context.max_tokens?;
    let threshold = m.inference.compaction.threshold;
    let rule = CompactionRule { max_tokens, threshold };
    rule.crossed(fixed_tokens).then(|| {
        format!(
            "capsule {}: the system prompt and tool specs alone are about {fixed_tokens} tokens, at or over the \
             compaction threshold ({threshold} × context.max_tokens {max_tokens}): compaction cannot bring the \
             context under it, so after one that does not, the next waits until the history outgrows what it left",
            m.name
        )
    })
}

/// Why a compaction ended the session.
enum Fatal {
    Spend(String),
    Failed(String),
}

impl Session {
    /// Starts a session: starts its tools' MCP servers, fires `on-stage` (its errors only
    /// logged: no trace exists yet), writes `session_start`, fires `on-session-start`.
    ///
    /// # Errors
    /// [`StartError::Tools`] when an MCP server cannot be started (nothing else has run);
    /// [`StartError::Trace`] when the trace cannot be written.
    pub async fn start(cfg: SessionConfig, parts: Parts) -> Result<Session, StartError> {
        let m = cfg.manifest.clone();
        // Its MCP servers are up before anything else runs (issue #35).
        parts.tools.start(&cfg.call_context).await?;
        let fixed_tokens = parts.estimator.count_repeated(&cfg.system_prompt)
            + parts.estimator.count_repeated(&tools_json(&parts.tools.specs()));
        let policies = m.hooks.iter().map(|h| (h.name.clone(), h.commit_policy)).collect();
        if let Some(warning) = fixed_part_warning(&m, fixed_tokens) {
            tracing::warn!("{warning}");
        }
        let session = Session {
            cfg,
            parts,
            policies,
            fixed_tokens,
            totals: Totals::default(),
            last_exit: ExitStatus::Ok,
            started: Instant::now(),
            ended: false,
            task_stop: CancellationToken::new(),
        };
        if session.wants(Binding::OnStage) {
            let sid = session.session_id();
            for r in session
                .parts
                .hooks
                .dispatch(&sid, &HookEvent::OnStage { shell_allow: m.capabilities.shell_allow.clone() })
                .await
            {
                if let Err(e) = r.answer {
                    tracing::warn!(hook = %r.hook, error = %e, "on-stage hook failed");
                }
            }
        }
        session.emit(Event::SessionStart {
            capsule_name: m.name.clone(),
            capsule_version: m.version.clone(),
            model: session.cfg.model_label.clone(),
            driver: session.parts.driver.kind().to_string(),
            max_turns: m.inference.max_turns,
            capabilities: if m.capabilities.shell_allow.is_empty() { vec![] } else { vec!["shell".into()] },
            tools_declared: session.parts.tools.specs().iter().map(|s| s.name.clone()).collect(),
            system_prompt_source: session.cfg.system_prompt_source.to_string(),
            system_prompt_sha256: session.cfg.system_prompt_sha256.clone(),
            resumed_from: session.cfg.resumed_from.clone(),
            context_id: None,
        })?;
        if session.wants(Binding::OnSessionStart) {
            session
                .dispatch(HookEvent::OnSessionStart {
                    capsule_name: m.name.clone(),
                    capsule_version: m.version.clone(),
                    model: session.cfg.model_label.clone(),
                    capabilities: if m.capabilities.shell_allow.is_empty() { vec![] } else { vec!["shell".into()] },
                })
                .await?;
        }
        Ok(session)
    }

    /// Writes an event the host produces around the loop (`shell_completed`,
    /// `shell_abandoned`, …) to the session's trace.
    ///
    /// # Errors
    /// [`trace::Error`] when the trace cannot be written.
    pub fn record(&self, event: Event) -> Result<String, trace::Error> {
        self.emit(event)
    }

    /// The session id.
    pub fn session_id(&self) -> String {
        self.parts.tracer.lock().expect("tracer lock").session_id().to_string()
    }

    fn emit(&self, event: Event) -> Result<String, trace::Error> {
        self.parts.tracer.lock().expect("tracer lock").emit(event)
    }

    fn emit_all(&self, events: Vec<Event>) -> Result<(), trace::Error> {
        for e in events {
            self.emit(e)?;
        }
        Ok(())
    }

    /// Whether any hook receives events of `binding` (a hook without a binding receives
    /// all but `on-stage`).
    fn wants(&self, binding: Binding) -> bool {
        self.cfg
            .manifest
            .hooks
            .iter()
            .any(|h| h.binding == Some(binding) || (h.binding.is_none() && binding != Binding::OnStage))
    }

    /// Delivers `event`, writes a `hook_dispatch_error` for each failed hook and for each
    /// async fault collected so far, and returns the replies.
    async fn dispatch(&self, event: HookEvent) -> Result<Vec<Reply>, trace::Error> {
        let binding = event.binding();
        let replies = self.parts.hooks.dispatch_until(&self.session_id(), &event, &self.task_stop).await;
        for r in &replies {
            if let Err(e) = &r.answer {
                self.emit(Event::HookDispatchError {
                    hook_name: r.hook.clone(),
                    event: binding.as_str().to_string(),
                    arm: e.arm().to_string(),
                    message: e.to_string(),
                })?;
            }
        }
        self.flush_faults(self.parts.hooks.take_faults())?;
        if binding.honoured_policy().is_none() {
            // An observe-only event: any answer but `none` is reported and ignored.
            self.honoured(binding, replies.clone())?;
        }
        Ok(replies)
    }

    /// Writes a `hook_dispatch_error` per fault, then a `sandbox` line per hook program
    /// started sandboxed since the last flush.
    fn flush_faults(&self, faults: Vec<crate::hooks::Fault>) -> Result<(), trace::Error> {
        for f in faults {
            self.emit(Event::HookDispatchError { hook_name: f.hook, event: f.event, arm: f.arm, message: f.message })?;
        }
        for h in self.parts.hooks.take_sandboxed() {
            let r = h.rules;
            self.emit(Event::Sandbox {
                turn: self.parts.position.turn.load(Ordering::SeqCst),
                task_id: self.parts.position.task_id.lock().expect("position lock").clone(),
                tool_name: None,
                hook_name: Some(h.hook),
                event: Some(h.event),
                read: r.read,
                write: r.write,
                network: r.network,
                memory_mb: r.memory_mb,
                pids: r.pids,
                cpu_secs: r.cpu_secs,
                landlock_abi: r.landlock_abi,
                enforced_by: r.enforced_by,
            })?;
        }
        Ok(())
    }

    /// The first answer of the kind `binding` honours, from a hook whose `commit_policy`
    /// allows it; every other non-`none` answer is reported and ignored.
    fn honoured(&self, binding: Binding, replies: Vec<Reply>) -> Result<Option<(String, Answer)>, trace::Error> {
        let mut chosen = None;
        for r in replies {
            let Ok(answer) = r.answer else { continue };
            if answer == Answer::None {
                continue;
            }
            let policy = self.policies.get(&r.hook).copied().unwrap_or(CommitPolicy::None);
            let wanted = binding.honoured_policy();
            let kind_ok = match (&answer, wanted) {
                (Answer::ReopenTask { .. }, Some(CommitPolicy::ReopenTask))
                | (Answer::SeedContext { .. }, Some(CommitPolicy::SeedContext))
                | (Answer::ReplaceContext { .. }, Some(CommitPolicy::ReplaceContext)) => Some(policy) == wanted,
                _ => false,
            };
            if !kind_ok {
                self.emit(Event::HookDispatchError {
                    hook_name: r.hook.clone(),
                    event: binding.as_str().to_string(),
                    arm: answer.action().to_string(),
                    message: format!(
                        "answer {} is not honoured for {} with commit_policy {}",
                        answer.action(),
                        binding.as_str(),
                        policy.as_str()
                    ),
                })?;
                continue;
            }
            if chosen.is_none() {
                chosen = Some((r.hook, answer));
            }
        }
        Ok(chosen)
    }

    fn bootstrap_log(&self, line: &str) {
        let Some(dir) = &self.cfg.logs_dir else { return };
        let write = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("bootstrap.log"))
            .and_then(|mut f| writeln!(f, "{} {line}", self.parts.clock.now_ms()));
        if let Err(e) = write {
            tracing::warn!(error = %e, "could not write bootstrap.log");
        }
    }

    /// Runs one task to its end: `task_start`, seeding, the attempts, `task_end`; writes
    /// the result text to `out/result.txt`. `prior` is history loaded ahead of the task.
    ///
    /// # Errors
    /// [`trace::Error`]: a trace write failed, and the session must end.
    pub async fn run_task(&mut self, task: TaskSpec, prior: Vec<Message>) -> Result<TaskReport, trace::Error> {
        self.run_task_until(task, prior, CancellationToken::new()).await
    }

    /// [`Session::run_task`] that stops when `cancel` fires: the model call or tool call
    /// under way is dropped (a shell command's process group is killed with it), no
    /// further turn or tool call starts, and the task ends `canceled` with its `task_end`
    /// written (issue #8: a cancel reaches a running task at its next await).
    ///
    /// # Errors
    /// [`trace::Error`]: a trace write failed, and the session must end.
    pub async fn run_task_until(
        &mut self,
        task: TaskSpec,
        prior: Vec<Message>,
        cancel: CancellationToken,
    ) -> Result<TaskReport, trace::Error> {
        let span = self.task_span(&task);
        let report = self.run_task_inner(task, prior, cancel, None).instrument(span.clone()).await;
        ended(&span, &report);
        report
    }

    /// The `invoke_agent {capsule}` span around a task (OpenTelemetry GenAI conventions).
    fn task_span(&self, task: &TaskSpec) -> tracing::Span {
        tracing::info_span!(
            "invoke_agent",
            otel.name = %format!("invoke_agent {}", self.cfg.manifest.name),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.agent.name = %self.cfg.manifest.name,
            gen_ai.agent.version = %self.cfg.manifest.version,
            gen_ai.conversation.id = %task.context_id,
            mur.task_id = %task.task_id,
            mur.lane = %task.lane(),
            otel.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
        )
    }

    /// [`Session::run_task_until`] for the cluster worker (issue #8 §Checkpoints,
    /// §Takeover): after every turn, before the next model call, what the turn added is
    /// handed to `durable.checkpoints` and awaited; with `durable.takeover` the task starts
    /// where the checkpoint left it: `task_start`, then `task_takeover`, no
    /// `on-task-start` hooks (the seed is in the history already), and the next model call.
    ///
    /// # Errors
    /// [`trace::Error`]: a trace write failed, and the session must end.
    pub async fn run_task_durable(
        &mut self,
        task: TaskSpec,
        prior: Vec<Message>,
        cancel: CancellationToken,
        durable: Durable,
    ) -> Result<TaskReport, trace::Error> {
        let span = self.task_span(&task);
        let report = self.run_task_inner(task, prior, cancel, Some(durable)).instrument(span.clone()).await;
        ended(&span, &report);
        report
    }

    async fn run_task_inner(
        &mut self,
        task: TaskSpec,
        prior: Vec<Message>,
        cancel: CancellationToken,
        mut durable: Option<Durable>,
    ) -> Result<TaskReport, trace::Error> {
        // The inherited deadline is a cancellation with its own exit status.
        let deadline_hit = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut timer = None;
        let cancel = match durable.as_ref().and_then(|d| d.deadline) {
            Some(at) => {
                let token = cancel.child_token();
                let (fire, hit) = (token.clone(), deadline_hit.clone());
                // Aborted when dropped: the deadline timer goes with its task.
                timer = Some(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
                    tokio::time::sleep_until(at).await;
                    hit.store(true, Ordering::SeqCst);
                    fire.cancel();
                })));
                token
            }
            None => cancel,
        };
        let _timer = timer;
        self.task_stop = cancel.clone();
        let started = Instant::now();
        let m = self.cfg.manifest.clone();
        *self.parts.position.task_id.lock().expect("position lock") = Some(task.task_id.clone());
        self.parts.position.turn.store(0, Ordering::SeqCst);
        self.emit(Event::TaskStart {
            task_id: task.task_id.clone(),
            context_id: task.context_id.clone(),
            source: task.source.clone(),
            message_parts_bytes: task.text.len() as u64,
            origin: task.origin,
            lane: task.lane(),
            // Inside the task's `invoke_agent` span.
            trace_id: mur_nats::trace_context::trace_id(&tracing::Span::current()),
        })?;

        self.parts.driver.task_started();
        let takeover = durable.as_mut().and_then(|d| d.takeover.take());
        let resumed = takeover.as_ref().and_then(|t| t.checkpoint.clone());
        let mut journaling = durable.as_ref().and_then(|d| d.journal.clone()).map(|journal| {
            let replay = takeover.as_ref().map(|t| t.replay.clone()).unwrap_or_default();
            Journaling { journal, in_doubt: replay.in_doubt_so_far(), replay, unrecorded: None }
        });
        if let Some(t) = &takeover {
            self.emit(Event::TaskTakeover {
                task_id: task.task_id.clone(),
                turn: t.checkpoint.as_ref().map_or(0, |c| c.counters.turns),
                delivery: t.delivery,
                previous_session_id: t.previous_session_id.clone(),
                previous_worker: t.previous_worker.clone(),
            })?;
        }
        let mut head = Vec::new();
        if resumed.is_none() && self.wants(Binding::OnTaskStart) {
            let prior_tokens = prior.iter().map(|p| self.count(p)).sum();
            let replies = self
                .dispatch(HookEvent::OnTaskStart {
                    task_id: task.task_id.clone(),
                    context_id: task.context_id.clone(),
                    source: task.source.clone(),
                    input_bytes: task.text.len() as u64,
                    budget_tokens: m.context.seed_budget_tokens(),
                    context_window: m.context.max_tokens.unwrap_or(0),
                    prior_tokens,
                })
                .await?;
            if let Some((hook, Answer::SeedContext { messages })) = self.honoured(Binding::OnTaskStart, replies)? {
                head = self.commit_seed(&task.task_id, &hook, messages).await?;
            }
        }
        head.extend(prior);

        let rule = m
            .context
            .max_tokens
            .map(|max_tokens| CompactionRule { max_tokens, threshold: m.inference.compaction.threshold });
        let mut machine = TaskMachine::new(
            task,
            head,
            m.inference.max_turns,
            self.fixed_tokens,
            m.trace.capture,
            self.parts.estimator.clone(),
        )
        .with_compaction(rule)
        .with_reopens(m.lifecycle.max_task_reopens);
        // What an earlier session of the task already did: the task's counters go on
        // from it (`task_end` counts the whole task), this session's totals do not (its
        // `session_end` counts what it ran itself, as its trace shows).
        let earlier = resumed.as_ref().map(|t| t.counters).unwrap_or_default();
        if let Some(t) = resumed {
            self.parts.driver.taken_over_at(t.counters.turns);
            machine = machine.resumed(t.history, t.counters, t.session_tokens, t.reopens);
        }
        let superseded = durable.as_ref().and_then(|d| d.superseded.clone());
        let checkpoints = durable.map(|d| d.checkpoints);
        let mut fatal = false;
        let mut canceled = false;
        let mut action = machine.start();
        // What a stop makes of the task: canceled, or past its inherited deadline.
        let stopped = |machine: &mut TaskMachine| {
            if deadline_hit.load(Ordering::SeqCst) {
                machine.abort(
                    ExitStatus::DeadlineExceeded,
                    "stopped: the deadline inherited from the fleet loop passed".into(),
                )
            } else {
                machine.abort(ExitStatus::Canceled, "canceled".into())
            }
        };
        let outcome = loop {
            if cancel.is_cancelled() && !matches!(action, Action::Finish(_)) {
                canceled = true;
                action = Action::Finish(stopped(&mut machine));
            }
            action = match action {
                Action::Finish(outcome) => {
                    if fatal || canceled || !self.wants(Binding::OnTaskEnd) {
                        break outcome;
                    }
                    self.write_result(&outcome.result);
                    let replies = self
                        .dispatch(HookEvent::OnTaskEnd {
                            task_id: machine.task().task_id.clone(),
                            exit_status: outcome.exit_status,
                            result: outcome.result.clone(),
                            reopen_count: machine.reopen_count(),
                            attempt: machine.reopen_count() + 1,
                        })
                        .await?;
                    // Stopped while its on-task-end hooks judged it: their verdict (a gate's
                    // reopen) never came, so the task does not end as if it had passed.
                    if cancel.is_cancelled() {
                        break stopped(&mut machine);
                    }
                    match self.honoured(Binding::OnTaskEnd, replies)? {
                        Some((hook, Answer::ReopenTask { reason })) => {
                            match machine.on_reopen_request(&hook, &reason) {
                                Reopen::Granted(event, next) => {
                                    self.emit(*event)?;
                                    next
                                }
                                Reopen::Exhausted(outcome) => break outcome,
                            }
                        }
                        _ => break outcome,
                    }
                }
                Action::CallModel => {
                    if let Some(store) = &checkpoints
                        && machine.counters().turns > 0
                        && let Some(delta) = machine.take_delta()
                    {
                        let checkpoint = TurnCheckpoint {
                            turn: machine.counters().turns,
                            delta,
                            counters: machine.counters(),
                            session_tokens: machine.session_tokens(),
                            reopens: machine.reopens().to_vec(),
                        };
                        if let Err(e) = store.save(checkpoint).await {
                            machine.unmark();
                            tracing::warn!(task_id = %machine.task().task_id, error = %e, "a checkpoint was not stored");
                        }
                    }
                    if let Err(refusal) = self.parts.spend.check(machine.next_input_tokens()) {
                        self.emit(Event::SpendCeilingReached {
                            task_id: Some(machine.task().task_id.clone()),
                            origin: "loop".into(),
                            used_tokens: refusal.used,
                            requested_tokens: refusal.requested,
                            ceiling_tokens: refusal.ceiling,
                        })?;
                        fatal = true;
                        Action::Finish(machine.abort(
                            ExitStatus::SpendCeilingReached,
                            format!("stopped: spend ceiling reached: {refusal}"),
                        ))
                    } else {
                        self.parts.position.turn.store(machine.counters().turns, Ordering::SeqCst);
                        tokio::select! {
                            biased;
                            () = cancel.cancelled() => Action::CallModel,
                            next = self.call_model(&mut machine, journaling.as_mut()) => next?,
                        }
                    }
                }
                Action::RunTool { call_id, name, input } => {
                    let again = Action::RunTool { call_id: call_id.clone(), name: name.clone(), input: input.clone() };
                    tokio::select! {
                        biased;
                        () = cancel.cancelled() => again,
                        next = self.run_tool(&mut machine, call_id, name, input, journaling.as_mut()) => next?,
                    }
                }
                Action::Compact { turn, session_tokens } => {
                    match self.compact(&mut machine, turn, session_tokens).await? {
                        Ok(next) => next,
                        Err(Fatal::Spend(msg)) => {
                            fatal = true;
                            Action::Finish(machine.abort(
                                ExitStatus::SpendCeilingReached,
                                format!("stopped: spend ceiling reached: {msg}"),
                            ))
                        }
                        Err(Fatal::Failed(msg)) => {
                            fatal = true;
                            Action::Finish(
                                machine.abort(ExitStatus::Failed, format!("error: compaction hook failed: {msg}")),
                            )
                        }
                    }
                }
            };
        };
        // The task's stop reaches no hook of a later task (`mur run` sessions take several).
        self.task_stop = CancellationToken::new();
        let superseded = superseded.is_some_and(|s| s.is_cancelled());
        if superseded {
            // Not this session's end to write: the task's holder writes its one `task_end`.
            self.emit(Event::SessionSuperseded {
                task_id: machine.task().task_id.clone(),
                turns: machine.counters().turns,
            })?;
        } else {
            self.write_result(&outcome.result);
            self.emit(machine.task_end(started.elapsed().as_millis() as u64))?;
        }
        let c = machine.counters();
        self.totals.turns += c.turns.saturating_sub(earlier.turns);
        self.totals.input_tokens += c.input_tokens.saturating_sub(earlier.input_tokens);
        self.totals.output_tokens += c.output_tokens.saturating_sub(earlier.output_tokens);
        self.totals.tool_calls += c.tool_calls.saturating_sub(earlier.tool_calls);
        self.totals.shell_calls += c.shell_calls.saturating_sub(earlier.shell_calls);
        self.last_exit = outcome.exit_status;
        *self.parts.position.task_id.lock().expect("position lock") = None;
        Ok(TaskReport {
            task: machine.task().clone(),
            outcome,
            counters: c,
            reopen_count: machine.reopen_count(),
            history: machine.messages().to_vec(),
            fatal,
            tool_calls_in_doubt: journaling.map_or(0, |j| j.in_doubt),
            superseded,
        })
    }

    fn count(&self, m: &Message) -> u64 {
        self.parts.estimator.count(&serde_json::to_string(m).unwrap_or_default())
    }

    fn write_result(&self, text: &str) {
        if let Some(path) = &self.cfg.result_path
            && let Err(e) = std::fs::write(path, text)
        {
            tracing::warn!(error = %e, path = %path.display(), "could not write the result file");
        }
    }

    /// Feeds the machine turn `turn`'s response as the journal held it (issue #34): no
    /// model call, no hook; a `journal_replay` line stands for its `inference` line.
    fn replay_response(
        &self,
        machine: &mut TaskMachine,
        turn: u32,
        r: mur_proto::cluster::JournaledResponse,
    ) -> Result<Action, trace::Error> {
        let reply = crate::driver::ModelResponse { content: r.content, stop: stop_reason(r.stop), usage: r.usage };
        // A scripted model's next reply is the one after it.
        self.parts.driver.taken_over_at(turn + 1);
        let (events, next) = machine.on_model_reply(Ok(reply), 0);
        for e in events {
            if let Event::Inference { input_tokens, output_tokens, usage, .. } = e {
                self.emit(Event::JournalReplay {
                    task_id: machine.task().task_id.clone(),
                    turn,
                    what: "model_response".into(),
                    tool_name: None,
                    idempotency_key: None,
                    previous_worker: r.worker.clone(),
                    // Billed once, by the worker that died: the task's usage counts it here.
                    tokens: Some(mur_proto::trace::ReplayedTokens { input_tokens, output_tokens, usage }),
                })?;
            } else {
                self.emit(e)?;
            }
        }
        Ok(next)
    }

    async fn call_model(
        &self,
        machine: &mut TaskMachine,
        journaling: Option<&mut Journaling>,
    ) -> Result<Action, trace::Error> {
        let turn = machine.counters().turns;
        if let Some(r) = journaling.as_deref().and_then(|j| j.replay.response(turn)).cloned() {
            return self.replay_response(machine, turn, r);
        }
        let m = &self.cfg.manifest;
        // Between turns: tool lists an MCP server said changed are listed again (issue #35).
        self.parts.tools.refresh().await;
        let tools = self.parts.tools.specs();
        let request = ModelRequest {
            model: &self.cfg.model,
            system: &self.cfg.system_prompt,
            messages: machine.messages(),
            tools: &tools,
            max_tokens: m.inference.max_tokens,
            task_text: &machine.task().text,
            history_epoch: machine.history_epoch(),
        };
        let span = tracing::info_span!(
            "chat",
            otel.name = %format!("chat {}", self.cfg.model_label),
            otel.kind = "client",
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = self.parts.driver.kind(),
            gen_ai.request.model = %self.cfg.model_label,
            // Recorded once known: by the drivers (`driver::http`, the response's parsers),
            // and below from the reply (issue #32 §Spans).
            gen_ai.response.model = tracing::field::Empty,
            gen_ai.response.id = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            server.address = tracing::field::Empty,
            server.port = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let t0 = Instant::now();
        let (reply, attempts) = self.parts.driver.call_logged(&request).instrument(span.clone()).await;
        match &reply {
            Ok(r) => {
                span.record("gen_ai.response.finish_reasons", finish_reason(&r.stop));
            }
            Err(e) => {
                span.record("otel.status_code", "ERROR");
                span.record("error.type", e.kind());
            }
        }
        if attempts.len() > 1 || (reply.is_err() && !attempts.is_empty()) {
            let turn = machine.counters().turns;
            for a in attempts {
                self.emit(Event::ModelAttempt {
                    task_id: machine.task().task_id.clone(),
                    turn,
                    attempt: a.number,
                    status: a.status,
                    error: a.error,
                    waited_ms: a.waited_ms,
                    duration_ms: a.duration_ms,
                })?;
            }
        }
        // Journaled before any of its tool calls can run (issue #34): a takeover reuses it.
        if let (Some(j), Ok(r)) = (journaling, &reply) {
            let entry = mur_proto::cluster::Entry::ModelResponse {
                task_id: machine.task().task_id.clone(),
                turn,
                session_id: self.session_id(),
                worker: j.journal.worker().to_string(),
                content: r.content.clone(),
                stop: journal_stop(&r.stop),
                usage: r.usage.clone(),
                at_ms: self.parts.clock.now_ms(),
            };
            // Acknowledged with the first call's start, before that call runs: a call runs
            // only once its response is durable.
            if let Err(e) = j.journal.post(entry).await {
                tracing::warn!(task_id = %machine.task().task_id, turn, error = %e, "the model's response was not journaled: its tool calls will not run");
                j.unrecorded = Some((turn, e));
            }
        }
        let provider = self.parts.driver.kind();
        mur_nats::metrics::model_call(
            provider,
            &self.cfg.model_label,
            t0.elapsed(),
            reply.as_ref().err().map(|e| e.kind()),
        );
        let reply = reply.map_err(|e| e.to_string());
        let succeeded = reply.is_ok();
        let (events, next) = machine.on_model_reply(reply, t0.elapsed().as_millis() as u64);
        for e in &events {
            if let Event::Inference { input_tokens, output_tokens, usage, origin: None, .. } = e {
                let input = usage.input_tokens_actual.unwrap_or(*input_tokens);
                let output = usage.output_tokens_actual.unwrap_or(*output_tokens);
                span.record("gen_ai.usage.input_tokens", input);
                span.record("gen_ai.usage.output_tokens", output);
                mur_nats::metrics::tokens(provider, &self.cfg.model_label, input, output, usage.cached_tokens);
            }
        }
        if succeeded {
            self.parts.spend.add(machine.session_tokens());
        }
        let observed = events.iter().find_map(|e| match e {
            Event::Inference { turn, input_tokens, output_tokens, decision, tool_name, .. } => {
                Some(HookEvent::OnInference {
                    task_id: machine.task().task_id.clone(),
                    turn: *turn,
                    input_tokens: *input_tokens,
                    output_tokens: *output_tokens,
                    decision: decision.as_str().to_string(),
                    tool_name: tool_name.clone(),
                })
            }
            _ => None,
        });
        self.emit_all(events)?;
        if let Some(ev) = observed
            && self.wants(Binding::OnInference)
        {
            self.dispatch(ev).await?;
        }
        Ok(next)
    }

    /// Whether tool `name` is declared idempotent: a `tools:` entry's `idempotent`, the
    /// shell tools' `capabilities.shell.idempotent`, an MCP server's tool listed in its
    /// `mcp_servers[].idempotent` (`mcp__<server>__<tool>`); anything else is not.
    fn idempotent(&self, name: &str) -> bool {
        let m = &self.cfg.manifest;
        if m.capabilities.shell_allow.iter().any(|b| b == name) {
            return m.capabilities.shell_idempotent;
        }
        if let Some((server, tool)) =
            name.strip_prefix(mur_proto::manifest::MCP_TOOL_PREFIX).and_then(|n| n.split_once("__"))
        {
            return m.mcp_servers.iter().any(|s| s.name == server && s.idempotent.iter().any(|t| t == tool));
        }
        m.tools.iter().find(|t| t.name == name).is_some_and(|t| t.idempotent)
    }

    /// Runs one tool call, journaled when the task is (issue #34): a call whose result a
    /// takeover found is not run again (its result is reused); one found in doubt is
    /// run again with the same key if its tool is idempotent, else answered with the
    /// in-doubt text; any other call's start is journaled before it runs, its result when
    /// it ends. The call's command gets its idempotency key as `MUR_TOOL_CALL_ID`.
    async fn run_tool(
        &self,
        machine: &mut TaskMachine,
        call_id: String,
        name: String,
        input: serde_json::Value,
        journaling: Option<&mut Journaling>,
    ) -> Result<Action, trace::Error> {
        use mur_proto::cluster::{Entry, InDoubtAction, ToolStep};
        let (turn, index) = machine.call_position();
        let key = machine.call_key();
        let task_id = machine.task().task_id.clone();
        let t0 = Instant::now();
        // What the journal says of the call; `None` runs it.
        let mut answered: Option<ToolOutcome> = None;
        let mut reused = false;
        let mut in_doubt = None;
        if let Some(j) = journaling.as_deref() {
            if let Some((t, why)) = &j.unrecorded
                && *t == turn
            {
                answered = Some(ToolOutcome::error(format!(
                    "not run: the model's response could not be journaled, so a takeover could not tell whether \
                     this call ran ({why})"
                )));
            } else {
                match j.replay.tool(turn, index, &call_id, &name, self.idempotent(&name), &key) {
                    ToolStep::Run => {}
                    ToolStep::Reuse { text, is_error } => {
                        answered = Some(ToolOutcome { is_error, ..ToolOutcome::error(text) });
                        reused = true;
                        let previous_worker = j.replay.response(turn).map(|r| r.worker.clone()).unwrap_or_default();
                        self.emit(Event::JournalReplay {
                            task_id: task_id.clone(),
                            turn,
                            what: "tool_result".into(),
                            tool_name: Some(name.clone()),
                            idempotency_key: Some(key.clone()),
                            previous_worker,
                            tokens: None,
                        })?;
                    }
                    ToolStep::Rerun { previous_worker } => in_doubt = Some((InDoubtAction::Rerun, previous_worker)),
                    ToolStep::Report { previous_worker, text } => {
                        answered = Some(ToolOutcome::error(text));
                        in_doubt = Some((InDoubtAction::Reported, previous_worker));
                    }
                }
            }
        }
        if let Some((action, previous_worker)) = &in_doubt {
            self.emit(Event::ToolCallInDoubt {
                task_id: task_id.clone(),
                turn,
                tool_name: name.clone(),
                tool_call_id: call_id.clone(),
                idempotency_key: key.clone(),
                previous_worker: previous_worker.clone(),
                action: action.as_str().to_string(),
            })?;
        }
        let mut journaling = journaling;
        if let Some(j) = journaling.as_deref_mut()
            && in_doubt.is_some()
        {
            j.in_doubt += 1;
        }
        let stamp = |j: &Journaling| (self.session_id(), j.journal.worker().to_string(), self.parts.clock.now_ms());
        // The start, journaled and acknowledged before the call runs, together with what
        // was posted before it (the turn's response, the previous call's result).
        if answered.is_none()
            && let Some(j) = journaling.as_deref_mut()
        {
            let (session_id, worker, at_ms) = stamp(j);
            let start = Entry::ToolStart {
                task_id: task_id.clone(),
                turn,
                index,
                call_id: call_id.clone(),
                tool: name.clone(),
                key: key.clone(),
                session_id,
                worker,
                at_ms,
            };
            let start_key = start.key();
            let unstored = match j.journal.post(start).await {
                Ok(()) => j.sync(&task_id, Some(&start_key)).await,
                Err(e) => j.sync(&task_id, None).await.or(Some(e)),
            };
            if let Some((t, why)) = &j.unrecorded
                && *t == turn
            {
                answered = Some(ToolOutcome::error(format!(
                    "not run: the model's response could not be journaled, so a takeover could not tell whether \
                     this call ran ({why})"
                )));
            } else if let Some(e) = unstored {
                tracing::warn!(task_id, turn, index, error = %e, "a tool call's start was not journaled: it does not run");
                answered = Some(ToolOutcome::error(format!(
                    "not run: its start could not be journaled, so a takeover could not tell whether it ran ({e})"
                )));
            }
        }
        let ran = answered.is_none();
        let outcome = match answered {
            Some(outcome) => outcome,
            None => {
                let span = tracing::info_span!(
                    "execute_tool",
                    otel.name = %format!("execute_tool {name}"),
                    gen_ai.operation.name = "execute_tool",
                    gen_ai.tool.name = %name,
                    gen_ai.tool.call.id = %call_id,
                );
                let mut ctx = self.cfg.call_context.clone();
                ctx.tool_call_id = Some(key.clone());
                let outcome = self.parts.tools.call(&name, &input, &ctx).instrument(span).await;
                mur_nats::metrics::tool_call(&name, t0.elapsed());
                outcome
            }
        };
        // The result (or the in-doubt answer), so a later takeover reuses it.
        if !reused
            && (ran || in_doubt.is_some())
            && let Some(j) = journaling.as_deref()
        {
            let (session_id, worker, at_ms) = stamp(j);
            let result = Entry::ToolResult {
                task_id: task_id.clone(),
                turn,
                index,
                call_id: call_id.clone(),
                tool: name.clone(),
                text: outcome.text.clone(),
                is_error: outcome.is_error,
                in_doubt: in_doubt.as_ref().map(|(a, _)| *a),
                session_id,
                worker,
                at_ms,
            };
            // Acknowledged with the next call's start (or at the next sync): nothing
            // waits for it before then.
            if let Err(e) = j.journal.post(result).await {
                tracing::warn!(task_id, turn, index, error = %e, "a tool call's result was not journaled");
            }
        }
        let (mut events, next) = machine.on_tool_result(outcome, t0.elapsed().as_millis() as u64);
        if reused {
            // The call ran in an earlier session, whose trace has its lines.
            events.retain(|e| !matches!(e, Event::ToolCall { .. }));
        }
        let mut observed = Vec::new();
        for e in events.iter().filter(|_| ran) {
            match e {
                Event::ToolCall { turn, tool_name, output_bytes, duration_ms, status, .. }
                    if self.wants(Binding::OnToolCall) =>
                {
                    observed.push(HookEvent::OnToolCall {
                        task_id: machine.task().task_id.clone(),
                        turn: *turn,
                        tool_name: tool_name.clone(),
                        input: input.clone(),
                        output_bytes: *output_bytes,
                        duration_ms: *duration_ms,
                        status: if *status == mur_proto::trace::CallStatus::Ok { "ok" } else { "error" }.into(),
                        idempotency_key: Some(key.clone()),
                    })
                }
                Event::Shell { turn, binary, command, exit_code, stdout_bytes, stderr_bytes, duration_ms, .. }
                    if self.wants(Binding::OnShell) =>
                {
                    observed.push(HookEvent::OnShell {
                        task_id: machine.task().task_id.clone(),
                        turn: *turn,
                        binary: binary.clone(),
                        command: command.chars().take(200).collect(),
                        exit_code: *exit_code,
                        stdout_bytes: *stdout_bytes,
                        stderr_bytes: *stderr_bytes,
                        duration_ms: *duration_ms,
                        idempotency_key: Some(key.clone()),
                    })
                }
                _ => {}
            }
        }
        self.emit_all(events)?;
        for ev in observed {
            self.dispatch(ev).await?;
        }
        Ok(next)
    }

    /// Fires `on-compaction` (the context seed): a bound hook's error ends the session —
    /// `spend_ceiling_reached` when a spend ceiling refused its model call, `failed`
    /// otherwise; no hook, or no acceptable replacement, is declined and the loop goes on.
    async fn compact(
        &self,
        machine: &mut TaskMachine,
        turn: u32,
        session_tokens: u64,
    ) -> Result<Result<Action, Fatal>, trace::Error> {
        let m = &self.cfg.manifest;
        let reply = if self.wants(Binding::OnCompaction) {
            let replies = self
                .dispatch(HookEvent::OnCompaction {
                    task_id: machine.task().task_id.clone(),
                    turn,
                    messages: machine.messages().to_vec(),
                    session_tokens,
                    threshold: m.inference.compaction.threshold,
                    context_window: m.context.max_tokens.unwrap_or(0),
                    model: m.inference.compaction.model.clone(),
                    system_prompt: m.inference.compaction.system_prompt.clone(),
                    seed_budget_tokens: None,
                })
                .await?;
            if let Some(r) = replies.iter().find(|r| r.answer.is_err()) {
                let msg = r.answer.as_ref().err().map(ToString::to_string).unwrap_or_default();
                return Ok(Err(if r.spend_refused { Fatal::Spend(msg) } else { Fatal::Failed(msg) }));
            }
            match self.honoured(Binding::OnCompaction, replies)? {
                Some((_, Answer::ReplaceContext { messages })) => CompactionReply::Replaced(messages),
                _ => CompactionReply::NoReplacement,
            }
        } else {
            CompactionReply::NoReplacement
        };
        let replaced = match &reply {
            CompactionReply::Replaced(messages) => Some(messages.clone()),
            CompactionReply::NoReplacement => None,
        };
        let (events, next) = machine.on_compaction(reply);
        for e in &events {
            match e {
                Event::Compaction { tokens_before, tokens_after, .. } if m.inference.compaction.dump_summaries => {
                    self.dump_summary(turn, *tokens_before, *tokens_after, replaced.as_deref().unwrap_or_default());
                }
                Event::CompactionDeclined { reason, .. } => {
                    self.bootstrap_log(&format!("compaction declined at turn {turn}: {reason}"));
                }
                _ => {}
            }
        }
        self.emit_all(events)?;
        Ok(Ok(next))
    }

    fn dump_summary(&self, turn: u32, before: u64, after: u64, messages: &[Message]) {
        let Some(out) = self.cfg.result_path.as_ref().and_then(|p| p.parent()) else { return };
        let summary: Vec<String> =
            messages.iter().filter(|m| m.role != mur_proto::message::Role::Tool).map(Message::text).collect();
        let line = serde_json::json!({"turn": turn, "tokens_before": before, "tokens_after": after, "summary": summary.join("\n")});
        let write = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out.join("compaction-summaries.jsonl"))
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = write {
            tracing::warn!(error = %e, "could not write compaction-summaries.jsonl");
        }
    }

    /// Applies the seed table to a proposal (see [`seed`]); never fails the task.
    async fn commit_seed(
        &self,
        task_id: &str,
        hook: &str,
        messages: Vec<Message>,
    ) -> Result<Vec<Message>, trace::Error> {
        let m = &self.cfg.manifest;
        let budget = m.context.seed_budget_tokens();
        let tokens: Vec<u64> = messages.iter().map(|msg| self.count(msg)).collect();
        let proposed: u64 = tokens.iter().sum();
        let plan = seed::plan(seed::Inputs {
            process_transport: m.inference.transport == Transport::Process,
            budget,
            margin: m.context.seed_overflow_margin,
            compaction_hook: self.wants(Binding::OnCompaction),
            tokens: &tokens,
        });
        let (outcome, committed, reason): (&str, Vec<Message>, Option<&str>) = match plan {
            Plan::Reject(r) => ("rejected", Vec::new(), Some(r.as_str())),
            Plan::SeedAll => ("seeded", messages, None),
            Plan::Trim { keep_from } => ("trimmed", messages[keep_from..].to_vec(), None),
            Plan::Summarise { keep_from } => {
                let rest = messages[keep_from..].to_vec();
                let rest_tokens: u64 = tokens[keep_from..].iter().sum();
                match self.summarise_seed(task_id, &messages[..keep_from], budget.saturating_sub(rest_tokens)).await? {
                    Some(summary) => {
                        let summary_tokens: Vec<u64> = summary.iter().map(|s| self.count(s)).collect();
                        if summary_tokens.iter().sum::<u64>() > budget {
                            ("rejected", Vec::new(), Some(seed::Rejection::MessageOverBudget.as_str()))
                        } else {
                            let mut all = summary;
                            all.extend(rest);
                            let all_tokens: Vec<u64> = all.iter().map(|s| self.count(s)).collect();
                            let from = seed::trim_point(&all_tokens, budget);
                            ("compacted", all[from..].to_vec(), None)
                        }
                    }
                    None => ("trimmed", rest, None),
                }
            }
        };
        let committed_tokens: u64 = committed.iter().map(|c| self.count(c)).sum();
        self.emit(Event::ContextSeed {
            task_id: task_id.to_string(),
            hook_name: hook.to_string(),
            tokens: committed_tokens,
            proposed_tokens: proposed,
            budget_tokens: budget,
            outcome: outcome.to_string(),
            reason: reason.map(str::to_string),
            messages: committed.len() as u32,
        })?;
        if let Some(r) = reason {
            self.emit(Event::HookDispatchError {
                hook_name: hook.to_string(),
                event: Binding::OnTaskStart.as_str().to_string(),
                arm: "seed-rejected".into(),
                message: format!("seed of {proposed} tokens not committed: {r} (ceiling {budget})"),
            })?;
        }
        self.bootstrap_log(&format!(
            "context seed from hook {hook}: {outcome}{} ({committed_tokens} of {proposed} proposed tokens, ceiling {budget})",
            reason.map(|r| format!(" ({r})")).unwrap_or_default()
        ));
        Ok(committed)
    }

    /// Asks the `on-compaction` hooks to summarise an overflowing seed front.
    async fn summarise_seed(
        &self,
        task_id: &str,
        front: &[Message],
        room: u64,
    ) -> Result<Option<Vec<Message>>, trace::Error> {
        let m = &self.cfg.manifest;
        let replies = self
            .dispatch(HookEvent::OnCompaction {
                task_id: task_id.to_string(),
                turn: 0,
                messages: front.to_vec(),
                session_tokens: front.iter().map(|f| self.count(f)).sum(),
                threshold: m.inference.compaction.threshold,
                context_window: m.context.max_tokens.unwrap_or(0),
                model: m.inference.compaction.model.clone(),
                system_prompt: m.inference.compaction.system_prompt.clone(),
                seed_budget_tokens: Some(room),
            })
            .await?;
        Ok(match self.honoured(Binding::OnCompaction, replies)? {
            Some((_, Answer::ReplaceContext { messages })) if !messages.is_empty() => Some(messages),
            _ => None,
        })
    }

    /// The totals so far.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Ends the session: fires `on-session-end`, drains async hooks, writes their faults
    /// and `session_end` with the totals and the last task's exit status (or
    /// `exit_override`, for a session that died on the way).
    ///
    /// # Errors
    /// [`trace::Error`] when the trace cannot be written.
    pub async fn end(self, exit_override: Option<ExitStatus>) -> Result<ExitStatus, trace::Error> {
        self.end_until(exit_override, &CancellationToken::new()).await
    }

    /// [`Session::end`] under `stop` (a cluster task's cancel, its session being the
    /// task's): once it fires, the `on-session-end` hook under way is killed and none
    /// starts, and async hooks are not waited for (issue #8 §Cancel).
    ///
    /// # Errors
    /// As [`Session::end`].
    pub async fn end_until(
        mut self,
        exit_override: Option<ExitStatus>,
        stop: &CancellationToken,
    ) -> Result<ExitStatus, trace::Error> {
        self.task_stop = stop.clone();
        let exit_status = exit_override.unwrap_or(self.last_exit);
        if self.wants(Binding::OnSessionEnd) {
            let t = self.totals;
            self.dispatch(HookEvent::OnSessionEnd {
                total_turns: t.turns,
                total_input_tokens: t.input_tokens,
                total_output_tokens: t.output_tokens,
                total_tool_calls: t.tool_calls,
                total_shell_calls: t.shell_calls,
                duration_ms: self.started.elapsed().as_millis() as u64,
                exit_status,
            })
            .await?;
        }
        // A cancelled task's session waits for no async hook either: stragglers are killed
        // and reported at once.
        let drain = if self.task_stop.is_cancelled() { Duration::ZERO } else { DRAIN_DEADLINE };
        let faults = self.parts.hooks.drain(drain).await;
        self.flush_faults(faults)?;
        self.parts.tools.shutdown().await;
        self.finish(Some(exit_status))
    }

    fn finish(&mut self, exit_override: Option<ExitStatus>) -> Result<ExitStatus, trace::Error> {
        self.ended = true;
        let exit_status = exit_override.unwrap_or(self.last_exit);
        let t = self.totals;
        self.emit(Event::SessionEnd {
            total_turns: t.turns,
            total_input_tokens: t.input_tokens,
            total_output_tokens: t.output_tokens,
            total_tool_calls: t.tool_calls,
            total_shell_calls: t.shell_calls,
            duration_ms: self.started.elapsed().as_millis() as u64,
            exit_status,
        })?;
        Ok(exit_status)
    }
}

impl Drop for Session {
    /// `session_end` is written on every exit path: a session dropped without [`Session::end`]
    /// (a panic, an early return) records `failed`.
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.finish(Some(ExitStatus::Failed));
        }
    }
}

fn tools_json(specs: &[ToolSpec]) -> String {
    let v: Vec<_> = specs
        .iter()
        .map(|s| serde_json::json!({"name": s.name, "description": s.description, "parameters": s.parameters}))
        .collect();
    serde_json::to_string(&v).unwrap_or_default()
}

/// Marks the `invoke_agent` span of a task that did not end `ok` (issue #32 §Spans): status
/// `ERROR`, `error.type` = the exit status (`failed`, `max_turns_reached`, …); a trace
/// write that failed is `error.type` = `trace_write`.
fn ended(span: &tracing::Span, report: &Result<TaskReport, trace::Error>) {
    let error = match report {
        Ok(r) if r.outcome.exit_status == ExitStatus::Ok => return,
        Ok(r) => r.outcome.exit_status.as_str(),
        Err(_) => "trace_write",
    };
    span.record("otel.status_code", "ERROR");
    span.record("error.type", error);
}

/// A driver's stop reason as the journal stores it.
fn journal_stop(stop: &crate::driver::StopReason) -> mur_proto::cluster::Stop {
    use crate::driver::StopReason;
    use mur_proto::cluster::Stop;
    match stop {
        StopReason::ToolCall => Stop::ToolCall,
        StopReason::EndTurn => Stop::EndTurn,
        StopReason::MaxTokens => Stop::MaxTokens,
        StopReason::Error(e) => Stop::Error(e.clone()),
        StopReason::Other(o) => Stop::Other(o.clone()),
    }
}

/// A journaled stop reason back as the driver's.
fn stop_reason(stop: mur_proto::cluster::Stop) -> crate::driver::StopReason {
    use crate::driver::StopReason;
    use mur_proto::cluster::Stop;
    match stop {
        Stop::ToolCall => StopReason::ToolCall,
        Stop::EndTurn => StopReason::EndTurn,
        Stop::MaxTokens => StopReason::MaxTokens,
        Stop::Error(e) => StopReason::Error(e),
        Stop::Other(o) => StopReason::Other(o),
    }
}

/// `gen_ai.response.finish_reasons` of a reply: the provider-neutral stop reason
/// (`tool_call`, `end_turn`, `max_tokens`, `error`, or the provider's own word). The
/// convention's value is an array; a `tracing` field holds one string, and a reply has one.
fn finish_reason(stop: &crate::driver::StopReason) -> String {
    use crate::driver::StopReason;
    match stop {
        StopReason::ToolCall => "tool_call".into(),
        StopReason::EndTurn => "end_turn".into(),
        StopReason::MaxTokens => "max_tokens".into(),
        StopReason::Error(_) => "error".into(),
        StopReason::Other(other) => other.chars().take(40).collect(),
    }
}

#[cfg(test)]
mod journal_tests {
    //! The session's use of the journal (issue #34): a tool call runs only once its
    //! response and its start are acknowledged, and the appends that need not be awaited
    //! one by one share one round trip.
    use super::*;
    use crate::driver::scripted::{Reply as ScriptedReply, Script, Scripted, ScriptedCall};
    use crate::hooks::NoHooks;
    use crate::trace::MemorySink;
    use mur_nats::clock::SystemClock;
    use mur_proto::cluster::Entry;
    use mur_proto::task::Origin;
    use serde_json::{Value, json};

    /// What the journal and the tools saw, in order.
    #[derive(Clone, Debug, PartialEq)]
    enum Seen {
        /// An entry posted (its key).
        Post(String),
        /// A sync: the keys it acknowledged.
        Sync(Vec<String>),
        /// A tool call's effect (its idempotency key).
        Effect(String),
    }

    /// A journal in memory that refuses the keys in `refuse` at their sync.
    #[derive(Default)]
    struct Recorder {
        seen: Mutex<Vec<Seen>>,
        pending: Mutex<Vec<String>>,
        refuse: Vec<String>,
    }

    #[async_trait::async_trait]
    impl Journal for Recorder {
        fn worker(&self) -> &str {
            "wkr-test"
        }

        async fn post(&self, entry: Entry) -> Result<(), String> {
            self.seen.lock().unwrap().push(Seen::Post(entry.key()));
            self.pending.lock().unwrap().push(entry.key());
            Ok(())
        }

        async fn sync(&self) -> Vec<Unstored> {
            let keys = std::mem::take(&mut *self.pending.lock().unwrap());
            let (refused, acked): (Vec<String>, Vec<String>) = keys.into_iter().partition(|k| self.refuse.contains(k));
            self.seen.lock().unwrap().push(Seen::Sync(acked));
            refused.into_iter().map(|key| Unstored { key, why: "refused".into() }).collect()
        }
    }

    /// A tool that records its effect in the journal's log.
    struct Effects(Arc<Recorder>, Arc<[ToolSpec]>);

    #[async_trait::async_trait]
    impl Tools for Effects {
        fn specs(&self) -> Arc<[ToolSpec]> {
            self.1.clone()
        }

        async fn call(&self, _name: &str, _input: &Value, ctx: &CallContext) -> ToolOutcome {
            self.0.seen.lock().unwrap().push(Seen::Effect(ctx.tool_call_id.clone().unwrap_or_default()));
            ToolOutcome {
                text: "paid".into(),
                is_error: false,
                shell: None,
                detached: None,
                sandbox: None,
                mcp_server: None,
            }
        }
    }

    /// Runs a task whose model asks for `calls` tool calls per turn for `turns` turns, then
    /// ends; returns the journal's log and the tool results the model was given.
    async fn run(turns: usize, calls: usize, refuse: &[&str]) -> (Vec<Seen>, Vec<String>) {
        let (seen, results, _) = run_taken_over(turns, calls, refuse, None).await;
        (seen, results)
    }

    const MANIFEST: &str =
        "name: ledger\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n  max_turns: 50\n";

    /// [`run`], as a takeover with `replay` when given; also returns the trace.
    async fn run_taken_over(
        turns: usize,
        calls: usize,
        refuse: &[&str],
        replay: Option<mur_proto::cluster::Replay>,
    ) -> (Vec<Seen>, Vec<String>, Vec<mur_proto::trace::Line>) {
        run_with(MANIFEST, "pay", turns, calls, refuse, replay).await
    }

    /// [`run_taken_over`] with `manifest`, the model calling `tool`.
    async fn run_with(
        manifest: &str,
        tool: &str,
        turns: usize,
        calls: usize,
        refuse: &[&str],
        replay: Option<mur_proto::cluster::Replay>,
    ) -> (Vec<Seen>, Vec<String>, Vec<mur_proto::trace::Line>) {
        let dir = tempfile::tempdir().unwrap();
        let journal =
            Arc::new(Recorder { refuse: refuse.iter().map(|k| k.to_string()).collect(), ..Default::default() });
        let reply = |text: Option<&str>, tool_calls| ScriptedReply {
            text: text.map(str::to_string),
            tool_calls,
            stop_reason: None,
            error: None,
            usage: None,
            delay_ms: None,
        };
        let mut replies: Vec<ScriptedReply> = (0..turns)
            .map(|_| {
                reply(
                    None,
                    (0..calls).map(|_| ScriptedCall { name: tool.into(), input: json!({}), id: None }).collect(),
                )
            })
            .collect();
        replies.push(reply(Some("done"), vec![]));
        let manifest = Manifest::from_yaml(manifest, &|_| None).unwrap();
        let cfg = SessionConfig {
            manifest: Arc::new(manifest),
            model: String::new(),
            model_label: "scripted".into(),
            system_prompt: "Pay.".into(),
            system_prompt_source: "manifest",
            system_prompt_sha256: None,
            call_context: CallContext {
                capsule_dir: dir.path().to_path_buf(),
                workdir: dir.path().to_path_buf(),
                logs_dir: dir.path().join("logs"),
                sandbox: None,
                tool_call_id: None,
            },
            result_path: None,
            logs_dir: None,
            resumed_from: None,
        };
        let specs: Arc<[ToolSpec]> = Arc::new([ToolSpec {
            name: tool.into(),
            description: "pays".into(),
            parameters: json!({"type": "object", "properties": {}}),
        }]);
        let sink = MemorySink::default();
        let clock = Arc::new(SystemClock);
        let parts = Parts {
            driver: Arc::new(Scripted::new(Script { replies, repeat: false })),
            tools: Arc::new(Effects(journal.clone(), specs)),
            hooks: Arc::new(NoHooks),
            tracer: Arc::new(Mutex::new(Tracer::new("ses_test".into(), Box::new(sink.clone()), clock.clone()))),
            clock,
            estimator: crate::tokens::for_model("scripted", None),
            spend: Arc::new(Spend::new(None)),
            position: Arc::new(Position::default()),
        };
        let mut session = Session::start(cfg, parts).await.unwrap();
        let task = TaskSpec {
            task_id: "tsk_1".into(),
            context_id: "ctx_1".into(),
            text: "pay".into(),
            origin: Origin::User,
            source: "cli".into(),
        };
        struct Nowhere;
        #[async_trait::async_trait]
        impl Checkpoints for Nowhere {
            async fn save(&self, _: TurnCheckpoint) -> Result<(), String> {
                Ok(())
            }
        }
        let takeover = replay.map(|replay| Takeover {
            checkpoint: None,
            delivery: 2,
            previous_session_id: "ses_a".into(),
            previous_worker: "wkr-a".into(),
            replay,
        });
        let durable = Durable {
            takeover,
            checkpoints: Arc::new(Nowhere),
            journal: Some(journal.clone() as Arc<dyn Journal>),
            deadline: None,
            superseded: None,
        };
        let report = session.run_task_durable(task, Vec::new(), CancellationToken::new(), durable).await.unwrap();
        assert_eq!(report.outcome.exit_status, ExitStatus::Ok, "{}", report.outcome.result);
        let results = report
            .history
            .iter()
            .filter(|m| m.tool_call_id.is_some())
            .flat_map(|m| m.content.iter())
            .filter_map(|b| match b {
                mur_proto::message::Block::Text { text } => Some(text.clone()),
                mur_proto::message::Block::ToolCall { .. } => None,
            })
            .collect();
        let seen = journal.seen.lock().unwrap().clone();
        (seen, results, sink.lines())
    }

    /// A takeover finds `tool`'s call of turn 0 started and never ended; what was done.
    async fn in_doubt_after_takeover(manifest: &str, tool: &str) -> (Vec<Seen>, Vec<String>) {
        use mur_proto::cluster::{Entry, Replay, Stop};
        let call = mur_proto::message::Block::ToolCall { id: "call_0_0".into(), name: tool.into(), input: json!({}) };
        let entries = [
            Entry::ModelResponse {
                task_id: "tsk_1".into(),
                turn: 0,
                session_id: "ses_a".into(),
                worker: "wkr-a".into(),
                content: vec![call],
                stop: Stop::ToolCall,
                usage: Default::default(),
                at_ms: 1,
            },
            Entry::ToolStart {
                task_id: "tsk_1".into(),
                turn: 0,
                index: 0,
                call_id: "call_0_0".into(),
                tool: tool.into(),
                key: "tsk_1.0.0".into(),
                session_id: "ses_a".into(),
                worker: "wkr-a".into(),
                at_ms: 2,
            },
        ];
        let (seen, results, _) = run_with(manifest, tool, 1, 1, &[], Some(Replay::fold("tsk_1", entries))).await;
        (seen, results)
    }

    #[tokio::test]
    async fn an_mcp_tool_in_doubt_runs_again_only_when_its_server_lists_it_idempotent() {
        let with = |server: &str| {
            format!(
                "{MANIFEST}mcp_servers:\n  - name: {server}\n    command: [bank-server]\n    idempotent: [set_limit]\n"
            )
        };
        // Listed: run again, with the same key.
        let (seen, results) = in_doubt_after_takeover(&with("bank"), "mcp__bank__set_limit").await;
        assert_eq!(results, ["paid"]);
        assert!(seen.contains(&Seen::Effect("tsk_1.0.0".into())), "{seen:?}");
        // Another tool of the same server, and the same tool name on another server: reported.
        for (manifest, tool) in [(with("bank"), "mcp__bank__transfer"), (with("other"), "mcp__bank__set_limit")] {
            let (seen, results) = in_doubt_after_takeover(&manifest, tool).await;
            assert!(!seen.iter().any(|s| matches!(s, Seen::Effect(_))), "{tool}: {seen:?}");
            assert_eq!(results, [mur_proto::cluster::in_doubt_text(tool, "tsk_1.0.0", "wkr-a")], "{tool}");
        }
    }

    #[tokio::test]
    async fn a_response_reused_at_a_takeover_brings_its_tokens_to_the_tasks_usage() {
        use mur_proto::cluster::{Entry, Replay, Stop};
        use mur_proto::trace::{ProviderUsage, ReplayedTokens};
        let billed =
            ProviderUsage { input_tokens_actual: Some(123), output_tokens_actual: Some(9), ..Default::default() };
        let call = mur_proto::message::Block::ToolCall { id: "call_0_0".into(), name: "pay".into(), input: json!({}) };
        let entries = [
            Entry::ModelResponse {
                task_id: "tsk_1".into(),
                turn: 0,
                session_id: "ses_a".into(),
                worker: "wkr-a".into(),
                content: vec![call],
                stop: Stop::ToolCall,
                usage: billed.clone(),
                at_ms: 1,
            },
            Entry::ToolResult {
                task_id: "tsk_1".into(),
                turn: 0,
                index: 0,
                call_id: "call_0_0".into(),
                tool: "pay".into(),
                text: "paid before".into(),
                is_error: false,
                in_doubt: None,
                session_id: "ses_a".into(),
                worker: "wkr-a".into(),
                at_ms: 2,
            },
        ];
        let (seen, results, trace) = run_taken_over(1, 1, &[], Some(Replay::fold("tsk_1", entries))).await;
        // Nothing ran again, and the model was not asked turn 0 again.
        assert!(!seen.iter().any(|s| matches!(s, Seen::Effect(_))), "{seen:?}");
        assert_eq!(results, ["paid before"]);
        let replayed: Vec<&Option<ReplayedTokens>> = trace
            .iter()
            .filter_map(|l| match &l.event {
                Event::JournalReplay { what, tokens, .. } if what == "model_response" => Some(tokens),
                _ => None,
            })
            .collect();
        assert_eq!(replayed.len(), 1);
        assert_eq!(replayed[0].as_ref().map(|t| &t.usage), Some(&billed));
        // The task's usage: the reused response's 123 + 9, and the one call made here.
        let tally = crate::usage::UsageTally::default();
        for l in &trace {
            crate::trace::Sink::write(&mut tally.clone(), l).unwrap();
        }
        let made: Vec<(u64, u64)> = trace
            .iter()
            .filter_map(|l| match &l.event {
                Event::Inference { input_tokens, output_tokens, .. } => Some((*input_tokens, *output_tokens)),
                _ => None,
            })
            .collect();
        assert_eq!(made.len(), 1);
        let u = tally.usage().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (123 + made[0].0, 9 + made[0].1));
    }

    #[tokio::test]
    async fn a_call_runs_only_once_its_response_and_start_are_acknowledged_in_one_round_trip_per_call() {
        let (seen, results) = run(2, 2, &[]).await;
        assert_eq!(results, ["paid"; 4]);
        let post = |k: &str| Seen::Post(format!("jrnl.tsk_1.{k}"));
        let sync = |ks: &[&str]| Seen::Sync(ks.iter().map(|k| format!("jrnl.tsk_1.{k}")).collect());
        let effect = |k: &str| Seen::Effect(format!("tsk_1.{k}"));
        assert_eq!(
            seen,
            [
                // Turn 0: the response and the first start, acknowledged together.
                post("0.m"),
                post("0.0.s"),
                sync(&["0.m", "0.0.s"]),
                effect("0.0"),
                // The first result, acknowledged with the second start.
                post("0.0.r"),
                post("0.1.s"),
                sync(&["0.0.r", "0.1.s"]),
                effect("0.1"),
                // The last result, with the next turn's response and first start.
                post("0.1.r"),
                post("1.m"),
                post("1.0.s"),
                sync(&["0.1.r", "1.m", "1.0.s"]),
                effect("1.0"),
                post("1.0.r"),
                post("1.1.s"),
                sync(&["1.0.r", "1.1.s"]),
                effect("1.1"),
                post("1.1.r"),
                // The final response: nothing waits for it (the task's end does).
                post("2.m"),
            ]
        );
    }

    #[tokio::test]
    async fn no_call_runs_when_its_response_was_not_stored() {
        let (seen, results) = run(1, 2, &["jrnl.tsk_1.0.m"]).await;
        assert!(!seen.iter().any(|s| matches!(s, Seen::Effect(_))), "{seen:?}");
        assert_eq!(results.len(), 2);
        for r in &results {
            assert!(r.starts_with("not run: the model's response could not be journaled"), "{r}");
            assert!(r.ends_with("(refused)"), "{r}");
        }
    }

    #[tokio::test]
    async fn a_call_whose_start_was_not_stored_does_not_run() {
        let (seen, results) = run(1, 2, &["jrnl.tsk_1.0.0.s"]).await;
        let effects: Vec<&Seen> = seen.iter().filter(|s| matches!(s, Seen::Effect(_))).collect();
        assert_eq!(effects, [&Seen::Effect("tsk_1.0.1".into())]);
        assert_eq!(
            results,
            [
                "not run: its start could not be journaled, so a takeover could not tell whether it ran (refused)",
                "paid"
            ]
        );
    }
}
