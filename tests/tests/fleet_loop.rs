//! How a fleet loop ends on the cluster (issue #10 §Runs and loops; the fleet-loops seed,
//! §Three ways a loop ends, §Kill-switch; reference §9 Loop termination, Kill-switch):
//! a marker line converges it, a marker of an earlier run does not, the deadline ends it
//! between iterations; and how `mur fleet stop` stops one (issue #29 item 4): nothing new
//! starts, running steps are canceled and their commands killed (or, with `--drain`, let
//! finish), and the run ends `stopped` — a loop and a one-shot run alike.

use mur_proto::task::TaskState;
use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, mur};
use mur_tests::procs::{proc_gone, until};
use mur_tests::sandbox::Sandbox;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

fn ok(sb: &Sandbox, args: &[&str]) -> Run {
    sb.fleet_ok(args)
}

/// `mur fleet run ARGS` off the test's runtime threads.
async fn run(sb: &Sandbox, args: &[&str]) -> Run {
    sb.fleet_blocking(&[&["run"], args].concat()).await
}

/// A member whose reply is its task's text, after `pause` seconds of shell work.
fn echo_member(name: &str, pause: &str) -> TestCapsule {
    TestCapsule::new(
        &format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n"
        ),
        &[(
            "r.yaml",
            &format!(
                "replies:\n  - tool_calls: [{{ name: sh, input: {{ command: \"sleep {pause}\" }} }}]\n  - text: \"{{{{task}}}}\"\n"
            ),
        )],
    )
}

/// A member whose step appends its shell's pid to `dir/<name>.pids`, works `secs`
/// seconds, then leaves `dir/<name>.finished` and replies with its task's text.
fn slow_member(name: &str, dir: &Path, secs: u32) -> TestCapsule {
    let d = dir.display();
    TestCapsule::new(
        &format!(
            "name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n"
        ),
        &[(
            "r.yaml",
            &format!(
                "replies:\n  - tool_calls: [{{ name: sh, input: {{ command: \"echo $$ >> {d}/{name}.pids; sleep {secs}; touch {d}/{name}.finished\" }} }}]\n  - text: \"{{{{task}}}}\"\n"
            ),
        )],
    )
}

/// The pids `slow_member(name, dir, _)`'s steps recorded.
fn pids(dir: &Path, name: &str) -> Vec<u32> {
    std::fs::read_to_string(dir.join(format!("{name}.pids")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Defines the fleet `yaml` (its name first).
fn define(sb: &Sandbox, yaml: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.yaml");
    std::fs::write(&path, yaml).unwrap();
    ok(sb, &["create", path.to_str().unwrap()]);
}

/// `mur fleet run ARGS` in the background, against `sb`.
fn spawn_run(sb: &Sandbox, args: &[&str]) -> tokio::task::JoinHandle<Run> {
    let url = sb.nats.url();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run"]).args(&args).env("NATS_URL", url).env("USER", "tester"))
    })
}

fn jobs(sb: &Sandbox, fleet_name: &str) -> Vec<Value> {
    let out = ok(sb, &["jobs", fleet_name, "--all", "--json"]).stdout;
    serde_json::from_str::<Value>(out.trim()).unwrap().as_array().unwrap().clone()
}

/// The stop report on the last `stop` event of `fleet_name`'s channel.
fn stop_report(sb: &Sandbox, fleet_name: &str) -> Value {
    let events: Value = serde_json::from_str(ok(sb, &["log", fleet_name, "--json"]).stdout.trim()).unwrap();
    let stop = events.as_array().unwrap().iter().rev().find(|e| e["kind"] == "stop").expect("a stop event").clone();
    let mut report = stop["stop"].clone();
    assert_eq!(report["run_id"], stop["run_id"]);
    report.as_object_mut().unwrap().remove("run_id");
    report
}

fn status_of<'a>(jobs: &'a [Value], text: &str) -> &'a str {
    jobs.iter().find(|j| j["text"] == text).unwrap_or_else(|| panic!("no job {text:?}"))["status"].as_str().unwrap()
}

