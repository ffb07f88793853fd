//! The async side of the session loop: performs the [`TaskMachine`]'s actions through the
//! driver, the tools and the tracer, and frames tasks with `session_start`, `task_start`,
//! `task_end` and `session_end` (`reference/murmur-runtime.md` §1: one session_start /
//! session_end pair per launch, one task_start / task_end pair per task).
//!
//! Spans follow the OpenTelemetry GenAI conventions (`reference/jetstream-patterns.md`
//! §5.1): `invoke_agent {capsule}` around a task, `chat {model}` around a model call,
//! `execute_tool {tool}` around a tool call.

use super::machine::{Action, Counters, Outcome, TaskMachine, TaskSpec};
use crate::clock::Clock;
use crate::driver::{Driver, ModelRequest, ToolSpec};
use crate::tokens::Estimator;
use crate::tools::{CallContext, Tools};
use crate::trace::{self, Tracer};
use mur_proto::Manifest;
use mur_proto::message::Message;
use mur_proto::task::ExitStatus;
use mur_proto::trace::Event;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

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
    /// The session this one resumes.
    pub resumed_from: Option<String>,
}

/// A finished task.
#[derive(Clone, Debug)]
pub struct TaskReport {
    /// The task.
    pub task: TaskSpec,
    /// How it ended.
    pub outcome: Outcome,
    /// Its counters.
    pub counters: Counters,
    /// The conversation at the end (for threaded contexts).
    pub history: Vec<Message>,
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

/// One launch of a capsule.
pub struct Session {
    cfg: SessionConfig,
    driver: Arc<dyn Driver>,
    tools: Arc<dyn Tools>,
    tracer: Tracer,
    clock: Arc<dyn Clock>,
    estimator: Arc<dyn Estimator>,
    fixed_tokens: u64,
    totals: Totals,
    last_exit: ExitStatus,
    started: Instant,
    ended: bool,
}

impl Session {
    /// Starts a session: writes `session_start`.
    ///
    /// # Errors
    /// [`trace::Error`] when the trace cannot be written.
    pub fn start(
        cfg: SessionConfig,
        driver: Arc<dyn Driver>,
        tools: Arc<dyn Tools>,
        mut tracer: Tracer,
        clock: Arc<dyn Clock>,
        estimator: Arc<dyn Estimator>,
    ) -> Result<Session, trace::Error> {
        let m = &cfg.manifest;
        let fixed_tokens = estimator.count(&cfg.system_prompt) + estimator.count(&tools_json(tools.specs()));
        tracer.emit(Event::SessionStart {
            capsule_name: m.name.clone(),
            capsule_version: m.version.clone(),
            model: cfg.model_label.clone(),
            driver: driver.kind().to_string(),
            max_turns: m.inference.max_turns,
            capabilities: if m.capabilities.shell_allow.is_empty() { vec![] } else { vec!["shell".into()] },
            tools_declared: tools.specs().iter().map(|s| s.name.clone()).collect(),
            system_prompt_source: cfg.system_prompt_source.to_string(),
            system_prompt_sha256: cfg.system_prompt_sha256.clone(),
            resumed_from: cfg.resumed_from.clone(),
            context_id: None,
        })?;
        Ok(Session {
            cfg,
            driver,
            tools,
            tracer,
            clock,
            estimator,
            fixed_tokens,
            totals: Totals::default(),
            last_exit: ExitStatus::Ok,
            started: Instant::now(),
            ended: false,
        })
    }

    /// The session id.
    pub fn session_id(&self) -> &str {
        self.tracer.session_id()
    }

    /// Runs one task to its end: `task_start`, the loop, `task_end`; writes the result
    /// text to `out/result.txt`. `prior` is history loaded ahead of the task.
    ///
    /// # Errors
    /// [`trace::Error`]: a trace write failed, and the session must end.
    pub async fn run_task(&mut self, task: TaskSpec, prior: Vec<Message>) -> Result<TaskReport, trace::Error> {
        let span = tracing::info_span!(
            "invoke_agent",
            otel.name = %format!("invoke_agent {}", self.cfg.manifest.name),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.agent.name = %self.cfg.manifest.name,
            gen_ai.agent.version = %self.cfg.manifest.version,
            gen_ai.conversation.id = %task.context_id,
            mur.task_id = %task.task_id,
            mur.lane = %task.lane(),
        );
        self.run_task_inner(task, prior).instrument(span).await
    }

