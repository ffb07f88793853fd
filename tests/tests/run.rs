//! `mur run` end to end: the built binary, example capsules with the scripted driver, real
//! shell commands, and the exact trace they leave.

use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, event_types, mur, trace_lines};
use serde_json::Value;
use std::collections::HashSet;
use std::path::PathBuf;

fn run_json(capsule: &TestCapsule, extra: &[&str]) -> (Run, Value, PathBuf) {
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(extra).arg("--json"));
    let json = run.last_json();
    let dir = PathBuf::from(json["session_dir"].as_str().expect("session_dir"));
    (run, json, dir)
}

/// Checks the header rules every trace obeys (checklist T1, T15, T9).
fn check_trace_invariants(lines: &[Value]) {
    let session = lines[0]["session_id"].as_str().unwrap();
    assert!(session.starts_with("ses_") && session.len() == 36, "{session}");
    let mut seen = HashSet::new();
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["session_id"], session, "line {i}");
        assert!(l["timestamp"].as_u64().unwrap() > 1_600_000_000_000, "line {i}: timestamp in ms");
        let id = l["event_id"].as_str().unwrap();
        assert!(id.starts_with("evt_") && id.len() == 36, "{id}");
        match l["parent_id"].as_str() {
            None => assert_eq!(
                (i, l["event_type"].as_str()),
                (0, Some("session_start")),
                "only session_start has no parent"
            ),
            Some(p) => assert!(seen.contains(p), "line {i}: parent {p} is not an earlier line"),
        }
        assert!(seen.insert(id.to_string()), "duplicate event id {id}");
    }
    let sum =
        |ty: &str, k: &str| lines.iter().filter(|l| l["event_type"] == ty).map(|l| l[k].as_u64().unwrap()).sum::<u64>();
    let end = lines.last().unwrap();
    assert_eq!(end["event_type"], "session_end");
    assert_eq!(end["total_turns"].as_u64().unwrap(), sum("task_end", "turns"));
    assert_eq!(end["total_input_tokens"].as_u64().unwrap(), sum("task_end", "input_tokens"));
    assert_eq!(end["total_output_tokens"].as_u64().unwrap(), sum("task_end", "output_tokens"));
    assert_eq!(end["total_tool_calls"].as_u64().unwrap(), sum("task_end", "tool_calls"));
    assert_eq!(end["total_shell_calls"].as_u64().unwrap(), sum("task_end", "shell_calls"));
    let count = |ty: &str| lines.iter().filter(|l| l["event_type"] == ty).count() as u64;
    assert_eq!(end["total_turns"].as_u64().unwrap(), count("inference"));
    assert_eq!(end["total_tool_calls"].as_u64().unwrap(), count("tool_call"));
    assert_eq!(end["total_shell_calls"].as_u64().unwrap(), count("shell"));
}

