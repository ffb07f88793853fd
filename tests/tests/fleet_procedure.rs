//! Fleets with a `procedure:` on the cluster (the fleet-loops seed, §A fixed step graph,
//! §Unattended runs; the fleet reference, §6, §9 "Procedure / planning / fan-out"): the
//! real `mur` binary asks the leading coordinator to run; the coordinator sends each step
//! as a `peer` task to workers running scripted capsules, rank by rank.

use mur_proto::cluster::TaskRecord;
use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, mur};
use mur_tests::sandbox::Sandbox;
use serde_json::{Value, json};

/// The reply contract every procedure step ends with (reference §6, §8 #595).
const CONTRACT: &str = "End your reply with a \"Completion:\" checklist: one line per part of your step, \
                        \"- [x]\" when it is done and \"- [ ]\" when it is not.";

fn fleet(sb: &Sandbox, args: &[&str]) -> Run {
    sb.fleet(args)
}

fn ok(sb: &Sandbox, args: &[&str]) -> Run {
    sb.fleet_ok(args)
}

/// `mur fleet run ARGS` off the async runtime (the coordinator runs in this process).
async fn run(sb: &Sandbox, args: &[&str]) -> Run {
    sb.fleet_blocking(&[&["run"], args].concat()).await
}

/// A scripted capsule that answers every task with `reply`, or fails every task when
/// `reply` is `None` (the model reports an error).
fn capsule(name: &str, reply: Option<&str>) -> TestCapsule {
    let replies = match reply {
        Some(text) => format!("replies:\n  - text: {text:?}\n"),
        None => "replies:\n  - stop_reason: error\n    error: the model broke\n".to_string(),
    };
    TestCapsule::new(
        &format!("name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n"),
        &[("r.yaml", replies.as_str())],
    )
}

async fn push(sb: &Sandbox, capsules: &[TestCapsule]) {
    for c in capsules {
        sb.push(c.dir()).await;
    }
}

fn define(sb: &Sandbox, yaml: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.yaml");
    std::fs::write(&path, yaml).unwrap();
    ok(sb, &["apply", path.to_str().unwrap()]);
}

async fn tasks(sb: &Sandbox) -> Vec<TaskRecord> {
    sb.tasks().await
}

fn jobs(sb: &Sandbox, name: &str) -> Vec<Value> {
    serde_json::from_str::<Value>(ok(sb, &["jobs", name, "--all", "--json"]).stdout.trim())
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn task_for<'a>(tasks: &'a [TaskRecord], step: &str) -> &'a TaskRecord {
    let label = format!("\n\nStep {step}");
    let found: Vec<&TaskRecord> = tasks.iter().filter(|t| t.text.contains(&label)).collect();
    assert_eq!(found.len(), 1, "one task for step {step}: {tasks:#?}");
    found[0]
}

const ESSAY: &str = "\
name: essay
goal: Write about rivers.
members: [writer, critic]
router: critic
procedure:
  - id: draft
    member: writer
    task: Draft the answer.
  - id: facts
    member: critic
    task: List three facts.
  - id: review
    member: critic
    task: Find the weakest claim.
    depends_on: [draft]
";

