//! `trace.jsonl`: one JSON object per line, the session's record of what happened.
//!
//! The vocabulary and fields are those of the runtime reference, §1 ([main+]
//! generation): every line carries `event_type`, `session_id`, `timestamp` (Unix ms),
//! `event_id` (`evt_…`) and `parent_id` (null only on `session_start`); the tree is
//! session → task → turn (`inference`) → call events. Optional provider usage fields are
//! absent, never 0, when the provider did not report them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::task::{ExitStatus, Lane, Origin};

/// One line of `trace.jsonl`: the common header plus the event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Line {
    /// The event and its fields; serialised flat, tagged by `event_type`.
    #[serde(flatten)]
    pub event: Event,
    /// `ses_…`, the same on every line of a file.
    pub session_id: String,
    /// Unix time in milliseconds.
    pub timestamp: u64,
    /// `evt_…`, unique.
    pub event_id: String,
    /// The enclosing event (`session_start` for a task, `task_start` for a turn, the
    /// `inference` line for its calls); null only on `session_start`.
    pub parent_id: Option<String>,
}

/// Token usage as the provider reported it. Every field is optional: absent means the
/// provider did not say, which is not the same as 0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderUsage {
    /// Input tokens the provider counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens_actual: Option<u64>,
    /// Output tokens the provider counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens_actual: Option<u64>,
    /// Input tokens served from the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// Input tokens written to the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
}

/// The tokens of a model response reused from the tool-call journal (a `journal_replay`
/// line's `tokens`): the fields of the `inference` line it stands for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayedTokens {
    /// The runtime's estimate of the request's input tokens.
    pub input_tokens: u64,
    /// The runtime's estimate of the response's output tokens.
    pub output_tokens: u64,
    /// The provider's own counts, where it reported them.
    #[serde(default)]
    pub usage: ProviderUsage,
}

/// What a model response decided, as the `inference` line records it:
/// `tool_call` → `tool_call`, `end_turn` → `end_turn`, anything else (`max_tokens`
/// included) → `text` (the runtime reference, §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The model asked for tools.
    ToolCall,
    /// The model ended its turn.
    EndTurn,
    /// Anything else.
    Text,
}

impl Decision {
    /// The wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Decision::ToolCall => "tool_call",
            Decision::EndTurn => "end_turn",
            Decision::Text => "text",
        }
    }
}

/// `ok` or `error`, for a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallStatus {
    /// The tool ran (a shell command's non-zero exit included).
    Ok,
    /// The tool could not run or reported an error.
    Error,
}

