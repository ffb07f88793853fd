//! One task's inference loop as a pure state machine: it takes model replies and tool
//! results and answers with the next [`Action`] and the trace events to write. No IO, no
//! clock: durations are passed in.
//!
//! Rules (the session-loop seed, §Session Loop and §Turn limit;
//! the runtime reference, §4 and checklist I1–I16):
//! - one turn is one model call; at most `inference.max_turns` calls per task; when the
//!   limit is used up with the model still asking for tools, the task ends
//!   `max_turns_reached` with `error: inference loop exceeded N turns`;
//! - a reply carrying tool calls continues the loop whatever its stop reason says; its
//!   calls run in the order given, each answered by one `tool` message; an unknown tool is
//!   answered with an error result and the loop goes on;
//! - `tool_call` with no tool calls fails the task; `end_turn` and `max_tokens` end it `ok`
//!   with the text blocks joined by `\n`; an in-band `error` fails with `error: <msg>`;
//!   any other stop reason fails with `error: unsupported stop_reason '<x>'`;
//! - a driver error fails the task with `error: <text>`;
//! - token estimates: `input_tokens` counts the whole request (system, tools, every
//!   message), `output_tokens` the reply; `session_tokens` is this turn's input + output
//!   (occupancy, not a running sum). Each message is counted once, when appended.

use crate::driver::{ModelResponse, StopReason};
use crate::tokens::Estimator;
use crate::tools::Outcome as ToolOutcome;
use mur_proto::manifest::Capture;
use mur_proto::message::{Block, Message, join_text};
use mur_proto::task::ExitStatus;
use mur_proto::trace::{CallStatus, Decision, Event};
use serde_json::Value;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A task as the loop receives it (defined beside the task vocabulary, so the A2A intake
/// can build one without the loop).
pub use mur_proto::task::TaskSpec;

/// How a task ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The exit status.
    pub exit_status: ExitStatus,
    /// What `out/result.txt` holds: the final text, or `error: …`.
    pub result: String,
}

/// What the runner must do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Call the model with [`TaskMachine::messages`].
    CallModel,
    /// Run one tool call, then report with [`TaskMachine::on_tool_result`].
    RunTool {
        /// The provider's call id.
        call_id: String,
        /// Tool name as the model gave it.
        name: String,
        /// Its input.
        input: Value,
    },
    /// The context crossed the compaction threshold: fire `on-compaction` with
    /// [`TaskMachine::messages`], then report with [`TaskMachine::on_compaction`]. Never
    /// consumes a turn (the context seed).
    Compact {
        /// The turn whose reply crossed the threshold.
        turn: u32,
        /// That turn's occupancy.
        session_tokens: u64,
    },
    /// The task is over.
    Finish(Outcome),
}

/// `context.max_tokens` and `inference.compaction.threshold`, when compaction is on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompactionRule {
    /// The context window.
    pub max_tokens: u64,
    /// Fraction of it that triggers compaction.
    pub threshold: f64,
}

impl CompactionRule {
    /// Whether `tokens` reach the threshold: `tokens / max_tokens >= threshold`.
    pub fn crossed(&self, tokens: u64) -> bool {
        tokens as f64 / self.max_tokens as f64 >= self.threshold
    }
}

/// What the `on-compaction` hooks produced.
#[derive(Clone, Debug, PartialEq)]
pub enum CompactionReply {
    /// The first `replace-context` answer.
    Replaced(Vec<Message>),
    /// No hook bound, or none answered with a replacement.
    NoReplacement,
}

/// The answer to a hook's request to reopen the task.
#[derive(Clone, Debug, PartialEq)]
pub enum Reopen {
    /// Granted: write the event and run the next action.
    Granted(Box<Event>, Action),
    /// The reopen limit or the turn limit is used up: the task ends
    /// `reopen_budget_exhausted`.
    Exhausted(Outcome),
}

/// Per-task counters, as `task_end` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Model calls made.
    pub turns: u32,
    /// Sum of `inference.input_tokens`.
    pub input_tokens: u64,
    /// Sum of `inference.output_tokens`.
    pub output_tokens: u64,
    /// Tool calls made.
    pub tool_calls: u32,
    /// Shell commands run.
    pub shell_calls: u32,
}

