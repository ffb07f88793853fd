//! A task's session trace as the console shows it (issue #38): the lines of one task, from
//! its `task_start` to its `task_end`, grouped turn by turn. Pure: trace lines in, a
//! [`Timeline`] out; [`super::render`] makes HTML of it.

use mur_proto::trace::{CallStatus, Event, Line};

/// One task's part of a session trace, in trace order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// What happened, in order: turns, and the events between them.
    pub entries: Vec<Entry>,
    /// Whether the task's `task_start` was found in the lines.
    pub started: bool,
    /// Whether its `task_end` was found (a running or killed task has none).
    pub ended: bool,
}

/// One row of a [`Timeline`].
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A model call and the tool calls it asked for.
    Turn(Turn),
    /// Anything else the task's lines say (a takeover, a reopening, a compaction, a hook
    /// fault, its start and end): a kind (`takeover`, `reopened`, `compaction`, …) and a
    /// line for people.
    Note {
        /// The event's kind, as the trace names it (`task_takeover` → `takeover`).
        kind: &'static str,
        /// What it says.
        text: String,
    },
}

/// One `inference` line and the calls that followed it.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// 0-based turn number within the task.
    pub turn: u32,
    /// `tool_call`, `end_turn` or `text`.
    pub decision: &'static str,
    /// Runtime estimate of the request's tokens.
    pub input_tokens: u64,
    /// Runtime estimate of the response's tokens.
    pub output_tokens: u64,
    /// Wall time of the model call, ms.
    pub duration_ms: u64,
    /// `hook:<name>` for a hook's own model call.
    pub origin: Option<String>,
    /// Retried or failed HTTP attempts of the call, one line each.
    pub attempts: Vec<String>,
    /// The tool calls of the turn, in order.
    pub calls: Vec<Call>,
}

/// One tool call of a [`Turn`].
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// The tool's name.
    pub tool: String,
    /// Whether it returned an error.
    pub ok: bool,
    /// Bytes of its input and its output.
    pub input_bytes: u64,
    /// Bytes of its result text.
    pub output_bytes: u64,
    /// Wall time, ms.
    pub duration_ms: u64,
    /// The shell command and its exit code, for a shell call; other details (detached,
    /// replayed, in doubt, sandboxed) one line each.
    pub details: Vec<String>,
}