/// A 3-step procedure: `draft` and `facts` (rank 0) run at once, `review` (rank 1) starts
/// only after both ended and is sent the work, its task, `draft`'s output labelled by the
/// step id, and the reply contract — exactly. The router is never asked (no task for it
/// beyond its member steps), and the job is done with every step's output.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_procedure_runs_rank_by_rank_and_a_dependent_step_is_sent_its_dependencys_output() {
    let sb = Sandbox::start(1, 4).await;
    push(&sb, &[capsule("writer", Some("Rivers flow downhill.")), capsule("critic", Some("Noted."))]).await;
    define(&sb, ESSAY);
    let job = ok(&sb, &["send", "essay", "Write about the Rhine."]).sent_job_id();

    let ran = run(&sb, &["essay"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stderr.contains("done (converged) after 1 iteration"), "{}", ran.stderr);

    let tasks = tasks(&sb).await;
    assert_eq!(tasks.len(), 3, "one task per step, none for the router: {tasks:#?}");
    let (draft, facts, review) = (task_for(&tasks, "draft"), task_for(&tasks, "facts"), task_for(&tasks, "review"));
    assert_eq!(draft.text, format!("Write about the Rhine.\n\nStep draft: Draft the answer.\n\n{CONTRACT}"));
    assert_eq!(
        review.text,
        format!(
            "Write about the Rhine.\n\nStep review: Find the weakest claim.\n\nOutput of step draft:\n\
             Rivers flow downhill.\n\n{CONTRACT}"
        )
    );
    assert_eq!((draft.capsule.as_str(), review.capsule.as_str()), ("writer", "critic"));
    assert!(draft.deadline_at.is_some() && review.deadline_at.is_some());
    // Rank 1 was submitted only after both rank-0 steps had ended.
    let rank0_end = draft.ended_at.unwrap().max(facts.ended_at.unwrap());
    assert!(review.submitted_at >= rank0_end, "review {} before rank 0 ended {rank0_end}", review.submitted_at);
    // Rank 0's steps were both submitted before either of them had ended.
    assert!(facts.submitted_at <= draft.ended_at.unwrap() && draft.submitted_at <= facts.ended_at.unwrap());

    let jobs = jobs(&sb, "essay");
    assert_eq!(jobs[0]["id"], job.as_str());
    assert_eq!(jobs[0]["status"], "done");
    assert_eq!(jobs[0]["result"], "[draft]\nRivers flow downhill.\n\n[facts]\nNoted.\n\n[review]\nNoted.");
    let log = ok(&sb, &["log", "essay"]).stdout;
    for line in ["system delegation: writer ← step draft", "system delegation: critic ← step review"] {
        assert!(log.contains(line), "{line}: {log}");
    }
    assert!(!log.contains("← plan"), "the router is not asked: {log}");
    sb.shutdown().await;
}

/// A dependency cycle is refused when the run starts, naming the field and the steps;
/// nothing runs and the job stays queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_procedure_with_a_cycle_is_refused_when_the_run_starts() {
    let sb = Sandbox::start(1, 2).await;
    push(&sb, &[capsule("writer", Some("x"))]).await;
    define(
        &sb,
        "name: cyc\nmembers: [writer]\nprocedure:\n  - id: a\n    member: writer\n    depends_on: [b]\n  \
         - id: b\n    member: writer\n    depends_on: [a]\n",
    );
    ok(&sb, &["send", "cyc", "go"]);
    let ran = run(&sb, &["cyc"]).await;
    assert_eq!((ran.code, ran.stdout.as_str()), (2, ""), "{ran:?}");
    assert_eq!(
        ran.stderr,
        "mur fleet run: refused: invalid_request: fleet 'cyc': procedure: dependency cycle among steps \"a\", \"b\"\n"
    );
    assert_eq!(tasks(&sb).await.len(), 0);
    assert_eq!(jobs(&sb, "cyc")[0]["status"], "queued");
    sb.shutdown().await;
}

fn failing(name: &str, policy: &str) -> String {
    format!(
        "name: {name}\nmembers: [writer, broken]\nprocedure:\n  - id: first\n    member: broken\n{policy}  \
         - id: side\n    member: writer\n  - id: after\n    member: writer\n    depends_on: [side]\n"
    )
}