/// The conversation, append-only, with each message's token estimate kept beside it.
///
/// Each history has an [`epoch`](History::epoch): a process-unique, non-zero number that
/// stays the same while the history is only appended to and would be replaced by a fresh
/// one if the history were replaced or truncated (nothing does either yet). A clone gets
/// a fresh epoch too, since the two may then grow apart. Drivers key per-message caches on
/// it ([`ModelRequest::history_epoch`](crate::driver::ModelRequest::history_epoch)).
pub struct History {
    messages: Vec<Message>,
    tokens: Vec<u64>,
    total: u64,
    epoch: u64,
}

/// The next unused epoch; 0 is never handed out (it means "unknown" to drivers).
static NEXT_EPOCH: AtomicU64 = AtomicU64::new(1);

fn fresh_epoch() -> u64 {
    NEXT_EPOCH.fetch_add(1, Ordering::Relaxed)
}

impl Default for History {
    fn default() -> Self {
        History { messages: Vec::new(), tokens: Vec::new(), total: 0, epoch: fresh_epoch() }
    }
}

impl Clone for History {
    fn clone(&self) -> Self {
        History {
            messages: self.messages.clone(),
            tokens: self.tokens.clone(),
            total: self.total,
            epoch: fresh_epoch(),
        }
    }
}

impl History {
    /// Appends `message`, counting its tokens once.
    pub fn push(&mut self, message: Message, estimator: &dyn Estimator) {
        let tokens = estimator.count(&estimate_text(&message));
        self.push_counted(message, tokens);
    }

    /// Appends `message` with the estimate the caller already took of it, with the same
    /// estimator over [`estimate_text`] (the assistant reply is counted once, for both
    /// `output_tokens` and the history).
    fn push_counted(&mut self, message: Message, tokens: u64) {
        self.total += tokens;
        self.tokens.push(tokens);
        self.messages.push(message);
    }

    /// The messages, oldest first.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Sum of the messages' estimates.
    pub fn tokens(&self) -> u64 {
        self.total
    }

    /// This history's epoch: non-zero, unique in the process, unchanged by appends, new
    /// whenever the history is replaced, so a driver's per-message wire cache knows when
    /// to rebuild.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Replaces every message (compaction, a reopened attempt) under a fresh epoch.
    pub fn replace(&mut self, messages: Vec<Message>, estimator: &dyn Estimator) {
        *self = History::default();
        for m in messages {
            self.push(m, estimator);
        }
    }
}

/// What a message's estimate is taken over: its JSON in the runtime's message model.
fn estimate_text(message: &Message) -> String {
    serde_json::to_string(message).unwrap_or_default()
}

/// The loop of one task.
pub struct TaskMachine {
    task: TaskSpec,
    original_text: String,
    head: Vec<Message>,
    reopens: Vec<(String, String)>,
    max_reopens: u32,
    compaction: Option<CompactionRule>,
    /// After a committed compaction that left the count over the threshold: that count
    /// (issue #28 item 4). No compaction fires again until the history alone grows past
    /// it; the first check it blocks writes one `compaction_declined` line
    /// (`threshold_unreachable`), and `.1` records that it was written.
    futile: Option<(u64, bool)>,
    resume: Option<Action>,
    history: History,
    max_turns: u32,
    fixed_tokens: u64,
    capture: Capture,
    estimator: Arc<dyn Estimator>,
    counters: Counters,
    turn: u32,
    session_tokens: u64,
    pending: VecDeque<(String, String, Value)>,
    /// The place in the turn's response of the call at the front of `pending` (0-based).
    call_index: u32,
    finished: Option<Outcome>,
    /// The history's epoch and length at the last [`TaskMachine::take_delta`].
    marked: (u64, usize),
}

/// What the history gained since the previous [`TaskMachine::take_delta`].
#[derive(Clone, Debug, PartialEq)]
pub struct Delta {
    /// `messages` is the whole history: it was replaced (or this is the first delta).
    pub replace: bool,
    /// The messages added (or all of them).
    pub messages: Vec<Message>,
}

