//! The loop rules, driven without IO: a list of model replies and a tool function stand in
//! for the driver and the tools.
use super::*;
use crate::tools::{DetachedWork, ShellRun};
use mur_proto::message::Role;
use mur_proto::task::Origin;
use mur_proto::trace::ProviderUsage;
use serde_json::json;

/// Counts one token per byte, so expected values are exact.
struct PerByte;
impl Estimator for PerByte {
    fn count(&self, text: &str) -> u64 {
        text.len() as u64
    }
}

fn task(text: &str) -> TaskSpec {
    TaskSpec {
        task_id: "tsk_1".into(),
        context_id: "ctx_1".into(),
        text: text.into(),
        origin: Origin::User,
        source: "cli".into(),
    }
}

fn machine(max_turns: u32) -> TaskMachine {
    TaskMachine::new(task("do it"), Vec::new(), max_turns, 100, Capture::Meta, Arc::new(PerByte))
}

fn text(t: &str, stop: StopReason) -> ModelResponse {
    ModelResponse { content: vec![Block::Text { text: t.into() }], stop, usage: ProviderUsage::default() }
}

fn call(id: &str, name: &str) -> Block {
    Block::ToolCall { id: id.into(), name: name.into(), input: json!({"command": "echo hi"}) }
}

fn calls(blocks: Vec<Block>, stop: StopReason) -> ModelResponse {
    ModelResponse { content: blocks, stop, usage: ProviderUsage::default() }
}

fn ok_tool(text: &str) -> ToolOutcome {
    ToolOutcome { text: text.into(), is_error: false, shell: None, detached: None, sandbox: None, mcp_server: None }
}

/// Runs the machine against `replies` (repeating the last one forever) and `tool`;
/// returns the outcome, the events and the number of model calls.
fn drive(
    m: &mut TaskMachine,
    replies: Vec<Result<ModelResponse, String>>,
    mut tool: impl FnMut(&str) -> ToolOutcome,
) -> (Outcome, Vec<Event>, usize) {
    let mut events = Vec::new();
    let mut model_calls = 0;
    let mut action = m.start();
    loop {
        action = match action {
            Action::Finish(o) => return (o, events, model_calls),
            Action::CallModel => {
                let reply = replies[model_calls.min(replies.len() - 1)].clone();
                model_calls += 1;
                let (ev, next) = m.on_model_reply(reply, 7);
                events.extend(ev);
                next
            }
            Action::RunTool { name, .. } => {
                let (ev, next) = m.on_tool_result(tool(&name), 3);
                events.extend(ev);
                next
            }
            Action::Compact { .. } => {
                let (ev, next) = m.on_compaction(CompactionReply::NoReplacement);
                events.extend(ev);
                next
            }
        };
    }
}

fn types(events: &[Event]) -> Vec<&'static str> {
    events.iter().map(Event::event_type).collect()
}

#[test]
fn end_turn_ends_ok_with_the_text_blocks_joined() {
    let mut m = machine(10);
    let reply = ModelResponse {
        content: vec![Block::Text { text: "line one".into() }, Block::Text { text: "line two".into() }],
        stop: StopReason::EndTurn,
        usage: ProviderUsage::default(),
    };
    let (o, events, n) = drive(&mut m, vec![Ok(reply)], ok_tool);
    assert_eq!(o, Outcome { exit_status: ExitStatus::Ok, result: "line one\nline two".into() });
    assert_eq!(n, 1);
    let Event::Inference { turn, decision, tool_name, .. } = &events[0] else { panic!() };
    assert_eq!((*turn, *decision, tool_name.as_deref()), (0, Decision::EndTurn, None));
}

#[test]
fn max_tokens_ends_ok_with_the_partial_text_and_decision_text() {
    let mut m = machine(10);
    let (o, events, _) = drive(&mut m, vec![Ok(text("cut sh", StopReason::MaxTokens))], ok_tool);
    assert_eq!(o, Outcome { exit_status: ExitStatus::Ok, result: "cut sh".into() });
    let Event::Inference { decision, .. } = &events[0] else { panic!() };
    assert_eq!(*decision, Decision::Text);
}