/// Every event a trace may hold.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event_type", rename_all = "snake_case")]
pub enum Event {
    /// Once per launch, first.
    SessionStart {
        /// `name` of the manifest.
        capsule_name: String,
        /// `version` of the manifest.
        capsule_version: String,
        /// The model name, or the driver's label when it has none (`scripted`).
        model: String,
        /// `openai`, `anthropic`, `scripted` or `process`: a scripted run says so.
        driver: String,
        /// `inference.max_turns`.
        max_turns: u32,
        /// Capabilities granted (`shell` when any binary is allowed).
        capabilities: Vec<String>,
        /// Tool names offered to the model, in order.
        tools_declared: Vec<String>,
        /// `manifest`, `cli` or `none`.
        system_prompt_source: String,
        /// SHA-256 (hex) of the resolved system prompt, null when there is none.
        system_prompt_sha256: Option<String>,
        /// The session this one resumes (`mur run --resume`).
        resumed_from: Option<String>,
        /// The context the session resumes, if any.
        context_id: Option<String>,
    },
    /// A task begins; resets the per-task counters.
    TaskStart {
        /// `tsk_…`.
        task_id: String,
        /// `ctx_…`.
        context_id: String,
        /// `cli`, `task_md`, `a2a`, `cluster`, `detached_shell`, `detached_lost`.
        source: String,
        /// Bytes of the task text.
        message_parts_bytes: u64,
        /// Where the task came from.
        origin: Origin,
        /// The lane it waited in.
        lane: Lane,
        /// The OpenTelemetry trace the task's spans belong to (32 hex digits), when the
        /// process exports spans: a key to find the task on a tracing dashboard (issue #7
        /// §Trace context).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trace_id: Option<String>,
    },
    /// One model call (a turn).
    Inference {
        /// 0-based turn number within the task.
        turn: u32,
        /// The task.
        task_id: String,
        /// Runtime estimate of the request's tokens.
        input_tokens: u64,
        /// Runtime estimate of the response's tokens.
        output_tokens: u64,
        /// What the response decided.
        decision: Decision,
        /// The first tool called, if any.
        tool_name: Option<String>,
        /// Wall time of the model call, ms.
        duration_ms: u64,
        /// Provider-reported usage.
        #[serde(flatten)]
        usage: ProviderUsage,
        /// `hook:<name>` for a hook's own model call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        origin: Option<String>,
    },
    /// One HTTP attempt of a model call that was retried or failed (issue #3: every
    /// attempt is visible). Written before the call's `inference` line; a call that
    /// succeeded on its first attempt writes none.
    ModelAttempt {
        /// The task.
        task_id: String,
        /// The turn the call belongs to (0-based).
        turn: u32,
        /// 1-based attempt number.
        attempt: u32,
        /// HTTP status, when one came back.
        status: Option<u16>,
        /// What went wrong, when something did.
        error: Option<String>,
        /// Time waited before this attempt, ms.
        waited_ms: u64,
        /// Duration of this attempt, ms.
        duration_ms: u64,
    },
    /// One tool call, written after the tool returned.
    ToolCall {
        /// Turn that asked for it.
        turn: u32,
        /// The task.
        task_id: String,
        /// Tool name as the model gave it.
        tool_name: String,
        /// The provider's call id.
        tool_call_id: Option<String>,
        /// The call's input (omitted with `trace.capture: none`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        input: Option<Value>,
        /// Bytes of the serialised input.
        input_bytes: u64,
        /// The result text (only with `trace.capture: content`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output: Option<String>,
        /// Bytes of the result text.
        output_bytes: u64,
        /// Wall time, ms.
        duration_ms: u64,
        /// `ok` or `error`.
        status: CallStatus,
        /// The MCP server that served the call, for a tool of `mcp_servers:` (issue #35).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mcp_server: Option<String>,
        /// The call's idempotency key, `<task>.<turn>.<index>`, the same on every attempt
        /// (issue #34; `MUR_TOOL_CALL_ID` in the command's environment).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        idempotency_key: Option<String>,
    },
    /// A tool call a takeover found started and never ended (issue #34): its worker died
    /// while it ran. `action` says what was done: `rerun` (its tool is declared
    /// idempotent: it ran again with the same key) or `reported` (not run again; the model
    /// was told it may or may not have taken effect).
    ToolCallInDoubt {
        /// The task.
        task_id: String,
        /// Turn that asked for it.
        turn: u32,
        /// Tool name.
        tool_name: String,
        /// The provider's call id.
        tool_call_id: String,
        /// Its idempotency key.
        idempotency_key: String,
        /// The worker that started it and died.
        previous_worker: String,
        /// `rerun` or `reported`.
        action: String,
    },
    /// A takeover reused what the task's journal held instead of doing it again (issue
    /// #34): `what` is `model_response` (turn `turn`'s response, not asked again) or
    /// `tool_result` (a call that had ended, not run again).
    JournalReplay {
        /// The task.
        task_id: String,
        /// The model call.
        turn: u32,
        /// `model_response` or `tool_result`.
        what: String,
        /// The tool, for a `tool_result`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_name: Option<String>,
        /// The call's idempotency key, for a `tool_result`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        idempotency_key: Option<String>,
        /// The worker that did it first.
        previous_worker: String,
        /// For a `model_response`: its tokens, as its `inference` line would have counted
        /// them. The worker that was billed for the call died before it could report it,
        /// so the task's usage counts them here, once.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tokens: Option<ReplayedTokens>,
    },
    /// A shell command, written right after its `tool_call` line.
    Shell {
        /// Turn that asked for it.
        turn: u32,
        /// The task.
        task_id: String,
        /// Resolved absolute path of the binary (or its bare name when unresolved).
        binary: String,
        /// The command as the model gave it.
        command: String,
        /// Exit code; 128+signal when killed by a signal.
        exit_code: i32,
        /// Bytes written to stdout.
        stdout_bytes: u64,
        /// Bytes written to stderr.
        stderr_bytes: u64,
        /// Wall time, ms.
        duration_ms: u64,
    },
    /// A shell command outlived `lifecycle.shell_grace_secs` and moved to the background
    /// (the session-loop seed, §Detached shell). Written instead of the `shell` line, right
    /// after its `tool_call` line, and counted as a shell call.
    ShellDetached {
        /// Turn that asked for it.
        turn: u32,
        /// The task that started it.
        task_id: String,
        /// `wrk_…`, the handle the turn was given.
        work_id: String,
        /// Resolved absolute path of the binary (or its bare name when unresolved).
        binary: String,
        /// The command as the model gave it.
        command: String,
        /// The grace period it outlived, ms.
        grace_ms: u64,
    },
    /// A tool call's command, or a hook program, ran sandboxed (issue #37): the rules it
    /// ran under. For a tool call, written right after the call's `shell` or
    /// `shell_detached` line (after its `tool_call` line for a command tool); for a hook
    /// program, after the dispatch of the event it was started for (once per start of a
    /// persistent hook). A denial the kernel made comes back in the process's own output
    /// (`Permission denied`, `Operation not permitted`).
    Sandbox {
        /// Turn that asked for it (for a hook: the turn under way, 0 before the first).
        turn: u32,
        /// The task; absent for a hook started outside a task (`on-session-start`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        task_id: Option<String>,
        /// The tool called; absent for a hook.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_name: Option<String>,
        /// The hook started; absent for a tool call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hook_name: Option<String>,
        /// The binding of the event the hook was started for (`on-task-start`); absent for
        /// a tool call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event: Option<String>,
        /// Readable paths besides the system's programs and libraries (the capsule folder
        /// and `sandbox.read`), absolute.
        read: Vec<String>,
        /// Writable paths (the folder commands run in, the session folder and
        /// `sandbox.write`), absolute.
        write: Vec<String>,
        /// `sandbox.network`: `none`, `loopback` or the `[host:port, …]` list. A hook's
        /// shows the inference endpoint's address added when the session's rule does not
        /// reach it (`none` → `[127.0.0.1:PORT]`).
        network: String,
        /// `sandbox.memory_mb`, MiB, for all the command's processes together.
        memory_mb: Option<u64>,
        /// `sandbox.pids`: processes and threads at once.
        pids: Option<u32>,
        /// `sandbox.cpu_secs`: CPU seconds per process.
        cpu_secs: Option<u64>,
        /// The kernel's Landlock ABI.
        landlock_abi: u32,
        /// The mechanisms in force (`landlock`, `landlock-scope`, `seccomp`,
        /// `no_new_privs`, `rlimit-cpu`, `cgroup v1` or `cgroup v2`, `nftables`).
        enforced_by: Vec<String>,
    },
    /// A detached command ended and its completion task was enqueued
    /// (the session-loop seed, §Detached shell). Not counted again as a shell call.
    ShellCompleted {
        /// `wrk_…`.
        work_id: String,
        /// Resolved absolute path of the binary (or its bare name).
        binary: String,
        /// The command as the model gave it.
        command: String,
        /// Exit code; 128+signal when killed by a signal.
        exit_code: i32,
        /// Wall time from start to exit, ms.
        duration_ms: u64,
        /// Where its output went, `logs/<work_id>.log` (relative to the workdir).
        output_path: String,
        /// Bytes of output (stdout and stderr) in that file.
        output_bytes: u64,
        /// `ok` for exit code 0, else `error`.
        status: CallStatus,
        /// The `completion` task that carries the result.
        completion_task_id: String,
    },
    /// A detached command still running when its session ended; its result is lost
    /// (the session-loop seed, §Detached shell). Also reported on stderr.
    ShellAbandoned {
        /// `wrk_…`.
        work_id: String,
        /// Resolved absolute path of the binary (or its bare name).
        binary: String,
        /// The command as the model gave it.
        command: String,
        /// Time since the command started, ms.
        running_ms: u64,
    },
    /// A resume found a `shell_detached` line with no end and reported the command lost
    /// (the session-loop seed, §What a resume reports). Appended to the trace of the
    /// session that started the command; the header's `session_id` is the writer's, so
    /// the session the command belonged to has its own field.
    ShellLost {
        /// The session that detached the command (whose trace this line is appended to).
        original_session_id: String,
        /// `wrk_…`.
        work_id: String,
        /// Resolved absolute path of the binary (or its bare name).
        binary: String,
        /// The command as the model gave it.
        command: String,
        /// The `timestamp` of the `shell_detached` line (Unix ms).
        detached_at_ms: u64,
        /// The resuming session that reported the loss.
        reconciled_by_session: String,
        /// The `completion` task that carries the report.
        reconciled_task_id: String,
    },
    /// A hook vetoed the task's outcome and the task runs again (the session-loop seed,
    /// §Task reopening). Between `task_start` and `task_end`.
    TaskReopened {
        /// The task.
        task_id: String,
        /// The hook that asked.
        hook_name: String,
        /// Its feedback.
        reason: String,
        /// 1-based ordinal of this reopen.
        reopen_number: u32,
    },
    /// This session took the task over from a worker that stopped answering for it (issue
    /// #8 §Takeover): the conversation and counters come from the task's last checkpoint,
    /// and the loop goes on after turn `turn`. Right after `task_start`.
    TaskTakeover {
        /// The task.
        task_id: String,
        /// Turns already made when the checkpoint was written; the next model call is
        /// turn `turn` (0-based), as `inference.turn` counts.
        turn: u32,
        /// The delivery of the dispatch this session got (2 for the first takeover).
        delivery: u64,
        /// The session that wrote the checkpoint.
        previous_session_id: String,
        /// The worker that ran that session.
        previous_worker: String,
    },
    /// This session stopped because the task is no longer its own (issue #33): while its
    /// worker was cut off, the task was taken over by another session, which runs it or
    /// has ended it (or the task was dead-lettered). In place of `task_end`, which the
    /// task's holder writes once: this session writes no `task_end`, no result and no
    /// terminal record. Its `session_end` follows (exit `canceled`).
    SessionSuperseded {
        /// The task.
        task_id: String,
        /// Turns this session's task had made when it stopped.
        turns: u32,
    },
    /// A seed proposal's fate (the session-loop seed, §Context seeding).
    ContextSeed {
        /// The task.
        task_id: String,
        /// The hook whose proposal it was.
        hook_name: String,
        /// Tokens committed (0 when rejected).
        tokens: u64,
        /// Tokens proposed.
        proposed_tokens: u64,
        /// The ceiling: floor(`context.max_tokens` × `context.seed_budget`).
        budget_tokens: u64,
        /// `seeded`, `trimmed`, `compacted` or `rejected`.
        outcome: String,
        /// For `rejected`: `unsupported_transport`, `no_budget`, `message_over_budget`,
        /// `overflow_over_limit`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// Messages committed.
        messages: u32,
    },
    /// A compaction replaced the history (the context seed).
    Compaction {
        /// The turn after which it ran.
        turn: u32,
        /// The task.
        task_id: String,
        /// Occupancy before.
        tokens_before: u64,
        /// Occupancy after, recounted on the new history.
        tokens_after: u64,
    },
    /// The threshold was crossed but the history was not replaced; the session goes on.
    CompactionDeclined {
        /// The turn after which it was checked.
        turn: u32,
        /// The task.
        task_id: String,
        /// Occupancy at the time.
        tokens: u64,
        /// `no_hook_replacement`, `unresolved_tool_call`, or `threshold_unreachable` (the
        /// last compaction left the count over the threshold and the history has not
        /// outgrown it since; written once per such compaction, issue #28 item 4).
        reason: String,
    },
    /// A spend ceiling refused a model call before it was sent.
    SpendCeilingReached {
        /// The task, if one was running.
        task_id: Option<String>,
        /// `loop` for the session loop's own call, `hook:<name>` for a hook's.
        origin: String,
        /// Tokens spent so far in the session (runtime estimates).
        used_tokens: u64,
        /// Tokens the refused call would have added.
        requested_tokens: u64,
        /// `inference.max_session_tokens`.
        ceiling_tokens: u64,
    },
    /// A hook failed, or answered something its binding or policy does not honour.
    HookDispatchError {
        /// The hook.
        hook_name: String,
        /// The binding of the event (`on-task-end`), or `drain`.
        event: String,
        /// `error`, `timeout`, `queue-overflow`, or the action that was not honoured.
        arm: String,
        /// What happened.
        message: String,
    },
    /// The task's single terminal record.
    TaskEnd {
        /// The task.
        task_id: String,
        /// How it ended.
        exit_status: ExitStatus,
        /// Wall time, ms.
        duration_ms: u64,
        /// Model calls made (all attempts).
        turns: u32,
        /// Sum of the inference lines' `input_tokens`.
        input_tokens: u64,
        /// Sum of the inference lines' `output_tokens`.
        output_tokens: u64,
        /// Tool calls made.
        tool_calls: u32,
        /// Shell commands run.
        shell_calls: u32,
        /// Reopens granted; 0 for a task that ran once.
        #[serde(default)]
        reopen_count: u32,
    },
    /// Once per launch, last; totals are sums over the task records.
    SessionEnd {
        /// Sum of `task_end.turns`. Every total counts what this session ran: a task it
        /// took over adds its counts less those of the checkpoint it resumed from (the
        /// earlier session's), so the totals match this session's trace.
        total_turns: u32,
        /// Sum of `task_end.input_tokens`.
        total_input_tokens: u64,
        /// Sum of `task_end.output_tokens`.
        total_output_tokens: u64,
        /// Sum of `task_end.tool_calls`.
        total_tool_calls: u32,
        /// Sum of `task_end.shell_calls`.
        total_shell_calls: u32,
        /// Wall time of the session, ms.
        duration_ms: u64,
        /// The last task's exit status (`ok` for a session that ran none).
        exit_status: ExitStatus,
    },
}