/// The timeline of `task_id` in `lines` (one session's trace, in order): the lines from its
/// `task_start` to its `task_end`, those of other tasks left out.
pub fn of_task(lines: &[Line], task_id: &str) -> Timeline {
    let mut timeline = Timeline::default();
    let mut inside = false;
    let mut attempts: Vec<String> = Vec::new();
    for line in lines {
        if let Some(other) = task_of(&line.event)
            && other != task_id
        {
            continue;
        }
        match &line.event {
            Event::TaskStart { lane, origin, source, .. } => {
                inside = true;
                timeline.started = true;
                timeline.note("start", format!("started from {source}, origin {origin}, lane {lane}"));
                continue;
            }
            _ if !inside => continue,
            Event::Inference {
                turn, input_tokens, output_tokens, decision, duration_ms, origin, ..
            } => {
                timeline.entries.push(Entry::Turn(Turn {
                    turn: *turn,
                    decision: decision_name(*decision),
                    input_tokens: *input_tokens,
                    output_tokens: *output_tokens,
                    duration_ms: *duration_ms,
                    origin: origin.clone(),
                    attempts: std::mem::take(&mut attempts),
                    calls: Vec::new(),
                }));
            }
            Event::ModelAttempt { attempt, status, error, duration_ms, .. } => {
                let status = status.map_or_else(|| "no response".to_string(), |s| format!("HTTP {s}"));
                let error = error.as_deref().map(|e| format!(": {e}")).unwrap_or_default();
                attempts.push(format!("attempt {attempt}: {status} after {duration_ms} ms{error}"));
            }
            Event::ToolCall { tool_name, input_bytes, output_bytes, duration_ms, status, mcp_server, .. } => {
                let call = Call {
                    tool: tool_name.clone(),
                    ok: *status == CallStatus::Ok,
                    input_bytes: *input_bytes,
                    output_bytes: *output_bytes,
                    duration_ms: *duration_ms,
                    details: mcp_server.iter().map(|s| format!("served by MCP server {s}")).collect(),
                };
                match timeline.last_turn() {
                    Some(turn) => turn.calls.push(call),
                    None => timeline.note("tool_call", format!("{tool_name} outside a turn")),
                }
            }
            Event::Shell { command, exit_code, .. } => {
                timeline.detail(format!("$ {command} → exit {exit_code}"));
            }
            Event::ShellDetached { command, work_id, grace_ms, .. } => {
                timeline.detail(format!("$ {command} → detached as {work_id} after {grace_ms} ms"));
            }
            Event::Sandbox { enforced_by, network, .. } => {
                timeline.detail(format!("sandboxed ({}; network {network})", enforced_by.join(", ")));
            }
            Event::ToolCallInDoubt { tool_name, previous_worker, action, .. } => timeline.note(
                "in_doubt",
                format!("{tool_name} was running on {previous_worker} when it stopped answering: {action}"),
            ),
            Event::JournalReplay { turn, what, tool_name, previous_worker, .. } => {
                let what = match tool_name {
                    Some(tool) => format!("{what} of {tool}"),
                    None => what.clone(),
                };
                timeline.note("replay", format!("turn {turn}: {what} reused from {previous_worker}'s journal"))
            }
            Event::TaskTakeover { turn, delivery, previous_session_id, previous_worker, .. } => timeline.note(
                "takeover",
                format!(
                    "taken over from {previous_worker} (session {previous_session_id}) at turn {turn}, delivery {delivery}"
                ),
            ),
            Event::TaskReopened { hook_name, reason, reopen_number, .. } => {
                timeline.note("reopened", format!("reopened ({reopen_number}) by hook {hook_name}: {reason}"))
            }
            Event::Compaction { turn, tokens_before, tokens_after, .. } => timeline
                .note("compaction", format!("compacted after turn {turn}: {tokens_before} → {tokens_after} tokens")),
            Event::CompactionDeclined { turn, tokens, reason, .. } => {
                timeline.note("compaction", format!("compaction declined after turn {turn} at {tokens} tokens: {reason}"))
            }
            Event::ContextSeed { hook_name, outcome, tokens, .. } => {
                timeline.note("seed", format!("context seed from {hook_name}: {outcome} ({tokens} tokens)"))
            }
            Event::SpendCeilingReached { origin, used_tokens, ceiling_tokens, .. } => timeline.note(
                "ceiling",
                format!("spend ceiling reached ({origin}): {used_tokens} of {ceiling_tokens} tokens used"),
            ),
            Event::HookDispatchError { hook_name, event, arm, message } => {
                timeline.note("hook", format!("hook {hook_name} on {event}: {arm}: {message}"))
            }
            Event::TaskEnd { exit_status, duration_ms, turns, input_tokens, output_tokens, tool_calls, .. } => {
                timeline.ended = true;
                inside = false;
                timeline.note(
                    "end",
                    format!(
                        "ended {exit_status} after {duration_ms} ms: {turns} turns, {input_tokens} tokens in, \
                         {output_tokens} out, {tool_calls} tool calls"
                    ),
                );
            }
            _ => {}
        }
    }
    timeline
}

impl Timeline {
    fn note(&mut self, kind: &'static str, text: String) {
        self.entries.push(Entry::Note { kind, text });
    }

    fn last_turn(&mut self) -> Option<&mut Turn> {
        match self.entries.last_mut() {
            Some(Entry::Turn(turn)) => Some(turn),
            _ => None,
        }
    }

    /// A detail of the last call of the last turn (a shell command's line follows its
    /// `tool_call` line).
    fn detail(&mut self, text: String) {
        if let Some(call) = self.last_turn().and_then(|t| t.calls.last_mut()) {
            call.details.push(text);
        }
    }

    /// The turns, in order.
    pub fn turns(&self) -> impl Iterator<Item = &Turn> {
        self.entries.iter().filter_map(|e| match e {
            Entry::Turn(t) => Some(t),
            Entry::Note { .. } => None,
        })
    }
}

/// The task an event belongs to, for events that name one.
fn task_of(event: &Event) -> Option<&str> {
    match event {
        Event::TaskStart { task_id, .. }
        | Event::Inference { task_id, .. }
        | Event::ModelAttempt { task_id, .. }
        | Event::ToolCall { task_id, .. }
        | Event::ToolCallInDoubt { task_id, .. }
        | Event::JournalReplay { task_id, .. }
        | Event::Shell { task_id, .. }
        | Event::ShellDetached { task_id, .. }
        | Event::TaskReopened { task_id, .. }
        | Event::TaskTakeover { task_id, .. }
        | Event::ContextSeed { task_id, .. }
        | Event::Compaction { task_id, .. }
        | Event::CompactionDeclined { task_id, .. }
        | Event::TaskEnd { task_id, .. } => Some(task_id),
        Event::Sandbox { task_id, .. } | Event::SpendCeilingReached { task_id, .. } => task_id.as_deref(),
        _ => None,
    }
}

