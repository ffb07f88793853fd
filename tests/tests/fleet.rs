//! `mur fleet …` against an in-process cluster (issue #10, storage/API/CLI part): the real
//! `mur` binary talks to the coordinator's `mur.api.fleet.*` endpoints, which keep fleets in
//! `mur_fleets`, jobs in `mur_jobs` and the channel in `MUR_FLEET`. What a run engine would
//! write (claimed and finished jobs, member replies) is written here straight into the
//! buckets and the stream.

use anyhow::Result;
use mur_coordinator::fleet::api::Fleets;
use mur_proto::fleet::{Job, JobStatus};
use mur_proto::fleet_store::{self, Author, ChannelEvent, EventKind, Sentinel, StopState};
use mur_tests::mur::{Run, example, mur};
use mur_tests::sandbox::Sandbox;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn fleet(sb: &Sandbox, args: &[&str]) -> Run {
    sb.fleet(args)
}

fn ok(sb: &Sandbox, args: &[&str]) -> Run {
    sb.fleet_ok(args)
}

/// Runs `mur fleet ARGS`, expects it refused, and returns its stderr.
fn refused(sb: &Sandbox, args: &[&str]) -> String {
    let run = fleet(sb, args);
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "mur fleet {args:?} should be refused: {run:?}");
    run.stderr
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

async fn fleets_kv(sb: &Sandbox) -> async_nats::jetstream::kv::Store {
    async_nats::jetstream::new(sb.client.clone()).get_key_value(fleet_store::FLEETS_BUCKET).await.unwrap()
}

async fn jobs_kv(sb: &Sandbox) -> async_nats::jetstream::kv::Store {
    async_nats::jetstream::new(sb.client.clone()).get_key_value(fleet_store::JOBS_BUCKET).await.unwrap()
}

/// A handle on the fleet state as another coordinator would hold it.
async fn handle(sb: &Sandbox) -> Fleets {
    let js = async_nats::jetstream::new(sb.nats.connect().await);
    let res = mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await.unwrap();
    Fleets::new(js, &res, "test")
}

