//! Hooks end to end (issue #4): real hook programs (small scripts) run by `mur run`, with
//! the exact trace lines each rule of the seeds produces — reopening, the seeding table,
//! the compaction outcomes, spend ceilings, staging checks and hook errors.

use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, event_types, mur, trace_lines};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Runs the capsule with `--task` and returns the run, its JSON line and the trace.
fn run(capsule: &TestCapsule, task: &str) -> (Run, Value, Vec<Value>, PathBuf) {
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(["--task", task, "--json"]));
    let json = run.last_json();
    let dir = PathBuf::from(json["session_dir"].as_str().unwrap_or_else(|| panic!("{run:?}")));
    let lines = trace_lines(&dir);
    (run, json, lines, dir)
}

fn of_type<'a>(lines: &'a [Value], ty: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["event_type"] == ty).collect()
}

/// A scripted capsule whose model answers `replies` (YAML list items) with `extra`
/// manifest text appended.
fn capsule(replies: &str, extra: &str, files: &[(&str, &str)]) -> TestCapsule {
    let manifest =
        format!("name: hooked\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n{extra}");
    let mut all = vec![("replies.yaml", replies)];
    all.extend_from_slice(files);
    TestCapsule::new(&manifest, &all)
}

/// The runtime's token estimate of a message (`BytesOver4` over its JSON).
fn tokens_of(text: &str) -> u64 {
    let json = serde_json::to_string(&mur_proto::message::Message::user(text)).unwrap();
    (json.len() as u64).div_ceil(4)
}

const ALWAYS_DONE: &str = "replies:\n  - text: attempt 1\n  - text: attempt 2\n  - text: attempt 3\n  - text: attempt 4\n  - text: attempt 5\n";

/// A gatekeeper that always asks to reopen, logging what it saw.
const REJECT_ALWAYS: &str = r#"#!/usr/bin/env python3
import json, sys
ev = json.load(sys.stdin)
with open("events.log", "a") as f:
    f.write(json.dumps(ev) + "\n")
print(json.dumps({"action": "reopen-task", "reason": "not good enough (attempt %d)" % ev["attempt"]}))
"#;

fn gate_manifest(limit: u32, max_turns: u32) -> String {
    format!(
        "  max_turns: {max_turns}\nlifecycle:\n  max_task_reopens: {limit}\nhooks:\n  - name: gate\n    binding: on-task-end\n    commit_policy: reopen-task\n    command: [./gate.py]\n"
    )
}