#[test]
fn hello_example_runs_a_command_and_reports_its_output() {
    let capsule = TestCapsule::example("hello");
    let (run, json, dir) = run_json(&capsule, &[]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(json["exit_status"], "ok");
    let result = std::fs::read_to_string(dir.join("out/result.txt")).unwrap();
    assert_eq!(result, json["result"].as_str().unwrap());
    assert!(result.contains("hello from murmur"), "{result}");
    assert!(
        result.starts_with("$ echo \"hello from murmur\"\n\nExit code: 0\nStdout:\nhello from murmur\n"),
        "{result}"
    );
    assert!(dir.starts_with(capsule.workdir()), "{dir:?}");
    assert!(dir.join("MURMUR.md").is_file());

    let lines = trace_lines(&dir);
    check_trace_invariants(&lines);
    assert_eq!(
        event_types(&lines),
        [
            "session_start",
            "task_start",
            "inference",
            "tool_call",
            "shell",
            "sandbox",
            "inference",
            "task_end",
            "session_end"
        ]
    );
    let start = &lines[0];
    assert_eq!(start["capsule_name"], "hello");
    assert_eq!(start["capsule_version"], "1.0.0");
    assert_eq!(start["driver"], "scripted");
    assert_eq!(start["max_turns"], 5);
    assert_eq!(start["tools_declared"], serde_json::json!(["sh"]));
    assert_eq!(start["system_prompt_source"], "manifest");
    let task = &lines[1];
    assert_eq!(task["source"], "task_md");
    assert_eq!((task["origin"].as_str(), task["lane"].as_str()), (Some("user"), Some("user")));
    assert_eq!(task["message_parts_bytes"], "echo \"hello from murmur\"\n".len());
    assert_eq!(
        (lines[2]["turn"].as_u64(), lines[2]["decision"].as_str(), lines[2]["tool_name"].as_str()),
        (Some(0), Some("tool_call"), Some("sh"))
    );
    assert_eq!(lines[3]["tool_name"], "sh");
    assert_eq!(lines[3]["status"], "ok");
    assert_eq!(lines[3]["input"], serde_json::json!({"command": "echo \"hello from murmur\"\n"}));
    assert!(lines[3].get("output").is_none(), "output is not captured by default");
    assert_eq!(lines[3]["parent_id"], lines[2]["event_id"]);
    assert_eq!(lines[4]["exit_code"], 0);
    assert_eq!(lines[4]["stdout_bytes"], "hello from murmur\n".len());
    assert!(lines[4]["binary"].as_str().unwrap().ends_with("/sh"), "{}", lines[4]["binary"]);
    // The example is sandboxed: its rules follow the command's line.
    assert_eq!((lines[5]["tool_name"].as_str(), lines[5]["network"].as_str()), (Some("sh"), Some("none")));
    assert_eq!(lines[5]["cpu_secs"], 600);
    assert_eq!(lines[5]["parent_id"], lines[2]["event_id"]);
    assert_eq!((lines[6]["turn"].as_u64(), lines[6]["decision"].as_str()), (Some(1), Some("end_turn")));
    assert!(lines[6]["tool_name"].is_null());
    let end = &lines[7];
    assert_eq!(
        (end["exit_status"].as_str(), end["turns"].as_u64(), end["tool_calls"].as_u64()),
        (Some("ok"), Some(2), Some(1))
    );
    assert_eq!((end["shell_calls"].as_u64(), end["reopen_count"].as_u64()), (Some(1), Some(0)));
    assert_eq!(end["parent_id"], task["event_id"]);
    assert_eq!(lines[8]["exit_status"], "ok");
    for l in &lines {
        if l["event_type"] == "inference" {
            for k in ["input_tokens_actual", "output_tokens_actual", "cached_tokens", "cache_write_tokens"] {
                assert!(l.get(k).is_none(), "{k} must be absent when the provider reports no usage");
            }
        }
    }
}

#[test]
fn turn_limit_example_makes_exactly_three_model_calls() {
    let capsule = TestCapsule::example("turn-limit");
    let (run, json, dir) = run_json(&capsule, &[]);
    assert_ne!(run.code, 0);
    assert_eq!(json["exit_status"], "max_turns_reached");
    assert_eq!(std::fs::read_to_string(dir.join("out/result.txt")).unwrap(), "error: inference loop exceeded 3 turns");
    let lines = trace_lines(&dir);
    check_trace_invariants(&lines);
    assert_eq!(lines.iter().filter(|l| l["event_type"] == "inference").count(), 3);
    let end = lines.iter().find(|l| l["event_type"] == "task_end").unwrap();
    assert_eq!(end["exit_status"], "max_turns_reached");
    assert_eq!(lines.last().unwrap()["exit_status"], "max_turns_reached");
}

#[test]
fn two_tools_in_one_turn_run_in_order() {
    let capsule = TestCapsule::example("two-tools");
    let (run, json, dir) = run_json(&capsule, &[]);
    assert_eq!(run.code, 0, "{run:?}");
    let lines = trace_lines(&dir);
    check_trace_invariants(&lines);
    let calls: Vec<_> = lines
        .iter()
        .filter(|l| l["event_type"] == "tool_call")
        .map(|l| (l["turn"].as_u64().unwrap(), l["tool_name"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(calls, [(0, "sh".to_string()), (0, "ls".to_string())]);
    let result = json["result"].as_str().unwrap();
    assert!(result.contains("notes.txt"), "ls ran after sh wrote the file: {result}");
}

#[test]
fn task_flag_takes_text_or_a_file() {
    let capsule = TestCapsule::example("hello");
    let (_, json, _) = run_json(&capsule, &["--task", "echo from-the-flag"]);
    assert!(json["result"].as_str().unwrap().contains("from-the-flag"));
    let file = capsule.dir().join("other-task.txt");
    std::fs::write(&file, "echo from-a-file").unwrap();
    let (_, json, dir) = run_json(&capsule, &["--task", file.to_str().unwrap()]);
    assert!(json["result"].as_str().unwrap().contains("from-a-file"));
    assert_eq!(trace_lines(&dir)[1]["source"], "cli");
}

/// A `task.md` that is a folder is an error naming it, not a launch without a task (which
/// would wait for messages for ever).
#[test]
fn a_task_md_that_is_a_folder_is_an_error() {
    let capsule = TestCapsule::example("hello");
    let _ = std::fs::remove_file(capsule.dir().join("task.md"));
    std::fs::create_dir(capsule.dir().join("task.md")).unwrap();
    // Under `timeout`: the old behaviour waits for ever.
    let run =
        Run::of(std::process::Command::new("timeout").arg("60").arg(mur().get_program()).arg("run").arg(capsule.dir()));
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains(&format!("reading {}", capsule.dir().join("task.md").display())), "{}", run.stderr);
}

#[test]
fn workdir_flag_puts_sessions_under_dot_murmur() {
    let capsule = TestCapsule::example("hello");
    let wd = tempfile::tempdir().unwrap();
    let (run, json, dir) = run_json(&capsule, &["--workdir", wd.path().to_str().unwrap()]);
    assert_eq!(run.code, 0, "{run:?}");
    let sid = json["session_id"].as_str().unwrap();
    assert_eq!(dir, wd.path().join(".murmur").join(sid));
    assert!(
        dir.join("trace.jsonl").is_file() && dir.join("out/result.txt").is_file() && dir.join("MURMUR.md").is_file()
    );
    // A second session shares the workdir.
    let (_, json2, dir2) = run_json(&capsule, &["--workdir", wd.path().to_str().unwrap()]);
    assert_ne!(json2["session_id"], json["session_id"]);
    assert_eq!(dir2.parent(), dir.parent());
}

#[test]
fn running_out_of_scripted_replies_fails_the_task_and_still_ends_the_session() {
    let capsule = TestCapsule::new(
        "name: short\nversion: 0.1.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n",
        &[("r.yaml", "replies:\n  - tool_calls: [{ name: sh, input: { command: 'true' } }]\n")],
    );
    let (run, json, dir) = run_json(&capsule, &["--task", "go"]);
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(json["exit_status"], "failed");
    assert_eq!(
        std::fs::read_to_string(dir.join("out/result.txt")).unwrap(),
        "error: scripted driver: no reply left for model call 2 (the script has 1 replies)"
    );
    let lines = trace_lines(&dir);
    check_trace_invariants(&lines);
    assert_eq!(
        event_types(&lines),
        ["session_start", "task_start", "inference", "tool_call", "shell", "task_end", "session_end"]
    );
    assert_eq!(lines[6]["exit_status"], "failed");
}

#[test]
fn unknown_tools_and_refused_binaries_get_error_results_and_the_loop_goes_on() {
    let capsule = TestCapsule::new(
        "name: refuse\nversion: 0.1.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n",
        &[(
            "r.yaml",
            "replies:\n  - tool_calls:\n      - { name: rm, input: { command: '-rf /tmp/nothing' } }\n      - { name: sh, input: { command: 'echo still here' } }\n  - text: \"{{tool_result}}\"\n",
        )],
    );
    let (run, json, dir) = run_json(&capsule, &["--task", "go"]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(json["result"].as_str().unwrap().contains("still here"));
    let lines = trace_lines(&dir);
    let statuses: Vec<_> = lines
        .iter()
        .filter(|l| l["event_type"] == "tool_call")
        .map(|l| l["status"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(statuses, ["error", "ok"]);
}

#[test]
fn a_bad_manifest_is_refused_with_the_field_and_rule_and_nothing_is_written() {
    let capsule = TestCapsule::new(
        "name: bad\nversion: 1\ninference:\n  driver: scripted\n  script: r.yaml\n  max_turns: 0\n",
        &[],
    );
    let run = Run::of(mur().arg("run").arg(capsule.dir()));
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("inference.max_turns: must be at least 1, got 0"), "{}", run.stderr);
    assert!(!capsule.workdir().exists(), "no session folder for a refused manifest");
}

#[test]
fn trace_steps_prints_one_row_per_turn() {
    let capsule = TestCapsule::example("hello");
    let (_, json, _) = run_json(&capsule, &[]);
    let sid = json["session_id"].as_str().unwrap();
    let wd = capsule.workdir();
    let steps = Run::of(mur().args(["trace", "steps", "--json", "--workdir"]).arg(&wd));
    assert_eq!(steps.code, 0, "{steps:?}");
    let v = steps.last_json();
    assert_eq!(v["session_id"], sid);
    assert_eq!(v["turns"], 2);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows[0]["kind"], "task");
    assert_eq!((rows[0]["lane"].as_str(), rows[0]["origin"].as_str()), (Some("user"), Some("user")));
    assert_eq!((rows[1]["decision"].as_str(), rows[1]["tool"].as_str()), (Some("tool_call"), Some("sh")));
    assert!(rows[1]["tool_ms"].is_u64());
    assert_eq!((rows[2]["decision"].as_str(), rows[2]["tool"].is_null()), (Some("end_turn"), true));

    let text = Run::of(mur().args(["trace", "steps", &sid[sid.len() - 6..], "--workdir"]).arg(&wd));
    assert_eq!(text.code, 0, "{text:?}");
    assert!(text.stdout.starts_with(&format!("Session {sid}  (2 turns)\n")), "{}", text.stdout);
    assert!(text.stdout.contains("end_turn") && text.stdout.contains("—"), "{}", text.stdout);

    let show = Run::of(mur().args(["trace", "show", "--json", "--workdir"]).arg(&wd));
    let v = show.last_json();
    assert_eq!(
        (v["exit_status"].as_str(), v["turns"].as_u64(), v["tool_calls"].as_u64()),
        (Some("ok"), Some(2), Some(1))
    );

    let missing = Run::of(mur().args(["trace", "steps", "nope", "--workdir"]).arg(&wd));
    assert_ne!(missing.code, 0);
    assert!(missing.stderr.contains("no session matching \"nope\""), "{}", missing.stderr);
}