/// `on_failure`: `abort` (the default) lets the failed step's rank finish and starts no
/// later rank — the run ends `iteration-failed`, the job `failed`; `skip` goes on and the
/// job is done; `retry` sends the step again `max_retries` times, then aborts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn abort_stops_later_ranks_skip_goes_on_and_retry_sends_the_step_again() {
    let sb = Sandbox::start(1, 4).await;
    push(&sb, &[capsule("writer", Some("Written.")), capsule("broken", None)]).await;

    define(&sb, &failing("abort", ""));
    ok(&sb, &["send", "abort", "work"]);
    let ran = run(&sb, &["abort"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(ran.stderr.contains("ended: iteration-failed"), "{}", ran.stderr);
    let all = tasks(&sb).await;
    assert_eq!(all.len(), 2, "rank 0 only: {all:#?}");
    let failure = task_for(&all, "first").result.clone().unwrap_or_default();
    assert!(failure.contains("the model broke"), "{failure}");
    let job = &jobs(&sb, "abort")[0];
    assert_eq!(job["status"], "failed");
    assert_eq!(
        job["result"],
        format!("[first] failed:\n{failure}\n\n[side]\nWritten.\n\n[after] not run: the run stopped first")
    );

    define(&sb, &failing("skip", "    on_failure: skip\n"));
    ok(&sb, &["send", "skip", "work"]);
    let ran = run(&sb, &["skip"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(tasks(&sb).await.len(), 2 + 3);
    let job = &jobs(&sb, "skip")[0];
    assert_eq!(job["status"], "done");
    assert_eq!(
        job["result"],
        format!("[first] skipped after failing:\n{failure}\n\n[side]\nWritten.\n\n[after]\nWritten.")
    );

    define(&sb, &failing("retry", "    on_failure: retry\n    max_retries: 2\n"));
    ok(&sb, &["send", "retry", "work"]);
    let ran = run(&sb, &["retry"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    let all = tasks(&sb).await;
    assert_eq!(all.len(), 5 + 3 + 1, "three tries of first, side; not after: {all:#?}");
    let log = ok(&sb, &["log", "retry"]).stdout;
    assert!(log.contains("system delegation: broken ← step first (attempt 3 of 3)"), "{log}");
    assert_eq!(jobs(&sb, "retry")[0]["status"], "failed");
    sb.shutdown().await;
}

const GATE: &str = "\
name: gate
members: [writer, critic]
procedure:
  - id: deploy
    member: writer
    task: Deploy it.
    tier: destructive
  - id: check
    member: critic
    task: Check it.
  - id: announce
    member: critic
    task: Announce it.
    depends_on: [deploy]
";

/// `hitl` (§Unattended runs): a step whose tier is not auto-approved is parked — the job
/// goes `blocked`, its dependent is not run, the independent branch completes, and the run
/// ends `awaiting-approval`. `mur fleet approve` answers it; the next run takes the job,
/// runs the parked step and its dependent (sent the parked step's output), does not run
/// the completed step again, and the job is done. `mur fleet deny` fails the step instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_job_is_approved_and_the_next_run_continues_from_the_parked_step() {
    let sb = Sandbox::start(1, 4).await;
    push(&sb, &[capsule("writer", Some("Deployed.")), capsule("critic", Some("Checked."))]).await;
    define(&sb, GATE);
    let job = ok(&sb, &["send", "gate", "Ship v2."]).sent_job_id();

    let ran = run(&sb, &["gate"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(ran.stderr.contains("ended: awaiting-approval"), "{}", ran.stderr);
    let all = tasks(&sb).await;
    assert_eq!(all.iter().map(|t| t.capsule.as_str()).collect::<Vec<_>>(), ["critic"], "only check ran");
    let parked = &jobs(&sb, "gate")[0];
    assert_eq!(parked["status"], "blocked");
    assert_eq!(parked["approval"], json!({"steps": ["deploy"], "decision": null, "by": null, "at": null}));
    assert_eq!(parked["steps_done"], json!({"check": "Checked."}));
    assert_eq!(
        parked["result"],
        "[deploy] awaits approval\n\n[check]\nChecked.\n\n[announce] not run: depends on step deploy, which awaits approval"
    );
    let log = ok(&sb, &["log", "gate"]).stdout;
    assert!(
        log.contains(&format!("system note: step deploy (destructive) awaits approval: mur fleet approve gate {job}")),
        "{log}"
    );
    assert!(
        log.contains(&format!("system state-change: job {job} blocked: awaiting approval of step deploy")),
        "{log}"
    );
    // The stop's remedy names the blocked job.
    assert!(
        log.contains(&format!("; approve the parked steps: mur fleet approve gate {job}, then run it again")),
        "{log}"
    );
    // Nothing to approve on a job that is not blocked; a blocked job is not taken again
    // before it is answered.
    let done_job = ok(&sb, &["send", "gate", "Other work."]).sent_job_id();
    let not_blocked = fleet(&sb, &["approve", "gate", &done_job]);
    assert_eq!(
        (not_blocked.code, not_blocked.stderr.trim()),
        (2, format!("mur: conflict: job {done_job} is not awaiting approval (it is queued)").as_str())
    );
    ok(&sb, &["cancel", "gate", &done_job]);

    let approved = ok(&sb, &["approve", "gate", &job[..job.len() - 4]]);
    assert_eq!(approved.stdout, format!("approved job {job} (step deploy); the next run of the fleet takes it\n"));
    let again = fleet(&sb, &["approve", "gate", &job]);
    assert_eq!(
        (again.code, again.stderr.trim()),
        (2, format!("mur: conflict: job {job} was already approved by tester; the next run takes it").as_str())
    );

    let ran = run(&sb, &["gate"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let all = tasks(&sb).await;
    assert_eq!(all.len(), 3, "deploy and announce ran, check did not run again: {all:#?}");
    assert_eq!(
        task_for(&all, "announce").text,
        format!("Ship v2.\n\nStep announce: Announce it.\n\nOutput of step deploy:\nDeployed.\n\n{CONTRACT}")
    );
    let finished = jobs(&sb, "gate").into_iter().find(|j| j["id"] == job.as_str()).unwrap();
    assert_eq!(finished["status"], "done");
    assert_eq!(finished["result"], "[deploy]\nDeployed.\n\n[check]\nChecked.\n\n[announce]\nChecked.");
    assert_eq!(finished["approval"]["decision"], "approved");
    let log = ok(&sb, &["log", "gate"]).stdout;
    assert!(log.contains("system note: step deploy (destructive) approved by tester"), "{log}");

    // Denied: the parked step fails (on_failure abort), the job fails.
    let denied_job = ok(&sb, &["send", "gate", "Ship v3."]).sent_job_id();
    assert_eq!(run(&sb, &["gate"]).await.code, 1);
    let denied = ok(&sb, &["deny", "gate", &denied_job, "--by", "ops"]);
    assert_eq!(denied.stdout, format!("denied job {denied_job} (step deploy); the next run of the fleet takes it\n"));
    let ran = run(&sb, &["gate"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(ran.stderr.contains("ended: iteration-failed"), "{}", ran.stderr);
    let failed = jobs(&sb, "gate").into_iter().find(|j| j["id"] == denied_job.as_str()).unwrap();
    assert_eq!(failed["status"], "failed");
    assert_eq!(
        failed["result"],
        "[deploy] failed:\ndenied by ops\n\n[check]\nChecked.\n\n[announce] not run: the run stopped first"
    );
    sb.shutdown().await;
}

/// `needs:` travels with every delegated step (reference §1, §9 "Delegates receive … the
/// fleet's `needs`"), with the loop's time left; the worker checks them before it starts
/// a session, and a step whose needs are not on its `PATH` fails without running.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delegates_receive_the_fleets_needs_and_a_worker_without_one_does_not_start_the_step() {
    let sb = Sandbox::start(1, 2).await;
    push(&sb, &[capsule("writer", Some("Written."))]).await;
    define(&sb, "name: tools\nmembers: [writer]\nneeds: [sh]\n");
    ok(&sb, &["send", "tools", "first"]);
    let ran = run(&sb, &["tools"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let all = tasks(&sb).await;
    assert_eq!((all[0].needs.clone(), all[0].result.as_deref()), (vec!["sh".to_string()], Some("Written.")));
    let deadline = all[0].deadline_at.expect("the time left travels with the step");
    assert!(deadline > all[0].submitted_at && deadline <= all[0].submitted_at + 3_600_000, "{deadline}");

    define(&sb, "name: tools\nmembers: [writer]\nneeds: [sh, mur-no-such-tool]\n");
    ok(&sb, &["send", "tools", "second"]);
    let ran = run(&sb, &["tools"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    let job = jobs(&sb, "tools").into_iter().find(|j| j["text"] == "second").unwrap();
    assert_eq!(job["status"], "failed");
    assert_eq!(job["result"], "needs: mur-no-such-tool not on this worker's PATH; the task did not start");
    sb.shutdown().await;
}

/// `parallel:` (reference §6, Broadcast): one step per track, members taken in turn, each
/// sent the work with its track's `Approach:`; the job's result has every track's reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parallel_tracks_each_send_the_work_with_their_approach_to_members_in_turn() {
    let sb = Sandbox::start(1, 4).await;
    push(&sb, &[capsule("writer", Some("Written.")), capsule("critic", Some("Noted."))]).await;
    define(
        &sb,
        "name: spec\nmembers: [writer, critic]\nparallel:\n  mode: speculative\n  tracks:\n    - name: one\n      \
         approach: top-down\n    - name: two\n      approach: bottom-up\n    - name: three\n",
    );
    ok(&sb, &["send", "spec", "Fix the bug."]);
    let ran = run(&sb, &["spec"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let mut sent: Vec<(String, String)> = tasks(&sb).await.into_iter().map(|t| (t.capsule, t.text)).collect();
    sent.sort();
    assert_eq!(
        sent,
        [
            ("critic".to_string(), "Fix the bug.\n\nApproach: bottom-up".to_string()),
            ("writer".to_string(), "Fix the bug.".to_string()),
            ("writer".to_string(), "Fix the bug.\n\nApproach: top-down".to_string()),
        ]
    );
    let job = &jobs(&sb, "spec")[0];
    assert_eq!(job["status"], "done");
    assert_eq!(job["result"], "[writer]\nWritten.\n\n[critic]\nNoted.\n\n[writer]\nWritten.");
    sb.shutdown().await;
}

/// The fan-out bound (§The bounds): with `fanout: 1` the steps of a rank — a broadcast's
/// or a procedure's — are sent one after the other, each once the previous one ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fanout_key_caps_the_steps_in_flight_for_broadcasts_and_procedure_ranks() {
    let sb = Sandbox::start(1, 4).await;
    push(&sb, &[capsule("writer", Some("Written.")), capsule("critic", Some("Noted."))]).await;
    let one_at_a_time = |tasks: &mut Vec<TaskRecord>| {
        tasks.sort_by_key(|t| t.submitted_at);
        for pair in tasks.windows(2) {
            assert!(
                pair[1].submitted_at >= pair[0].ended_at.unwrap(),
                "{} sent before {} ended: {tasks:#?}",
                pair[1].task_id,
                pair[0].task_id
            );
        }
    };
    define(
        &sb,
        "name: wide\ngoal: Go.\nmembers: [writer, critic]\nfanout: 1\nparallel:\n  mode: speculative\n  tracks:\n    \
         - name: a\n    - name: b\n    - name: c\n",
    );
    assert_eq!(run(&sb, &["wide"]).await.code, 0);
    let mut sent = tasks(&sb).await;
    assert_eq!(sent.len(), 3);
    one_at_a_time(&mut sent);

    define(
        &sb,
        "name: steps\ngoal: Go.\nmembers: [writer, critic]\nfanout: 1\nprocedure:\n  - id: a\n    member: writer\n  \
         - id: b\n    member: critic\n  - id: c\n    member: writer\n",
    );
    assert_eq!(run(&sb, &["steps"]).await.code, 0);
    let mut sent: Vec<TaskRecord> = tasks(&sb).await.into_iter().filter(|t| t.text.contains("\n\nStep ")).collect();
    assert_eq!(sent.len(), 3);
    one_at_a_time(&mut sent);
    sb.shutdown().await;
}

/// `mur fleet stop` stops a procedure midway (issue #29 item 4): of 30 steps sent one at a
/// time (`fanout: 1`), the one running when the stop comes is canceled, no step is sent
/// after the stop has answered, the job ends `canceled` and the run `stopped`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_procedure_stopped_midway_starts_no_more_steps_and_ends_stopped() {
    let sb = Sandbox::start(1, 2).await;
    let plodder = TestCapsule::new(
        "name: plodder\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\ncapabilities:\n  shell:\n    allow: [sh]\n",
        &[("r.yaml", "replies:\n  - tool_calls: [{ name: sh, input: { command: \"sleep 1\" } }]\n  - text: Done.\n")],
    );
    push(&sb, &[plodder]).await;
    let steps: String = (0..30).map(|n| format!("  - id: s{n}\n    member: plodder\n")).collect();
    define(&sb, &format!("name: thirty\ngoal: Go.\nmembers: [plodder]\nfanout: 1\nprocedure:\n{steps}"));
    let job = ok(&sb, &["send", "thirty", "Thirty steps."]).sent_job_id();
    let url = sb.nats.url();
    let running = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run", "thirty", "--deadline", "5m"]).env("NATS_URL", url))
    });
    mur_tests::procs::until("three steps sent", std::time::Duration::from_secs(60), || async {
        (tasks(&sb).await.len() >= 3).then_some(())
    })
    .await;
    ok(&sb, &["stop", "thirty"]);
    let answered = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let ran = running.await.unwrap();
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(ran.stderr.contains("ended: stopped"), "{}", ran.stderr);
    let all = tasks(&sb).await;
    assert!(all.len() < 30, "{} steps ran", all.len());
    let late: Vec<_> = all.iter().filter(|t| t.submitted_at > answered).collect();
    assert!(late.is_empty(), "steps sent after the stop answered: {late:#?}");
    let canceled = all.iter().filter(|t| t.state == mur_proto::task::TaskState::Canceled).count();
    // The stop may land between two steps (none running); at most the one running is canceled.
    assert!(canceled <= 1, "{all:#?}");
    assert!(all.iter().all(|t| t.state.is_terminal()), "{all:#?}");
    let job = jobs(&sb, "thirty").into_iter().find(|j| j["id"] == job.as_str()).unwrap();
    assert_eq!(job["status"], "canceled", "{job}");
    sb.shutdown().await;
}

/// `hitl.mode: wait`: the run parks the step on the job (`blocked`) and waits for the
/// answer instead of ending; `mur fleet approve` given while it waits lets the same run go
/// on — the parked step and its dependent run, and the run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_hitl_mode_wait_the_run_waits_for_the_approval_and_goes_on() {
    let sb = Sandbox::start(1, 4).await;
    push(&sb, &[capsule("writer", Some("Deployed.")), capsule("critic", Some("Checked."))]).await;
    define(&sb, &GATE.replace("members: [writer, critic]\n", "members: [writer, critic]\nhitl:\n  mode: wait\n"));
    let job = ok(&sb, &["send", "gate", "Ship v2."]).sent_job_id();
    let url = sb.nats.url();
    let running = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run", "gate", "--deadline", "2m"]).env("NATS_URL", url))
    });
    let kv =
        async_nats::jetstream::new(sb.client.clone()).get_key_value(mur_proto::fleet_store::JOBS_BUCKET).await.unwrap();
    let key = mur_proto::fleet_store::job_key("gate", &job);
    let parked: Value = mur_tests::procs::until("the job blocked", std::time::Duration::from_secs(30), || async {
        let v: Value = serde_json::from_slice(&kv.get(&key).await.ok()??).ok()?;
        (v["status"] == "blocked").then_some(v)
    })
    .await;
    assert_eq!(parked["approval"], json!({"steps": ["deploy"], "decision": null, "by": null, "at": null}));
    assert_eq!(parked["steps_done"], json!({"check": "Checked."}));
    ok(&sb, &["approve", "gate", &job]);
    let ran = running.await.unwrap();
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stderr.contains("done (converged) after 1 iteration"), "{}", ran.stderr);
    let all = tasks(&sb).await;
    assert_eq!(all.len(), 3, "{all:#?}");
    let done = &jobs(&sb, "gate")[0];
    assert_eq!(done["status"], "done");
    assert_eq!(done["result"], "[deploy]\nDeployed.\n\n[check]\nChecked.\n\n[announce]\nChecked.");
    let log = ok(&sb, &["log", "gate"]).stdout;
    assert!(
        log.contains(&format!(
            "system state-change: job {job} blocked: waiting for approval of step deploy (hitl.mode wait)"
        )),
        "{log}"
    );
    assert!(log.contains("system note: step deploy (destructive) approved by tester"), "{log}");
    sb.shutdown().await;
}

/// A parked step of the standing goal (no job queued) still gets a handle: the run stores
/// a job for the goal (source `goal`, `blocked`), the note names it, and once approved the
/// next run takes it and continues from the parked step.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_parked_standing_goal_becomes_a_blocked_job_that_can_be_approved() {
    let sb = Sandbox::start(1, 4).await;
    push(&sb, &[capsule("writer", Some("Deployed.")), capsule("critic", Some("Checked."))]).await;
    define(&sb, &GATE.replace("name: gate\n", "name: gate\ngoal: Keep prod current.\n"));
    let ran = run(&sb, &["gate"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(ran.stderr.contains("ended: awaiting-approval"), "{}", ran.stderr);
    let listed = jobs(&sb, "gate");
    assert_eq!(listed.len(), 1);
    let job = listed[0]["id"].as_str().unwrap().to_string();
    assert_eq!(
        (&listed[0]["status"], &listed[0]["source"], &listed[0]["text"]),
        (&json!("blocked"), &json!("goal"), &json!("Keep prod current."))
    );
    assert_eq!(listed[0]["approval"]["steps"], json!(["deploy"]));
    let log = ok(&sb, &["log", "gate"]).stdout;
    assert!(
        log.contains(&format!("system note: step deploy (destructive) awaits approval: mur fleet approve gate {job}")),
        "{log}"
    );
    assert!(
        log.contains(&format!("; approve the parked steps: mur fleet approve gate {job}, then run it again")),
        "{log}"
    );
    ok(&sb, &["approve", "gate", &job]);
    let ran = run(&sb, &["gate"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let done = &jobs(&sb, "gate")[0];
    assert_eq!(done["status"], "done");
    assert_eq!(done["result"], "[deploy]\nDeployed.\n\n[check]\nChecked.\n\n[announce]\nChecked.");
    assert_eq!(tasks(&sb).await.len(), 3, "check ran once");
    sb.shutdown().await;
}

/// The README's `examples/fleets/release.yaml` with the `examples/reviewer` capsule: the
/// first run parks `publish` (and so `announce`) while `notes` and the auto-approved
/// `checks` run; after `mur fleet approve` the next run finishes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_release_example_parks_publish_until_it_is_approved() {
    let sb = Sandbox::start(1, 4).await;
    sb.push(&mur_tests::capsule::repo_root().join("examples/reviewer")).await;
    let file = mur_tests::capsule::repo_root().join("examples/fleets/release.yaml");
    ok(&sb, &["create", file.to_str().unwrap()]);
    let job = ok(&sb, &["send", "release", "Release v2.1."]).sent_job_id();
    let ran = run(&sb, &["release"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(ran.stderr.contains("ended: awaiting-approval"), "{}", ran.stderr);
    let log = ok(&sb, &["log", "release"]).stdout;
    assert!(log.contains("system note: step checks (read) auto-approved by hitl.auto_approve_tiers"), "{log}");
    assert_eq!(jobs(&sb, "release")[0]["approval"]["steps"], json!(["publish"]));
    ok(&sb, &["approve", "release", &job]);
    let ran = run(&sb, &["release"]).await;
    assert_eq!(ran.code, 0, "{ran:?}");
    let done = &jobs(&sb, "release")[0];
    assert_eq!(done["status"], "done");
    let result = done["result"].as_str().unwrap();
    let announce = result.split("[announce]\n").nth(1).unwrap();
    assert!(
        announce.starts_with(
            "reviewed: Release v2.1.\n\nStep announce: Announce it.\n\nOutput of step publish:\n\
             reviewed: Release v2.1.\n\nStep publish: Publish the release."
        ),
        "{result}"
    );
    assert_eq!(tasks(&sb).await.len(), 4, "each step ran once");
    sb.shutdown().await;
}

/// A delegation the task API refuses (here: a member capsule never pushed) fails the step
/// and is written as a `note`, not as a member's reply (reference §6).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_delegation_fails_the_step_and_is_noted() {
    let sb = Sandbox::start(1, 2).await;
    define(&sb, "name: ghost\nmembers: [nobody]\nprocedure:\n  - id: a\n    member: nobody\n");
    ok(&sb, &["send", "ghost", "Go."]);
    let ran = run(&sb, &["ghost"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    assert!(ran.stderr.contains("ended: iteration-failed"), "{}", ran.stderr);
    let refusal = "not_found: capsule: no capsule named \"nobody\" (push it with `mur capsule push`)";
    let log = ok(&sb, &["log", "ghost"]).stdout;
    assert!(
        log.contains(&format!("system note: step a: the delegation to nobody was refused: {refusal} [run ")),
        "{log}"
    );
    assert!(!log.contains("member:nobody"), "no member replied: {log}");
    assert_eq!(tasks(&sb).await.len(), 0);
    let job = &jobs(&sb, "ghost")[0];
    assert_eq!(job["status"], "failed");
    assert_eq!(job["result"], format!("[a] failed:\nerror: the delegated task was refused: {refusal}"));
    sb.shutdown().await;
}

/// The same for a broadcast (no `procedure:`): the refusal's reason reaches the job's result
/// and the channel, as a system note — not as the member's reply, which would count as its
/// progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_broadcast_delegation_keeps_its_reason_and_is_noted() {
    let sb = Sandbox::start(1, 2).await;
    define(&sb, "name: ghosts\nmembers: [nobody]\n");
    ok(&sb, &["send", "ghosts", "Go."]);
    let ran = run(&sb, &["ghosts"]).await;
    assert_eq!(ran.code, 1, "{ran:?}");
    let refusal = "not_found: capsule: no capsule named \"nobody\" (push it with `mur capsule push`)";
    let log = ok(&sb, &["log", "ghosts"]).stdout;
    assert!(log.contains(&format!("system note: the delegation to nobody was refused: {refusal} [run ")), "{log}");
    assert!(!log.contains("member:nobody"), "no member replied: {log}");
    let job = &jobs(&sb, "ghosts")[0];
    assert_eq!(job["status"], "failed");
    assert!(
        job["result"].as_str().unwrap().contains(&format!("error: the delegated task was refused: {refusal}")),
        "{job}"
    );
    sb.shutdown().await;
}