const PAIR: &str = "name: pair\ngoal: Answer the question.\nmembers: [writer, critic]\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitions_round_trip_through_create_apply_ls_show_and_rm() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    let builder = example("examples/fleets/builder.yaml");
    let builder = builder.to_str().unwrap();
    let builder_text = std::fs::read_to_string(builder)?;

    assert_eq!(ok(&sb, &["create", builder]).stdout, "created fleet builder\n");
    assert_eq!(
        refused(&sb, &["create", builder]),
        "mur: conflict: fleet builder already exists (replace it with `mur fleet apply FILE`)\n"
    );
    assert_eq!(ok(&sb, &["apply", builder]).stdout, "unchanged fleet builder\n");
    let pair = write(dir.path(), "pair.yaml", PAIR);
    assert_eq!(ok(&sb, &["apply", pair.to_str().unwrap()]).stdout, "created fleet pair\n");
    let pair2 = write(dir.path(), "pair2.yaml", &format!("{PAIR}loop:\n  trigger: interval:1h\n  max_iterations: 8\n"));
    let applied = ok(&sb, &["apply", pair2.to_str().unwrap()]);
    assert_eq!(applied.stdout, "replaced fleet pair\n");
    assert_eq!(
        applied.stderr,
        "notice: loop.max_iterations: is ignored: loops are bounded by deadline, stuck and cost \
         (a 10000-iteration diagnostic ceiling remains)\n"
    );
    assert_eq!(
        ok(&sb, &["apply", pair.to_str().unwrap(), "--json"]).last_json(),
        json!({"fleet": "pair", "action": "replaced", "notices": []})
    );

    let ls = ok(&sb, &["ls"]).stdout;
    let rows: Vec<Vec<&str>> = ls.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(
        rows,
        [
            vec!["FLEET", "STATE", "MEMBERS", "QUEUED", "RUNNING", "BLOCKED", "TRIGGER", "DONE_WHEN"],
            vec!["builder", "started", "builder", "0", "0", "0", "manual", "queue-empty"],
            vec!["pair", "started", "writer,critic", "0", "0", "0", "manual"],
        ]
    );
    let ls = ok(&sb, &["ls", "--json"]).last_json();
    assert_eq!(
        ls[1],
        json!({"name": "pair", "members": ["writer", "critic"], "stop": {"state": "started"}, "queued": 0,
               "running": 0, "blocked": 0, "trigger": "manual", "done_when": "", "error": null})
    );

    assert_eq!(
        ok(&sb, &["show", "builder"]).stdout,
        format!(
            "fleet     builder\nstate     started\nmembers   builder\nloop      trigger manual; done_when queue-empty\n\
             jobs      0 queued, 0 running, 0 blocked\n---\n{builder_text}"
        )
    );
    let show = ok(&sb, &["show", "pair", "--json"]).last_json();
    assert_eq!((show["yaml"].as_str(), show["notices"].clone()), (Some(PAIR), json!([])));

    ok(&sb, &["send", "pair", "one"]);
    ok(&sb, &["send", "pair", "two"]);
    assert_eq!(ok(&sb, &["ls", "--json"]).last_json()[1]["queued"], 2);
    assert_eq!(ok(&sb, &["rm", "pair"]).stdout, "removed fleet pair\n");
    assert_eq!(
        refused(&sb, &["show", "pair"]),
        "mur: not_found: fleet: no fleet named \"pair\" (create it with `mur fleet create FILE`)\n"
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&refused(&sb, &["show", "pair", "--json"])).unwrap(),
        json!({"code": "not_found",
               "error": "not_found: fleet: no fleet named \"pair\" (create it with `mur fleet create FILE`)"})
    );
    assert_eq!(ok(&sb, &["ls", "--json"]).last_json(), json!([ls[0].clone()]));
    // A fleet made again under the name starts without the removed one's jobs.
    ok(&sb, &["create", pair.to_str().unwrap()]);
    assert_eq!(ok(&sb, &["jobs", "pair", "--all", "--json"]).last_json(), json!([]));
    assert_eq!(ok(&sb, &["ls", "--json"]).last_json()[1]["queued"], 0);
    ok(&sb, &["rm", "pair"]);
    assert_eq!(
        refused(&sb, &["show", "Bad"]),
        "mur: invalid_request: fleet: must be 1-64 characters of a-z, 0-9, '-' or '_', got \"Bad\"\n"
    );
    sb.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_fleet_yaml_is_refused_naming_the_field_and_nothing_stored_changes() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    let pair = write(dir.path(), "pair.yaml", PAIR);
    ok(&sb, &["create", pair.to_str().unwrap()]);
    let kv = fleets_kv(&sb).await;
    let before = kv.entry("def.pair").await?.unwrap();

    let broken = write(
        dir.path(),
        "broken.yaml",
        &format!("{PAIR}fanout: 0\nloop:\n  done_when: DONE\n  deadline: 2026-12-31\n"),
    );
    assert_eq!(
        refused(&sb, &["apply", broken.to_str().unwrap()]),
        "mur: invalid_request: loop.done_when: must be empty (the router judges), queue-empty or marker:<TEXT>; \
         the marker: prefix is required (marker:DONE), got \"DONE\"\n\
         loop.deadline: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, \
         got \"2026-12-31\"\n\
         fanout: must be a positive integer, got 0\n"
    );
    let unknown = write(dir.path(), "unknown.yaml", &format!("{PAIR}loop:\n  max_iteration: 3\n"));
    let err = refused(&sb, &["apply", unknown.to_str().unwrap()]);
    assert!(err.starts_with("mur: invalid_request: loop: unknown field `max_iteration`"), "{err}");
    let members = write(dir.path(), "members.yaml", "name: pair\nmembers: [Writer, critic, critic]\n");
    assert_eq!(
        refused(&sb, &["apply", members.to_str().unwrap()]),
        "mur: invalid_request: members[0]: must be a capsule name (1-64 characters of a-z, 0-9, '-' or '_', \
         starting with a letter or digit), got \"Writer\"\nmembers[2]: duplicate member \"critic\"\n"
    );
    let not_yaml = write(dir.path(), "not.yaml", "name: [pair\n");
    let err = refused(&sb, &["create", not_yaml.to_str().unwrap()]);
    assert!(err.starts_with("mur: invalid_request: "), "{err}");
    let missing = refused(&sb, &["create", dir.path().join("nope.yaml").to_str().unwrap()]);
    assert!(missing.starts_with("mur: reading "), "{missing}");

    // Nothing stored changed: same text, same revision, no other fleet.
    let after = kv.entry("def.pair").await?.unwrap();
    assert_eq!((after.revision, after.value), (before.revision, before.value));
    assert_eq!(ok(&sb, &["ls", "--json"]).last_json().as_array().unwrap().len(), 1);
    sb.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_loop_refuses_every_value_that_used_to_mean_something_else() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    let pair = write(dir.path(), "pair.yaml", PAIR);
    ok(&sb, &["create", pair.to_str().unwrap()]);
    let kv = fleets_kv(&sb).await;
    let before = kv.entry("def.pair").await?.unwrap();

    // the fleet-loops seed, §Settings that used to mean something else, row by row.
    let table: [(&[&str], &str); 4] = [
        (
            &["--deadline", "2026-12-31"],
            "--deadline: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, \
             got \"2026-12-31\"",
        ),
        (&["--trigger", "cron:0 9 31 2 *"], "--trigger: cron: never fires: February has no 31st, got \"0 9 31 2 *\""),
        (&["--budget-usd", "-1"], "--budget-usd: must be a non-negative number (0 for no ceiling), got -1"),
        (
            &["--done-when", "DONE"],
            "--done-when: must be empty (the router judges), queue-empty or marker:<TEXT>; the marker: prefix is \
             required (marker:DONE), got \"DONE\"",
        ),
    ];
    for (flags, message) in table {
        let mut args = vec!["set-loop", "pair"];
        args.extend_from_slice(flags);
        assert_eq!(refused(&sb, &args), format!("mur: invalid_request: {message}\n"), "{flags:?}");
    }
    // Every bad flag of one call is reported; a good one beside them is not applied.
    assert_eq!(
        refused(&sb, &["set-loop", "pair", "--done-when", "queue-empty", "--budget-usd", "-0.5", "--deadline", "-5m"]),
        "mur: invalid_request: --deadline: must be a duration such as 30s, 5m, 2h, 1d or 1h30m, got \"-5m\"\n\
         --budget-usd: must be a non-negative number (0 for no ceiling), got -0.5\n"
    );
    assert_eq!(
        refused(&sb, &["set-loop", "pair"]),
        "mur: invalid_request: give at least one of --done-when, --trigger, --deadline, --budget-usd, --timezone, \
         --overlap, --catchup, --pause-after-failures\n"
    );
    // The schedule's keys (issue #36), each refused naming its flag, all at once.
    assert_eq!(
        refused(
            &sb,
            &[
                "set-loop",
                "pair",
                "--timezone",
                "Berlin",
                "--overlap",
                "queue",
                "--catchup",
                "0",
                "--pause-after-failures",
                "-1"
            ]
        ),
        "mur: invalid_request: --timezone: must be an IANA time zone name (UTC, Europe/Berlin, America/New_York), \
         got \"Berlin\"\n--overlap: must be skip, queue_one or cancel_previous, got \"queue\"\n--catchup: must be \
         longer than zero (leave it out for the built-in 90s), got \"0\"\n--pause-after-failures: must be a whole \
         number of failed runs in a row from 0 (never pause) to 1000, got \"-1\"\n"
    );
    let after = kv.entry("def.pair").await?.unwrap();
    assert_eq!((after.revision, &after.value), (before.revision, &before.value));

    // Accepted values are stored in the definition's loop: block, as execution reads them.
    let shown = ok(
        &sb,
        &["set-loop", "pair", "--done-when", "marker:ALL DONE", "--trigger", "cron:0 9 * * 1-5", "--budget-usd", "2.5"],
    );
    assert!(shown.stdout.contains("loop      trigger cron:0 9 * * 1-5; done_when marker:ALL DONE\n"), "{shown:?}");
    let stored = String::from_utf8(kv.get("def.pair").await?.unwrap().to_vec())?;
    let fleet = mur_proto::Fleet::parse(&stored)?;
    assert_eq!(fleet.r#loop.done_when, mur_proto::fleet::DoneWhen::Marker("ALL DONE".into()));
    assert_eq!(fleet.r#loop.trigger.as_text(), "cron:0 9 * * 1-5");
    assert_eq!((fleet.r#loop.budget_usd, fleet.members), (2.5, vec!["writer".to_string(), "critic".to_string()]));
    ok(&sb, &["set-loop", "pair", "--done-when", ""]);
    let stored = String::from_utf8(kv.get("def.pair").await?.unwrap().to_vec())?;
    assert_eq!(mur_proto::Fleet::parse(&stored)?.r#loop.done_when, mur_proto::fleet::DoneWhen::Router);
    assert_eq!(
        refused(&sb, &["set-loop", "ghost", "--done-when", "queue-empty"]),
        "mur: not_found: fleet: no fleet named \"ghost\" (create it with `mur fleet create FILE`)\n"
    );
    sb.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_fleet_with_values_an_older_version_accepted_loads_and_takes_an_unrelated_edit() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let legacy = "name: legacy\nmembers: [worker]\ncolour: blue\nloop:\n  trigger: cron:0 9 31 2 *\n  \
                  done_when: DONE\n  deadline: 2026-12-31\n  budget_usd: -1\n";
    let kv = fleets_kv(&sb).await;
    kv.put("def.legacy", legacy.into()).await?;

    let show = ok(&sb, &["show", "legacy", "--json"]).last_json();
    assert_eq!(show["yaml"], legacy);
    assert_eq!((show["members"].clone(), show["error"].clone()), (json!(["worker"]), Value::Null));
    assert_eq!(
        show["notices"],
        json!([
            "colour: unknown key (stored by an older version; ignored)",
            "loop.trigger: cron: never fires: February has no 31st, got \"0 9 31 2 *\" (stored by an older version; \
             it never fires)",
            "loop.done_when: must be empty (the router judges), queue-empty or marker:<TEXT>; the marker: prefix is \
             required (marker:DONE), got \"DONE\" (stored by an older version; the router judges DONE)",
            "loop.deadline: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, \
             got \"2026-12-31\" (stored by an older version; ignored; the loop is bounded by its other limits)",
            "loop.budget_usd: must be a non-negative number (0 for no ceiling), got -1 (stored by an older version; \
             ignored)",
        ])
    );
    // An unrelated edit goes through; the stale values stay as stored.
    let edited = ok(&sb, &["set-loop", "legacy", "--done-when", "queue-empty", "--json"]).last_json();
    assert_eq!(edited["done_when"], "queue-empty");
    let stored: serde_yaml_ng::Value = serde_yaml_ng::from_str(edited["yaml"].as_str().unwrap())?;
    assert_eq!(stored["loop"]["done_when"], "queue-empty");
    assert_eq!(stored["loop"]["deadline"], "2026-12-31");
    assert_eq!(stored["loop"]["trigger"], "cron:0 9 31 2 *");
    assert_eq!(edited["notices"].as_array().unwrap().len(), 4);
    // A job can be queued on it too; the stale value it carries is still refused when given.
    ok(&sb, &["send", "legacy", "echo hi"]);
    assert_eq!(
        refused(&sb, &["set-loop", "legacy", "--trigger", "cron:0 9 31 2 *"]),
        "mur: invalid_request: --trigger: cron: never fires: February has no 31st, got \"0 9 31 2 *\"\n"
    );
    sb.shutdown().await;
    Ok(())
}

/// Moves a job as a run would: claims it under `run_id`, then ends it with `end`.
async fn run_job(kv: &async_nats::jetstream::kv::Store, fleet: &str, id: &str, run_id: &str, end: Option<JobStatus>) {
    let key = fleet_store::job_key(fleet, id);
    let entry = kv.entry(&key).await.unwrap().unwrap();
    let mut job: Job = serde_json::from_slice(&entry.value).unwrap();
    job.claim(run_id, 1_000).unwrap();
    if let Some(end) = end {
        job.transition(end, 2_000).unwrap();
        job.result = Some(format!("result of {run_id}"));
    }
    kv.update(&key, serde_json::to_vec(&job).unwrap().into(), entry.revision).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_queued_listed_filtered_by_run_id_prefix_and_canceled() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    let pair = write(dir.path(), "pair.yaml", PAIR);
    ok(&sb, &["create", pair.to_str().unwrap()]);

    let mut ids = Vec::new();
    for text in ["first", "second", "third", "fourth"] {
        let sent = ok(&sb, &["send", "pair", text]);
        let id = sent.sent_job_id();
        let uuid = uuid::Uuid::parse_str(&id)?;
        // A sentence, as `mur fleet create` prints (issue #29: it was the bare id).
        assert_eq!(
            (uuid.get_version_num(), uuid.hyphenated().to_string(), sent.stdout),
            (7, id.clone(), format!("queued job {id} in fleet pair\n"))
        );
        ids.push(id);
    }
    let sent = ok(&sb, &["send", "pair", "fifth", "--json"]).last_json();
    assert_eq!(
        (sent["status"].clone(), sent["text"].clone(), sent["source"].clone()),
        (json!("queued"), json!("fifth"), json!("cli"))
    );
    ids.push(sent["id"].as_str().unwrap().to_string());
    assert_eq!(refused(&sb, &["send", "pair", "  "]), "mur: invalid_request: text: must not be only whitespace\n");
    // Issue #29: no command's argument can carry a NUL (the command line cannot either:
    // straight to the API).
    let err = mur_nats::api::call::<Job>(
        &sb.client,
        fleet_store::api::SEND,
        serde_json::to_vec(&json!({"fleet": "pair", "text": "echo a\u{0}b"}))?,
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid_request: text: must not contain a NUL character (U+0000: no command's argument can carry one), \
         found at byte 6"
    );
    assert_eq!(
        refused(&sb, &["send", "ghost", "x"]),
        "mur: not_found: fleet: no fleet named \"ghost\" (create it with `mur fleet create FILE`)\n"
    );

    // What a loop with run id `loop1` and a later one `loop2` leave behind.
    let kv = jobs_kv(&sb).await;
    run_job(&kv, "pair", &ids[0], "loop1-0", Some(JobStatus::Done)).await;
    run_job(&kv, "pair", &ids[1], "loop1-1", None).await;
    run_job(&kv, "pair", &ids[2], "loop2-0", Some(JobStatus::Failed)).await;

    let listed = |args: &[&str]| -> Vec<(String, String, Value)> {
        let mut all = vec!["jobs", "pair", "--json"];
        all.extend_from_slice(args);
        ok(&sb, &all)
            .last_json()
            .as_array()
            .unwrap()
            .iter()
            .map(|j| {
                (j["id"].as_str().unwrap().to_string(), j["status"].as_str().unwrap().to_string(), j["run_id"].clone())
            })
            .collect()
    };
    let row = |i: usize, status: &str, run: Value| (ids[i].clone(), status.to_string(), run);
    assert_eq!(
        listed(&[]),
        [row(1, "running", json!("loop1-1")), row(3, "queued", Value::Null), row(4, "queued", Value::Null)]
    );
    assert_eq!(
        listed(&["--all"]),
        [
            row(0, "done", json!("loop1-0")),
            row(1, "running", json!("loop1-1")),
            row(2, "failed", json!("loop2-0")),
            row(3, "queued", Value::Null),
            row(4, "queued", Value::Null),
        ]
    );
    assert_eq!(listed(&["--since", "loop1"]), [row(0, "done", json!("loop1-0")), row(1, "running", json!("loop1-1"))]);
    assert_eq!(listed(&["--since", "loop2-0"]), [row(2, "failed", json!("loop2-0"))]);
    // `--status`: only jobs in it, a finished status without `--all`, with `--since` too.
    assert_eq!(listed(&["--status", "queued"]), [row(3, "queued", Value::Null), row(4, "queued", Value::Null)]);
    assert_eq!(listed(&["--status", "done"]), [row(0, "done", json!("loop1-0"))]);
    assert_eq!(listed(&["--since", "loop1", "--status", "running"]), [row(1, "running", json!("loop1-1"))]);
    assert_eq!(listed(&["--since", "loop2", "--status", "running"]), []);
    // The --json objects carry every field.
    let done = &ok(&sb, &["jobs", "pair", "--all", "--json"]).last_json()[0];
    assert_eq!(
        *done,
        json!({"id": ids[0], "status": "done", "text": "first", "result": "result of loop1-0", "error": null,
               "run_id": "loop1-0", "source": "cli", "created_at": done["created_at"], "started_at": 1000,
               "finished_at": 2000, "approval": null, "steps_done": {}})
    );
    // The table.
    let table = ok(&sb, &["jobs", "pair", "--since", "loop1"]).stdout;
    let rows: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(
        rows,
        [
            vec!["JOB", "STATUS", "RUN", "TEXT", "RESULT"],
            vec![ids[0].as_str(), "done", "loop1-0", "first", "result", "of", "loop1-0"],
            vec![ids[1].as_str(), "running", "loop1-1", "second"],
        ]
    );
    let empty = fleet(&sb, &["jobs", "pair", "--since", "nothing"]);
    assert_eq!((empty.code, empty.stdout.as_str()), (0, ""));
    assert_eq!(
        empty.stderr,
        "no jobs to show (queue one with `mur fleet send pair \"text\"`; --all shows finished ones)\n"
    );

    // Cancel: a queued one and a running one; a finished one is refused.
    assert_eq!(ok(&sb, &["cancel", "pair", &ids[3]]).stdout, format!("canceled job {}\n", ids[3]));
    let canceled = ok(&sb, &["cancel", "pair", &ids[1], "--json"]).last_json();
    assert_eq!((canceled["status"].clone(), canceled["run_id"].clone()), (json!("canceled"), json!("loop1-1")));
    assert!(canceled["finished_at"].as_u64().is_some());
    assert_eq!(
        refused(&sb, &["cancel", "pair", &ids[0]]),
        format!(
            "mur: conflict: job {} has already ended (done); only a queued, running or blocked job can be canceled\n",
            ids[0]
        )
    );
    assert_eq!(
        refused(&sb, &["cancel", "pair", &ids[3]]),
        format!(
            "mur: conflict: job {} has already ended (canceled); only a queued, running or blocked job can be \
             canceled\n",
            ids[3]
        )
    );
    assert_eq!(refused(&sb, &["cancel", "pair", "ffff"]), "mur: not_found: job: no job ffff in fleet pair\n");
    // A prefix naming one job works; one naming several is refused.
    let last = &ids[4];
    assert_eq!(ok(&sb, &["cancel", "pair", &last[..last.len() - 2]]).stdout, format!("canceled job {last}\n"));
    let common = common_prefix(&ids);
    assert_eq!(
        refused(&sb, &["cancel", "pair", &common]),
        format!("mur: invalid_request: job: {common:?} names 5 jobs of fleet pair; give more of the id\n")
    );
    assert_eq!(listed(&[]), []);
    // rm takes the jobs with the fleet.
    ok(&sb, &["rm", "pair"]);
    assert_eq!(kv.keys().await?.count().await, 0);
    sb.shutdown().await;
    Ok(())
}

fn common_prefix(ids: &[String]) -> String {
    let first = &ids[0];
    let n =
        (0..first.len()).take_while(|&i| ids.iter().all(|id| id.as_bytes().get(i) == first.as_bytes().get(i))).count();
    first[..n].to_string()
}

use futures::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_and_start_flip_the_sentinel_and_an_unreadable_one_counts_as_stopped() -> Result<()> {
    let mut sb = Sandbox::start(0, 1).await;
    sb.add_coordinator().await;
    let dir = tempfile::tempdir()?;
    let pair = write(dir.path(), "pair.yaml", PAIR);
    ok(&sb, &["create", pair.to_str().unwrap()]);
    // Another coordinator's view.
    let other = handle(&sb).await;
    assert_eq!(other.stop_state("pair").await, StopState::Started);

    assert_eq!(ok(&sb, &["stop", "pair", "--by", "ann"]).stdout, "fleet pair stopped by ann\n");
    let seen = tokio::time::Instant::now();
    assert!(other.stop_state("pair").await.is_stopped());
    assert!(seen.elapsed() < Duration::from_secs(1));
    let kv = fleets_kv(&sb).await;
    let sentinel: Sentinel = serde_json::from_slice(&kv.get("stopped.pair").await?.unwrap())?;
    assert_eq!(sentinel.by, "ann");
    // Stopping again keeps the first sentinel.
    assert_eq!(ok(&sb, &["stop", "pair"]).stdout, "fleet pair stopped by ann\n");
    let show = ok(&sb, &["show", "pair", "--json"]).last_json();
    assert_eq!(show["stop"], json!({"state": "stopped", "sentinel": {"at": sentinel.at, "by": "ann"}}));

    assert_eq!(ok(&sb, &["start", "pair"]).stdout, "fleet pair started\n");
    assert_eq!(kv.get("stopped.pair").await?, None);
    assert_eq!(other.stop_state("pair").await, StopState::Started);
    assert_eq!(ok(&sb, &["start", "pair"]).stdout, "fleet pair started\n");
    // --by defaults to $USER.
    assert_eq!(ok(&sb, &["stop", "pair"]).stdout, "fleet pair stopped by tester\n");
    ok(&sb, &["start", "pair"]);
    // A `--drain` stop is kept by another `--drain` one, and replaced by a stop that cancels.
    ok(&sb, &["stop", "pair", "--drain", "--by", "carl"]);
    ok(&sb, &["stop", "pair", "--drain", "--by", "dora"]);
    let drained: Sentinel = serde_json::from_slice(&kv.get("stopped.pair").await?.unwrap())?;
    assert_eq!((drained.by.as_str(), drained.drain), ("carl", true));
    assert_eq!(ok(&sb, &["stop", "pair", "--by", "eve"]).stdout, "fleet pair stopped by eve\n");
    let canceling: Sentinel = serde_json::from_slice(&kv.get("stopped.pair").await?.unwrap())?;
    assert_eq!((canceling.by.as_str(), canceling.drain), ("eve", false));
    ok(&sb, &["start", "pair"]);

    // A sentinel that does not parse: the fleet counts as stopped (fail closed).
    kv.put("stopped.pair", "stopped".into()).await?;
    let unreadable = StopState::Unreadable { error: "sentinel: expected value at line 1 column 1".into() };
    assert_eq!(other.stop_state("pair").await, unreadable);
    assert!(unreadable.is_stopped());
    let show = ok(&sb, &["show", "pair"]).stdout;
    assert!(
        show.contains("\nstate     stopped (sentinel unreadable: sentinel: expected value at line 1 column 1)\n"),
        "{show}"
    );
    let ls = ok(&sb, &["ls"]).stdout;
    assert!(ls.lines().nth(1).unwrap().starts_with(" pair   stopped (sentinel unreadable)  writer,critic"), "{ls}");
    // stop writes a good sentinel over it; start clears it.
    assert_eq!(ok(&sb, &["stop", "pair", "--by", "bob"]).stdout, "fleet pair stopped by bob\n");
    assert_eq!(ok(&sb, &["start", "pair"]).stdout, "fleet pair started\n");
    assert_eq!(
        refused(&sb, &["stop", "ghost"]),
        "mur: not_found: fleet: no fleet named \"ghost\" (create it with `mur fleet create FILE`)\n"
    );
    sb.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_larger_than_a_nats_payload_is_read_page_by_page() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    let pair = write(dir.path(), "pair.yaml", PAIR);
    ok(&sb, &["create", pair.to_str().unwrap()]);
    let fleets = handle(&sb).await;
    // 48 replies of 40 kB: nearly 2 MB, twice what one NATS message may carry.
    for n in 0..48u64 {
        let mut reply = ChannelEvent::system(EventKind::Reply, format!("{n}:{}", "x".repeat(40_000)), n);
        reply.author = Author::Member("writer".into());
        fleets.publish("pair", &reply).await.unwrap();
    }
    let events = ok(&sb, &["log", "pair", "--json"]).last_json();
    let texts: Vec<String> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["text"].as_str().unwrap().split(':').next().unwrap().into())
        .collect();
    assert_eq!(texts, (0..48).map(|n| n.to_string()).collect::<Vec<_>>());
    let plain = ok(&sb, &["log", "pair"]).stdout;
    assert_eq!(plain.lines().count(), 48);
    sb.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn log_prints_the_channel_with_authors_and_sequence_numbers() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    let pair = write(dir.path(), "pair.yaml", PAIR);
    ok(&sb, &["create", pair.to_str().unwrap()]);
    let other = write(dir.path(), "other.yaml", "name: other\nmembers: [w]\n");
    ok(&sb, &["create", other.to_str().unwrap()]);
    assert_eq!(ok(&sb, &["log", "pair"]).stdout, "");

    let job = ok(&sb, &["send", "pair", "build it"]).sent_job_id();
    ok(&sb, &["stop", "pair", "--by", "ann"]);
    // What a run engine writes: a delegation, a member's reply (another fleet's event between).
    let fleets = handle(&sb).await;
    let mut delegation = ChannelEvent::system(EventKind::Delegation, "build it", 5);
    delegation.author = Author::Router;
    delegation.run_id = Some("loop1-0".into());
    let d = fleets.publish("pair", &delegation).await.unwrap();
    fleets.publish("other", &ChannelEvent::system(EventKind::Note, "elsewhere", 6)).await.unwrap();
    let mut reply = ChannelEvent::system(EventKind::Reply, "built\nALL DONE", 7);
    reply.author = Author::Member("writer".into());
    reply.run_id = Some("loop1-0".into());
    let r = fleets.publish("pair", &reply).await.unwrap();
    ok(&sb, &["start", "pair"]);

    let events = ok(&sb, &["log", "pair", "--json"]).last_json();
    let events = events.as_array().unwrap();
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!((seqs[2], seqs[3]), (d, r));
    assert_eq!(
        events.iter().map(|e| (e["author"].clone(), e["kind"].clone(), e["text"].clone())).collect::<Vec<_>>(),
        [
            (json!("system"), json!("state-change"), json!(format!("job {job} queued"))),
            (json!("system"), json!("state-change"), json!("stopped by ann")),
            (json!("router"), json!("delegation"), json!("build it")),
            (json!({"member": "writer"}), json!("reply"), json!("built\nALL DONE")),
            (json!("system"), json!("state-change"), json!("started: the kill-switch is cleared")),
        ]
    );
    assert_eq!(events[0]["job_id"], job.as_str());
    assert_eq!(
        events[3],
        json!({"seq": r, "at": 7, "author": {"member": "writer"}, "kind": "reply",
                                 "text": "built\nALL DONE", "run_id": "loop1-0", "job_id": null})
    );

    let text = ok(&sb, &["log", "pair", "--since", &seqs[1].to_string()]).stdout;
    assert_eq!(
        text,
        format!(
            "#{d} router delegation: build it [run loop1-0]\n#{r} member:writer reply: built\n    ALL DONE [run loop1-0]\n\
             #{} system state-change: started: the kill-switch is cleared\n",
            seqs[4]
        )
    );
    assert_eq!(ok(&sb, &["log", "pair", "--since", &seqs[4].to_string(), "--json"]).last_json(), json!([]));
    // The channel goes with the fleet.
    ok(&sb, &["rm", "pair"]);
    assert!(fleets.channel("pair", 0).await.unwrap().is_empty());
    assert_eq!(fleets.channel("other", 0).await.unwrap().len(), 1);
    sb.shutdown().await;
    Ok(())
}

/// Issue #10 §Runs and loops, the seed's own example on real work: the `builder` fleet
/// drains its queue on the cluster. `mur fleet run builder --loop --deadline 5m` prints
/// the bounds line, runs on the leading coordinator, each queued job becomes a `peer` task
/// for the member (run as a shell command by the scripted driver), the job ends `done`
/// with the command's real output, and the loop ends `queue-drained`: exit 0. A stopped
/// fleet refuses a run: exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_builder_fleet_drains_its_queue_on_the_cluster_and_a_stopped_fleet_refuses_a_run() {
    let sb = Sandbox::start(1, 2).await;
    sb.push(&example("examples/builder")).await;
    ok(&sb, &["create", example("examples/fleets/builder.yaml").to_str().unwrap()]);
    ok(&sb, &["send", "builder", "echo built $((20+3))"]);
    ok(&sb, &["send", "builder", "echo tested"]);
    let url = sb.nats.url();
    let run = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run", "builder", "--loop", "--deadline", "5m"]).env("NATS_URL", url))
    })
    .await
    .unwrap();
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stderr.starts_with("bounds: deadline 5m ← --deadline; stuck 10m ← built-in\n"), "{}", run.stderr);
    assert!(run.stderr.contains("done (queue-drained) after 2 iterations"), "{}", run.stderr);
    let run_id = run.run_id();
    assert!(run_id.starts_with("fleet-builder-"), "{run_id}");

    let jobs: Value = serde_json::from_str(ok(&sb, &["jobs", "builder", "--all", "--json"]).stdout.trim()).unwrap();
    let jobs = jobs.as_array().unwrap();
    assert_eq!(jobs.len(), 2);
    let by_text = |t: &str| jobs.iter().find(|j| j["text"] == t).unwrap().clone();
    let first = by_text("echo built $((20+3))");
    assert_eq!(first["status"], "done");
    assert!(first["result"].as_str().unwrap().contains("built 23"), "{first}");
    assert_eq!(first["run_id"], format!("{run_id}-0"));
    assert_eq!(by_text("echo tested")["run_id"], format!("{run_id}-1"));
    // --since selects the loop's iterations' jobs by prefix.
    let since: Value =
        serde_json::from_str(ok(&sb, &["jobs", "builder", "--since", &run_id, "--json"]).stdout.trim()).unwrap();
    assert_eq!(since.as_array().unwrap().len(), 2);
    // The channel has the delegations, the member's replies and the stop reason.
    let log = ok(&sb, &["log", "builder"]).stdout;
    assert!(log.contains("system delegation: builder ← echo tested"), "{log}");
    assert!(log.contains("member:builder reply:"), "{log}");
    assert!(log.contains(&format!("system stop: run {run_id} stopped: queue-drained")), "{log}");

    // `mur job status` (by run id or an iteration's id) and `mur fleet status`.
    for id in [run_id.clone(), format!("{run_id}-1")] {
        let status = Run::of(mur().args(["job", "status", &id, "--json"]).env("NATS_URL", sb.nats.url()));
        assert_eq!(status.code, 0, "{status:?}");
        let v = status.last_json();
        assert_eq!((v["run_id"].as_str(), v["state"].as_str()), (Some(run_id.as_str()), Some("done")));
        assert_eq!((v["stop"].as_str(), v["iterations"].as_u64()), (Some("queue-drained"), Some(2)));
        assert_eq!(v["liveness"], json!({"verdict": "over"}));
    }
    let latest = ok(&sb, &["status", "builder"]).stdout;
    assert!(latest.contains(&format!("run        {run_id}\n")), "{latest}");
    assert!(latest.contains("state      done (queue-drained)\nliveness   over\n"), "{latest}");
    assert!(latest.contains("\nbounds     deadline 5m ← --deadline; stuck 10m ← built-in\n"), "{latest}");
    // A run left `running` by a coordinator that died: no heartbeat, so the verdict is dead.
    let orphan: fleet_store::RunRecord = serde_json::from_value(json!({
        "run_id": "run-orphan", "fleet": "builder", "state": "running",
        "bounds": "bounds: deadline 1h ← built-in; stuck 10m ← built-in", "coordinator": "gone",
        "iterations": 1, "started_at": 1, "updated_at": 1,
    }))
    .unwrap();
    fleets_kv(&sb)
        .await
        .put(fleet_store::run_key("run-orphan"), serde_json::to_vec(&orphan).unwrap().into())
        .await
        .unwrap();
    // The leader finds it dead (issue #11 §Jobs that outlive their coordinator) and ends it.
    let ended = mur_tests::procs::until("the orphaned run ended", Duration::from_secs(10), || async {
        let status = Run::of(mur().args(["job", "status", "run-orphan", "--json"]).env("NATS_URL", sb.nats.url()));
        let v = status.last_json();
        (v["state"] == "ended").then_some(v)
    })
    .await;
    assert_eq!(
        (ended["stop"].as_str(), ended["liveness"].clone()),
        (Some("coordinator-lost"), json!({"verdict": "over"}))
    );
    assert_eq!(
        ended["notices"],
        json!(["orphaned: gone stopped while running run run-orphan (no heartbeat for 10 s); failed by coordinator"])
    );
    let missing = Run::of(mur().args(["job", "status", "run-nope"]).env("NATS_URL", sb.nats.url()));
    assert_eq!((missing.code, missing.stderr.trim()), (2, "mur: no run run-nope"));
    let dash = Run::of(mur().args(["job", "status", "--", "-1"]).env("NATS_URL", sb.nats.url()));
    assert_eq!((dash.code, dash.stderr.trim()), (2, "mur: no run -1"));
    let missing = Run::of(mur().args(["job", "status", "run-nope", "--json"]).env("NATS_URL", sb.nats.url()));
    assert_eq!(
        (missing.code, missing.stdout.as_str(), missing.stderr.as_str()),
        (2, "", "{\"code\":\"not_found\",\"error\":\"no run run-nope\"}\n")
    );

    ok(&sb, &["stop", "builder"]);
    let refused = fleet(&sb, &["run", "builder"]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(
        refused.stderr.contains("fleet 'builder' is stopped (`mur fleet start builder` clears it)"),
        "{}",
        refused.stderr
    );
    sb.shutdown().await;
}

/// `mur fleet run` follows the run's own channel events from where the channel stood
/// when it started: a fleet whose channel already holds many pages (8 MB here, 16 of
/// the log's 512 KB pages) still shows the run's milestones, where the follower paged
/// through the history from the first event and never reached them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_shows_its_milestones_however_long_the_channel_before_it() {
    let sb = Sandbox::start(1, 1).await;
    sb.push(&example("examples/builder")).await;
    ok(&sb, &["create", example("examples/fleets/builder.yaml").to_str().unwrap()]);
    let fleets = handle(&sb).await;
    for n in 0..80u64 {
        let old = ChannelEvent::system(EventKind::Reply, format!("{n}:{}", "x".repeat(100_000)), n);
        fleets.publish("builder", &old).await.unwrap();
    }
    ok(&sb, &["send", "builder", "echo followed"]);
    let url = sb.nats.url();
    let run = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run", "builder", "--json"]).env("NATS_URL", url))
    })
    .await
    .unwrap();
    assert_eq!(run.code, 0, "{run:?}");
    let lines: Vec<Value> = run.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let run_id = lines[0]["run_id"].as_str().unwrap();
    let events: Vec<&Value> = lines.iter().filter(|l| l["type"] == "event").collect();
    assert!(!events.is_empty(), "no milestone shown: {}", run.stdout);
    assert!(events.iter().all(|e| e["run_id"].as_str().is_some_and(|r| r.starts_with(run_id))), "{events:?}");
    assert!(events.iter().any(|e| e["text"].as_str().is_some_and(|t| t.contains("echo followed"))), "{events:?}");
    sb.shutdown().await;
}

