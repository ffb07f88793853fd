//! Model calls against what third-party servers really send (issue #28): parallel tool
//! calls in every streamed and whole-reply shape, streams that break, stall, trickle, end
//! early, carry malformed chunks or lines past the cap, in-stream provider errors, error
//! bodies of both providers, and the key of the output cap. Every test drives the real
//! driver (or `mur run`) against the testkit's fake servers over real sockets.

use mur_proto::message::{Block, Message};
use mur_tests::capsule::TestCapsule;
use mur_tests::fake_anthropic::{AnthropicReply, FakeAnthropic, event_frame, streamed_text_events};
use mur_tests::fake_openai::{FakeOpenAi, FakeReply, sse_frame};
use mur_tests::mur::{Run, event_types, mur, trace_lines};
use mur_worker::driver::anthropic::{self, Anthropic};
use mur_worker::driver::http::Policy;
use mur_worker::driver::openai::{self, MaxTokensParam, OpenAi};
use mur_worker::driver::{Driver, Error, ModelRequest, ProviderError, StopReason, ToolSpec};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn policy(max_retries: u32, timeout_ms: u64, idle_ms: u64) -> Policy {
    Policy {
        max_retries,
        timeout: Duration::from_millis(timeout_ms),
        idle_timeout: Duration::from_millis(idle_ms),
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(20),
    }
}

fn openai_driver(fake: &FakeOpenAi, stream: bool, policy: Policy) -> OpenAi {
    OpenAi::new(openai::Config {
        endpoint: fake.url(),
        api_key: None,
        stream,
        policy,
        max_tokens_param: MaxTokensParam::MaxTokens,
    })
}

fn anthropic_driver(fake: &FakeAnthropic, policy: Policy) -> Anthropic {
    Anthropic::new(anthropic::Config {
        endpoint: fake.url(),
        api_key: None,
        model: Some("claude-fake".into()),
        stream: true,
        policy,
    })
}

fn request<'a>(messages: &'a [Message], tools: &'a [ToolSpec]) -> ModelRequest<'a> {
    ModelRequest { model: "fake-model", system: "", messages, history_epoch: 0, tools, max_tokens: 64, task_text: "" }
}

fn call(id: &str, name: &str, input: Value) -> Block {
    Block::ToolCall { id: id.into(), name: name.into(), input }
}

fn chunk(delta: Value, finish_reason: Value) -> Value {
    json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})
}

fn piece(index: u64, id: Option<&str>, name: Option<&str>, arguments: &str) -> Value {
    let mut function = json!({"arguments": arguments});
    if let Some(name) = name {
        function["name"] = json!(name);
    }
    let mut p = json!({"index": index, "function": function});
    if let Some(id) = id {
        p["id"] = json!(id);
        p["type"] = json!("function");
    }
    p
}

/// A streamed reply: one chunk per tool-call piece, then `finish_reason: tool_calls`.
fn streamed_calls(pieces: &[Value]) -> FakeReply {
    let mut chunks: Vec<Value> = pieces.iter().map(|p| chunk(json!({"tool_calls": [p]}), Value::Null)).collect();
    chunks.push(chunk(json!({}), json!("tool_calls")));
    FakeReply::Stream(chunks)
}

/// The shapes of issue #28 item 1, as (label, pieces, the calls murmur must see).
fn shapes() -> Vec<(&'static str, Vec<Value>, Vec<Block>)> {
    let a = json!({"command": "echo a"});
    let b = json!({"command": "echo b"});
    vec![
        (
            "ids present, distinct indexes",
            vec![
                piece(0, Some("call_x"), Some("sh"), "{\"command\": \"echo a\"}"),
                piece(1, Some("call_y"), Some("sh"), "{\"command\": \"echo b\"}"),
            ],
            vec![call("call_x", "sh", a.clone()), call("call_y", "sh", b.clone())],
        ),
        (
            "ids absent, distinct indexes",
            vec![
                piece(0, None, Some("sh"), "{\"command\": \"echo a\"}"),
                piece(1, None, Some("sh"), "{\"command\": \"echo b\"}"),
            ],
            vec![call("call_0", "sh", a.clone()), call("call_1", "sh", b.clone())],
        ),
        (
            "ids absent, one index",
            vec![
                piece(0, None, Some("sh"), "{\"command\": \"echo a\"}"),
                piece(0, None, Some("sh"), "{\"command\": \"echo b\"}"),
                piece(0, None, Some("read"), "{\"path\": \"x\"}"),
            ],
            vec![
                call("call_0", "sh", a.clone()),
                call("call_1", "sh", b.clone()),
                call("call_2", "read", json!({"path": "x"})),
            ],
        ),
        (
            "one call's arguments over many deltas",
            vec![
                piece(0, Some("call_z"), Some("sh"), ""),
                piece(0, None, None, "{\"comm"),
                piece(0, None, None, "and\": "),
                piece(0, None, None, "\"echo"),
                piece(0, None, None, " a\"}"),
            ],
            vec![call("call_z", "sh", a.clone())],
        ),
    ]
}