#[test]
fn reopen_limit_three_reopens_three_times_then_exhausts() {
    let c = capsule(ALWAYS_DONE, &gate_manifest(3, 10), &[("gate.py", REJECT_ALWAYS)]);
    let (run, json, lines, dir) = run(&c, "write the report");
    assert_ne!(run.code, 0);
    assert_eq!(json["exit_status"], "reopen_budget_exhausted");
    let reopened = of_type(&lines, "task_reopened");
    assert_eq!(reopened.len(), 3);
    for (i, r) in reopened.iter().enumerate() {
        assert_eq!(r["hook_name"], "gate");
        assert_eq!(r["reopen_number"], i as u64 + 1);
        assert_eq!(r["reason"], format!("not good enough (attempt {})", i + 1));
    }
    let end = of_type(&lines, "task_end")[0];
    assert_eq!((end["reopen_count"].as_u64(), end["turns"].as_u64()), (Some(3), Some(4)));
    assert_eq!(end["exit_status"], "reopen_budget_exhausted");
    assert_eq!(of_type(&lines, "task_start").len(), 1, "one task_start whatever the reopens");
    // The hook saw each attempt, numbered.
    let seen: Vec<Value> = std::fs::read_to_string(c.dir().join("events.log"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(seen.len(), 4);
    assert_eq!(seen[0]["event"], "on-task-end");
    assert_eq!(seen[0]["version"], 1);
    assert_eq!(seen[0]["hook"], "gate");
    assert_eq!((seen[0]["attempt"].as_u64(), seen[0]["reopen_count"].as_u64()), (Some(1), Some(0)));
    assert_eq!((seen[3]["attempt"].as_u64(), seen[3]["reopen_count"].as_u64()), (Some(4), Some(3)));
    assert_eq!(seen[3]["result"], "attempt 4");
    assert_eq!(seen[0]["exit_status"], "ok");
    assert_eq!(seen[0]["session_id"], lines[0]["session_id"]);
    assert_eq!(std::fs::read_to_string(dir.join("out/result.txt")).unwrap(), "attempt 4");
}

#[test]
fn reopen_limit_zero_ends_exhausted_without_a_reopen_line() {
    let c = capsule(ALWAYS_DONE, &gate_manifest(0, 10), &[("gate.py", REJECT_ALWAYS)]);
    let (_, json, lines, _) = run(&c, "t");
    assert_eq!(json["exit_status"], "reopen_budget_exhausted");
    assert!(of_type(&lines, "task_reopened").is_empty());
    assert_eq!(of_type(&lines, "task_end")[0]["reopen_count"], 0);
    assert_eq!(of_type(&lines, "inference").len(), 1);
}

#[test]
fn reopen_limit_one_feeds_the_reason_back_into_the_task() {
    // The second attempt's model sees the feedback: the scripted reply echoes the task.
    let replies = "replies:\n  - text: first\n  - text: \"second saw: {{task}}\"\n";
    let gate = "#!/bin/sh\nif [ -f approved ]; then echo '{\"action\":\"none\"}'; else touch approved; echo '{\"action\":\"reopen-task\",\"reason\":\"add tests\"}'; fi\n";
    let c = capsule(replies, &gate_manifest(1, 10), &[("gate.sh", gate)]);
    let manifest = std::fs::read_to_string(c.dir().join("murmur.yaml")).unwrap().replace("./gate.py", "./gate.sh");
    std::fs::write(c.dir().join("murmur.yaml"), manifest).unwrap();
    let (run, json, lines, _) = run(&c, "write code");
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(
        json["result"],
        "second saw: write code\n\n---\n## Reopen feedback\n\n### 1 (from hook gate)\nadd tests\n"
    );
    assert_eq!(
        event_types(&lines),
        ["session_start", "task_start", "inference", "task_reopened", "inference", "task_end", "session_end"]
    );
    assert_eq!(of_type(&lines, "task_end")[0]["reopen_count"], 1);
}

#[test]
fn reopening_shares_the_turn_budget() {
    let c = capsule(ALWAYS_DONE, &gate_manifest(5, 2), &[("gate.py", REJECT_ALWAYS)]);
    let (_, json, lines, _) = run(&c, "t");
    assert_eq!(json["exit_status"], "reopen_budget_exhausted");
    assert_eq!(of_type(&lines, "inference").len(), 2, "two turns in all, not two per attempt");
    assert_eq!(of_type(&lines, "task_reopened").len(), 1);
    assert_eq!(of_type(&lines, "task_end")[0]["turns"], 2);
}

// ---- Context seeding: each row of the seed's table, in order.

/// A seed hook proposing `texts` as user messages.
fn seeder(texts: &[String]) -> String {
    let msgs: Vec<Value> = texts.iter().map(|t| serde_json::json!({"role": "user", "content": t})).collect();
    format!(
        "#!/bin/sh\ncat > seen-task-start.json\ncat <<'EOF'\n{}\nEOF\n",
        serde_json::json!({"action": "seed-context", "messages": msgs})
    )
}

fn seed_manifest(context: &str, compaction_hook: bool) -> String {
    let mut m = format!(
        "{context}hooks:\n  - name: memory\n    binding: on-task-start\n    commit_policy: seed-context\n    command: [./seed.sh]\n"
    );
    if compaction_hook {
        m.push_str("  - name: squash\n    binding: on-compaction\n    commit_policy: replace-context\n    command: [./squash.py]\n");
    }
    m
}

const SQUASH: &str = r#"#!/usr/bin/env python3
import json, sys
ev = json.load(sys.stdin)
with open("squash-events.log", "a") as f:
    f.write(json.dumps(ev) + "\n")
print(json.dumps({"action": "replace-context", "messages": [{"role": "user", "content": "short summary"}]}))
"#;

/// Runs a seeding case; returns the `context_seed` line.
fn seed_case(
    context: &str,
    texts: &[String],
    compaction_hook: bool,
    process: bool,
) -> (Value, Vec<Value>, TestCapsule) {
    let seed = seeder(texts);
    let c = if process {
        TestCapsule::new(
            &format!(
                "name: seeded\nversion: 1\ninference:\n  transport: process\n  command: [./agent.sh]\n{}",
                seed_manifest(context, false)
            ),
            &[("seed.sh", &seed), ("agent.sh", "#!/bin/sh\ncat\n")],
        )
    } else {
        capsule(
            "replies:\n  - text: done\n",
            &seed_manifest(context, compaction_hook),
            &[("seed.sh", &seed), ("squash.py", SQUASH)],
        )
    };
    let (run, json, lines, _) = run(&c, "the task");
    assert_eq!(json["exit_status"], "ok", "a seed never fails the task: {run:?}");
    let seeds = of_type(&lines, "context_seed");
    assert_eq!(seeds.len(), 1, "{lines:?}");
    (seeds[0].clone(), lines, c)
}

fn x(n: usize) -> String {
    "x".repeat(n)
}

/// A text whose message is estimated at exactly `tokens` tokens.
fn sized(tokens: u64) -> String {
    let base = serde_json::to_string(&mur_proto::message::Message::user("")).unwrap().len();
    let s = x(tokens as usize * 4 - base);
    assert_eq!(tokens_of(&s), tokens);
    s
}

#[test]
fn seed_under_the_process_transport_is_rejected() {
    let (s, _, _) = seed_case("context:\n  max_tokens: 1000\n", &[x(10)], false, true);
    assert_eq!((s["outcome"].as_str(), s["reason"].as_str()), (Some("rejected"), Some("unsupported_transport")));
    assert_eq!(s["tokens"], 0);
}

#[test]
fn seed_without_context_max_tokens_is_rejected() {
    let (s, lines, c) = seed_case("", &[x(10)], false, false);
    assert_eq!((s["outcome"].as_str(), s["reason"].as_str()), (Some("rejected"), Some("no_budget")));
    assert_eq!(s["budget_tokens"], 0);
    let err = of_type(&lines, "hook_dispatch_error");
    assert_eq!((err[0]["hook_name"].as_str(), err[0]["arm"].as_str()), (Some("memory"), Some("seed-rejected")));
    let seen: Value =
        serde_json::from_str(&std::fs::read_to_string(c.dir().join("seen-task-start.json")).unwrap()).unwrap();
    assert_eq!(seen["event"], "on-task-start");
    assert_eq!(seen["budget_tokens"], 0);
    assert!(seen["task_id"].as_str().unwrap().starts_with("tsk_"));
    assert!(seen["context_id"].as_str().unwrap().starts_with("ctx_"));
}

#[test]
fn seed_with_one_message_wider_than_the_ceiling_is_rejected() {
    // ceiling floor(1000 × 0.10) = 100 tokens
    let (s, _, c) = seed_case("context:\n  max_tokens: 1000\n", &[x(500)], false, false);
    assert_eq!((s["outcome"].as_str(), s["reason"].as_str()), (Some("rejected"), Some("message_over_budget")));
    assert_eq!(s["budget_tokens"], 100);
    assert_eq!(s["proposed_tokens"], tokens_of(&x(500)));
    let seen: Value =
        serde_json::from_str(&std::fs::read_to_string(c.dir().join("seen-task-start.json")).unwrap()).unwrap();
    assert_eq!((seen["budget_tokens"].as_u64(), seen["context_window"].as_u64()), (Some(100), Some(1000)));
}

#[test]
fn seed_more_than_three_times_over_is_rejected() {
    // five messages of ~90 tokens = ~450 > 100 + 3 × 100
    let texts: Vec<String> = (0..5).map(|_| x(300)).collect();
    let (s, _, _) = seed_case("context:\n  max_tokens: 1000\n", &texts, true, false);
    assert_eq!((s["outcome"].as_str(), s["reason"].as_str()), (Some("rejected"), Some("overflow_over_limit")));
}

#[test]
fn seed_that_fits_is_seeded_whole_ahead_of_the_task() {
    let texts = vec!["remember a".to_string(), "remember b".to_string()];
    let (s, lines, _) = seed_case("context:\n  max_tokens: 1000\n", &texts, false, false);
    assert_eq!(s["outcome"], "seeded");
    assert!(s.get("reason").is_none());
    assert_eq!(s["messages"], 2);
    assert_eq!(s["tokens"], tokens_of("remember a") + tokens_of("remember b"));
    assert_eq!(s["proposed_tokens"], s["tokens"]);
    // The seed is counted in the first request: input tokens include both messages.
    let first = of_type(&lines, "inference")[0]["input_tokens"].as_u64().unwrap();
    assert!(first > s["tokens"].as_u64().unwrap());
}

#[test]
fn seed_over_by_no_more_than_the_margin_is_trimmed() {
    // ceiling 100; two messages of 55 tokens = 110: over by 10 = margin 10% of 100
    let a = sized(55);
    let (s, _, _) = seed_case("context:\n  max_tokens: 1000\n", &[a.clone(), a], true, false);
    assert_eq!(
        (s["outcome"].as_str(), s["messages"].as_u64(), s["tokens"].as_u64()),
        (Some("trimmed"), Some(1), Some(55))
    );
}

#[test]
fn seed_over_by_more_with_a_compaction_hook_is_summarised_first() {
    let a = sized(40);
    // three of 40 = 120: over by 20 > margin 10 → the front is summarised
    let (s, _, c) = seed_case("context:\n  max_tokens: 1000\n", &[a.clone(), a.clone(), a], true, false);
    assert_eq!(s["outcome"], "compacted");
    assert_eq!(s["messages"], 3, "summary + the two that fit");
    assert_eq!(s["tokens"], tokens_of("short summary") + 80);
    let ev: Value = serde_json::from_str(
        std::fs::read_to_string(c.dir().join("squash-events.log")).unwrap().lines().next().unwrap(),
    )
    .unwrap();
    assert_eq!(ev["event"], "on-compaction");
    assert_eq!(ev["messages"].as_array().unwrap().len(), 1, "only the overflowing front");
    assert!(ev["seed_budget_tokens"].is_u64());
}

#[test]
fn seed_over_by_more_without_a_compaction_hook_is_trimmed() {
    let a = sized(40);
    let (s, _, _) = seed_case("context:\n  max_tokens: 1000\n", &[a.clone(), a.clone(), a], false, false);
    assert_eq!(
        (s["outcome"].as_str(), s["messages"].as_u64(), s["tokens"].as_u64()),
        (Some("trimmed"), Some(2), Some(80))
    );
}

#[test]
fn a_reopened_attempt_gets_the_same_seed_without_asking_again() {
    let seed = seeder(&["remember".to_string()])
        .replace("cat > seen-task-start.json", "cat >> seen-task-start.json; echo >> seen-task-start.json");
    let extra = format!(
        "context:\n  max_tokens: 1000\nlifecycle:\n  max_task_reopens: 1\n{}  - name: gate\n    binding: on-task-end\n    commit_policy: reopen-task\n    command: [./gate.py]\n",
        seed_manifest("", false)
    );
    let c = capsule(ALWAYS_DONE, &extra, &[("seed.sh", &seed), ("gate.py", REJECT_ALWAYS)]);
    let (_, _, lines, _) = run(&c, "t");
    assert_eq!(of_type(&lines, "context_seed").len(), 1);
    let asked = std::fs::read_to_string(c.dir().join("seen-task-start.json")).unwrap();
    assert_eq!(asked.lines().filter(|l| !l.trim().is_empty()).count(), 1);
    let inputs: Vec<u64> = of_type(&lines, "inference").iter().map(|l| l["input_tokens"].as_u64().unwrap()).collect();
    assert_eq!(inputs.len(), 2);
}

// ---- Compaction: each row of the outcomes table.

/// A capsule whose context is tiny, so every turn crosses the threshold.
fn compacting(hooks: &str, files: &[(&str, &str)], extra_inference: &str) -> TestCapsule {
    let replies = "replies:\n  - tool_calls: [{ name: sh, input: { command: 'echo one' } }]\n  - tool_calls: [{ name: sh, input: { command: 'echo two' } }]\n  - text: finished\n";
    capsule(
        replies,
        &format!("{extra_inference}context:\n  max_tokens: 100\ncapabilities:\n  shell:\n    allow: [sh]\n{hooks}"),
        files,
    )
}

#[test]
fn no_compaction_hook_declines_and_the_session_goes_on() {
    let c = compacting("", &[], "");
    let (run, json, lines, _) = run(&c, "t");
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(json["result"], "finished");
    let declined = of_type(&lines, "compaction_declined");
    assert_eq!(declined.len(), 2);
    assert_eq!((declined[0]["turn"].as_u64(), declined[0]["reason"].as_str()), (Some(0), Some("no_hook_replacement")));
    assert_eq!(declined[1]["turn"], 1);
    assert_eq!(
        event_types(&lines)[..6],
        ["session_start", "task_start", "inference", "compaction_declined", "tool_call", "shell"],
        "compaction is checked before the tools run"
    );
    assert_eq!(of_type(&lines, "inference").len(), 3, "compaction never consumes a turn");
}

const KEEP_TAIL: &str = r#"#!/usr/bin/env python3
import json, sys
ev = json.load(sys.stdin)
msgs = ev["messages"]
# keep the last assistant message (its calls are about to run), summarise the rest
print(json.dumps({"action": "replace-context", "messages": [{"role": "user", "content": "summary"}, msgs[-1]]}))
"#;

const DROP_ALL: &str = "#!/bin/sh\ncat >/dev/null\necho '{\"action\":\"replace-context\",\"messages\":[{\"role\":\"user\",\"content\":\"summary\"}]}'\n";

fn compaction_hook(script: &str) -> String {
    format!(
        "hooks:\n  - name: squash\n    binding: on-compaction\n    commit_policy: replace-context\n    command: [{script}]\n"
    )
}

#[test]
fn a_committed_compaction_replaces_the_history_and_recounts() {
    let c = compacting(
        &compaction_hook("./squash.py"),
        &[("squash.py", KEEP_TAIL)],
        "  compaction:\n    dump_summaries: true\n",
    );
    let (run, _, lines, dir) = run(&c, "t");
    assert_eq!(run.code, 0, "{run:?}");
    let done = of_type(&lines, "compaction");
    // The 100-token context stays over the threshold after the first compaction, so the
    // next turn declines (`threshold_unreachable`, issue #28 item 4) instead of compacting
    // again.
    assert_eq!(done.len(), 1);
    assert_eq!(done[0]["turn"], 0);
    let declined = of_type(&lines, "compaction_declined");
    assert_eq!(declined.len(), 1);
    assert_eq!(
        (declined[0]["turn"].as_u64(), declined[0]["reason"].as_str()),
        (Some(1), Some("threshold_unreachable"))
    );
    // Recounted on the new history: the task message "t" was replaced by "summary", the
    // pending assistant message kept, so the count moves by exactly that difference.
    let (before, after) = (done[0]["tokens_before"].as_i64().unwrap(), done[0]["tokens_after"].as_i64().unwrap());
    assert_eq!(after - before, tokens_of("summary") as i64 - tokens_of("t") as i64);
    // The next request carries the compacted history: its input equals tokens_after plus the
    // tool result appended since.
    let inputs: Vec<u64> = of_type(&lines, "inference").iter().map(|l| l["input_tokens"].as_u64().unwrap()).collect();
    assert!(inputs[1] > done[0]["tokens_after"].as_u64().unwrap());
    let dump = std::fs::read_to_string(dir.join("out/compaction-summaries.jsonl")).unwrap();
    assert_eq!(dump.lines().count(), 1);
    let first: Value = serde_json::from_str(dump.lines().next().unwrap()).unwrap();
    assert_eq!(first["summary"].as_str().unwrap().lines().next(), Some("summary"));
}

#[test]
fn a_replacement_that_orphans_a_tool_call_is_declined() {
    let c = compacting(&compaction_hook("./squash.sh"), &[("squash.sh", DROP_ALL)], "");
    let (run, _, lines, _) = run(&c, "t");
    assert_eq!(run.code, 0, "{run:?}");
    let declined = of_type(&lines, "compaction_declined");
    assert_eq!(declined[0]["reason"], "unresolved_tool_call");
    assert!(of_type(&lines, "compaction").is_empty());
}

#[test]
fn a_compaction_hook_error_fails_the_session() {
    let c = compacting(
        &compaction_hook("./squash.sh"),
        &[("squash.sh", "#!/bin/sh\ncat >/dev/null\necho 'summariser crashed' >&2\nexit 4\n")],
        "",
    );
    let (run, json, lines, dir) = run(&c, "t");
    assert_eq!(run.code, 1);
    assert_eq!(json["exit_status"], "failed");
    let result = std::fs::read_to_string(dir.join("out/result.txt")).unwrap();
    assert_eq!(result, "error: compaction hook failed: hook exited with code 4: summariser crashed");
    assert_eq!(of_type(&lines, "inference").len(), 1, "no further turns run");
    assert!(of_type(&lines, "tool_call").is_empty());
    assert_eq!(lines.last().unwrap()["exit_status"], "failed");
    let log = std::fs::read_to_string(dir.join("logs/hook-squash.log")).unwrap();
    assert!(log.contains("summariser crashed"), "{log}");
}

/// A compaction hook that asks the runtime for a model call far over the ceiling, and
/// fails when refused.
const GREEDY: &str = r#"#!/usr/bin/env python3
import json, os, sys, urllib.request, urllib.error
json.load(sys.stdin)
body = json.dumps({"messages": [{"role": "user", "content": "x" * 100000}]}).encode()
req = urllib.request.Request(os.environ["MURMUR_INFERENCE_URL"], data=body, headers={"content-type": "application/json"})
try:
    urllib.request.urlopen(req)
except urllib.error.HTTPError as e:
    sys.stderr.write("refused: %s\n" % e.read().decode())
    sys.exit(1)
print(json.dumps({"action": "none"}))
"#;

#[test]
fn a_compaction_hook_refused_by_the_spend_ceiling_ends_the_session_spend_ceiling_reached() {
    let c = compacting(&compaction_hook("./greedy.py"), &[("greedy.py", GREEDY)], "  max_session_tokens: 5000\n");
    let (run, json, lines, dir) = run(&c, "t");
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(json["exit_status"], "spend_ceiling_reached");
    let result = std::fs::read_to_string(dir.join("out/result.txt")).unwrap();
    assert!(result.starts_with("stopped: spend ceiling reached: "), "{result}");
    let refused = of_type(&lines, "spend_ceiling_reached");
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0]["origin"], "hook:squash");
    assert_eq!(refused[0]["ceiling_tokens"], 5000);
    assert_eq!(lines.last().unwrap()["exit_status"], "spend_ceiling_reached");
}