/// the fleet-loops seed, §The bounds: "Every member the loop delegates to inherits the
/// remaining time". A step still running when the loop's deadline passes is stopped by its
/// worker (its shell command killed): the task ends `deadline_exceeded`, the job `failed`,
/// and the run ends `deadline` (exit 1): its iteration failed for the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_step_outliving_the_loops_deadline_is_stopped_by_its_worker() {
    let sb = Sandbox::start(1, 1).await;
    sb.push(&example("examples/builder")).await;
    ok(&sb, &["create", example("examples/fleets/builder.yaml").to_str().unwrap()]);
    ok(&sb, &["send", "builder", "sleep 60"]);
    let url = sb.nats.url();
    let started = std::time::Instant::now();
    let run = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run", "builder", "--deadline", "2s", "--json"]).env("NATS_URL", url))
    })
    .await
    .unwrap();
    assert_eq!(run.code, 1, "{run:?}");
    assert!(started.elapsed() < Duration::from_secs(30), "the step was stopped, not waited for");
    assert!(run.stderr.contains("ended: deadline"), "{}", run.stderr);
    let jobs: Value = serde_json::from_str(ok(&sb, &["jobs", "builder", "--all", "--json"]).stdout.trim()).unwrap();
    let job = &jobs[0];
    assert_eq!(job["status"], "failed");
    assert_eq!(job["result"], "stopped: the deadline inherited from the fleet loop passed");
    let tasks = sb.tasks().await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].exit_status, Some(mur_proto::ExitStatus::DeadlineExceeded));
    assert_eq!(tasks[0].origin, mur_proto::task::Origin::Peer);
    assert!(tasks[0].deadline_at.is_some());
    sb.shutdown().await;
}