#[test]
fn tool_calls_run_in_order_then_the_model_is_called_again() {
    let mut m = machine(10);
    let mut ran = Vec::new();
    let (o, events, n) = drive(
        &mut m,
        vec![
            Ok(calls(vec![call("a", "sh"), call("b", "ls")], StopReason::ToolCall)),
            Ok(text("done", StopReason::EndTurn)),
        ],
        |name| {
            ran.push(name.to_string());
            ok_tool(&format!("out of {name}"))
        },
    );
    assert_eq!(ran, ["sh", "ls"]);
    assert_eq!(n, 2);
    assert_eq!(o.exit_status, ExitStatus::Ok);
    assert_eq!(types(&events), ["inference", "tool_call", "tool_call", "inference"]);
    let roles: Vec<_> = m.messages().iter().map(|msg| msg.role).collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool, Role::Tool, Role::Assistant]);
    assert_eq!(m.messages()[2].tool_call_id.as_deref(), Some("a"));
    assert_eq!(m.messages()[3].tool_call_id.as_deref(), Some("b"));
    assert_eq!(m.messages()[3].text(), "out of ls");
    assert_eq!(m.counters().tool_calls, 2);
}

#[test]
fn a_reply_with_tool_calls_continues_whatever_its_stop_reason() {
    let mut m = machine(10);
    let (o, _, n) = drive(
        &mut m,
        vec![Ok(calls(vec![call("a", "sh")], StopReason::EndTurn)), Ok(text("done", StopReason::EndTurn))],
        ok_tool,
    );
    assert_eq!((o.exit_status, n), (ExitStatus::Ok, 2));
}

#[test]
fn tool_call_stop_without_tool_calls_fails() {
    let mut m = machine(10);
    let (o, events, n) = drive(&mut m, vec![Ok(text("", StopReason::ToolCall))], ok_tool);
    assert_eq!(o.exit_status, ExitStatus::Failed);
    assert_eq!(o.result, "error: stop_reason tool_call but the reply carries no tool calls");
    assert_eq!(n, 1);
    assert_eq!(types(&events), ["inference"]);
}

#[test]
fn unsupported_stop_reason_fails_with_its_name() {
    let mut m = machine(10);
    let (o, _, _) = drive(&mut m, vec![Ok(text("x", StopReason::Other("content_filter".into())))], ok_tool);
    assert_eq!(
        o,
        Outcome { exit_status: ExitStatus::Failed, result: "error: unsupported stop_reason 'content_filter'".into() }
    );
}

#[test]
fn in_band_error_fails_with_its_message() {
    let mut m = machine(10);
    let (o, _, _) = drive(&mut m, vec![Ok(text("", StopReason::Error("overloaded".into())))], ok_tool);
    assert_eq!(o, Outcome { exit_status: ExitStatus::Failed, result: "error: overloaded".into() });
}

#[test]
fn driver_error_fails_without_counting_a_turn() {
    let mut m = machine(10);
    let (o, events, _) = drive(&mut m, vec![Err("provider returned HTTP 401: bad key".into())], ok_tool);
    assert_eq!(
        o,
        Outcome { exit_status: ExitStatus::Failed, result: "error: provider returned HTTP 401: bad key".into() }
    );
    assert!(events.is_empty());
    assert_eq!(m.counters().turns, 0);
}

#[test]
fn turn_limit_allows_exactly_n_model_calls() {
    for limit in [1u32, 3] {
        let mut m = machine(limit);
        let (o, events, n) = drive(&mut m, vec![Ok(calls(vec![call("a", "sh")], StopReason::ToolCall))], ok_tool);
        assert_eq!(n, limit as usize, "limit {limit}");
        assert_eq!(o.exit_status, ExitStatus::MaxTurnsReached);
        assert_eq!(o.result, format!("error: inference loop exceeded {limit} turns"));
        assert_eq!(m.counters().turns, limit);
        let turns: Vec<u32> = events
            .iter()
            .filter_map(|e| if let Event::Inference { turn, .. } = e { Some(*turn) } else { None })
            .collect();
        assert_eq!(turns, (0..limit).collect::<Vec<_>>());
    }
}