/// `marker:TEXT` converges on a member reply with TEXT alone on a line — not on a line
/// that only contains it — and a marker an earlier run left on the channel does not
/// converge a new run, which then ends at its deadline, between iterations.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_marker_alone_on_a_line_converges_the_loop_and_an_earlier_runs_marker_does_not() {
    let sb = Sandbox::start(1, 2).await;
    let member = echo_member("scribe", "0");
    sb.push(member.dir()).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("ship.yaml");
    std::fs::write(&yaml, "name: ship\ngoal: Ship it.\nmembers: [scribe]\nloop:\n  done_when: \"marker:SHIPPED\"\n")
        .unwrap();
    ok(&sb, &["create", yaml.to_str().unwrap()]);
    ok(&sb, &["send", "ship", "first: not SHIPPED yet"]);
    ok(&sb, &["send", "ship", "second:\n  SHIPPED  \nall done"]);
    ok(&sb, &["send", "ship", "third: never reached"]);

    let first = run(&sb, &["ship", "--loop", "--deadline", "5m"]).await;
    assert_eq!(first.code, 0, "{first:?}");
    assert!(first.stderr.contains("done (converged) after 2 iterations"), "{}", first.stderr);
    let all = jobs(&sb, "ship");
    assert_eq!(
        (status_of(&all, "first: not SHIPPED yet"), status_of(&all, "second:\n  SHIPPED  \nall done")),
        ("done", "done")
    );
    assert_eq!(status_of(&all, "third: never reached"), "queued", "the loop stopped when it converged");
    assert_eq!(
        stop_report(&sb, "ship"),
        serde_json::json!({"from": "working", "to": "completed", "stop_reason": "converged", "iterations": 2,
            "spent_usd": 0.0})
    );

    // A new run: the channel still holds the first run's marker, which must not count.
    // It works the third job, then the standing goal, until its deadline.
    let started = std::time::Instant::now();
    let second = run(&sb, &["ship", "--loop", "--deadline", "3s"]).await;
    assert_eq!(second.code, 1, "{second:?}");
    assert!(second.stderr.contains("ended: deadline"), "{}", second.stderr);
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_eq!(status_of(&jobs(&sb, "ship"), "third: never reached"), "done");
    let report = stop_report(&sb, "ship");
    assert_eq!((report["to"].as_str(), report["stop_reason"].as_str()), (Some("failed"), Some("deadline")));
    assert_eq!(
        report["remedy"], "raise the deadline: mur fleet run ship --loop --deadline <D>, or limits.deadline",
        "{report}"
    );
    sb.shutdown().await;
}

/// `mur fleet stop --drain` reaches a running loop before its next iteration: the
/// iteration in flight finishes, no other starts, and the run ends `stopped` (exit 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_draining_stop_lets_the_iteration_in_flight_finish_and_starts_no_other() {
    let sb = Sandbox::start(1, 2).await;
    let member = echo_member("plodder", "2");
    sb.push(member.dir()).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("plod.yaml");
    std::fs::write(&yaml, "name: plod\ngoal: Keep going.\nmembers: [plodder]\nloop:\n  done_when: queue-empty\n")
        .unwrap();
    ok(&sb, &["create", yaml.to_str().unwrap()]);
    for n in 0..5 {
        ok(&sb, &["send", "plod", &format!("job {n}")]);
    }
    let url = sb.nats.url();
    let looping = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run", "plod", "--loop", "--deadline", "5m"]).env("NATS_URL", url))
    });
    // Stop once the first job is running.
    mur_tests::procs::until("the first job running", Duration::from_secs(60), || async {
        jobs(&sb, "plod").iter().any(|j| j["status"] == "running").then_some(())
    })
    .await;
    ok(&sb, &["stop", "plod", "--drain"]);
    let looping = looping.await.unwrap();
    assert_eq!(looping.code, 1, "{looping:?}");
    assert!(looping.stderr.contains("ended: stopped"), "{}", looping.stderr);
    let all = jobs(&sb, "plod");
    let done = all.iter().filter(|j| j["status"] == "done").count();
    let queued = all.iter().filter(|j| j["status"] == "queued").count();
    assert_eq!((done, queued), (1, 4), "the iteration in flight finished and no other started: {all:?}");
    assert_eq!(
        stop_report(&sb, "plod"),
        serde_json::json!({"from": "working", "to": "canceled", "stop_reason": "stopped",
            "remedy": "mur fleet start plod clears the kill-switch", "iterations": 1, "spent_usd": 0.0})
    );
    // A stopped fleet refuses a manual run, naming the kill-switch.
    let refused = run(&sb, &["plod"]).await;
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("stopped"), "{}", refused.stderr);
    sb.shutdown().await;
}