/// the fleet-loops seed with a router: the `pair` example (router `planner`, members
/// `builder` and `reviewer`). The router plans the iteration (a `decision` on the channel),
/// each member gets the job followed by the router's assignment, and with `done_when`
/// empty the router judges DONE after the iteration: the loop converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_with_a_router_plans_each_iteration_and_converges_when_the_router_says_done() {
    let sb = Sandbox::start(1, 4).await;
    for capsule in ["examples/builder", "examples/planner", "examples/reviewer"] {
        sb.push(&example(capsule)).await;
    }
    ok(&sb, &["create", example("examples/fleets/pair.yaml").to_str().unwrap()]);
    ok(&sb, &["send", "pair", "echo paired"]);
    let url = sb.nats.url();
    let run = tokio::task::spawn_blocking(move || {
        Run::of(mur().args(["fleet", "run", "pair", "--loop", "--deadline", "5m"]).env("NATS_URL", url))
    })
    .await
    .unwrap();
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stderr.contains("done (converged) after 1 iteration"), "{}", run.stderr);
    let log = ok(&sb, &["log", "pair"]).stdout;
    assert!(log.contains("system delegation: planner ← plan"), "{log}");
    assert!(
        log.contains("router decision: DONE when both report: builder runs the job, reviewer reads it back."),
        "{log}"
    );
    let jobs: Value = serde_json::from_str(ok(&sb, &["jobs", "pair", "--all", "--json"]).stdout.trim()).unwrap();
    let result = jobs[0]["result"].as_str().unwrap();
    assert_eq!(jobs[0]["status"], "done");
    assert!(result.starts_with("[builder]\n$ echo paired\n"), "{result}");
    // The assignment reaches the builder's shell as comments: its command still succeeds.
    assert!(result.contains("Exit code: 0\n"), "{result}");
    assert!(
        result.contains(
            "[reviewer]\nreviewed: echo paired\n\n# The router's assignment:\n# DONE when both report: builder runs the job, reviewer reads it back."
        ),
        "{result}"
    );
    sb.shutdown().await;
}