#[test]
fn one_failing_call_among_several_fails_alone() {
    let mut m = machine(10);
    let (o, events, _) = drive(
        &mut m,
        vec![
            Ok(calls(vec![call("a", "sh"), call("b", "nope"), call("c", "sh")], StopReason::ToolCall)),
            Ok(text("done", StopReason::EndTurn)),
        ],
        |name| {
            if name == "nope" { ToolOutcome::error("unknown tool \"nope\"") } else { ok_tool("fine") }
        },
    );
    assert_eq!(o.exit_status, ExitStatus::Ok);
    let statuses: Vec<_> = events
        .iter()
        .filter_map(|e| if let Event::ToolCall { status, .. } = e { Some(*status) } else { None })
        .collect();
    assert_eq!(statuses, [CallStatus::Ok, CallStatus::Error, CallStatus::Ok]);
    let tool_msgs: Vec<_> = m.messages().iter().filter(|msg| msg.role == Role::Tool).collect();
    assert_eq!(tool_msgs.len(), 3);
    assert!(!tool_msgs[0].is_error && tool_msgs[1].is_error && !tool_msgs[2].is_error);
}

#[test]
fn shell_results_write_a_shell_line_after_the_tool_call_line() {
    let mut m = machine(10);
    let (_, events, _) = drive(
        &mut m,
        vec![Ok(calls(vec![call("a", "sh")], StopReason::ToolCall)), Ok(text("done", StopReason::EndTurn))],
        |_| ToolOutcome {
            text: "$ echo hi\nExit code: 0".into(),
            is_error: false,
            shell: Some(ShellRun {
                binary: "/bin/sh".into(),
                command: "echo hi".into(),
                exit_code: 0,
                stdout_bytes: 3,
                stderr_bytes: 0,
            }),
            detached: None,
            sandbox: None,
            mcp_server: None,
        },
    );
    assert_eq!(types(&events), ["inference", "tool_call", "shell", "inference"]);
    let Event::Shell { turn, binary, exit_code, stdout_bytes, duration_ms, .. } = &events[2] else { panic!() };
    assert_eq!((*turn, binary.as_str(), *exit_code, *stdout_bytes, *duration_ms), (0, "/bin/sh", 0, 3, 3));
    assert_eq!(m.counters().shell_calls, 1);
}

#[test]
fn a_detached_shell_result_writes_shell_detached_instead_of_shell_and_counts_one_shell_call() {
    let mut m = machine(10);
    let (_, events, _) = drive(
        &mut m,
        vec![Ok(calls(vec![call("a", "sh")], StopReason::ToolCall)), Ok(text("done", StopReason::EndTurn))],
        |_| ToolOutcome {
            text: "still running in the background as wrk_1 (sh: sleep 30)".into(),
            is_error: false,
            shell: None,
            detached: Some(DetachedWork {
                work_id: "wrk_1".into(),
                binary: "/bin/sh".into(),
                command: "sleep 30".into(),
                grace_ms: 10_000,
                running_ms: 10_002,
                output_path: "logs/wrk_1.log".into(),
            }),
            sandbox: None,
            mcp_server: None,
        },
    );
    assert_eq!(types(&events), ["inference", "tool_call", "shell_detached", "inference"]);
    assert_eq!(
        events[2],
        Event::ShellDetached {
            turn: 0,
            task_id: "tsk_1".into(),
            work_id: "wrk_1".into(),
            binary: "/bin/sh".into(),
            command: "sleep 30".into(),
            grace_ms: 10_000,
        }
    );
    let Event::ToolCall { status, .. } = &events[1] else { panic!() };
    assert_eq!(*status, CallStatus::Ok);
    assert_eq!((m.counters().tool_calls, m.counters().shell_calls), (1, 1));
    let Event::TaskEnd { shell_calls, .. } = m.task_end(1) else { panic!() };
    assert_eq!(shell_calls, 1);
}

#[test]
fn tokens_count_the_whole_request_and_session_tokens_is_this_turns_occupancy() {
    let mut m = machine(10);
    let user_json = serde_json::to_string(&Message::user("do it")).unwrap().len() as u64;
    let reply = calls(vec![call("a", "sh")], StopReason::ToolCall);
    let assistant_json = serde_json::to_string(&Message::assistant(reply.content.clone())).unwrap().len() as u64;
    let (events, _) = {
        m.start();
        m.on_model_reply(Ok(reply), 1)
    };
    let Event::Inference { input_tokens, output_tokens, .. } = &events[0] else { panic!() };
    assert_eq!(*input_tokens, 100 + user_json);
    assert_eq!(*output_tokens, assistant_json);
    assert_eq!(m.session_tokens(), 100 + user_json + assistant_json);
    let tool_json = serde_json::to_string(&Message::tool_result("a", "ok", false)).unwrap().len() as u64;
    m.on_tool_result(ok_tool("ok"), 1);
    let (events, _) = m.on_model_reply(Ok(text("end", StopReason::EndTurn)), 1);
    let Event::Inference { input_tokens, .. } = &events[0] else { panic!() };
    assert_eq!(*input_tokens, 100 + user_json + assistant_json + tool_json);
    assert_eq!(m.counters().input_tokens, 100 + user_json + 100 + user_json + assistant_json + tool_json);
}