#[tokio::test]
async fn streamed_parallel_tool_calls_come_apart_in_every_shape() {
    let shapes = shapes();
    let fake = FakeOpenAi::start(shapes.iter().map(|(_, pieces, _)| streamed_calls(pieces)).collect());
    let driver = openai_driver(&fake, true, Policy::default());
    let messages = [Message::user("run both")];
    for (label, _, want) in shapes {
        let r = driver.call(&request(&messages, &[])).await.unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(r.content, want, "{label}");
        assert_eq!(r.stop, StopReason::ToolCall, "{label}");
    }
}

#[tokio::test]
async fn whole_reply_parallel_tool_calls_come_apart_in_every_shape() {
    let shapes = shapes();
    // A whole reply lists each call once: the streamed pieces of one call are joined here
    // into one entry, the others are taken as sent (index and all).
    let replies = shapes
        .iter()
        .map(|(label, pieces, _)| {
            let entries: Vec<Value> = if label.starts_with("one call's") {
                vec![piece(0, Some("call_z"), Some("sh"), "{\"command\": \"echo a\"}")]
            } else {
                pieces.clone()
            };
            FakeReply::Json(json!({
                "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "tool_calls",
                             "message": {"role": "assistant", "content": null, "tool_calls": entries}}],
            }))
        })
        .collect();
    let fake = FakeOpenAi::start(replies);
    let driver = openai_driver(&fake, false, Policy::default());
    let messages = [Message::user("run both")];
    for (label, _, want) in shapes {
        let r = driver.call(&request(&messages, &[])).await.unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(r.content, want, "{label}");
    }
}

fn openai_capsule(url: &str, extra: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: remote\nversion: 0.1.0\ninference:\n  driver: openai\n  endpoint: {url}\n  model: fake-model\n{extra}"
        ),
        &[],
    )
}

fn anthropic_capsule(url: &str, extra: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: remote\nversion: 0.1.0\ninference:\n  driver: anthropic\n  endpoint: {url}\n  model: claude-fake\n{extra}"
        ),
        &[],
    )
}

async fn run(capsule: &TestCapsule) -> (Run, Value, PathBuf) {
    let dir = capsule.dir().to_path_buf();
    let run =
        tokio::task::spawn_blocking(move || Run::of(mur().arg("run").arg(&dir).args(["--task", "say hi", "--json"])))
            .await
            .unwrap();
    let json = run.last_json();
    let session_dir = PathBuf::from(json["session_dir"].as_str().unwrap());
    (run, json, session_dir)
}

/// `(attempt, status, error)` of each `model_attempt` line.
fn attempts(lines: &[Value]) -> Vec<(u64, Option<u64>, Option<String>)> {
    lines
        .iter()
        .filter(|l| l["event_type"] == "model_attempt")
        .map(|l| (l["attempt"].as_u64().unwrap(), l["status"].as_u64(), l["error"].as_str().map(str::to_string)))
        .collect()
}