/// `fleet.jobs` answers in one NATS message (1 MiB here) while a job's text may be up to
/// 1 MiB: twelve jobs of 100 KB each list with their texts clipped, and the CLI says which
/// (before, the reply was refused by the server and `mur fleet jobs` timed out), naming
/// five of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_long_texts_list_clipped() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    ok(&sb, &["create", write(dir.path(), "pair.yaml", PAIR).to_str().unwrap()]);
    let text = "x".repeat(100_000);
    let ids: Vec<String> = (0..12).map(|_| ok(&sb, &["send", "pair", &text]).sent_job_id()).collect();
    let run = ok(&sb, &["jobs", "pair", "--json"]);
    let jobs = run.last_json();
    let listed: Vec<&str> = jobs.as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap()).collect();
    assert_eq!(listed, ids.iter().map(String::as_str).collect::<Vec<_>>(), "oldest first, all of them");
    let clipped = format!("{}…", "x".repeat(mur_proto::page::FIELD_BYTES));
    assert!(jobs.as_array().unwrap().iter().all(|j| j["text"] == clipped.as_str()));
    assert_eq!(
        run.stderr,
        format!("note: long texts cut after 4096 bytes (then `…`) in 12 of them: {} and 7 more\n", ids[..5].join(", "))
    );
    Ok(())
}

