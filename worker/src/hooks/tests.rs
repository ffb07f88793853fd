//! [`ProcessHooks`] through the [`Hooks`] trait, with small `sh` and Python hook programs
//! written into a temporary capsule folder. Waits are on conditions with deadlines.

use super::process::{Config, ProcessHooks};
use super::*;
use mur_proto::manifest::{Binding, CommitPolicy, ExecutionMode, Hook};
use mur_proto::message::Message;
use mur_proto::task::ExitStatus;
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const SID: &str = "ses_test";

/// A temporary capsule folder (`capsule/`) and logs folder (`logs/`).
struct Capsule {
    _dir: tempfile::TempDir,
    config: Config,
}

impl Capsule {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            capsule_dir: dir.path().join("capsule"),
            logs_dir: dir.path().join("logs"),
            builtins: HashMap::new(),
            gate: None,
            workdir: None,
            sandbox: None,
        };
        std::fs::create_dir_all(config.capsule_dir.join("hooks")).unwrap();
        Capsule { _dir: dir, config }
    }

    /// A path in the capsule folder.
    fn path(&self, rel: &str) -> PathBuf {
        self.config.capsule_dir.join(rel)
    }

    /// Writes `body` at `rel` in the capsule folder; returns `rel`.
    fn write(&self, rel: &str, body: &str) -> String {
        std::fs::write(self.path(rel), body).unwrap();
        rel.to_string()
    }

    /// The text of file `rel` of the capsule folder, empty when it does not exist.
    fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.path(rel)).unwrap_or_default()
    }

    /// The pid a hook wrote to `rel`.
    fn pid(&self, rel: &str) -> i32 {
        self.read(rel).trim().parse().unwrap_or_else(|e| panic!("{rel}: {e}"))
    }

    fn log(&self, hook: &str) -> String {
        std::fs::read_to_string(self.config.logs_dir.join(format!("hook-{hook}.log"))).unwrap_or_default()
    }

    fn hooks(&self, hooks: Vec<Hook>) -> ProcessHooks {
        ProcessHooks::new(hooks, self.config.clone())
    }
}

/// A blocking hook with a 30 s timeout.
fn hook(name: &str, binding: Option<Binding>, command: &[&str]) -> Hook {
    Hook {
        name: name.into(),
        binding,
        execution_mode: ExecutionMode::Blocking,
        commit_policy: CommitPolicy::None,
        command: command.iter().map(|s| s.to_string()).collect(),
        timeout_secs: 30,
        persistent: false,
    }
}

fn async_hook(name: &str, binding: Option<Binding>, command: &[&str]) -> Hook {
    Hook { execution_mode: ExecutionMode::Async, ..hook(name, binding, command) }
}

/// The Python to run hooks with: the system one when present (no version-manager shim
/// adding variables of its own), else `python3` on `PATH`.
fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() { "/usr/bin/python3" } else { "python3" }
}

/// `sh -c` with `script`, after reading the event.
fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), format!("cat >/dev/null; {script}")]
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn task_end(attempt: u32) -> Event {
    Event::OnTaskEnd {
        task_id: "tsk_1".into(),
        exit_status: ExitStatus::Ok,
        result: "done".into(),
        reopen_count: attempt - 1,
        attempt,
    }
}

fn stage() -> Event {
    Event::OnStage { shell_allow: vec!["git".into()] }
}

fn session_start() -> Event {
    Event::OnSessionStart {
        capsule_name: "probe".into(),
        capsule_version: "0.1.0".into(),
        model: "fake".into(),
        capabilities: vec![],
    }
}

fn inference(turn: u32) -> Event {
    Event::OnInference {
        task_id: "tsk_1".into(),
        turn,
        input_tokens: 10,
        output_tokens: 5,
        decision: "text".into(),
        tool_name: None,
    }
}

fn reopen(reason: &str) -> Answer {
    Answer::ReopenTask { reason: reason.into() }
}

/// The reason of a reopen-task answer.
fn reason(reply: &Reply) -> String {
    match &reply.answer {
        Ok(Answer::ReopenTask { reason }) => reason.clone(),
        other => panic!("{}: expected a reopen-task answer, got {other:?}", reply.hook),
    }
}

fn names(replies: &[Reply]) -> Vec<&str> {
    replies.iter().map(|r| r.hook.as_str()).collect()
}