fn decision_name(decision: mur_proto::trace::Decision) -> &'static str {
    use mur_proto::trace::Decision;
    match decision {
        Decision::ToolCall => "tool_call",
        Decision::EndTurn => "end_turn",
        Decision::Text => "text",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn line(v: serde_json::Value) -> Line {
        let mut v = v;
        v["session_id"] = json!("ses_1");
        v["timestamp"] = json!(1);
        v["event_id"] = json!("evt_1");
        v["parent_id"] = json!(null);
        serde_json::from_value(v).unwrap()
    }

    fn start(task: &str) -> Line {
        line(json!({"event_type": "task_start", "task_id": task, "context_id": "ctx_1", "source": "cluster",
            "message_parts_bytes": 3, "origin": "user", "lane": "user"}))
    }

    fn inference(task: &str, turn: u32, decision: &str) -> Line {
        line(json!({"event_type": "inference", "task_id": task, "turn": turn, "input_tokens": 100 + turn,
            "output_tokens": 7, "decision": decision, "tool_name": null, "duration_ms": 12}))
    }

    fn end(task: &str) -> Line {
        line(json!({"event_type": "task_end", "task_id": task, "exit_status": "ok", "duration_ms": 40,
            "turns": 2, "input_tokens": 201, "output_tokens": 14, "tool_calls": 1, "shell_calls": 1}))
    }

    #[test]
    fn a_tasks_turns_carry_their_tool_calls_and_other_tasks_are_left_out() {
        let lines = vec![
            start("tsk_other"),
            inference("tsk_other", 0, "end_turn"),
            end("tsk_other"),
            start("tsk_1"),
            line(json!({"event_type": "model_attempt", "task_id": "tsk_1", "turn": 0, "attempt": 1,
                "status": 503, "error": "busy", "waited_ms": 0, "duration_ms": 5})),
            inference("tsk_1", 0, "tool_call"),
            line(json!({"event_type": "tool_call", "task_id": "tsk_1", "turn": 0, "tool_name": "sh",
                "tool_call_id": "c1", "input_bytes": 20, "output_bytes": 300, "duration_ms": 9, "status": "ok"})),
            line(json!({"event_type": "shell", "task_id": "tsk_1", "turn": 0, "binary": "/bin/sh",
                "command": "echo <b>", "exit_code": 0, "stdout_bytes": 4, "stderr_bytes": 0, "duration_ms": 8})),
            line(json!({"event_type": "compaction", "task_id": "tsk_1", "turn": 0, "tokens_before": 900,
                "tokens_after": 200})),
            inference("tsk_1", 1, "end_turn"),
            end("tsk_1"),
        ];
        let t = of_task(&lines, "tsk_1");
        assert!(t.started && t.ended);
        let turns: Vec<&Turn> = t.turns().collect();
        assert_eq!(turns.len(), 2);
        assert_eq!((turns[0].turn, turns[0].decision, turns[0].input_tokens), (0, "tool_call", 100));
        assert_eq!(turns[0].attempts, ["attempt 1: HTTP 503 after 5 ms: busy"]);
        assert_eq!(turns[0].calls.len(), 1);
        let call = &turns[0].calls[0];
        assert_eq!((call.tool.as_str(), call.ok, call.input_bytes, call.output_bytes), ("sh", true, 20, 300));
        assert_eq!(call.details, ["$ echo <b> → exit 0"]);
        assert_eq!((turns[1].turn, turns[1].decision, turns[1].calls.len()), (1, "end_turn", 0));
        let kinds: Vec<&str> = t
            .entries
            .iter()
            .map(|e| match e {
                Entry::Turn(_) => "turn",
                Entry::Note { kind, .. } => kind,
            })
            .collect();
        assert_eq!(kinds, ["start", "turn", "compaction", "turn", "end"]);
    }

    #[test]
    fn a_takeover_and_a_reopening_are_notes_of_the_task() {
        let lines = vec![
            start("tsk_1"),
            line(json!({"event_type": "task_takeover", "task_id": "tsk_1", "turn": 3, "delivery": 2,
                "previous_session_id": "ses_0", "previous_worker": "wkr_a"})),
            line(json!({"event_type": "task_reopened", "task_id": "tsk_1", "hook_name": "check",
                "reason": "tests fail", "reopen_number": 1})),
        ];
        let t = of_task(&lines, "tsk_1");
        assert!(t.started && !t.ended, "a running task has no end yet");
        let notes: Vec<String> = t
            .entries
            .iter()
            .filter_map(|e| match e {
                Entry::Note { text, .. } => Some(text.clone()),
                Entry::Turn(_) => None,
            })
            .collect();
        assert_eq!(
            notes[1..],
            [
                "taken over from wkr_a (session ses_0) at turn 3, delivery 2".to_string(),
                "reopened (1) by hook check: tests fail".to_string(),
            ]
        );
        assert_eq!(of_task(&lines, "tsk_none"), Timeline::default());
    }
}