/// `mur fleet rm` of a fleet with a run going is refused and removes nothing: the run would
/// go on writing jobs and channel events for a fleet that is gone, and into a new fleet of
/// the same name. Once the run has ended, the fleet is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_with_a_run_going_is_not_removed() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    ok(&sb, &["create", write(dir.path(), "pair.yaml", PAIR).to_str().unwrap()]);
    let job = ok(&sb, &["send", "pair", "Go."]).sent_job_id();
    // A run as a coordinator keeps its record while it runs.
    let kv = fleets_kv(&sb).await;
    let mut run = json!({
        "run_id": "run_going", "fleet": "pair", "state": "running", "bounds": "bounds: none",
        "coordinator": "c1", "iterations": 1, "started_at": 1, "updated_at": 2,
    });
    kv.put(fleet_store::run_key("run_going"), serde_json::to_vec(&run)?.into()).await?;
    assert_eq!(
        refused(&sb, &["rm", "pair"]),
        "mur: conflict: fleet pair: run run_going is going; stop it first (`mur fleet stop pair`), \
         then remove the fleet once it has ended\n"
    );
    assert_eq!(ok(&sb, &["jobs", "pair", "--json"]).last_json()[0]["id"], job.as_str(), "nothing was removed");
    ok(&sb, &["show", "pair"]);
    assert_eq!(kv.get(fleet_store::removing_key("pair")).await?, None, "a refused removal leaves no mark");
    run["state"] = json!("done");
    kv.put(fleet_store::run_key("run_going"), serde_json::to_vec(&run)?.into()).await?;
    assert_eq!(ok(&sb, &["rm", "pair"]).stdout, "removed fleet pair\n");
    assert_eq!(kv.get(fleet_store::removing_key("pair")).await?, None, "a removal leaves no mark");
    Ok(())
}