#[test]
fn capture_decides_what_tool_call_lines_keep() {
    for (capture, has_input, has_output) in
        [(Capture::None, false, false), (Capture::Meta, true, false), (Capture::Content, true, true)]
    {
        let mut m = TaskMachine::new(task("t"), Vec::new(), 5, 0, capture, Arc::new(PerByte));
        m.start();
        m.on_model_reply(Ok(calls(vec![call("a", "sh")], StopReason::ToolCall)), 1);
        let (events, _) = m.on_tool_result(ok_tool("secret output"), 1);
        let Event::ToolCall { input, output, input_bytes, output_bytes, .. } = &events[0] else { panic!() };
        assert_eq!((input.is_some(), output.is_some()), (has_input, has_output), "{capture:?}");
        assert_eq!(*input_bytes, r#"{"command":"echo hi"}"#.len() as u64);
        assert_eq!(*output_bytes, "secret output".len() as u64);
    }
}

#[test]
fn task_end_reports_the_counters() {
    let mut m = machine(10);
    drive(
        &mut m,
        vec![Ok(calls(vec![call("a", "sh")], StopReason::ToolCall)), Ok(text("done", StopReason::EndTurn))],
        ok_tool,
    );
    let Event::TaskEnd { exit_status, turns, tool_calls, shell_calls, reopen_count, duration_ms, .. } = m.task_end(42)
    else {
        panic!()
    };
    assert_eq!(
        (exit_status, turns, tool_calls, shell_calls, reopen_count, duration_ms),
        (ExitStatus::Ok, 2, 1, 0, 0, 42)
    );
}

#[test]
fn prior_history_comes_before_the_task_message() {
    let m = TaskMachine::new(task("now"), vec![Message::user("earlier")], 5, 0, Capture::Meta, Arc::new(PerByte));
    let texts: Vec<_> = m.messages().iter().map(Message::text).collect();
    assert_eq!(texts, ["earlier", "now"]);
}

fn compacting(max_tokens: u64, threshold: f64) -> TaskMachine {
    machine(10).with_compaction(Some(CompactionRule { max_tokens, threshold }))
}

#[test]
fn crossing_the_threshold_compacts_before_the_tools_run() {
    let mut m = compacting(100, 0.5);
    m.start();
    let (events, action) = m.on_model_reply(Ok(calls(vec![call("a", "sh")], StopReason::ToolCall)), 1);
    assert_eq!(types(&events), ["inference"]);
    let Action::Compact { turn, session_tokens } = action else { panic!("{action:?}") };
    assert_eq!((turn, session_tokens), (0, m.session_tokens()));
    // No replacement: declined, and the tool still runs next; no turn consumed.
    let (events, action) = m.on_compaction(CompactionReply::NoReplacement);
    let Event::CompactionDeclined { reason, tokens, turn, .. } = &events[0] else { panic!() };
    assert_eq!((reason.as_str(), *tokens, *turn), ("no_hook_replacement", session_tokens, 0));
    assert!(matches!(action, Action::RunTool { .. }));
    assert_eq!(m.counters().turns, 1);
}

#[test]
fn a_final_reply_does_not_compact() {
    let mut m = compacting(10, 0.1);
    let (o, events, _) = drive(&mut m, vec![Ok(text("done", StopReason::EndTurn))], ok_tool);
    assert_eq!(o.exit_status, ExitStatus::Ok);
    assert_eq!(types(&events), ["inference"]);
}

#[test]
fn a_committed_replacement_recounts_tokens_on_the_new_history() {
    let mut m = compacting(1000, 0.1);
    m.start();
    let reply = calls(vec![call("a", "sh")], StopReason::ToolCall);
    let pending = Message::assistant(reply.content.clone());
    m.on_model_reply(Ok(reply), 1);
    let before = m.session_tokens();
    let epoch = m.history_epoch();
    let summary = Message::user("summary");
    let (events, action) = m.on_compaction(CompactionReply::Replaced(vec![summary.clone(), pending.clone()]));
    let after = 100
        + serde_json::to_string(&summary).unwrap().len() as u64
        + serde_json::to_string(&pending).unwrap().len() as u64;
    let Event::Compaction { tokens_before, tokens_after, .. } = &events[0] else { panic!("{events:?}") };
    assert_eq!((*tokens_before, *tokens_after), (before, after));
    assert_eq!(m.session_tokens(), after);
    assert_ne!(m.history_epoch(), epoch, "a replaced history has a new epoch");
    assert_eq!(m.messages().len(), 2);
    assert!(matches!(action, Action::RunTool { .. }), "the pending call still runs");
}

#[test]
fn a_replacement_dropping_the_pending_call_is_declined() {
    let mut m = compacting(1000, 0.1);
    m.start();
    m.on_model_reply(Ok(calls(vec![call("a", "sh")], StopReason::ToolCall)), 1);
    let (events, _) = m.on_compaction(CompactionReply::Replaced(vec![Message::user("summary")]));
    let Event::CompactionDeclined { reason, .. } = &events[0] else { panic!() };
    assert_eq!(reason, "unresolved_tool_call");
    assert_eq!(m.messages().len(), 2, "history unchanged");
}

fn finish_once(m: &mut TaskMachine) {
    let (o, _, _) = drive(m, vec![Ok(text("attempt", StopReason::EndTurn))], ok_tool);
    assert_eq!(o.exit_status, ExitStatus::Ok);
}

#[test]
fn a_granted_reopen_reruns_with_feedback_and_shares_the_turn_count() {
    let mut m = machine(10).with_reopens(1);
    finish_once(&mut m);
    let Reopen::Granted(event, action) = m.on_reopen_request("gate", "tests fail") else { panic!() };
    assert_eq!(
        *event,
        Event::TaskReopened {
            task_id: "tsk_1".into(),
            hook_name: "gate".into(),
            reason: "tests fail".into(),
            reopen_number: 1
        }
    );
    assert_eq!(action, Action::CallModel);
    assert_eq!(m.messages().len(), 1);
    assert_eq!(m.messages()[0].text(), "do it\n\n---\n## Reopen feedback\n\n### 1 (from hook gate)\ntests fail\n");
    let (events, _) = m.on_model_reply(Ok(text("again", StopReason::EndTurn)), 1);
    let Event::Inference { turn, .. } = &events[0] else { panic!() };
    assert_eq!(*turn, 1, "turns count across attempts");
    assert_eq!(m.counters().turns, 2);
    // The limit (1) is used up now.
    let Reopen::Exhausted(o) = m.on_reopen_request("gate", "still failing") else { panic!() };
    assert_eq!(o, Outcome { exit_status: ExitStatus::ReopenBudgetExhausted, result: "again".into() });
    let Event::TaskEnd { reopen_count, exit_status, .. } = m.task_end(1) else { panic!() };
    assert_eq!((reopen_count, exit_status), (1, ExitStatus::ReopenBudgetExhausted));
}

#[test]
fn reopen_limit_zero_exhausts_at_once() {
    let mut m = machine(10).with_reopens(0);
    finish_once(&mut m);
    assert!(matches!(m.on_reopen_request("gate", "no"), Reopen::Exhausted(_)));
    assert_eq!(m.reopen_count(), 0);
}

#[test]
fn a_used_up_turn_limit_exhausts_a_reopen() {
    let mut m = machine(1).with_reopens(3);
    finish_once(&mut m);
    let Reopen::Exhausted(o) = m.on_reopen_request("gate", "more") else { panic!() };
    assert_eq!(o.exit_status, ExitStatus::ReopenBudgetExhausted);
}

#[test]
fn a_reopened_attempt_keeps_the_head() {
    let mut m = TaskMachine::new(task("now"), vec![Message::user("seed")], 5, 0, Capture::Meta, Arc::new(PerByte))
        .with_reopens(1);
    finish_once(&mut m);
    m.on_reopen_request("gate", "again");
    assert_eq!(m.messages()[0].text(), "seed");
    assert_eq!(m.messages().len(), 2);
}

#[test]
fn history_epoch_is_non_zero_kept_across_appends_and_unique_per_history() {
    let mut a = machine(5);
    let b = machine(5);
    let epoch = a.history_epoch();
    assert_ne!(epoch, 0, "0 means unknown to drivers");
    assert_ne!(epoch, b.history_epoch(), "two tasks' histories never share an epoch");
    a.start();
    a.on_model_reply(Ok(calls(vec![call("c1", "sh")], StopReason::ToolCall)), 1);
    a.on_tool_result(ok_tool("hi"), 1);
    assert_eq!(a.messages().len(), 3);
    assert_eq!(a.history_epoch(), epoch, "appending keeps the epoch");
    // A clone may grow apart from its original, so it is another history.
    let history = History::default();
    assert_ne!(history.clone().epoch(), history.epoch());
}

/// Counts its calls, one token per byte.
#[derive(Default)]
struct CountingCalls(std::sync::atomic::AtomicUsize);
impl Estimator for CountingCalls {
    fn count(&self, text: &str) -> u64 {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        text.len() as u64
    }
}

#[test]
fn each_message_is_counted_once_the_reply_included() {
    let estimator = Arc::new(CountingCalls::default());
    let mut m = TaskMachine::new(task("do it"), Vec::new(), 10, 100, Capture::Meta, estimator.clone());
    let replies = vec![
        Ok(calls(vec![call("c1", "sh")], StopReason::ToolCall)),
        Ok(calls(vec![call("c2", "sh"), call("c3", "sh")], StopReason::ToolCall)),
        Ok(text("done", StopReason::EndTurn)),
    ];
    let (outcome, events, model_calls) = drive(&mut m, replies, |_| ok_tool("hi"));
    assert_eq!(outcome.exit_status, ExitStatus::Ok);
    assert_eq!(model_calls, 3);
    // user + 3 replies + 3 tool results; each reply's output_tokens is its history count.
    assert_eq!(m.messages().len(), 7);
    assert_eq!(estimator.0.load(std::sync::atomic::Ordering::Relaxed), 7);
    let outputs: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Inference { output_tokens, .. } => Some(*output_tokens),
            _ => None,
        })
        .collect();
    let replies: Vec<u64> = m
        .messages()
        .iter()
        .filter(|msg| msg.role == Role::Assistant)
        .map(|msg| serde_json::to_string(msg).unwrap().len() as u64)
        .collect();
    assert_eq!(outputs, replies);
}