impl Event {
    /// The `event_type` string.
    pub fn event_type(&self) -> &'static str {
        match self {
            Event::SessionStart { .. } => "session_start",
            Event::TaskStart { .. } => "task_start",
            Event::Inference { .. } => "inference",
            Event::ModelAttempt { .. } => "model_attempt",
            Event::ToolCall { .. } => "tool_call",
            Event::Shell { .. } => "shell",
            Event::ShellDetached { .. } => "shell_detached",
            Event::ShellCompleted { .. } => "shell_completed",
            Event::ShellAbandoned { .. } => "shell_abandoned",
            Event::Sandbox { .. } => "sandbox",
            Event::ShellLost { .. } => "shell_lost",
            Event::TaskEnd { .. } => "task_end",
            Event::TaskReopened { .. } => "task_reopened",
            Event::TaskTakeover { .. } => "task_takeover",
            Event::SessionSuperseded { .. } => "session_superseded",
            Event::ToolCallInDoubt { .. } => "tool_call_in_doubt",
            Event::JournalReplay { .. } => "journal_replay",
            Event::ContextSeed { .. } => "context_seed",
            Event::Compaction { .. } => "compaction",
            Event::CompactionDeclined { .. } => "compaction_declined",
            Event::SpendCeilingReached { .. } => "spend_ceiling_reached",
            Event::HookDispatchError { .. } => "hook_dispatch_error",
            Event::SessionEnd { .. } => "session_end",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_serialise_flat_with_the_header() {
        let line = Line {
            event: Event::TaskEnd {
                task_id: "tsk_1".into(),
                exit_status: ExitStatus::MaxTurnsReached,
                duration_ms: 5,
                turns: 3,
                input_tokens: 10,
                output_tokens: 2,
                tool_calls: 3,
                shell_calls: 3,
                reopen_count: 0,
            },
            session_id: "ses_1".into(),
            timestamp: 1700000000000,
            event_id: "evt_1".into(),
            parent_id: Some("evt_0".into()),
        };
        let json = serde_json::to_string(&line).unwrap();
        assert_eq!(
            json,
            r#"{"event_type":"task_end","task_id":"tsk_1","exit_status":"max_turns_reached","duration_ms":5,"turns":3,"input_tokens":10,"output_tokens":2,"tool_calls":3,"shell_calls":3,"reopen_count":0,"session_id":"ses_1","timestamp":1700000000000,"event_id":"evt_1","parent_id":"evt_0"}"#
        );
        assert_eq!(serde_json::from_str::<Line>(&json).unwrap(), line);
    }

    #[test]
    fn unreported_usage_is_absent_not_zero() {
        let e = Event::Inference {
            turn: 0,
            task_id: "t".into(),
            input_tokens: 1,
            output_tokens: 1,
            decision: Decision::Text,
            tool_name: None,
            duration_ms: 0,
            usage: ProviderUsage { output_tokens_actual: Some(7), ..Default::default() },
            origin: None,
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["output_tokens_actual"], 7);
        assert!(v.get("input_tokens_actual").is_none());
        assert!(v.get("cached_tokens").is_none());
        assert_eq!(v["decision"], "text");
    }

    #[test]
    fn detached_shell_events_carry_their_event_type_and_round_trip() {
        let events = [
            Event::ShellDetached {
                turn: 2,
                task_id: "tsk_1".into(),
                work_id: "wrk_1".into(),
                binary: "/bin/sh".into(),
                command: "sleep 30".into(),
                grace_ms: 10_000,
            },
            Event::ShellCompleted {
                work_id: "wrk_1".into(),
                binary: "/bin/sh".into(),
                command: "sleep 30".into(),
                exit_code: 137,
                duration_ms: 30_000,
                output_path: "logs/wrk_1.log".into(),
                output_bytes: 0,
                status: CallStatus::Error,
                completion_task_id: "tsk_2".into(),
            },
            Event::ShellAbandoned {
                work_id: "wrk_1".into(),
                binary: "/bin/sh".into(),
                command: "sleep 30".into(),
                running_ms: 12,
            },
            Event::ShellLost {
                original_session_id: "ses_old".into(),
                work_id: "wrk_1".into(),
                binary: "/bin/sh".into(),
                command: "sleep 30".into(),
                detached_at_ms: 1_700_000_000_000,
                reconciled_by_session: "ses_new".into(),
                reconciled_task_id: "tsk_3".into(),
            },
        ];
        let types: Vec<&str> = events.iter().map(Event::event_type).collect();
        assert_eq!(types, ["shell_detached", "shell_completed", "shell_abandoned", "shell_lost"]);
        for e in events {
            let v = serde_json::to_value(&e).unwrap();
            assert_eq!(v["event_type"], e.event_type());
            assert_eq!(serde_json::from_value::<Event>(v).unwrap(), e);
        }
        let v = serde_json::to_value(Event::ShellCompleted {
            work_id: "wrk_1".into(),
            binary: "sh".into(),
            command: "false".into(),
            exit_code: 1,
            duration_ms: 1,
            output_path: "logs/wrk_1.log".into(),
            output_bytes: 0,
            status: CallStatus::Error,
            completion_task_id: "tsk_2".into(),
        })
        .unwrap();
        assert_eq!(v["status"], "error");
    }
}