/// A sandbox with the fleet `pair` created, for the removal tests: the sandbox, the folder
/// of its fleet file, `mur_fleets`, the definition's revision and the time now (unix ms).
async fn pair_to_remove() -> Result<(Sandbox, tempfile::TempDir, async_nats::jetstream::kv::Store, u64, u64)> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    ok(&sb, &["create", write(dir.path(), "pair.yaml", PAIR).to_str().unwrap()]);
    let kv = fleets_kv(&sb).await;
    let revision = kv.entry(fleet_store::def_key("pair")).await?.unwrap().revision;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64;
    Ok((sb, dir, kv, revision, now))
}

/// The mark of a `mur fleet rm` of the definition at `revision` begun at `at` (unix ms).
fn removal_mark(revision: u64, at: u64) -> Vec<u8> {
    serde_json::to_vec(&fleet_store::Removing { revision, at }).unwrap()
}

/// `mur fleet rm` marks the fleet before it looks for a run going, and a run looks for the
/// mark once its record is written: of a removal and a run at once, one sees the other. A
/// run that finds the mark of the definition it read starts nothing and leaves no record,
/// a job sent then is taken back;
/// a stale mark (a removal that died) or one of an earlier definition of the same name
/// holds no run back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_or_a_job_arriving_while_its_fleet_is_being_removed_is_refused() -> Result<()> {
    let (sb, _dir, kv, revision, now) = pair_to_remove().await?;
    let run_keys = || async {
        let keys: Vec<String> = futures::TryStreamExt::try_collect(kv.keys().await.unwrap()).await.unwrap();
        keys.into_iter().filter(|k| k.starts_with("run.")).collect::<Vec<_>>()
    };

    kv.put(fleet_store::removing_key("pair"), removal_mark(revision, now).into()).await?;
    let run = fleet(&sb, &["run", "pair"]);
    assert_eq!(
        (run.code, run.stdout.as_str(), run.stderr.as_str()),
        (2, "", "mur fleet run: refused: conflict: fleet pair is being removed (mur fleet rm); nothing was run\n")
    );
    let run = fleet(&sb, &["run", "pair", "--json"]);
    assert_eq!((run.code, run.stdout.as_str()), (2, ""));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&run.stderr).unwrap(),
        json!({"code": "conflict",
               "error": "refused: conflict: fleet pair is being removed (mur fleet rm); nothing was run"})
    );
    assert_eq!(run_keys().await, Vec::<String>::new(), "no run record is left");
    // A job sent meanwhile is taken back: it would be left for the next fleet of the name.
    assert_eq!(
        refused(&sb, &["send", "pair", "Late."]),
        "mur: conflict: fleet pair is being removed (mur fleet rm); the job was not queued\n"
    );
    assert_eq!(ok(&sb, &["jobs", "pair", "--all", "--json"]).stdout.trim(), "[]");
    assert_eq!(ok(&sb, &["log", "pair"]).stdout, "", "nothing was written to the channel");

    // A removal that died a minute ago, and one of an earlier definition, hold nothing back:
    // the run starts (and fails, its members not being pushed).
    for (revision, at) in [(revision, now - fleet_store::Removing::STALE_MS - 1_000), (revision - 1, now)] {
        kv.put(fleet_store::removing_key("pair"), removal_mark(revision, at).into()).await?;
        let run = fleet(&sb, &["run", "pair"]);
        assert_eq!(run.code, 1, "{run:?}");
        assert!(run.stderr.contains("ended: iteration-failed"), "{run:?}");
    }
    assert_eq!(run_keys().await.len(), 2);
    Ok(())
}