fn text_chunk(text: &str) -> Value {
    chunk(json!({"content": text}), Value::Null)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_that_breaks_ends_early_or_is_malformed_is_retried_whole() {
    let fake = FakeOpenAi::start(vec![
        FakeReply::Drop(vec![sse_frame(&text_chunk("hel"))]),
        FakeReply::Raw(vec![sse_frame(&text_chunk("hel"))]),
        FakeReply::Raw(vec![sse_frame(&text_chunk("hel")), b"data: {\"choices\": [\n\n".to_vec()]),
        FakeReply::Stream(vec![text_chunk("hello"), chunk(json!({}), json!("stop"))]),
    ]);
    let capsule = openai_capsule(&fake.url(), "  stream: true\n  max_retries: 3\n");
    let (run, json, dir) = run(&capsule).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(json["result"], "hello");
    let lines = trace_lines(&dir);
    assert_eq!(
        event_types(&lines),
        [
            "session_start",
            "task_start",
            "model_attempt",
            "model_attempt",
            "model_attempt",
            "model_attempt",
            "inference",
            "task_end",
            "session_end"
        ]
    );
    let log = attempts(&lines);
    assert_eq!((log[0].0, log[0].1), (1, Some(200)), "{log:?}");
    let broke = log[0].2.as_deref().unwrap();
    assert_eq!(broke, "connection to the provider failed: the stream broke: error decoding response body");
    assert_eq!(
        log[1..],
        [
            (
                2,
                Some(200),
                Some(
                    "malformed provider response: the stream ended before data: [DONE] and without a finish_reason"
                        .into()
                )
            ),
            (
                3,
                Some(200),
                Some("malformed provider response: a streamed chunk is not JSON (EOF while parsing a list at line 1 column 13)".into())
            ),
            (4, Some(200), None),
        ]
    );
    // Each attempt sent the same request: nothing of a failed stream reached the history.
    let sent = fake.requests();
    assert_eq!(sent.len(), 4);
    assert!(sent.iter().all(|b| *b == sent[0]), "{sent:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn spent_retries_on_a_broken_stream_fail_the_task() {
    let fake = FakeOpenAi::start(vec![
        FakeReply::Raw(vec![sse_frame(&text_chunk("hel"))]),
        FakeReply::Raw(vec![sse_frame(&text_chunk("hel"))]),
        FakeReply::text("never asked"),
    ]);
    let capsule = openai_capsule(&fake.url(), "  stream: true\n  max_retries: 1\n");
    let (run, json, dir) = run(&capsule).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(json["exit_status"], "failed");
    let result = std::fs::read_to_string(dir.join("out/result.txt")).unwrap();
    assert_eq!(
        result,
        "error: malformed provider response: the stream ended before data: [DONE] and without a finish_reason"
    );
    assert_eq!(attempts(&trace_lines(&dir)).len(), 2);
    assert_eq!(fake.served(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_overloaded_error_mid_stream_is_retried_with_a_model_attempt_line_each() {
    let usage = json!({"input_tokens": 10, "output_tokens": 1});
    let mut cut = streamed_text_events("hel", usage.clone(), 1);
    cut.truncate(3);
    cut.push((
        "error".into(),
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    ));
    let fake = FakeAnthropic::start(vec![
        AnthropicReply::Sse(cut),
        // Truncated: no message_stop.
        AnthropicReply::Raw(vec![event_frame(
            "message_start",
            &json!({"type": "message_start", "message": {"usage": usage}}),
        )]),
        AnthropicReply::streamed_text("hello", usage.clone(), 2),
    ]);
    let capsule = anthropic_capsule(&fake.url(), "  stream: true\n  max_retries: 2\n");
    let (run, json, dir) = run(&capsule).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(json["result"], "hello");
    assert_eq!(
        attempts(&trace_lines(&dir)),
        [
            (1, Some(200), Some("the provider reported an error: overloaded_error: Overloaded".into())),
            (2, Some(200), Some("malformed provider response: stream ended before message_stop".into())),
            (3, Some(200), None),
        ]
    );
    assert_eq!(fake.requests().len(), 3);
}

#[tokio::test]
async fn a_stalled_stream_fails_its_attempt_at_the_idle_timeout_and_is_retried() {
    let fake = FakeOpenAi::start(vec![
        FakeReply::Stall(vec![sse_frame(&text_chunk("hel"))]),
        FakeReply::Stream(vec![text_chunk("hello"), chunk(json!({}), json!("stop"))]),
    ]);
    let driver = openai_driver(&fake, true, policy(1, 8_000, 1_000));
    let started = Instant::now();
    let (reply, log) = driver.call_logged(&request(&[Message::user("x")], &[])).await;
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    assert_eq!(reply.unwrap().content, [Block::Text { text: "hello".into() }]);
    let errors: Vec<_> = log.iter().map(|a| (a.status, a.error.clone())).collect();
    assert_eq!(
        errors,
        [
            (Some(200), Some("the provider sent nothing for 1 s (inference.idle_timeout_secs)".into())),
            (Some(200), None)
        ]
    );
    assert!(log[0].duration_ms >= 1_000, "{log:?}");

    // The anthropic driver, the same way.
    let usage = json!({"input_tokens": 10, "output_tokens": 1});
    let fake = FakeAnthropic::start(vec![
        AnthropicReply::Stall(vec![event_frame(
            "message_start",
            &json!({"type": "message_start", "message": {"usage": usage}}),
        )]),
        AnthropicReply::streamed_text("hello", usage.clone(), 2),
    ]);
    let driver = anthropic_driver(&fake, policy(1, 8_000, 1_000));
    let started = Instant::now();
    let (reply, log) = driver.call_logged(&request(&[Message::user("x")], &[])).await;
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    assert_eq!(reply.unwrap().content, [Block::Text { text: "hello".into() }]);
    let errors: Vec<_> = log.iter().map(|a| (a.status, a.error.clone())).collect();
    assert_eq!(
        errors,
        [
            (Some(200), Some("the provider sent nothing for 1 s (inference.idle_timeout_secs)".into())),
            (Some(200), None)
        ]
    );
}

#[tokio::test]
async fn a_trickling_stream_is_cut_at_the_whole_call_deadline() {
    // A comment every 200 ms: never idle for 1 s, never done.
    let trickle = || FakeReply::Trickle(b": still thinking\n\n".to_vec(), Duration::from_millis(200));
    let fake = FakeOpenAi::start(vec![trickle(), trickle()]);
    let driver = openai_driver(&fake, true, policy(1, 2_000, 1_000));
    let started = Instant::now();
    let (reply, log) = driver.call_logged(&request(&[Message::user("x")], &[])).await;
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_secs(4) && elapsed < Duration::from_secs(7), "{elapsed:?}");
    assert_eq!(reply.unwrap_err().to_string(), "model call timed out after 2 s");
    let errors: Vec<_> = log.iter().map(|a| (a.number, a.error.clone())).collect();
    assert_eq!(
        errors,
        [(1, Some("model call timed out after 2 s".into())), (2, Some("model call timed out after 2 s".into()))]
    );
}

#[tokio::test]
async fn a_line_past_the_cap_fails_naming_the_limit_and_is_not_retried() {
    // A valid chunk of 9 MiB, one line: past the 8 MiB line limit.
    let big = sse_frame(&text_chunk(&"x".repeat(9 << 20)));
    let fake = FakeOpenAi::start(vec![
        FakeReply::Raw(vec![big.clone(), b"data: [DONE]\n\n".to_vec()]),
        FakeReply::text("never asked"),
    ]);
    let driver = openai_driver(&fake, true, policy(3, 30_000, 30_000));
    let (reply, log) = driver.call_logged(&request(&[Message::user("x")], &[])).await;
    let want = "the provider's stream broke a limit: an SSE line is longer than the 8388608-byte line limit";
    assert_eq!(reply.unwrap_err().to_string(), want);
    assert_eq!(log.len(), 1);
    assert_eq!(fake.served(), 1);

    // An event of many lines past the 16 MiB event limit, on the anthropic driver.
    let line = format!("data: {}\n", "y".repeat(4 << 20)).into_bytes();
    let fake = FakeAnthropic::start(vec![AnthropicReply::Raw(vec![line; 5])]);
    let driver = anthropic_driver(&fake, policy(3, 30_000, 30_000));
    let err = driver.call(&request(&[Message::user("x")], &[])).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "the provider's stream broke a limit: an SSE event is larger than the 16777216-byte event limit"
    );
    assert_eq!(fake.requests().len(), 1);
}

#[tokio::test]
async fn error_bodies_of_both_providers_are_parsed_the_same_way() {
    let openai_body = r#"{"error": {"message": "Rate limit reached for gpt-4o", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}"#;
    let fake = FakeOpenAi::start(vec![FakeReply::Status(400, openai_body.into())]);
    let err =
        openai_driver(&fake, false, Policy::default()).call(&request(&[Message::user("x")], &[])).await.unwrap_err();
    let Error::Status { status, body, provider } = err else { panic!("a status error: {err}") };
    assert_eq!(status, 400);
    assert_eq!(body, "requests: Rate limit reached for gpt-4o (code rate_limit_exceeded)");
    assert_eq!(
        provider,
        Some(Box::new(ProviderError {
            kind: Some("requests".into()),
            message: "Rate limit reached for gpt-4o".into(),
            code: Some("rate_limit_exceeded".into()),
        }))
    );

    let fake = FakeAnthropic::start(vec![AnthropicReply::Status(
        400,
        "invalid_request_error".into(),
        "max_tokens: 100000 > 64000".into(),
    )]);
    let err = anthropic_driver(&fake, Policy::default()).call(&request(&[Message::user("x")], &[])).await.unwrap_err();
    let Error::Status { status, body, provider } = err else { panic!("a status error: {err}") };
    assert_eq!(status, 400);
    assert_eq!(body, "invalid_request_error: max_tokens: 100000 > 64000");
    assert_eq!(
        provider,
        Some(Box::new(ProviderError {
            kind: Some("invalid_request_error".into()),
            message: "max_tokens: 100000 > 64000".into(),
            code: None,
        }))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_output_cap_goes_under_the_key_the_manifest_picks() {
    let fake = FakeOpenAi::start(vec![FakeReply::text("a"), FakeReply::text("b")]);
    let picked = openai_capsule(&fake.url(), "  max_tokens: 300\n  max_tokens_param: max_completion_tokens\n");
    let (run1, _, _) = run(&picked).await;
    assert_eq!(run1.code, 0, "{run1:?}");
    // A local server without the key: max_tokens, the default off api.openai.com.
    let default = openai_capsule(&fake.url(), "  max_tokens: 300\n");
    let (run2, _, _) = run(&default).await;
    assert_eq!(run2.code, 0, "{run2:?}");
    let sent = fake.requests();
    assert_eq!((sent[0].get("max_completion_tokens"), sent[0].get("max_tokens")), (Some(&json!(300)), None));
    assert_eq!((sent[1].get("max_completion_tokens"), sent[1].get("max_tokens")), (None, Some(&json!(300))));
}

/// A compaction hook that keeps the last assistant message (its calls are about to run)
/// after a one-line summary, and counts its calls in `hook-calls.log`.
const KEEP_TAIL: &str = r#"#!/usr/bin/env python3
import json, sys
ev = json.load(sys.stdin)
with open("hook-calls.log", "a") as f:
    f.write("%d\n" % ev["turn"])
msgs = ev["messages"]
print(json.dumps({"action": "replace-context", "messages": [{"role": "user", "content": "summary"}, msgs[-1]]}))
"#;

fn tool_call_reply(i: u32) -> FakeReply {
    FakeReply::Json(json!({
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": format!("call_{i}"), "type": "function",
                            "function": {"name": "sh", "arguments": format!("{{\"command\": \"echo {i}\"}}")}}]}}],
    }))
}