/// `mur fleet stop` stops a loop mid-step (issue #29 item 4): the running step's task ends
/// `canceled` and its command is killed (it never gets to leave its marker), no other step
/// or iteration starts, the job worked on ends `canceled`, the rest stay queued, and the
/// run ends `stopped` long before the step's 30 s of work would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_cancels_a_running_loops_step_kills_its_command_and_starts_nothing_more() {
    let sb = Sandbox::start(1, 2).await;
    let marks = tempfile::tempdir().unwrap();
    let member = slow_member("sloth", marks.path(), 30);
    sb.push(member.dir()).await;
    define(&sb, "name: lazy\ngoal: Rest.\nmembers: [sloth]\nloop:\n  done_when: queue-empty\n");
    for n in 0..3 {
        ok(&sb, &["send", "lazy", &format!("job {n}")]);
    }
    let looping = spawn_run(&sb, &["lazy", "--loop", "--deadline", "5m"]);
    let pid = until("the first step's command running", Duration::from_secs(60), || async {
        pids(marks.path(), "sloth").first().copied()
    })
    .await;
    let asked = std::time::Instant::now();
    ok(&sb, &["stop", "lazy"]);
    let looping = looping.await.unwrap();
    let took = asked.elapsed();
    assert_eq!(looping.code, 1, "{looping:?}");
    assert!(looping.stderr.contains("ended: stopped"), "{}", looping.stderr);
    assert!(took < Duration::from_secs(15), "the run took {took:?} to end after the stop");
    until("the step's command killed", Duration::from_secs(10), || async { proc_gone(pid).then_some(()) }).await;
    assert!(!marks.path().join("sloth.finished").exists(), "the command ran to its end");
    assert_eq!(pids(marks.path(), "sloth"), vec![pid], "no other step started");
    let tasks = sb.tasks().await;
    assert_eq!(tasks.len(), 1, "no other step started: {tasks:#?}");
    assert_eq!(tasks[0].state, TaskState::Canceled, "{:?}", tasks[0]);
    let all = jobs(&sb, "lazy");
    assert_eq!(status_of(&all, "job 0"), "canceled", "{all:?}");
    assert_eq!((status_of(&all, "job 1"), status_of(&all, "job 2")), ("queued", "queued"));
    let report = stop_report(&sb, "lazy");
    assert_eq!((report["to"].as_str(), report["stop_reason"].as_str()), (Some("canceled"), Some("stopped")));
    sb.shutdown().await;
}