#[test]
fn the_loops_own_call_over_the_ceiling_is_refused_before_it_is_sent() {
    let c = capsule("replies:\n  - text: never\n", "  max_session_tokens: 10\n", &[]);
    let (_, json, lines, _) = run(&c, "t");
    assert_eq!(json["exit_status"], "spend_ceiling_reached");
    assert!(of_type(&lines, "inference").is_empty());
    assert_eq!(of_type(&lines, "spend_ceiling_reached")[0]["origin"], "loop");
}

// ---- Staging checks and hook errors.

#[test]
fn staging_checks_refuse_before_the_session_starts() {
    let c = capsule(
        ALWAYS_DONE,
        "hooks:\n  - name: gate\n    binding: on-inference\n    commit_policy: reopen-task\n    command: [./gate.py]\n",
        &[("gate.py", REJECT_ALWAYS)],
    );
    let run = Run::of(mur().arg("run").arg(c.dir()).args(["--task", "t"]));
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("hooks[0].commit_policy: hook \"gate\" (binding on-inference, commit_policy reopen-task): binding on-inference can only honour none"),
        "{}",
        run.stderr
    );
    assert!(!c.workdir().exists());
}

#[test]
fn a_failing_hook_is_logged_and_traced_and_the_session_goes_on() {
    let c = capsule(
        "replies:\n  - text: fine\n",
        "hooks:\n  - name: noisy\n    binding: on-inference\n    command: [./noisy.sh]\n  - name: chatty\n    binding: on-inference\n    command: [./chatty.sh]\n",
        &[
            ("noisy.sh", "#!/bin/sh\necho 'boom' >&2\nexit 2\n"),
            ("chatty.sh", "#!/bin/sh\necho '{\"action\":\"reopen-task\",\"reason\":\"x\"}'\n"),
        ],
    );
    let (run, json, lines, dir) = run(&c, "t");
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(json["result"], "fine");
    let errs = of_type(&lines, "hook_dispatch_error");
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert_eq!(
        (errs[0]["hook_name"].as_str(), errs[0]["event"].as_str(), errs[0]["arm"].as_str()),
        (Some("noisy"), Some("on-inference"), Some("error"))
    );
    assert_eq!(
        (errs[1]["hook_name"].as_str(), errs[1]["arm"].as_str()),
        (Some("chatty"), Some("reopen-task")),
        "an answer the binding does not honour is reported and ignored"
    );
    assert!(std::fs::read_to_string(dir.join("logs/hook-noisy.log")).unwrap().contains("boom"));
}