/// Polls `done` until it holds, failing after 10 s.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether process `pid` still exists, zombie or not (a reaped child does not).
fn exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether a process other than a zombie is still in process group `pgid`.
fn group_has_live_members(pgid: i32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        // After the `(comm)` field: state, ppid, pgrp.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            return false;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        fields.len() > 2 && fields[2] == pgid.to_string() && !matches!(fields[0], "Z" | "X")
    })
}

/// Waits until group `pgid` has no live member, and checks its leader was reaped.
async fn assert_gone(pgid: i32) {
    wait_until(&format!("process group {pgid} is gone"), || !group_has_live_members(pgid)).await;
    assert!(!exists(pgid), "process {pgid} was not reaped");
}

#[tokio::test]
async fn blocking_hooks_answer_in_manifest_order_and_every_one_is_called() {
    let c = Capsule::new();
    let answering =
        |name: &str| sh(&format!(r#"echo {name} >> calls; echo '{{"action":"reopen-task","reason":"{name}"}}'"#));
    let (a, b, z) = (answering("a"), answering("b"), answering("z"));
    let other = sh("echo other >> calls");
    let hooks = c.hooks(vec![
        hook("zeta", Some(Binding::OnTaskEnd), &args(&z)),
        hook("alpha", Some(Binding::OnTaskEnd), &args(&a)),
        hook("shell-watch", Some(Binding::OnShell), &args(&other)),
        hook("beta", Some(Binding::OnTaskEnd), &args(&b)),
    ]);
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    assert_eq!(names(&replies), ["zeta", "alpha", "beta"]);
    assert_eq!(replies.iter().map(reason).collect::<Vec<_>>(), ["z", "a", "b"]);
    assert!(replies.iter().all(|r| !r.spend_refused));
    assert_eq!(c.read("calls"), "z\na\nb\n");
}

#[tokio::test]
async fn a_hook_without_binding_receives_every_event_but_on_stage() {
    let c = Capsule::new();
    let quiet = sh("true");
    let hooks = c.hooks(vec![
        hook("all", None, &args(&quiet)),
        hook("end", Some(Binding::OnTaskEnd), &args(&quiet)),
        hook("stage", Some(Binding::OnStage), &args(&quiet)),
    ]);
    assert_eq!(names(&hooks.dispatch(SID, &stage()).await), ["stage"]);
    assert_eq!(names(&hooks.dispatch(SID, &session_start()).await), ["all"]);
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    assert_eq!(names(&replies), ["all", "end"]);
    assert!(replies.iter().all(|r| r.answer == Ok(Answer::None)), "{replies:?}");
}

#[tokio::test]
async fn one_shot_hooks_get_the_event_on_stdin_and_answer_on_stdout() {
    let c = Capsule::new();
    let echo = c.write(
        "hooks/echo.py",
        r#"import json, sys
ev = json.load(sys.stdin)
reason = f"{ev['version']} {ev['event']} {ev['hook']} {ev['session_id']} {ev['task_id']} {ev['attempt']}"
print(json.dumps({"action": "reopen-task", "reason": reason}))
"#,
    );
    let seed = sh(r#"echo '{"action":"seed-context","messages":[{"role":"user","content":"remember x"}]}'"#);
    let quiet = sh("true");
    let hooks = c.hooks(vec![
        hook("echo", Some(Binding::OnTaskEnd), &[python(), &echo]),
        hook("seed", None, &args(&seed)),
        hook("quiet", None, &args(&quiet)),
    ]);
    let replies = hooks.dispatch(SID, &task_end(2)).await;
    assert_eq!(replies[0].answer, Ok(reopen("1 on-task-end echo ses_test tsk_1 2")));
    assert_eq!(replies[1].answer, Ok(Answer::SeedContext { messages: vec![Message::user("remember x")] }));
    assert_eq!(replies[2].answer, Ok(Answer::None));
}

#[tokio::test]
async fn a_relative_command_is_taken_from_the_capsule_folder_and_runs_there() {
    let c = Capsule::new();
    let script = c.write(
        "hooks/where.sh",
        r#"#!/bin/sh
cat >/dev/null
printf '{"action":"reopen-task","reason":"%s|%s"}\n' "$(pwd -P)" "$HOME"
"#,
    );
    std::fs::set_permissions(c.path(&script), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let hooks = c.hooks(vec![hook("where", None, &[&script])]);
    // A script just written in this multi-threaded test process can be briefly held open
    // by a sibling test's fork: start again while exec fails with ETXTBSY.
    let deadline = Instant::now() + Duration::from_secs(10);
    let reply = loop {
        let reply = hooks.dispatch(SID, &task_end(1)).await.remove(0);
        match &reply.answer {
            Err(Error::Spawn(m)) if m.contains("Text file busy") && Instant::now() < deadline => continue,
            _ => break reply,
        }
    };
    let home = std::path::absolute(&c.config.capsule_dir).unwrap();
    let cwd = c.config.capsule_dir.canonicalize().unwrap();
    assert_eq!(reason(&reply), format!("{}|{}", cwd.display(), home.display()));
}

#[tokio::test]
async fn a_program_that_cannot_start_is_a_spawn_error() {
    let c = Capsule::new();
    let hooks = c.hooks(vec![hook("missing", None, &["hooks/missing.sh"]), hook("empty", None, &[])]);
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    assert!(matches!(&replies[0].answer, Err(Error::Spawn(m)) if m.contains("hooks/missing.sh")), "{replies:?}");
    assert!(matches!(&replies[1].answer, Err(Error::Spawn(m)) if m.contains("empty command")), "{replies:?}");
    assert!(c.log("missing").contains(" on-task-end error: could not start hook: "), "{}", c.log("missing"));
}

#[tokio::test]
async fn a_non_zero_exit_is_an_exit_error_with_stderr_and_is_logged() {
    let c = Capsule::new();
    let fail = sh("echo ignored; echo first problem >&2; echo second problem >&2; exit 3");
    let hooks = c.hooks(vec![hook("fail", None, &args(&fail))]);
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    assert_eq!(replies[0].answer, Err(Error::Exit { code: 3, stderr: "first problem\nsecond problem".into() }));
    let log = c.log("fail");
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 3, "{log}");
    assert!(lines[0].ends_with(" on-task-end stderr: first problem"), "{log}");
    assert!(lines[1].ends_with(" on-task-end stderr: second problem"), "{log}");
    assert!(lines[2].ends_with(" on-task-end error: hook exited with code 3: first problem\\nsecond problem"), "{log}");
    // The line starts with an RFC 3339 time.
    assert_eq!(lines[2].as_bytes()[4], b'-', "{log}");
    assert_eq!(&lines[2][23..25], "Z ", "{log}");
}

#[tokio::test]
async fn the_stderr_tail_of_an_exit_error_is_at_most_2_kib() {
    let c = Capsule::new();
    let noisy = sh("i=0; while [ $i -lt 300 ]; do echo \"line $i of noise\" >&2; i=$((i+1)); done; exit 1");
    let hooks = c.hooks(vec![hook("noisy", None, &args(&noisy))]);
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    let Err(Error::Exit { code: 1, stderr }) = &replies[0].answer else { panic!("{replies:?}") };
    assert!(stderr.len() <= 2048, "{}", stderr.len());
    assert!(stderr.ends_with("line 299 of noise"), "{stderr}");
}

#[tokio::test]
async fn output_outside_the_answer_schema_is_a_bad_answer() {
    let c = Capsule::new();
    let explode = sh(r#"echo '{"action":"explode"}'"#);
    let prose = sh("echo all good");
    let hooks = c.hooks(vec![hook("explode", None, &args(&explode)), hook("prose", None, &args(&prose))]);
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    for reply in &replies {
        assert!(
            matches!(&reply.answer, Err(Error::BadAnswer(m)) if m.starts_with("answer is not a hook answer object")),
            "{reply:?}"
        );
    }
    assert!(
        c.log("explode").contains(" on-task-end error: answer is not a hook answer object"),
        "{}",
        c.log("explode")
    );
}

#[tokio::test]
async fn a_timeout_kills_the_whole_process_group() {
    let c = Capsule::new();
    let slow = vec!["sh".to_string(), "-c".into(), "echo $$ > pid; sleep 30 & sleep 30".into()];
    let mut h = hook("slow", None, &args(&slow));
    h.timeout_secs = 1;
    let hooks = c.hooks(vec![h]);
    let started = Instant::now();
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    let took = started.elapsed();
    assert_eq!(replies[0].answer, Err(Error::Timeout(1)));
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(4), "took {took:?}");
    assert_gone(c.pid("pid")).await;
    assert!(c.log("slow").contains(" on-task-end error: hook timed out after 1 s"), "{}", c.log("slow"));
}

const COUNTER: &str = r#"import json, os, sys
with open("pids", "a") as f:
    f.write(f"{os.getpid()}\n")
n = 0
while True:
    line = sys.stdin.readline()
    if not line:
        break
    n += 1
    ev = json.loads(line)
    print(f"handling {n}", file=sys.stderr, flush=True)
    if ev["attempt"] == int(sys.argv[1]):
        import time
        time.sleep(30)
    print(json.dumps({"action": "reopen-task", "reason": f"{n} {ev['attempt']}"}), flush=True)
    if n == int(sys.argv[2]):
        sys.exit(4)
"#;

#[tokio::test]
async fn a_persistent_hook_keeps_state_and_restarts_fresh_after_dying() {
    let c = Capsule::new();
    let counter = c.write("hooks/counter.py", COUNTER);
    // Never hangs; exits after its second event.
    let hooks = c.hooks(vec![Hook { persistent: true, ..hook("counter", None, &[python(), &counter, "0", "2"]) }]);
    let mut reasons = Vec::new();
    for attempt in 1..=4 {
        reasons.push(hooks.dispatch(SID, &task_end(attempt)).await.remove(0).answer);
    }
    assert_eq!(reasons[0], Ok(reopen("1 1")));
    assert_eq!(reasons[1], Ok(reopen("2 2")));
    assert!(matches!(&reasons[2], Err(Error::Died(m)) if m.contains("exited with code 4")), "{reasons:?}");
    assert_eq!(reasons[3], Ok(reopen("1 4")), "a restarted hook starts from fresh state");
    let log = c.log("counter");
    assert!(log.contains(" on-task-end error: persistent hook died: "), "{log}");
    assert!(log.contains(" on-task-end restart: ") && log.contains("state of its previous process is lost"), "{log}");
    assert!(log.contains(" on-task-end stderr: handling 2"), "{log}");

    let pids: Vec<i32> = c.read("pids").lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(pids.len(), 2, "one process per life");
    assert!(!exists(pids[0]), "the dead process was reaped");
    assert!(hooks.drain(Duration::from_secs(5)).await.is_empty());
    assert_gone(pids[1]).await;
}

#[tokio::test]
async fn a_persistent_hook_that_times_out_is_killed_and_restarted() {
    let c = Capsule::new();
    let counter = c.write("hooks/counter.py", COUNTER);
    // Hangs on attempt 2; never exits on its own.
    let hooks = c.hooks(vec![Hook {
        persistent: true,
        timeout_secs: 1,
        ..hook("counter", None, &[python(), &counter, "2", "0"])
    }]);
    assert_eq!(hooks.dispatch(SID, &task_end(1)).await[0].answer, Ok(reopen("1 1")));
    let started = Instant::now();
    assert_eq!(hooks.dispatch(SID, &task_end(2)).await[0].answer, Err(Error::Timeout(1)));
    assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
    let first: i32 = c.read("pids").lines().next().unwrap().parse().unwrap();
    assert_gone(first).await;
    assert_eq!(hooks.dispatch(SID, &task_end(3)).await[0].answer, Ok(reopen("1 3")));
    assert!(c.log("counter").contains(" on-task-end restart: "), "{}", c.log("counter"));
}

#[tokio::test]
async fn drain_stops_persistent_processes_and_reaps_them() {
    let c = Capsule::new();
    let looping = vec![
        "sh".to_string(),
        "-c".into(),
        r#"echo $$ > pid; while read line; do echo '{"action":"none"}'; done"#.into(),
    ];
    let hooks = c.hooks(vec![Hook { persistent: true, ..hook("loop", None, &args(&looping)) }]);
    assert_eq!(hooks.dispatch(SID, &task_end(1)).await[0].answer, Ok(Answer::None));
    assert_eq!(hooks.dispatch(SID, &task_end(2)).await[0].answer, Ok(Answer::None));
    let pid = c.pid("pid");
    assert!(exists(pid));
    assert!(hooks.drain(Duration::from_secs(5)).await.is_empty());
    assert_gone(pid).await;
}

const MARKER: &str = r#"import json, os, sys, time
ev = json.load(sys.stdin)
with open("marks", "a") as f:
    f.write(f"start {ev['turn']}\n")
while sys.argv[1] == "wait" and not os.path.exists("release"):
    time.sleep(0.01)
if sys.argv[1] == "pause":
    time.sleep(0.05)
with open("marks", "a") as f:
    f.write(f"end {ev['turn']}\n")
"#;

#[tokio::test]
async fn an_async_hook_handles_its_events_in_order_never_concurrently() {
    let c = Capsule::new();
    let marker = c.write("hooks/marker.py", MARKER);
    let hooks = c.hooks(vec![async_hook("marker", Some(Binding::OnInference), &[python(), &marker, "pause"])]);
    for turn in 0..5 {
        assert!(hooks.dispatch(SID, &inference(turn)).await.is_empty(), "async hooks give no reply");
    }
    assert!(hooks.drain(Duration::from_secs(30)).await.is_empty());
    assert!(hooks.take_faults().is_empty());
    let expected: String = (0..5).map(|t| format!("start {t}\nend {t}\n")).collect();
    assert_eq!(c.read("marks"), expected);
}

#[tokio::test]
async fn a_full_async_queue_drops_the_event_as_an_overflow_fault() {
    let c = Capsule::new();
    let marker = c.write("hooks/marker.py", MARKER);
    let hooks = c
        .hooks(vec![async_hook("marker", Some(Binding::OnInference), &[python(), &marker, "wait"])])
        .with_queue_capacity(1);
    hooks.dispatch(SID, &inference(0)).await;
    wait_until("the hook handles event 0", || c.read("marks") == "start 0\n").await;
    hooks.dispatch(SID, &inference(1)).await; // queued
    hooks.dispatch(SID, &inference(2)).await; // no room
    let faults = hooks.take_faults();
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!((faults[0].hook.as_str(), faults[0].event.as_str()), ("marker", "on-inference"));
    assert_eq!(faults[0].arm, "queue-overflow");
    assert!(faults[0].message.contains("full"), "{}", faults[0].message);
    assert!(c.log("marker").contains(" on-inference queue-overflow: "), "{}", c.log("marker"));

    c.write("release", "");
    assert!(hooks.drain(Duration::from_secs(30)).await.is_empty());
    assert!(hooks.take_faults().is_empty());
    assert_eq!(c.read("marks"), "start 0\nend 0\nstart 1\nend 1\n");
}

#[tokio::test]
async fn async_errors_become_faults_and_answers_are_discarded() {
    let c = Capsule::new();
    let fail = sh("echo broken >&2; exit 2");
    let answer = sh(r#"echo '{"action":"reopen-task","reason":"ignored"}'"#);
    let hooks = c.hooks(vec![
        async_hook("fail", Some(Binding::OnSessionEnd), &args(&fail)),
        async_hook("answer", Some(Binding::OnSessionEnd), &args(&answer)),
    ]);
    let end = Event::OnSessionEnd {
        total_turns: 1,
        total_input_tokens: 1,
        total_output_tokens: 1,
        total_tool_calls: 0,
        total_shell_calls: 0,
        duration_ms: 5,
        exit_status: ExitStatus::Ok,
    };
    assert!(hooks.dispatch(SID, &end).await.is_empty());
    assert!(hooks.drain(Duration::from_secs(30)).await.is_empty());
    assert_eq!(
        hooks.take_faults(),
        [Fault {
            hook: "fail".into(),
            event: "on-session-end".into(),
            arm: "error".into(),
            message: "hook exited with code 2: broken".into(),
        }]
    );
    assert!(hooks.take_faults().is_empty(), "faults are taken once");
}

#[tokio::test]
async fn drain_reports_stragglers_after_one_shared_deadline_and_kills_them() {
    let c = Capsule::new();
    let slow_a = vec!["sh".to_string(), "-c".into(), "echo $$ > pid-a; sleep 30".into()];
    let slow_b = vec!["sh".to_string(), "-c".into(), "echo $$ > pid-b; sleep 30".into()];
    let quick = sh("true");
    let hooks = c.hooks(vec![
        async_hook("slow-a", None, &args(&slow_a)),
        async_hook("quick", None, &args(&quick)),
        async_hook("slow-b", None, &args(&slow_b)),
    ]);
    hooks.dispatch(SID, &session_start()).await;
    wait_until("both slow hooks run", || !c.read("pid-a").is_empty() && !c.read("pid-b").is_empty()).await;
    let started = Instant::now();
    let faults = hooks.drain(Duration::from_secs(1)).await;
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(1) && took < Duration::from_millis(1900), "took {took:?}");
    assert_eq!(faults.iter().map(|f| f.hook.as_str()).collect::<Vec<_>>(), ["slow-a", "slow-b"]);
    for f in &faults {
        assert_eq!((f.event.as_str(), f.arm.as_str()), ("drain", "timeout"), "{f:?}");
        assert!(f.message.starts_with("1 event(s) not handled"), "{}", f.message);
    }
    assert!(c.log("slow-a").contains(" drain timeout: "), "{}", c.log("slow-a"));
    assert_gone(c.pid("pid-a")).await;
    assert_gone(c.pid("pid-b")).await;
    // After the drain, async events are dropped as faults.
    hooks.dispatch(SID, &session_start()).await;
    assert_eq!(hooks.take_faults().len(), 3);
}

#[tokio::test]
async fn hook_processes_see_no_host_environment() {
    // SAFETY: no other thread of this test reads or writes this variable; std serialises
    // environment access with process spawning.
    unsafe { std::env::set_var("MUR_SECRET_TEST", "1") };
    let c = Capsule::new();
    let dump = "import json, os; print(json.dumps({'action': 'reopen-task', 'reason': json.dumps(dict(os.environ))}))";
    let hooks = c.hooks(vec![hook("env-probe", None, &[python(), "-c", dump])]);
    let reply = hooks.dispatch(SID, &task_end(1)).await.remove(0);
    let env: HashMap<String, String> = serde_json::from_str(&reason(&reply)).unwrap();
    let mut keys: Vec<&str> = env.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["HOME", "LANG", "MURMUR_HOOK_NAME", "MURMUR_REAP_MARK", "MURMUR_SESSION_ID", "PATH"], "{env:?}");
    assert!(env["MURMUR_REAP_MARK"].len() == 32 && env["MURMUR_REAP_MARK"].bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(env["HOME"], std::path::absolute(&c.config.capsule_dir).unwrap().display().to_string());
    assert_eq!(env["LANG"], "C.UTF-8");
    assert_eq!(env["MURMUR_SESSION_ID"], SID);
    assert_eq!(env["MURMUR_HOOK_NAME"], "env-probe");
}

/// Answers with what it saw; counts its calls.
struct Echo(Mutex<Vec<Envelope>>);

#[async_trait]
impl Builtin for Echo {
    async fn handle(&self, event: &Envelope) -> Result<Answer, String> {
        self.0.lock().unwrap().push(event.clone());
        Ok(reopen(&format!("{} saw {}", event.hook, event.event.binding().as_str())))
    }
}

struct Failing;

#[async_trait]
impl Builtin for Failing {
    async fn handle(&self, _: &Envelope) -> Result<Answer, String> {
        Err("memory store unavailable".into())
    }
}

struct Stuck;

#[async_trait]
impl Builtin for Stuck {
    async fn handle(&self, _: &Envelope) -> Result<Answer, String> {
        std::future::pending().await
    }
}

#[tokio::test]
async fn builtin_hooks_are_called_in_process_in_manifest_order() {
    let mut c = Capsule::new();
    let echo = Arc::new(Echo(Mutex::new(Vec::new())));
    c.config.builtins.insert("builtin:compact".into(), echo.clone());
    c.config.builtins.insert("builtin:memory".into(), Arc::new(Failing));
    c.config.builtins.insert("builtin:stuck".into(), Arc::new(Stuck));
    let quiet = sh("true");
    let hooks = c.hooks(vec![
        hook("compactor", None, &["builtin:compact"]),
        hook("memory", None, &["builtin:memory"]),
        hook("plain", None, &args(&quiet)),
        hook("ghost", None, &["builtin:ghost"]),
        Hook { timeout_secs: 1, ..hook("stuck", None, &["builtin:stuck"]) },
    ]);
    let replies = hooks.dispatch(SID, &task_end(1)).await;
    assert_eq!(names(&replies), ["compactor", "memory", "plain", "ghost", "stuck"]);
    assert_eq!(replies[0].answer, Ok(reopen("compactor saw on-task-end")));
    assert_eq!(replies[1].answer, Err(Error::Builtin("memory store unavailable".into())));
    assert_eq!(replies[2].answer, Ok(Answer::None));
    assert_eq!(replies[3].answer, Err(Error::Spawn("no built-in hook named \"builtin:ghost\"".into())));
    assert_eq!(replies[4].answer, Err(Error::Timeout(1)));
    let seen = echo.0.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!((seen[0].session_id.as_str(), seen[0].version), (SID, mur_proto::hook::VERSION));
    assert!(c.log("memory").contains(" on-task-end error: memory store unavailable"), "{}", c.log("memory"));
}

/// A gate that gives scripted outcomes in order, then echoes the last message.
struct FakeGate {
    outcomes: Mutex<VecDeque<Result<String, InferenceError>>>,
    calls: Mutex<Vec<(String, InferenceRequest)>>,
}

#[async_trait]
impl InferenceGate for FakeGate {
    async fn run_inference(&self, hook: &str, request: InferenceRequest) -> Result<String, InferenceError> {
        let text = request.messages.last().map(Message::text).unwrap_or_default();
        self.calls.lock().unwrap().push((hook.to_string(), request));
        self.outcomes.lock().unwrap().pop_front().unwrap_or_else(|| Ok(format!("echo: {text}")))
    }
}

const ASKER: &str = r#"import json, os, sys, urllib.request, urllib.error
ev = json.load(sys.stdin)
url = os.environ["MURMUR_INFERENCE_URL"]
body = json.dumps({"messages": [{"role": "user", "content": f"attempt {ev['attempt']}"}], "max_tokens": 50})
req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"}, method="POST")
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        text = json.load(r)["text"]
except urllib.error.HTTPError as e:
    print(f"{e.code} {e.read().decode()}", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"action": "reopen-task", "reason": f"{text} via {url}"}))
"#;

#[tokio::test]
async fn hooks_make_model_calls_through_the_inference_gate() {
    let mut c = Capsule::new();
    let gate = Arc::new(FakeGate {
        outcomes: Mutex::new(VecDeque::from([
            Err(InferenceError::SpendCeiling("session tokens 100/100".into())),
            Err(InferenceError::Driver("upstream 500".into())),
        ])),
        calls: Mutex::new(Vec::new()),
    });
    c.config.gate = Some(gate.clone());
    let asker = c.write("hooks/asker.py", ASKER);
    let hooks = c.hooks(vec![hook("asker", Some(Binding::OnTaskEnd), &[python(), &asker])]);

    let refused = hooks.dispatch(SID, &task_end(1)).await.remove(0);
    assert!(refused.spend_refused, "{refused:?}");
    assert_eq!(
        refused.answer,
        Err(Error::Exit { code: 1, stderr: r#"429 {"error":"spend ceiling reached: session tokens 100/100"}"#.into() })
    );

    let failed = hooks.dispatch(SID, &task_end(2)).await.remove(0);
    assert!(!failed.spend_refused, "the flag is per event");
    assert_eq!(failed.answer, Err(Error::Exit { code: 1, stderr: r#"502 {"error":"upstream 500"}"#.into() }));

    let answered = hooks.dispatch(SID, &task_end(3)).await.remove(0);
    assert!(!answered.spend_refused);
    let text = reason(&answered);
    let (reply, url) = text.split_once(" via ").unwrap();
    assert_eq!(reply, "echo: attempt 3");
    assert!(url.starts_with("http://127.0.0.1:") && url.ends_with("/hooks/asker/inference"), "{url}");

    let calls = gate.calls.lock().unwrap();
    assert_eq!(calls.len(), 3);
    assert!(calls.iter().all(|(hook, r)| hook == "asker" && r.max_tokens == Some(50) && r.system.is_none()));
    assert_eq!(calls[2].1.messages, [Message::user("attempt 3")]);
}

#[tokio::test]
async fn the_inference_endpoint_refuses_unknown_hooks_and_bad_bodies() {
    let mut c = Capsule::new();
    c.config.gate = Some(Arc::new(FakeGate { outcomes: Mutex::new(VecDeque::new()), calls: Mutex::new(Vec::new()) }));
    let probe = c.write(
        "hooks/probe.py",
        r#"import json, os, sys, urllib.request, urllib.error
sys.stdin.read()
url = os.environ["MURMUR_INFERENCE_URL"]
codes = []
for target, body in [(url.replace("/probe/", "/nobody/"), b'{"messages": []}'), (url, b'{"nope": 1}')]:
    req = urllib.request.Request(target, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        urllib.request.urlopen(req, timeout=10)
        codes.append("200")
    except urllib.error.HTTPError as e:
        codes.append(str(e.code))
print(json.dumps({"action": "reopen-task", "reason": " ".join(codes)}))
"#,
    );
    let hooks = c.hooks(vec![hook("probe", None, &[python(), &probe])]);
    let reply = hooks.dispatch(SID, &task_end(1)).await.remove(0);
    assert_eq!(reason(&reply), "404 422");
}

#[tokio::test]
async fn a_cancel_kills_the_blocking_hook_under_way_and_starts_no_further_one() {
    let c = Capsule::new();
    let slow = vec!["sh".to_string(), "-c".into(), "echo $$ > pid; sleep 60 & sleep 60".into()];
    let after = vec!["sh".to_string(), "-c".into(), "touch ran; echo '{\"action\":\"none\"}'".into()];
    let hooks = c.hooks(vec![hook("slow", None, &args(&slow)), hook("after", None, &args(&after))]);
    let cancel = tokio_util::sync::CancellationToken::new();
    let event = task_end(1);
    let dispatched = hooks.dispatch_until(SID, &event, &cancel);
    let fire = async {
        wait_until("the slow hook has started", || c.path("pid").exists() && !c.read("pid").is_empty()).await;
        let started = Instant::now();
        cancel.cancel();
        started
    };
    let (replies, cancelled_at) = tokio::join!(dispatched, fire);
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(5),
        "the dispatch ended {:?} after the cancel",
        cancelled_at.elapsed()
    );
    let died = Err(Error::Canceled);
    assert_eq!(names(&replies), ["slow", "after"]);
    assert_eq!([replies[0].answer.clone(), replies[1].answer.clone()], [died.clone(), died]);
    assert_gone(c.pid("pid")).await;
    assert!(!c.path("ran").exists(), "no hook starts after the cancel");
    // Hooks dispatched without a cancel still run.
    assert_eq!(hooks.dispatch(SID, &task_end(2)).await[1].answer, Ok(Answer::None));
    assert!(c.path("ran").exists());
}

/// A persistent hook that writes two lines per event: the second answers nothing, and is
/// dropped (and logged) before the next event rather than read as that event's answer.
#[tokio::test]
async fn a_persistent_hooks_extra_line_is_dropped_not_read_as_the_next_answer() {
    let c = Capsule::new();
    // Both lines in one write, so the extra one is there by the time the answer is read.
    let script = "n=0\nwhile read -r line; do\n  n=$((n+1))\n  \
                  printf '{\"action\":\"reopen-task\",\"reason\":\"answer %s\"}\\n{\"action\":\"reopen-task\",\"reason\":\"extra %s\"}\\n' $n $n\n\
                  done\n";
    let hooks = c.hooks(vec![Hook { persistent: true, ..hook("chatty", None, &["sh", "-c", script]) }]);
    assert_eq!(hooks.dispatch(SID, &task_end(1)).await[0].answer, Ok(reopen("answer 1")));
    assert_eq!(hooks.dispatch(SID, &task_end(2)).await[0].answer, Ok(reopen("answer 2")));
    let log = c.log("chatty");
    assert!(
        log.contains(
            " stray: a line written after the last answer, not an answer to this event: dropped: \
             {\"action\":\"reopen-task\",\"reason\":\"extra 1\"}"
        ),
        "{log}"
    );
}

/// A hook that times out is killed with what it started outside its process group
/// (`setsid`): found by the mark every process it starts inherits (`MURMUR_REAP_MARK`).
#[tokio::test]
async fn a_timed_out_hook_is_killed_with_what_it_started_outside_its_group() {
    let c = Capsule::new();
    let hooks = c.hooks(vec![Hook {
        timeout_secs: 3,
        ..hook("escaper", None, &args(&sh("setsid sh -c 'echo $$ > escaped.pid; exec sleep 300' & sleep 60")))
    }]);
    assert_eq!(hooks.dispatch(SID, &task_end(1)).await[0].answer, Err(Error::Timeout(3)));
    let pid: i32 = c.read("escaped.pid").trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while crate::tools::process::is_running(pid) {
        assert!(Instant::now() < deadline, "the escaped process {pid} still runs");
        tokio::task::yield_now().await;
    }
}