/// A one-shot run stopped mid-run ends `stopped`, not `done (converged)` (issue #29 item
/// 4): with `fanout: 1` the first member's step is running and the second's waits for the
/// slot; the stop cancels the first and the second never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_one_shot_run_stopped_midway_ends_stopped_and_its_waiting_step_never_starts() {
    let sb = Sandbox::start(1, 2).await;
    let marks = tempfile::tempdir().unwrap();
    let (first, second) = (slow_member("first", marks.path(), 30), slow_member("second", marks.path(), 30));
    sb.push(first.dir()).await;
    sb.push(second.dir()).await;
    define(&sb, "name: duo\ngoal: Take turns.\nmembers: [first, second]\nfanout: 1\n");
    let once = spawn_run(&sb, &["duo"]);
    let pid = until("the first step's command running", Duration::from_secs(60), || async {
        pids(marks.path(), "first").first().copied()
    })
    .await;
    ok(&sb, &["stop", "duo"]);
    let once = once.await.unwrap();
    assert_eq!(once.code, 1, "{once:?}");
    assert!(once.stderr.contains("ended: stopped"), "{}", once.stderr);
    assert!(!once.stderr.contains("converged"), "{}", once.stderr);
    until("the step's command killed", Duration::from_secs(10), || async { proc_gone(pid).then_some(()) }).await;
    assert!(pids(marks.path(), "second").is_empty(), "the waiting step started");
    let tasks = sb.tasks().await;
    assert_eq!(
        tasks.iter().map(|t| (t.capsule.as_str(), t.state)).collect::<Vec<_>>(),
        [("first", TaskState::Canceled)]
    );
    let report = stop_report(&sb, "duo");
    assert_eq!(report["stop_reason"], "stopped", "{report}");
    sb.shutdown().await;
}

/// The cluster config's `limits:` is the scope after the fleet's own (§The bounds): a
/// run of a fleet without limits takes its deadline from it, and a bad block stops the
/// coordinator at start, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_configs_limits_bound_a_fleet_without_its_own() {
    let cluster = mur_tests::procs::Procs::start("limits:\n  deadline: 45m\n  stuck: off\n").await;
    let _coordinator = cluster.coordinator("coordinator-1");
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("c.yaml");
    std::fs::write(&yaml, "name: scoped\ngoal: g.\nmembers: [nobody]\nlimits:\n  stuck: 5m\n").unwrap();
    let created = mur_tests::procs::until("the coordinator answers", Duration::from_secs(30), || async {
        let out = cluster.command().args(["fleet", "create", yaml.to_str().unwrap()]).output().ok()?;
        out.status.success().then_some(())
    });
    created.await;
    let run = cluster.command().args(["fleet", "run", "scoped", "--json"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.starts_with("bounds: deadline 45m ← config.yaml; stuck 5m ← fleet.yaml\n"),
        "per key: the fleet's stuck, the cluster's deadline: {stderr}"
    );

    let bad = mur_tests::procs::Procs::start("limits:\n  deadline: 2026-12-31\n").await;
    let out = bad.command().args(["coordinator", "--config"]).arg(bad.dir().join("config.yaml")).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("limits.deadline: must be a duration"), "{stderr}");
}