impl TaskMachine {
    /// A machine for `task`. `head` is what goes ahead of the task message: the seed, then
    /// history loaded for a threaded conversation. `fixed_tokens` is the estimate of the
    /// system prompt and tool list, which every request carries.
    pub fn new(
        task: TaskSpec,
        head: Vec<Message>,
        max_turns: u32,
        fixed_tokens: u64,
        capture: Capture,
        estimator: Arc<dyn Estimator>,
    ) -> Self {
        let mut history = History::default();
        for m in &head {
            history.push(m.clone(), estimator.as_ref());
        }
        history.push(Message::user(task.text.clone()), estimator.as_ref());
        TaskMachine {
            original_text: task.text.clone(),
            task,
            head,
            reopens: Vec::new(),
            max_reopens: 0,
            compaction: None,
            futile: None,
            resume: None,
            history,
            max_turns,
            fixed_tokens,
            capture,
            estimator,
            counters: Counters::default(),
            turn: 0,
            session_tokens: 0,
            pending: VecDeque::new(),
            call_index: 0,
            finished: None,
            marked: (0, 0),
        }
    }

    /// The machine of a task taken over from a checkpoint (issue #8 §Takeover): the whole
    /// `history` as the checkpoint left it, its counters, its last `session_tokens` and
    /// the reopens granted so far (the task's text gets their feedback section again).
    /// The next action is a model call, unless the turn budget is spent. The checkpointed
    /// history counts as already written: the first [`TaskMachine::take_delta`] returns
    /// only what comes after it.
    pub fn resumed(
        mut self,
        history: Vec<Message>,
        counters: Counters,
        session_tokens: u64,
        reopens: Vec<(String, String)>,
    ) -> Self {
        if !reopens.is_empty() {
            self.task.text = feedback_text(&self.original_text, &reopens);
        }
        self.reopens = reopens;
        self.history.replace(history, self.estimator.as_ref());
        self.counters = counters;
        self.turn = counters.turns.saturating_sub(1);
        self.session_tokens = session_tokens;
        self.marked = (self.history.epoch(), self.history.messages().len());
        self
    }

    /// What the history gained since the last call (the first call: everything), for a
    /// per-turn checkpoint; `None` when nothing was added. Call it between turns, when no
    /// tool call is pending, so a checkpoint never holds a tool call without its result.
    pub fn take_delta(&mut self) -> Option<Delta> {
        let (epoch, len) = self.marked;
        let messages = self.history.messages();
        let delta = if epoch != self.history.epoch() {
            Delta { replace: true, messages: messages.to_vec() }
        } else if len < messages.len() {
            Delta { replace: false, messages: messages[len..].to_vec() }
        } else {
            return None;
        };
        self.marked = (self.history.epoch(), messages.len());
        Some(delta)
    }

    /// Forgets what [`TaskMachine::take_delta`] handed out last, so the next delta is the
    /// whole history (after a checkpoint that could not be stored, the chain must start
    /// over).
    pub fn unmark(&mut self) {
        self.marked = (0, 0);
    }

    /// Reopens granted so far, as `(hook, reason)`.
    pub fn reopens(&self) -> &[(String, String)] {
        &self.reopens
    }

    /// Turns compaction on (`context.max_tokens` and `inference.compaction.threshold`).
    pub fn with_compaction(mut self, rule: Option<CompactionRule>) -> Self {
        self.compaction = rule;
        self
    }

    /// Allows up to `max` reopens (`lifecycle.max_task_reopens`).
    pub fn with_reopens(mut self, max: u32) -> Self {
        self.max_reopens = max;
        self
    }

    /// Reopens granted so far.
    pub fn reopen_count(&self) -> u32 {
        self.reopens.len() as u32
    }

    /// Tokens the next request will carry (system, tools and the whole history).
    pub fn next_input_tokens(&self) -> u64 {
        self.fixed_tokens + self.history.tokens()
    }

    /// The first action.
    pub fn start(&mut self) -> Action {
        if self.counters.turns >= self.max_turns {
            return self.finish(ExitStatus::MaxTurnsReached, self.turn_limit_message());
        }
        Action::CallModel
    }

    /// The task.
    pub fn task(&self) -> &TaskSpec {
        &self.task
    }

    /// The conversation to send.
    pub fn messages(&self) -> &[Message] {
        self.history.messages()
    }

    /// The epoch of the conversation [`messages`](TaskMachine::messages) returns (see
    /// [`History::epoch`]).
    pub fn history_epoch(&self) -> u64 {
        self.history.epoch()
    }