#[test]
fn the_gatekeeper_and_memory_examples_run() {
    let gate = TestCapsule::example("gatekeeper");
    let run = Run::of(mur().arg("run").arg(gate.dir()).arg("--json"));
    assert_eq!(run.code, 0, "{run:?}");
    let json = run.last_json();
    let lines = trace_lines(Path::new(json["session_dir"].as_str().unwrap()));
    assert_eq!(of_type(&lines, "task_reopened").len(), 1);
    assert_eq!(of_type(&lines, "task_end")[0]["reopen_count"], 1);

    let memory = TestCapsule::example("memory");
    let wd = tempfile::tempdir().unwrap();
    let first = Run::of(
        mur().arg("run").arg(memory.dir()).args(["--task", "echo first", "--json", "--workdir"]).arg(wd.path()),
    );
    assert_eq!(first.code, 0, "{first:?}");
    let second = Run::of(
        mur().arg("run").arg(memory.dir()).args(["--task", "echo second", "--json", "--workdir"]).arg(wd.path()),
    );
    let lines = trace_lines(Path::new(second.last_json()["session_dir"].as_str().unwrap()));
    let seed = of_type(&lines, "context_seed");
    assert_eq!((seed[0]["outcome"].as_str(), seed[0]["messages"].as_u64()), (Some("seeded"), Some(1)));
}