/// Issue #29 items 5 and 13, off a terminal: `--max-iterations N` is accepted and ignored
/// with the seed's notice (it was refused: `unexpected argument`); the `bounds:` line and
/// each notice are printed once (the run's channel repeats them, and they were printed
/// again as milestones); the run id is labelled on stdout; no status line comes twice in a
/// row; and a step of 3 s is not a silence: with `MUR_FOLLOW_EVERY_SECS=1` the status comes
/// again each second with the running member's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_followed_loop_says_its_bounds_and_notices_once_and_never_falls_silent() {
    let sb = Sandbox::start(1, 2).await;
    let member = echo_member("slowpoke", "3");
    sb.push(member.dir()).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("slow.yaml");
    std::fs::write(&yaml, "name: slow\ngoal: Go.\nmembers: [slowpoke]\nloop:\n  done_when: queue-empty\n").unwrap();
    ok(&sb, &["create", yaml.to_str().unwrap()]);
    ok(&sb, &["send", "slow", "the one job"]);
    let mut cmd = mur();
    cmd.args(["fleet", "run", "slow", "--loop", "--deadline", "5m", "--max-iterations", "5"])
        .env("NATS_URL", sb.nats.url())
        .env("MUR_FOLLOW_EVERY_SECS", "1");
    let run = mur_tests::mur::run_blocking(cmd).await;
    assert_eq!(run.code, 0, "{run:?}");
    let err: Vec<&str> = run.stderr.lines().collect();
    assert_eq!(err[0], "bounds: deadline 5m ← --deadline; stuck 10m ← built-in", "{}", run.stderr);
    assert_eq!(run.stderr.matches("deadline 5m ← --deadline").count(), 1, "the bounds once: {}", run.stderr);
    let ignored = "notice: --max-iterations is ignored: loops are bounded by deadline, stuck and cost \
                   (a 10000-iteration diagnostic ceiling remains)";
    assert_eq!(err.iter().filter(|l| **l == ignored).count(), 1, "{}", run.stderr);
    let mut notices: Vec<&str> = err.iter().copied().filter(|l| l.contains("notice: ")).collect();
    let all = notices.len();
    notices.sort();
    notices.dedup();
    assert_eq!(notices.len(), all, "each notice once: {}", run.stderr);
    assert!(all >= 2, "the scripted members' unpriced-model notice too: {}", run.stderr);
    let id = run.run_id();
    assert!(id.starts_with("fleet-slow-"), "{run:?}");
    assert!(run.stdout.starts_with(&format!("run {id} started on coordinator ")), "{run:?}");
    let status: Vec<&str> = err.iter().copied().filter(|l| l.starts_with("status: ")).collect();
    assert!(status.windows(2).all(|w| w[0] != w[1]), "a status line twice in a row: {}", run.stderr);
    assert_eq!(status[0], "status: slowpoke waiting | permits 0 in use | spend $0.0000", "{}", run.stderr);
    let timed = status.iter().filter(|l| l.starts_with("status: slowpoke running ") && l.contains("s |")).count();
    assert!(timed >= 2, "the running step's time, at least every second: {}", run.stderr);
    assert!(err.last().unwrap().starts_with(&format!("run {id} done (queue-drained) after ")), "{}", run.stderr);
    sb.shutdown().await;
}

/// A follower whose cluster goes away (its nats-server killed) gives up after 30 s
/// without an answer — exit 2, saying so and naming the run — instead of following
/// nothing past the run's deadline (issue #29: on a fresh machine a `mur fleet run --loop
/// --deadline 10m` outlived its server by 20 minutes and kept its test binary running).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_whose_cluster_is_gone_gives_up_after_30_s_with_exit_2() {
    let mut sb = Sandbox::start(1, 2).await;
    sb.push(echo_member("spinner", "0").dir()).await;
    define(&sb, "name: spin\ngoal: Spin.\nmembers: [spinner]\nloop:\n  done_when: \"marker:NEVER\"\n");
    let mut follower = mur_tests::mur::Background::spawn(
        mur()
            .args(["fleet", "run", "spin", "--loop", "--deadline", "10m", "--run-id", "gone", "--json"])
            .env("NATS_URL", sb.nats.url())
            .env("USER", "tester"),
    );
    let started = follower.next_json(Duration::from_secs(60));
    assert_eq!((started["type"].as_str(), started["run_id"].as_str()), (Some("run"), Some("gone")), "{started}");
    sb.nats.kill();
    let killed = std::time::Instant::now();
    let (code, stderr) = tokio::task::spawn_blocking(move || follower.wait(Duration::from_secs(150))).await.unwrap();
    let waited = killed.elapsed();
    assert_eq!(code, Some(2), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    let said: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("not JSON ({e}): {last}"));
    assert_eq!(
        said["error"],
        "the cluster has not answered for 30 s; stopped following run gone, which goes on if the cluster does (mur fleet status spin)",
        "{stderr}"
    );
    assert!(waited >= Duration::from_secs(30), "gave up after {waited:?}, before 30 s without an answer");
}