/// Issue #28 item 4: a system prompt alone over `threshold × context.max_tokens` (about
/// 4,500 tokens against 980). Six tool-call turns, then a final text: the old loop
/// compacted after each of the six (each hook call leaving the count over); now the first
/// compaction commits, the next turn writes one `compaction_declined` with reason
/// `threshold_unreachable`, and no other compaction fires, since the history never outgrows
/// what the first left. `mur run` warns at load.
#[tokio::test(flavor = "multi_thread")]
async fn a_compaction_that_cannot_get_under_the_threshold_runs_once_not_every_turn() {
    let mut replies: Vec<FakeReply> = (0..6).map(tool_call_reply).collect();
    replies.push(FakeReply::text("finished"));
    let fake = FakeOpenAi::start(replies);
    let prompt = "lorem ipsum dolor sit amet ".repeat(700);
    let capsule = TestCapsule::new(
        &format!(
            "name: remote\nversion: 0.1.0\ninference:\n  driver: openai\n  endpoint: {}\n  model: fake-model\n  \
             system_prompt: \"{prompt}\"\ncontext:\n  max_tokens: 1000\ncapabilities:\n  shell:\n    allow: [sh]\n\
             hooks:\n  - name: squash\n    binding: on-compaction\n    commit_policy: replace-context\n    \
             command: [./squash.py]\n",
            fake.url()
        ),
        &[("squash.py", KEEP_TAIL)],
    );
    let (run, json, dir) = run(&capsule).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(json["result"], "finished");
    let lines = trace_lines(&dir);
    let of = |t: &str| lines.iter().filter(|l| l["event_type"] == t).cloned().collect::<Vec<_>>();
    assert_eq!(of("inference").len(), 7);
    let compactions = of("compaction");
    assert_eq!(compactions.len(), 1, "{compactions:?}");
    assert_eq!(compactions[0]["turn"], 0);
    let declined = of("compaction_declined");
    assert_eq!(declined.len(), 1, "{declined:?}");
    assert_eq!(
        (declined[0]["turn"].as_u64(), declined[0]["reason"].as_str()),
        (Some(1), Some("threshold_unreachable"))
    );
    let hook_calls = std::fs::read_to_string(capsule.dir().join("hook-calls.log")).unwrap();
    assert_eq!(hook_calls, "0\n");
    assert!(
        run.stderr.contains(
            "capsule remote: the system prompt and tool specs alone are about \
             "
        ) && run.stderr.contains("compaction cannot bring the context under it"),
        "{}",
        run.stderr
    );
    assert_eq!(fake.served(), 7);
}