    async fn run_task_inner(&mut self, task: TaskSpec, prior: Vec<Message>) -> Result<TaskReport, trace::Error> {
        let started = Instant::now();
        self.tracer.emit(Event::TaskStart {
            task_id: task.task_id.clone(),
            context_id: task.context_id.clone(),
            source: task.source.clone(),
            message_parts_bytes: task.text.len() as u64,
            origin: task.origin,
            lane: task.lane(),
        })?;
        let m = self.cfg.manifest.clone();
        let mut machine = TaskMachine::new(
            task,
            prior,
            m.inference.max_turns,
            self.fixed_tokens,
            m.trace.capture,
            self.estimator.clone(),
        );
        let mut action = machine.start();
        let outcome = loop {
            action = match action {
                Action::Finish(outcome) => break outcome,
                Action::CallModel => {
                    let request = ModelRequest {
                        model: &self.cfg.model,
                        system: &self.cfg.system_prompt,
                        messages: machine.messages(),
                        history_epoch: machine.history_epoch(),
                        tools: self.tools.specs(),
                        max_tokens: m.inference.max_tokens,
                        task_text: &machine.task().text,
                    };
                    let span = tracing::info_span!(
                        "chat",
                        otel.name = %format!("chat {}", self.cfg.model_label),
                        otel.kind = "client",
                        gen_ai.operation.name = "chat",
                        gen_ai.provider.name = self.driver.kind(),
                        gen_ai.request.model = %self.cfg.model_label,
                    );
                    let t0 = Instant::now();
                    let (reply, attempts) = self.driver.call_logged(&request).instrument(span).await;
                    if attempts.len() > 1 || (reply.is_err() && !attempts.is_empty()) {
                        let turn = machine.counters().turns;
                        for a in attempts {
                            self.tracer.emit(Event::ModelAttempt {
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
                    let reply = reply.map_err(|e| e.to_string());
                    let (events, next) = machine.on_model_reply(reply, t0.elapsed().as_millis() as u64);
                    self.emit_all(events)?;
                    next
                }
                Action::RunTool { call_id, name, input } => {
                    let span = tracing::info_span!(
                        "execute_tool",
                        otel.name = %format!("execute_tool {name}"),
                        gen_ai.operation.name = "execute_tool",
                        gen_ai.tool.name = %name,
                        gen_ai.tool.call.id = %call_id,
                    );
                    let t0 = Instant::now();
                    let outcome = self.tools.call(&name, &input, &self.cfg.call_context).instrument(span).await;
                    let (events, next) = machine.on_tool_result(outcome, t0.elapsed().as_millis() as u64);
                    self.emit_all(events)?;
                    next
                }
            };
        };
        if let Some(path) = &self.cfg.result_path
            && let Err(e) = std::fs::write(path, &outcome.result)
        {
            tracing::warn!(error = %e, path = %path.display(), "could not write the result file");
        }
        self.tracer.emit(machine.task_end(started.elapsed().as_millis() as u64, 0))?;
        let c = machine.counters();
        self.totals.turns += c.turns;
        self.totals.input_tokens += c.input_tokens;
        self.totals.output_tokens += c.output_tokens;
        self.totals.tool_calls += c.tool_calls;
        self.totals.shell_calls += c.shell_calls;
        self.last_exit = outcome.exit_status;
        Ok(TaskReport { task: machine.task().clone(), outcome, counters: c, history: machine.messages().to_vec() })
    }

    fn emit_all(&mut self, events: Vec<Event>) -> Result<(), trace::Error> {
        for e in events {
            self.tracer.emit(e)?;
        }
        Ok(())
    }

    /// The totals so far.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Ends the session: writes `session_end` with the totals and the last task's exit
    /// status (or `exit_override`, for a session that died on the way).
    ///
    /// # Errors
    /// [`trace::Error`] when the line cannot be written.
    pub fn end(mut self, exit_override: Option<ExitStatus>) -> Result<ExitStatus, trace::Error> {
        self.finish(exit_override)
    }

    fn finish(&mut self, exit_override: Option<ExitStatus>) -> Result<ExitStatus, trace::Error> {
        self.ended = true;
        let exit_status = exit_override.unwrap_or(self.last_exit);
        let t = self.totals;
        self.tracer.emit(Event::SessionEnd {
            total_turns: t.turns,
            total_input_tokens: t.input_tokens,
            total_output_tokens: t.output_tokens,
            total_tool_calls: t.tool_calls,
            total_shell_calls: t.shell_calls,
            duration_ms: self.started.elapsed().as_millis() as u64,
            exit_status,
        })?;
        let _ = &self.clock;
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
