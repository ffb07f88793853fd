//! Detached shell commands and resume (issue #6), end to end with `mur run`: the handle,
//! the completion task in the same context, `shell_abandoned`, and the loss report of a
//! resume after `mur run` was killed.

use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Background, Run, mur, trace_lines};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(40);

fn of_type<'a>(lines: &'a [Value], ty: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["event_type"] == ty).collect()
}

/// A command the test leaves running, killed by the test itself when it is dropped (an
/// assertion that fails included): the command writes its shell's pid to a file first
/// (`echo $$ > FILE`), and its process group — the shell tool starts each command in a
/// group of its own, led by that shell — is killed by that pid. Never by name: on a shared
/// machine `pkill -f "sleep 30"` kills other people's processes too.
struct Leftover {
    dir: tempfile::TempDir,
}

impl Leftover {
    fn new() -> Leftover {
        Leftover { dir: tempfile::tempdir().unwrap() }
    }

    /// `command`, prefixed with the line that writes its pid.
    fn command(&self, command: &str) -> String {
        format!("echo $$ > {}; {command}", self.dir.path().join("pid").display())
    }

    /// The shell's pid, once it has written it.
    fn pid(&self) -> i32 {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(pid) =
                std::fs::read_to_string(self.dir.path().join("pid")).ok().and_then(|s| s.trim().parse().ok())
            {
                return pid;
            }
            assert!(std::time::Instant::now() < deadline, "the command never wrote its pid");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process is still there.
    fn alive(&self) -> bool {
        // SAFETY: kill(2) with signal 0 only checks that the process exists.
        unsafe { libc::kill(self.pid(), 0) == 0 }
    }
}

impl Drop for Leftover {
    fn drop(&mut self) {
        let Some(pid) =
            std::fs::read_to_string(self.dir.path().join("pid")).ok().and_then(|s| s.trim().parse::<i32>().ok())
        else {
            return;
        };
        // SAFETY: signals to the process (group) this test's command started; getpgid only reads.
        unsafe {
            if libc::getpgid(pid) == pid {
                libc::killpg(pid, libc::SIGKILL);
            } else {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

fn capsule(lifecycle: &str, replies: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: bgwork\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\nlifecycle:\n  shell_grace_secs: 1\n{lifecycle}"
        ),
        &[("r.yaml", replies)],
    )
}

#[test]
fn a_long_command_returns_a_handle_and_comes_back_as_a_completion_task_in_its_context() {
    let replies = "replies:\n  - tool_calls: [{ name: sh, input: { command: 'sleep 3; echo $((6*7))-printed' } }]\n  - text: \"started: {{tool_result}}\"\n  - text: \"heard back: {{task}}\"\n";
    let c = capsule("  task_acceptance: queue\n  after_task: sleep\n", replies);
    let started = std::time::Instant::now();
    let mut bg =
        Background::spawn(mur().arg("run").arg(c.dir()).args(["--json", "--task", "build it", "--idle-exit", "5"]));
    let _ = bg.next_json(WAIT);
    let last = bg.next_json(WAIT);
    assert!(started.elapsed() >= Duration::from_secs(3), "the completion came after the command ended");
    assert_eq!(last["tasks"], 2);
    let lines = trace_lines(Path::new(last["session_dir"].as_str().unwrap()));
    let types: Vec<&str> = lines.iter().map(|l| l["event_type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        [
            "session_start",
            "task_start",
            "inference",
            "tool_call",
            "shell_detached",
            "inference",
            "task_end",
            "shell_completed",
            "task_start",
            "inference",
            "task_end",
            "session_end"
        ]
    );
    let detached = of_type(&lines, "shell_detached")[0];
    let work_id = detached["work_id"].as_str().unwrap();
    assert!(work_id.starts_with("wrk_") && work_id.len() == 36, "{work_id}");
    assert_eq!((detached["turn"].as_u64(), detached["grace_ms"].as_u64()), (Some(0), Some(1000)));
    assert_eq!(detached["command"], "sleep 3; echo $((6*7))-printed");
    let completed = of_type(&lines, "shell_completed")[0];
    assert_eq!(completed["work_id"], work_id);
    assert_eq!((completed["exit_code"].as_i64(), completed["status"].as_str()), (Some(0), Some("ok")));
    assert_eq!(completed["output_path"], format!("logs/{work_id}.log"));
    let starts = of_type(&lines, "task_start");
    assert_eq!(completed["completion_task_id"], starts[1]["task_id"]);
    assert_eq!(
        (starts[1]["origin"].as_str(), starts[1]["lane"].as_str(), starts[1]["source"].as_str()),
        (Some("completion"), Some("bg"), Some("detached_shell"))
    );
    assert_eq!(
        starts[1]["context_id"], starts[0]["context_id"],
        "the result rejoins the conversation that asked for it"
    );
    assert_eq!(of_type(&lines, "task_end")[0]["shell_calls"], 1, "a detached command counts as one shell call");
    // The first turn got the handle, not the output; the completion task names the log, not the output.
    let result = last["result"].as_str().unwrap();
    assert!(result.starts_with("heard back: "), "{result}");
    assert!(result.contains(work_id) && !result.contains("42-printed"), "{result}");
    // Without --workdir the session folder is the workdir: the log is under its logs/.
    let log =
        std::fs::read_to_string(Path::new(last["session_dir"].as_str().unwrap()).join(format!("logs/{work_id}.log")))
            .unwrap();
    assert!(log.contains("42-printed"), "{log}");
    assert_eq!(bg.wait(WAIT).0, Some(0));
}

#[test]
fn two_detached_commands_each_get_their_own_completion() {
    let replies = "replies:\n  - tool_calls:\n      - { name: sh, input: { command: 'sleep 2; echo one' } }\n      - { name: sh, input: { command: 'sleep 2; exit 3' } }\n  - text: both started\n  - text: \"a: {{task}}\"\n  - text: \"b: {{task}}\"\n";
    let c = capsule("  task_acceptance: queue\n  after_task: sleep\n", replies);
    let mut bg = Background::spawn(mur().arg("run").arg(c.dir()).args(["--json", "--task", "go", "--idle-exit", "5"]));
    let _ = bg.next_json(WAIT);
    let last = bg.next_json(WAIT);
    assert_eq!(last["tasks"], 3);
    let lines = trace_lines(Path::new(last["session_dir"].as_str().unwrap()));
    let done = of_type(&lines, "shell_completed");
    assert_eq!(done.len(), 2);
    let mut codes: Vec<i64> = done.iter().map(|d| d["exit_code"].as_i64().unwrap()).collect();
    codes.sort();
    assert_eq!(codes, [0, 3], "a failure takes the same path as a success");
    assert_eq!(of_type(&lines, "shell_detached").len(), 2);
}

#[test]
fn under_single_exit_a_running_command_is_abandoned_in_the_trace_and_on_stderr() {
    let leftover = Leftover::new();
    let replies = format!(
        "replies:\n  - tool_calls: [{{ name: sh, input: {{ command: '{}' }} }}]\n  - text: leaving\n",
        leftover.command("exec sleep 30")
    );
    let c = capsule("", &replies);
    let run = Run::of(mur().arg("run").arg(c.dir()).args(["--json", "--task", "go"]));
    assert_eq!(run.code, 0, "{run:?}");
    let json = run.last_json();
    let lines = trace_lines(Path::new(json["session_dir"].as_str().unwrap()));
    let gone = of_type(&lines, "shell_abandoned");
    assert_eq!(gone.len(), 1);
    let work_id = gone[0]["work_id"].as_str().unwrap();
    assert_eq!(gone[0]["work_id"], of_type(&lines, "shell_detached")[0]["work_id"]);
    assert_eq!(run.stderr.matches(work_id).count(), 1, "{}", run.stderr);
    assert!(run.stderr.contains("shell_abandoned: "), "{}", run.stderr);
    let pos = |ty: &str| lines.iter().position(|l| l["event_type"] == ty).unwrap();
    assert!(pos("shell_abandoned") < pos("session_end"));
    // Left to run: `leftover` kills it when dropped.
    assert!(leftover.alive(), "an abandoned command is left running");
}

#[test]
fn a_resume_after_a_kill_reports_the_lost_command_once_and_leaves_it_running() {
    let leftover = Leftover::new();
    let replies = format!(
        "replies:\n  - tool_calls: [{{ name: sh, input: {{ command: '{}' }} }}]\n  - text: busy\n    delay_ms: 60000\n  - text: \"report: {{{{task}}}}\"\n",
        leftover.command("sleep 20; echo lost")
    );
    let c = capsule("", &replies);
    let wd = tempfile::tempdir().unwrap();
    let mut bg =
        Background::spawn(mur().arg("run").arg(c.dir()).args(["--json", "--task", "go", "--workdir"]).arg(wd.path()));
    let first = bg.next_json(WAIT);
    let old_dir = first["session_dir"].as_str().unwrap().to_string();
    let old_id = first["session_id"].as_str().unwrap().to_string();
    let deadline = std::time::Instant::now() + WAIT;
    while !std::fs::read_to_string(Path::new(&old_dir).join("trace.jsonl"))
        .unwrap_or_default()
        .contains("shell_detached")
    {
        assert!(std::time::Instant::now() < deadline, "never detached");
        std::thread::sleep(Duration::from_millis(20));
    }
    bg.signal(9);
    let _ = bg.wait(WAIT);
    // The resumed sessions' model answers differently.
    std::fs::write(c.dir().join("r.yaml"), "replies:\n  - text: \"report: {{task}}\"\n  - text: hello back\n").unwrap();

    let resumed = Run::of(
        mur()
            .arg("run")
            .arg(c.dir())
            .args(["--json", "--resume", &old_id[old_id.len() - 8..], "--workdir"])
            .arg(wd.path()),
    );
    assert_eq!(resumed.code, 0, "{resumed:?}");
    let json = resumed.last_json();
    let result = json["result"].as_str().unwrap();
    assert!(result.starts_with("report: "), "{result}");
    let new_lines = trace_lines(Path::new(json["session_dir"].as_str().unwrap()));
    assert_eq!(new_lines[0]["resumed_from"], old_id.as_str());
    let starts = of_type(&new_lines, "task_start");
    assert_eq!(starts.len(), 1);
    assert_eq!(
        (starts[0]["origin"].as_str(), starts[0]["lane"].as_str(), starts[0]["source"].as_str()),
        (Some("completion"), Some("bg"), Some("detached_lost"))
    );
    let old_lines = trace_lines(Path::new(&old_dir));
    let lost = of_type(&old_lines, "shell_lost");
    assert_eq!(lost.len(), 1);
    assert_eq!(lost[0]["session_id"], old_id.as_str());
    assert_eq!(lost[0]["reconciled_by_session"], json["session_id"]);
    assert_eq!(lost[0]["reconciled_task_id"], starts[0]["task_id"]);
    assert_eq!(lost[0]["work_id"], of_type(&old_lines, "shell_detached")[0]["work_id"]);

    // A second resume reports nothing.
    let again = Run::of(
        mur()
            .arg("run")
            .arg(c.dir())
            .args(["--json", "--resume", &old_id, "--workdir"])
            .arg(wd.path())
            .args(["--task", "hello"]),
    );
    let lines = trace_lines(Path::new(again.last_json()["session_dir"].as_str().unwrap()));
    assert!(of_type(&lines, "task_start").iter().all(|s| s["source"] != "detached_lost"));
    assert_eq!(of_type(&trace_lines(Path::new(&old_dir)), "shell_lost").len(), 1);

    // The command itself was not killed by any of this (`leftover` kills it when dropped).
    assert!(leftover.alive(), "the detached command is still running");
}