    /// The counters so far.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// This turn's occupancy: input + output tokens of the last model call.
    pub fn session_tokens(&self) -> u64 {
        self.session_tokens
    }

    /// The outcome, once finished.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.finished.as_ref()
    }

    fn turn_limit_message(&self) -> String {
        format!("error: inference loop exceeded {} turns", self.max_turns)
    }

    fn finish(&mut self, exit_status: ExitStatus, result: String) -> Action {
        let outcome = Outcome { exit_status, result };
        self.finished = Some(outcome.clone());
        Action::Finish(outcome)
    }

    /// Ends the task from outside the loop (a trace failure, a cancellation).
    pub fn abort(&mut self, exit_status: ExitStatus, result: String) -> Outcome {
        self.pending.clear();
        self.finish(exit_status, result);
        self.finished.clone().expect("just set")
    }

    /// Feeds the model's reply (or the driver's error) for the call just made.
    pub fn on_model_reply(&mut self, reply: Result<ModelResponse, String>, duration_ms: u64) -> (Vec<Event>, Action) {
        let response = match reply {
            Ok(r) => r,
            Err(e) => {
                return (Vec::new(), self.finish(ExitStatus::Failed, format!("error: {e}")));
            }
        };
        self.turn = self.counters.turns;
        self.counters.turns += 1;
        let input_tokens = self.fixed_tokens + self.history.tokens();
        let assistant = Message::assistant(response.content);
        let output_tokens = self.estimator.count(&estimate_text(&assistant));
        self.counters.input_tokens += input_tokens;
        self.counters.output_tokens += output_tokens;
        self.session_tokens = input_tokens + output_tokens;

        let calls: Vec<(String, String, Value)> =
            assistant.tool_calls().map(|(id, name, input)| (id.to_string(), name.to_string(), input.clone())).collect();
        let decision = if !calls.is_empty() {
            Decision::ToolCall
        } else {
            match response.stop {
                StopReason::ToolCall => Decision::ToolCall,
                StopReason::EndTurn => Decision::EndTurn,
                _ => Decision::Text,
            }
        };
        let event = Event::Inference {
            turn: self.turn,
            task_id: self.task.task_id.clone(),
            input_tokens,
            output_tokens,
            decision,
            tool_name: calls.first().map(|(_, n, _)| n.clone()),
            duration_ms,
            usage: response.usage,
            origin: None,
        };
        let final_text = join_text(&assistant.content);
        self.history.push_counted(assistant, output_tokens);

        let action = match response.stop {
            StopReason::Error(msg) => self.finish(ExitStatus::Failed, format!("error: {msg}")),
            _ if !calls.is_empty() => {
                self.pending.extend(calls);
                self.call_index = 0;
                self.next_call()
            }
            StopReason::ToolCall => self
                .finish(ExitStatus::Failed, "error: stop_reason tool_call but the reply carries no tool calls".into()),
            StopReason::EndTurn | StopReason::MaxTokens => self.finish(ExitStatus::Ok, final_text),
            StopReason::Other(x) => self.finish(ExitStatus::Failed, format!("error: unsupported stop_reason '{x}'")),
        };
        // Compaction is checked after the response and before its tools run
        // (the context seed step 2; the runtime reference, §1 ordering), and only
        // when the loop goes on.
        if let (Action::RunTool { .. }, Some(rule)) = (&action, self.compaction)
            && rule.crossed(self.session_tokens)
        {
            // A compaction that could not get under the threshold is not repeated until the
            // history alone outgrows what it left (issue #28 item 4): the part every request
            // carries (system prompt, tools) does not shrink, so compacting again sooner
            // would cost a hook call (and maybe a model call) each turn for nothing.
            if let Some((left, reported)) = self.futile {
                if self.history.tokens() <= left {
                    let mut events = vec![event];
                    if !reported {
                        self.futile = Some((left, true));
                        events.push(Event::CompactionDeclined {
                            turn: self.turn,
                            task_id: self.task.task_id.clone(),
                            tokens: self.session_tokens,
                            reason: super::compaction::Decline::ThresholdUnreachable.as_str().to_string(),
                        });
                    }
                    return (events, action);
                }
                self.futile = None;
            }
            self.resume = Some(action);
            return (vec![event], Action::Compact { turn: self.turn, session_tokens: self.session_tokens });
        }
        (vec![event], action)
    }

    /// Feeds what the `on-compaction` hooks produced. A replacement is checked (tool
    /// results keep their calls, see [`super::compaction::accept`]); committed, it replaces
    /// the history and the token count is taken again on it, so the next check does not
    /// fire at once; otherwise a `compaction_declined` line is written and the loop goes on
    /// uncompacted. Either way no turn is consumed.
    pub fn on_compaction(&mut self, reply: CompactionReply) -> (Vec<Event>, Action) {
        let resume = self.resume.take().unwrap_or(Action::CallModel);
        let pending = self.history.messages().last().filter(|_| !self.pending.is_empty()).cloned();
        let decided = match reply {
            CompactionReply::NoReplacement => Err(super::compaction::Decline::NoHookReplacement),
            CompactionReply::Replaced(messages) => {
                super::compaction::accept(self.history.messages(), messages, pending.as_ref())
            }
        };
        let event = match decided {
            Ok(messages) => {
                let before = self.session_tokens;
                self.history.replace(messages, self.estimator.as_ref());
                self.session_tokens = self.next_input_tokens();
                let still_over = self.compaction.is_some_and(|rule| rule.crossed(self.session_tokens));
                self.futile = still_over.then_some((self.session_tokens, false));
                Event::Compaction {
                    turn: self.turn,
                    task_id: self.task.task_id.clone(),
                    tokens_before: before,
                    tokens_after: self.session_tokens,
                }
            }
            Err(decline) => Event::CompactionDeclined {
                turn: self.turn,
                task_id: self.task.task_id.clone(),
                tokens: self.session_tokens,
                reason: decline.as_str().to_string(),
            },
        };
        (vec![event], resume)
    }

    /// A hook bound to `on-task-end` with `commit_policy: reopen-task` asked to reopen the
    /// finished attempt (the session-loop seed, §Task reopening). Granted while reopens
    /// used < `lifecycle.max_task_reopens` and turns used < `inference.max_turns` (every
    /// attempt shares one cumulative turn count): the task's text gets a feedback section,
    /// the history restarts from the head, and the next attempt runs. Otherwise the task
    /// ends `reopen_budget_exhausted`, keeping the attempt's result text.
    pub fn on_reopen_request(&mut self, hook: &str, reason: &str) -> Reopen {
        let result = self.finished.as_ref().map(|o| o.result.clone()).unwrap_or_default();
        if self.reopen_count() >= self.max_reopens || self.counters.turns >= self.max_turns {
            let outcome = Outcome { exit_status: ExitStatus::ReopenBudgetExhausted, result };
            self.finished = Some(outcome.clone());
            return Reopen::Exhausted(outcome);
        }
        self.reopens.push((hook.to_string(), reason.to_string()));
        let text = feedback_text(&self.original_text, &self.reopens);
        self.task.text = text.clone();
        let mut messages = self.head.clone();
        messages.push(Message::user(text));
        self.history.replace(messages, self.estimator.as_ref());
        self.futile = None;
        self.pending.clear();
        self.finished = None;
        let event = Event::TaskReopened {
            task_id: self.task.task_id.clone(),
            hook_name: hook.to_string(),
            reason: reason.to_string(),
            reopen_number: self.reopen_count(),
        };
        Reopen::Granted(Box::new(event), Action::CallModel)
    }

    fn next_call(&mut self) -> Action {
        match self.pending.front() {
            Some((id, name, input)) => {
                Action::RunTool { call_id: id.clone(), name: name.clone(), input: input.clone() }
            }
            None if self.counters.turns >= self.max_turns => {
                let msg = self.turn_limit_message();
                self.finish(ExitStatus::MaxTurnsReached, msg)
            }
            None => Action::CallModel,
        }
    }

    /// The model call (0-based, as `inference.turn` counts) and the place in its response
    /// (0-based) of the tool call [`Action::RunTool`] last asked for: what its idempotency
    /// key is made of (issue #34).
    pub fn call_position(&self) -> (u32, u32) {
        (self.turn, self.call_index)
    }

    /// The idempotency key of the tool call [`Action::RunTool`] last asked for
    /// (`mur_proto::cluster::tool_call_key`).
    pub fn call_key(&self) -> String {
        mur_proto::cluster::tool_call_key(&self.task.task_id, self.turn, self.call_index)
    }

    /// Feeds the result of the tool call last asked for.
    pub fn on_tool_result(&mut self, outcome: ToolOutcome, duration_ms: u64) -> (Vec<Event>, Action) {
        let key = self.call_key();
        let Some((call_id, name, input)) = self.pending.pop_front() else {
            return (Vec::new(), self.next_call());
        };
        self.call_index += 1;
        self.counters.tool_calls += 1;
        let input_bytes = serde_json::to_string(&input).map_or(0, |s| s.len() as u64);
        let mut events = vec![Event::ToolCall {
            turn: self.turn,
            task_id: self.task.task_id.clone(),
            tool_name: name.clone(),
            tool_call_id: Some(call_id.clone()),
            input: (self.capture != Capture::None).then_some(input),
            input_bytes,
            output: (self.capture == Capture::Content).then(|| outcome.text.clone()),
            output_bytes: outcome.text.len() as u64,
            duration_ms,
            status: if outcome.is_error { CallStatus::Error } else { CallStatus::Ok },
            mcp_server: outcome.mcp_server.clone(),
            idempotency_key: Some(key),
        }];
        if let Some(work) = outcome.detached {
            // A demoted command: `shell_detached` replaces the `shell` line and counts as the
            // shell call (the runtime reference, §1, checklist D4).
            self.counters.shell_calls += 1;
            events.push(Event::ShellDetached {
                turn: self.turn,
                task_id: self.task.task_id.clone(),
                work_id: work.work_id,
                binary: work.binary,
                command: work.command,
                grace_ms: work.grace_ms,
            });
        } else if let Some(shell) = outcome.shell {
            self.counters.shell_calls += 1;
            events.push(Event::Shell {
                turn: self.turn,
                task_id: self.task.task_id.clone(),
                binary: shell.binary,
                command: shell.command,
                exit_code: shell.exit_code,
                stdout_bytes: shell.stdout_bytes,
                stderr_bytes: shell.stderr_bytes,
                duration_ms,
            });
        }
        if let Some(rules) = outcome.sandbox {
            events.push(Event::Sandbox {
                turn: self.turn,
                task_id: Some(self.task.task_id.clone()),
                tool_name: Some(name),
                hook_name: None,
                event: None,
                read: rules.read,
                write: rules.write,
                network: rules.network,
                memory_mb: rules.memory_mb,
                pids: rules.pids,
                cpu_secs: rules.cpu_secs,
                landlock_abi: rules.landlock_abi,
                enforced_by: rules.enforced_by,
            });
        }
        self.history.push(Message::tool_result(call_id, outcome.text, outcome.is_error), self.estimator.as_ref());
        (events, self.next_call())
    }

    /// The `task_end` event for the finished task.
    pub fn task_end(&self, duration_ms: u64) -> Event {
        let reopen_count = self.reopen_count();
        let c = self.counters;
        Event::TaskEnd {
            task_id: self.task.task_id.clone(),
            exit_status: self.finished.as_ref().map_or(ExitStatus::Failed, |o| o.exit_status),
            duration_ms,
            turns: c.turns,
            input_tokens: c.input_tokens,
            output_tokens: c.output_tokens,
            tool_calls: c.tool_calls,
            shell_calls: c.shell_calls,
            reopen_count,
        }
    }
}

/// The task text of a reopened attempt: the original (trailing whitespace trimmed), then a
/// "Reopen feedback" section with one numbered entry per reopen so far, naming its hook
/// (the runtime reference, §5, "Reopen").
pub fn feedback_text(original: &str, reopens: &[(String, String)]) -> String {
    let mut text = original.trim_end().to_string();
    text.push_str("\n\n---\n## Reopen feedback\n");
    for (i, (hook, reason)) in reopens.iter().enumerate() {
        text.push_str(&format!("\n### {} (from hook {hook})\n{}\n", i + 1, reason.trim_end()));
    }
    text
}

/// The blocks of a message (helper for callers that build replies).
pub fn text_block(text: impl Into<String>) -> Block {
    Block::Text { text: text.into() }
}

#[cfg(test)]
mod tests;