/// A `fleet apply` that would replace a definition a `fleet rm` is removing is refused
/// (the removal would drop it as soon as it was stored, after a reply of `replaced`) and
/// changes nothing; a stale mark, or one of an earlier definition, holds no apply back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_arriving_while_its_fleet_is_being_removed_is_refused_and_changes_nothing() -> Result<()> {
    let (sb, dir, kv, revision, now) = pair_to_remove().await?;
    let edited = PAIR.replace("Answer the question.", "Answer the question twice.");
    let edited = write(dir.path(), "edited.yaml", &edited);

    kv.put(fleet_store::removing_key("pair"), removal_mark(revision, now).into()).await?;
    assert_eq!(
        refused(&sb, &["apply", edited.to_str().unwrap()]),
        "mur: conflict: fleet pair: a removal (`mur fleet rm`) is under way; apply it again once it has ended\n"
    );
    let stored = kv.entry(fleet_store::def_key("pair")).await?.unwrap();
    assert_eq!((stored.revision, stored.value.as_ref()), (revision, PAIR.as_bytes()), "the definition is unchanged");

    for (marked, at) in [(revision, now - fleet_store::Removing::STALE_MS - 1_000), (revision - 1, now)] {
        kv.put(fleet_store::removing_key("pair"), removal_mark(marked, at).into()).await?;
        let text = std::fs::read_to_string(&edited)?.replace("twice", &format!("at {at}"));
        let path = write(dir.path(), "again.yaml", &text);
        assert_eq!(ok(&sb, &["apply", path.to_str().unwrap()]).stdout, "replaced fleet pair\n");
    }
    Ok(())
}

/// `mur fleet status NAME` of a fleet with no run says so; of a fleet that does not exist it
/// says that, as every other fleet command does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_status_tells_a_fleet_without_runs_from_one_that_does_not_exist() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    ok(&sb, &["create", write(dir.path(), "pair.yaml", PAIR).to_str().unwrap()]);
    assert_eq!(refused(&sb, &["status", "pair"]), "mur: fleet pair has no run yet\n");
    assert_eq!(
        refused(&sb, &["status", "ghost"]),
        "mur: not_found: fleet: no fleet named \"ghost\" (create it with `mur fleet create FILE`)\n"
    );
    Ok(())
}

/// `mur fleet send NAME -` reads the job's text from stdin, as `mur task send` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_text_of_a_dash_is_read_from_stdin() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    ok(&sb, &["create", write(dir.path(), "pair.yaml", PAIR).to_str().unwrap()]);
    let mut send = mur();
    send.args(["fleet", "send", "pair", "-", "--json"]).env("NATS_URL", sb.nats.url());
    let mut child = send.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn()?;
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"Line one.\nLine two.\n")?;
    let out = child.wait_with_output()?;
    assert!(out.status.success(), "{out:?}");
    let job: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(job["text"], "Line one.\nLine two.\n");
    Ok(())
}

/// Issue #36: `set-loop` takes the schedule's keys and prints the next three occurrences in
/// the fleet's zone and in UTC (and `--json` gives them as instants); `show` and `status`
/// print them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_loop_prints_the_next_three_occurrences_in_the_fleets_zone_and_in_utc() -> Result<()> {
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    ok(&sb, &["create", write(dir.path(), "pair.yaml", PAIR).to_str().unwrap()]);
    let args = [
        "set-loop",
        "pair",
        "--trigger",
        "cron:30 2 * * *",
        "--timezone",
        "Europe/Berlin",
        "--overlap",
        "queue_one",
        "--catchup",
        "1h",
        "--pause-after-failures",
        "3",
    ];
    let shown = ok(&sb, &args);
    assert!(
        shown.stdout.contains(
            "schedule  zone Europe/Berlin; overlap queue_one; catchup 1h; pauses after 3 failed runs in a row (0 so \
             far); 0 occurrence(s) skipped\n"
        ),
        "{shown:?}"
    );
    let next: Vec<&str> = shown.stdout.lines().filter(|l| l.starts_with("next ")).collect();
    assert_eq!(next.len(), 3, "{shown:?}");
    for line in &next {
        // 02:30 in Berlin is 00:30 UTC in summer time, 01:30 in winter time.
        let ok = (line.contains(" 02:30 CEST (+02:00) = ") && line.ends_with(" 00:30 UTC"))
            || (line.contains(" 02:30 CET (+01:00) = ") && line.ends_with(" 01:30 UTC"));
        assert!(ok, "{line}");
    }
    let json: Value = serde_json::from_str(&ok(&sb, &["show", "pair", "--json"]).stdout)?;
    let fires = json["schedule"]["next"].as_array().unwrap();
    assert_eq!(fires.len(), 3);
    let ats: Vec<u64> = fires.iter().map(|f| f["at"].as_u64().unwrap()).collect();
    assert!(ats.windows(2).all(|w| w[1] - w[0] >= 23 * 3_600_000 && w[1] - w[0] <= 25 * 3_600_000), "{ats:?}");
    assert_eq!(json["schedule"]["timezone"], "Europe/Berlin");
    assert_eq!(json["schedule"]["catchup"], "1h");
    let status = fleet(&sb, &["status", "pair"]);
    assert_eq!(status.code, 2, "{status:?}");
    assert_eq!(status.stdout.lines().filter(|l| l.starts_with("next ")).count(), 3, "{status:?}");
    sb.shutdown().await;
    Ok(())
}

/// Issue #36, exactly once across coordinators: two coordinators that read a fleet's
/// trigger state at the same revision and both claim the occurrence it makes due — each
/// over its own connection — are told apart by the compare-and-set: one claim is stored,
/// the other is refused as changed and stores nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinators_claiming_the_same_occurrence_one_wins() -> Result<()> {
    use mur_coordinator::fleet::schedule::{self as fleet_schedule, Action, Seen};
    use mur_coordinator::fleet::trigger::{WriteError, read_state, write_state};
    let sb = Sandbox::start(0, 1).await;
    let dir = tempfile::tempdir()?;
    let text = format!("{PAIR}loop:\n  trigger: interval:1h\n");
    ok(&sb, &["create", write(dir.path(), "pair.yaml", &text).to_str().unwrap()]);
    let lp = mur_proto::Fleet::parse(&text)?.r#loop;
    let mut claims = Vec::new();
    for name in ["coordinator-a", "coordinator-b"] {
        let js = async_nats::jetstream::new(sb.nats.connect().await);
        let kv = js.get_key_value(fleet_store::FLEETS_BUCKET).await?;
        let stored = read_state(&kv, "pair").await?;
        let id = format!("fleet-pair-{name}");
        let seen =
            Seen { now: 1_000, autorun: true, going: None, ended: None, claim_started: false, fresh_run_id: &id };
        let (state, actions) = fleet_schedule::step(&stored.state, &lp, &seen);
        assert_eq!(actions, [Action::Start { occurrence: 1_000, run_id: id.clone() }]);
        claims.push((kv, stored.revision, state));
    }
    let (a, b) = (&claims[0], &claims[1]);
    let (ra, rb) = tokio::join!(write_state(&a.0, "pair", a.1, &a.2), write_state(&b.0, "pair", b.1, &b.2));
    let (won, lost) = match (ra, rb) {
        (Ok(_), Err(e)) => (&a.2, e),
        (Err(e), Ok(_)) => (&b.2, e),
        other => panic!("exactly one claim must win: {other:?}"),
    };
    assert!(matches!(lost, WriteError::Changed(ref f) if f == "pair"), "{lost:?}");
    let stored = read_state(&claims[0].0, "pair").await?;
    assert_eq!(&stored.state, won);
    assert_eq!(stored.state.claim.as_ref().map(|c| c.occurrence), Some(1_000));
    sb.shutdown().await;
    Ok(())
}