#[test]
fn the_reopen_limit_is_fresh_for_every_task_of_a_queue_session() {
    // Two tasks in one queue session; the gate rejects each task's first attempt once.
    let gate = "#!/usr/bin/env python3\nimport json, os, sys\nev = json.load(sys.stdin)\nseen = 'seen-' + ev['task_id']\nif os.path.exists(seen):\n    print('{\"action\": \"none\"}')\nelse:\n    open(seen, 'w').close()\n    print(json.dumps({'action': 'reopen-task', 'reason': 'once more'}))\n";
    let extra = "lifecycle:\n  task_acceptance: queue\n  after_task: exit\n  queue_depth: 5\n  max_task_reopens: 1\nhooks:\n  - name: gate\n    binding: on-task-end\n    commit_policy: reopen-task\n    command: [./gate.py]\n";
    // The first reply is slow, so the second task arrives while the first runs.
    let replies = "replies:\n  - text: a\n    delay_ms: 3000\n  - text: b\n  - text: c\n  - text: d\n";
    let c = capsule(replies, extra, &[("gate.py", gate)]);
    let mut bg = mur_tests::mur::Background::spawn(mur().arg("run").arg(c.dir()).args(["--json", "--task", "first"]));
    let start = bg.next_json(std::time::Duration::from_secs(30));
    let url = start["url"].as_str().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(mur_a2a::client::Client::new(url).send("second", &Default::default())).unwrap();
    let last = bg.next_json(std::time::Duration::from_secs(30));
    let lines = trace_lines(Path::new(last["session_dir"].as_str().unwrap()));
    let ends: Vec<(String, u64)> = of_type(&lines, "task_end")
        .iter()
        .map(|l| (l["exit_status"].as_str().unwrap().to_string(), l["reopen_count"].as_u64().unwrap()))
        .collect();
    assert_eq!(ends, [("ok".to_string(), 1), ("ok".to_string(), 1)], "each task had its own reopen");
}