/// Issue #28 item 4: a fixed part (1,000 tokens) alone over the threshold (50 of 100). The
/// first compaction commits but leaves the count over; the next check writes one
/// `compaction_declined` (`threshold_unreachable`) and calls no hook, later checks write
/// nothing, until the history alone outgrows the post-compaction count.
#[test]
fn a_compaction_that_cannot_get_under_the_threshold_is_not_repeated_until_the_history_outgrows_it() {
    let mut m = TaskMachine::new(task("do it"), Vec::new(), 40, 1000, Capture::Meta, Arc::new(PerByte))
        .with_compaction(Some(CompactionRule { max_tokens: 100, threshold: 0.5 }));
    let mut action = m.start();
    let mut log: Vec<(u32, &'static str, String)> = Vec::new();
    while m.counters().turns < 30 {
        action = match action {
            Action::CallModel => {
                let (events, next) = m.on_model_reply(Ok(calls(vec![call("a", "sh")], StopReason::ToolCall)), 1);
                for e in &events {
                    if let Event::CompactionDeclined { turn, reason, .. } = e {
                        log.push((*turn, "declined", reason.clone()));
                    }
                }
                next
            }
            Action::RunTool { .. } => m.on_tool_result(ok_tool("hi"), 1).1,
            Action::Compact { turn, .. } => {
                let keep = vec![Message::user("summary"), m.messages().last().unwrap().clone()];
                let (events, next) = m.on_compaction(CompactionReply::Replaced(keep));
                let Event::Compaction { tokens_after, .. } = &events[0] else { panic!("{events:?}") };
                log.push((turn, "compaction", tokens_after.to_string()));
                next
            }
            Action::Finish(o) => panic!("{o:?}"),
        };
    }
    // The history (about 200 tokens a turn) outgrows the 1,164 left after 6 turns: 5
    // compactions in 30 turns where every turn compacted before, one declined line each.
    let mut want = Vec::new();
    for turn in [0, 6, 12, 18, 24] {
        want.push((turn, "compaction", "1164".to_string()));
        want.push((turn + 1, "declined", "threshold_unreachable".to_string()));
    }
    assert_eq!(log, want);
}
