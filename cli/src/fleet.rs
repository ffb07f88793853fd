//! `mur fleet …`: define fleets, queue jobs, flip the kill-switch and read the channel,
//! over the coordinator's `mur.api.fleet.*` API (issue #10). Every command takes the
//! connection options of [`Connection`] and `--json`. Running fleets (`mur fleet run`)
//! comes with the run engine.

use crate::nats::Connection;
use crate::task::call;
use anyhow::{Context, Result};
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::ErrorCode;
use mur_proto::fleet::Job;
use mur_proto::fleet_store;
use mur_proto::fleet_store::{
    AnswerRequest, CancelRequest, ChannelEvent, DefineReply, DefineRequest, FleetInfo, FleetRef, FleetSummary,
    JobsRequest, LogRequest, SendRequest, SetLoopRequest, StopRequest, StopState, api,
};
use mur_proto::page::Page;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options every `mur fleet` command takes.
#[derive(clap::Args, Debug)]
pub struct Common {
    #[command(flatten)]
    conn: Connection,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
}

/// `mur fleet …`
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Store a new fleet from a fleet.yaml (refused when it exists). `-` reads stdin.
    Create {
        /// The fleet.yaml.
        file: PathBuf,
        #[command(flatten)]
        common: Common,
    },
    /// Store a fleet from a fleet.yaml, creating it or replacing its definition.
    Apply {
        /// The fleet.yaml.
        file: PathBuf,
        #[command(flatten)]
        common: Common,
    },
    /// List fleets.
    Ls {
        #[command(flatten)]
        common: Common,
    },
    /// Print a fleet: its state, job counts, notices and its fleet.yaml as stored.
    Show {
        /// The fleet.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Remove a fleet with its jobs, its kill-switch and its channel.
    Rm {
        /// The fleet.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Queue a job; prints `queued job <id> in fleet <name>` (`--json`: the job) and runs
    /// nothing.
    Send {
        /// The fleet.
        name: String,
        /// The work; `-` reads it from stdin (a text too long for an argument).
        text: String,
        #[command(flatten)]
        common: Common,
    },
    /// List a fleet's queued, running and blocked jobs, oldest first.
    Jobs {
        /// The fleet.
        name: String,
        /// Include done, failed and canceled jobs.
        #[arg(long)]
        all: bool,
        /// Only jobs whose run id starts with this (a loop's id selects its iterations).
        #[arg(long, value_name = "RUN_ID_PREFIX")]
        since: Option<String>,
        /// Only jobs in this status (a finished one is listed without --all).
        #[arg(long, value_parser = ["queued", "running", "blocked", "done", "failed", "canceled"])]
        status: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Cancel a queued, running or blocked job (by id or a prefix naming one job).
    Cancel {
        /// The fleet.
        name: String,
        /// The job.
        job: String,
        #[command(flatten)]
        common: Common,
    },
    /// Approve the steps a blocked job is waiting on; the next run takes the job and runs
    /// them (by id or a prefix naming one job).
    Approve(AnswerArgs),
    /// Deny the steps a blocked job is waiting on; the next run fails them (their
    /// `on_failure` applies).
    Deny(AnswerArgs),
    /// Change the loop's settings; only the flags given are judged and changed.
    SetLoop(SetLoopArgs),
    /// Set the kill-switch: no loop iteration, step, trigger or manual run starts, and a
    /// running run's steps are canceled (their commands killed); the run ends `stopped`.
    Stop {
        /// The fleet.
        name: String,
        /// Who stops it (default: $USER).
        #[arg(long)]
        by: Option<String>,
        /// Let the steps already running finish; still nothing new starts.
        #[arg(long)]
        drain: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Fire one occurrence of the fleet's trigger now (a manual backfill of one): the
    /// leading coordinator takes it within a second, with autorun off or the trigger
    /// paused too; `loop.overlap` applies while a run is going. Prints what came of it.
    Trigger {
        /// The fleet.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Clear the kill-switch, and resume a trigger paused after failures.
    Start {
        /// The fleet.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Run the fleet on the leading coordinator: one iteration, or a loop with `--loop`,
    /// until it ends; prints the `bounds:` line and follows the channel (Ctrl-C detaches;
    /// the run goes on). Exits 0 when the run ended done (converged, or the queue drained),
    /// 1 when it ended otherwise, 2 when it was refused.
    Run {
        /// The fleet.
        name: String,
        /// A queued job to work on first (id or unique prefix).
        job: Option<String>,
        /// Keep iterating until a bound or `done_when` ends it.
        #[arg(long = "loop")]
        looping: bool,
        /// Wall clock for the run (`30m`, `2h`, …).
        #[arg(long, allow_hyphen_values = true)]
        deadline: Option<String>,
        /// Spend ceiling in USD.
        #[arg(long, allow_hyphen_values = true, value_parser = finite_usd)]
        budget_usd: Option<f64>,
        /// The run's id (default `run-<uuid>`, or `fleet-<name>-<uuid>` for a loop).
        #[arg(long)]
        run_id: Option<String>,
        /// Ignored, with a notice: loops are bounded by deadline, stuck and cost (a
        /// 10000-iteration diagnostic ceiling remains).
        #[arg(long, value_name = "N")]
        max_iterations: Option<u64>,
        #[command(flatten)]
        common: Common,
    },
    /// The fleet's schedule (next occurrences, a pause) and its latest run: its state,
    /// stop reason and liveness verdict.
    Status {
        /// The fleet.
        name: String,
        #[command(flatten)]
        common: Common,
    },
    /// Print the fleet's channel: every event with its author and sequence number.
    Log {
        /// The fleet.
        name: String,
        /// Only events after this sequence number.
        #[arg(long, value_name = "SEQ")]
        since: Option<u64>,
        #[command(flatten)]
        common: Common,
    },
}

/// `mur fleet approve|deny NAME JOB [--by WHO]`.
#[derive(clap::Args, Debug)]
pub struct AnswerArgs {
    /// The fleet.
    name: String,
    /// The blocked job.
    job: String,
    /// Who answers (default: $USER).
    #[arg(long)]
    by: Option<String>,
    #[command(flatten)]
    common: Common,
}

/// `mur fleet set-loop NAME [--done-when P] [--trigger T] [--deadline D] [--budget-usd N]`.
/// Values starting with `-` are taken as values, so the validator judges `--budget-usd -1`.
#[derive(clap::Args, Debug)]
pub struct SetLoopArgs {
    /// The fleet.
    name: String,
    /// Empty (the router judges), queue-empty, or marker:<TEXT>.
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    done_when: Option<String>,
    /// manual, interval:<duration> or cron:<5-field expression>.
    #[arg(long, value_name = "T", allow_hyphen_values = true)]
    trigger: Option<String>,
    /// A duration relative to the loop's start (30m, 2h); empty clears it.
    #[arg(long, value_name = "D", allow_hyphen_values = true)]
    deadline: Option<String>,
    /// A spend ceiling in USD; 0 for none.
    #[arg(long, value_name = "N", allow_hyphen_values = true, value_parser = finite_usd)]
    budget_usd: Option<f64>,
    /// The IANA zone a cron trigger is read in (Europe/Berlin); empty for UTC.
    #[arg(long, value_name = "ZONE", allow_hyphen_values = true)]
    timezone: Option<String>,
    /// What an occurrence does while a run is going: skip, queue_one or cancel_previous.
    #[arg(long, value_name = "POLICY", allow_hyphen_values = true)]
    overlap: Option<String>,
    /// How late a missed occurrence still runs (1h; one run for all missed); empty for 90s.
    #[arg(long, value_name = "D", allow_hyphen_values = true)]
    catchup: Option<String>,
    /// Pause the trigger after N failed runs in a row (0: never).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pause_after_failures: Option<String>,
    #[command(flatten)]
    common: Common,
}

/// Parses a `--budget-usd` value: any finite number (a negative one is judged by the
/// validator, which says why). `nan` and `inf` (or `1e400`) are refused here: JSON has no
/// such numbers, so they would reach the coordinator as no value at all, and a run would
/// go on without the ceiling it seemed to have (the fleet-loops seed, §Settings that used
/// to mean something else).
fn finite_usd(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(format!("--budget-usd: must be a finite number of USD, got {s:?}")),
        Err(_) => Err(format!("--budget-usd: must be a number of USD, got {s:?}")),
    }
}

/// Connects, calls `subject` with `body`, decodes the reply.
fn request<T: DeserializeOwned>(common: &Common, what: &str, subject: &str, body: &impl Serialize) -> Result<T> {
    let body = serde_json::to_vec(body)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let client = common.conn.connect(what).await?;
        call(&client, subject, body).await
    })
}

/// Calls `subject` with `body` in `span`, a client span whose W3C `traceparent` goes along
/// in the request headers, as `mur task send`'s does (issue #32 §Fleet runs traced): the
/// coordinator's span answering it, and what it starts, join the span's trace.
async fn call_traced<T: DeserializeOwned>(
    client: &async_nats::Client,
    span: tracing::Span,
    subject: &str,
    body: Vec<u8>,
) -> Result<T> {
    let call = async {
        let headers = mur_nats::trace_context::headers(&tracing::Span::current());
        mur_nats::api::call_with_headers(client, subject, headers, body).await
    };
    Ok(tracing::Instrument::instrument(call, span).await?)
}

/// A client span for a request to `subject` about `fleet` (OpenTelemetry messaging
/// conventions), with `mur.job_id` and `mur.run_id` to be recorded.
fn client_span(name: &'static str, subject: &str, fleet: &str) -> tracing::Span {
    tracing::info_span!(
        "fleet_client",
        otel.name = name,
        otel.kind = "client",
        messaging.system = "nats",
        messaging.operation.type = "send",
        messaging.destination.name = subject,
        mur.fleet = fleet,
        mur.job_id = tracing::field::Empty,
        mur.run_id = tracing::field::Empty,
    )
}

fn print_json(value: &impl Serialize) -> Result<()> {
    println!("{}", serde_json::to_string(value)?);
    Ok(())
}

fn read_file(file: &PathBuf) -> Result<String> {
    if file.as_os_str() == "-" {
        return std::io::read_to_string(std::io::stdin()).context("reading fleet.yaml from stdin");
    }
    std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))
}

fn table(header: &[&str]) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING).set_header(header.to_vec());
    t
}

/// A job's text cut to 50 characters (49 and `…` when longer), on one line.
/// A job's text or result in a table cell: one escaped line of at most 50 characters.
fn cut(text: &str) -> String {
    crate::text::cell(text, 50)
}

fn print_show(info: &FleetInfo) {
    let s = &info.summary;
    println!("fleet     {}", s.name);
    println!("state     {}", state_line(&s.stop));
    println!("members   {}", if s.members.is_empty() { "-".to_string() } else { s.members.join(", ") });
    println!(
        "loop      trigger {}; done_when {}",
        s.trigger,
        if s.done_when.is_empty() { "(router judges)" } else { &s.done_when }
    );
    println!("jobs      {} queued, {} running, {} blocked", s.queued, s.running, s.blocked);
    print_schedule(info);
    if let Some(e) = &s.error {
        println!("error     {}", crate::text::printable(e).replace('\n', "; "));
    }
    for n in &info.notices {
        println!("notice    {n}");
    }
    println!("---");
    print!("{}", info.yaml);
    if !info.yaml.ends_with('\n') {
        println!();
    }
}

/// The schedule lines of `mur fleet show`, `set-loop`, `start` and `status` (issue #36):
/// the policies, a pause, an occurrence waiting, the next occurrences in the fleet's zone
/// and in UTC.
fn print_schedule(info: &FleetInfo) {
    let Some(s) = &info.schedule else { return };
    let pause = match s.pause_after_failures {
        0 => "never pauses".to_string(),
        n => format!("pauses after {n} failed runs in a row ({} so far)", s.failures),
    };
    println!(
        "schedule  zone {}; overlap {}; catchup {}; {pause}; {} occurrence(s) skipped",
        s.timezone, s.overlap, s.catchup, s.skipped
    );
    let utc = |t: u64| mur_proto::fleet::schedule::show_instant(mur_proto::fleet::schedule::Tz::UTC, t);
    if let Some(at) = s.paused_at {
        println!(
            "paused    since {} after {} failed runs in a row: `mur fleet start {}` resumes it",
            utc(at),
            s.failures,
            info.summary.name
        );
    }
    if let Some(q) = s.queued {
        println!("waiting   occurrence {} waits for the run going to end", utc(q));
    }
    for n in &s.next {
        if n.local == n.utc {
            println!("next      {}", n.utc);
        } else {
            println!("next      {} = {}", n.local, n.utc);
        }
    }
}

/// `mur fleet trigger NAME`: asks, waits (up to 15 s) for the leader to take the
/// occurrence, and says what came of it.
fn trigger(common: &Common, name: String) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let client = common.conn.connect("mur fleet trigger").await?;
        let body = serde_json::to_vec(&FleetRef { fleet: name.clone() })?;
        let before: FleetInfo = call(&client, api::SHOW, body.clone()).await?;
        let before_run = before.schedule.as_ref().and_then(|s| s.run.clone());
        let asked: FleetInfo = call(&client, api::TRIGGER, body.clone()).await?;
        let at = asked.schedule.as_ref().and_then(|s| s.manual);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
        let mut info = asked;
        while info.schedule.as_ref().is_some_and(|s| s.manual.is_some()) {
            if tokio::time::Instant::now() >= deadline {
                if common.json {
                    print_json(&info)?;
                } else {
                    println!(
                        "asked fleet {name} for one occurrence; no leading coordinator has taken it yet (it will \
                         when one runs)"
                    );
                }
                return Ok(ExitCode::FAILURE);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            info = call(&client, api::SHOW, body.clone()).await?;
        }
        if common.json {
            print_json(&info)?;
            return Ok(ExitCode::SUCCESS);
        }
        let s = info.schedule.clone().unwrap_or_default();
        match (&s.run, s.queued) {
            (Some(run), _) if Some(run) != before_run.as_ref() => println!("triggered fleet {name}: run {run}"),
            (_, Some(q)) if Some(q) == at => {
                println!(
                    "triggered fleet {name}: the occurrence waits for the run going to end (loop.overlap {})",
                    s.overlap
                )
            }
            _ => println!("triggered fleet {name}: the occurrence started no run; see `mur fleet log {name}`"),
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn state_line(stop: &StopState) -> String {
    match stop {
        StopState::Started => "started".to_string(),
        StopState::Stopped { sentinel } => format!("stopped by {}", sentinel.by),
        StopState::Unreadable { error } => format!("stopped (sentinel unreadable: {error})"),
    }
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    match cmd {
        Command::Create { file, common } => define(&file, &common, api::CREATE, "mur fleet create"),
        Command::Apply { file, common } => define(&file, &common, api::APPLY, "mur fleet apply"),
        Command::Ls { common } => {
            let fleets: Vec<FleetSummary> = request(&common, "mur fleet ls", api::LIST, &serde_json::json!({}))?;
            if common.json {
                return print_json(&fleets).map(|()| ExitCode::SUCCESS);
            }
            let mut t = table(&["FLEET", "STATE", "MEMBERS", "QUEUED", "RUNNING", "BLOCKED", "TRIGGER", "DONE_WHEN"]);
            for f in fleets {
                t.add_row(vec![
                    f.name,
                    f.stop.label().to_string(),
                    if f.error.is_some() { "(does not load)".to_string() } else { f.members.join(",") },
                    f.queued.to_string(),
                    f.running.to_string(),
                    f.blocked.to_string(),
                    f.trigger,
                    f.done_when,
                ]);
            }
            println!("{t}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Show { name, common } => {
            let info: FleetInfo = request(&common, "mur fleet show", api::SHOW, &FleetRef { fleet: name })?;
            if common.json {
                print_json(&info)?;
            } else {
                print_show(&info);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Rm { name, common } => {
            let gone: FleetRef = request(&common, "mur fleet rm", api::REMOVE, &FleetRef { fleet: name })?;
            if common.json {
                print_json(&gone)?;
            } else {
                println!("removed fleet {}", gone.fleet);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Send { name, text, common } => {
            let text = crate::task::text_or_stdin(&text, "the job's text")?;
            let body = serde_json::to_vec(&SendRequest { fleet: name.clone(), text, source: None })?;
            let span = client_span("send_job", api::SEND, &name);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let job: Job = rt.block_on(async {
                let client = common.conn.connect("mur fleet send").await?;
                call_traced(&client, span.clone(), api::SEND, body).await
            })?;
            span.record("mur.job_id", job.id.as_str());
            drop(span);
            if common.json {
                print_json(&job)?;
            } else {
                // A sentence, as `fleet create` says `created fleet …` (the id alone read as
                // noise); scripts read `--json`'s `id`.
                println!("queued job {} in fleet {name}", job.id);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Jobs { name, all, since, status, common } => {
            // The parser allows only the spellings of a status.
            let status = status.and_then(|s| serde_json::from_value(serde_json::Value::String(s)).ok());
            let req = JobsRequest { fleet: name.clone(), all, since, status };
            let page: Page<Job> = request(&common, "mur fleet jobs", api::JOBS, &req)?;
            crate::task::page_notes(
                &page,
                "jobs",
                "the oldest finished ones were left out (--since RUN narrows)",
                None,
            );
            let jobs = page.items;
            if common.json {
                return print_json(&jobs).map(|()| ExitCode::SUCCESS);
            }
            if jobs.is_empty() {
                eprintln!(
                    "no jobs to show (queue one with `mur fleet send {name} \"text\"`; --all shows finished ones)"
                );
                return Ok(ExitCode::SUCCESS);
            }
            let mut t = table(&["JOB", "STATUS", "RUN", "TEXT", "RESULT"]);
            for j in jobs {
                let result = j.error.as_deref().or(j.result.as_deref()).map(cut).unwrap_or_default();
                t.add_row(vec![j.id, j.status.to_string(), j.run_id.unwrap_or_default(), cut(&j.text), result]);
            }
            println!("{t}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Cancel { name, job, common } => {
            let job: Job = request(&common, "mur fleet cancel", api::CANCEL, &CancelRequest { fleet: name, job })?;
            if common.json {
                print_json(&job)?;
            } else {
                println!("canceled job {}", job.id);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Approve(AnswerArgs { name, job, by, common }) => {
            answer(&common, "mur fleet approve", api::APPROVE, name, job, by)
        }
        Command::Deny(AnswerArgs { name, job, by, common }) => {
            answer(&common, "mur fleet deny", api::DENY, name, job, by)
        }
        Command::SetLoop(args) => {
            let req = SetLoopRequest {
                fleet: args.name,
                trigger: args.trigger,
                done_when: args.done_when,
                deadline: args.deadline,
                budget_usd: args.budget_usd,
                timezone: args.timezone,
                overlap: args.overlap,
                catchup: args.catchup,
                pause_after_failures: args.pause_after_failures,
            };
            let info: FleetInfo = request(&args.common, "mur fleet set-loop", api::SET_LOOP, &req)?;
            if args.common.json {
                print_json(&info)?;
            } else {
                print_show(&info);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Stop { name, by, drain, common } => {
            let by =
                by.or_else(|| std::env::var("USER").ok()).filter(|b| !b.is_empty()).unwrap_or_else(|| "cli".into());
            let info: FleetInfo =
                request(&common, "mur fleet stop", api::STOP, &StopRequest { fleet: name, by, drain })?;
            if common.json {
                print_json(&info)?;
            } else {
                println!("fleet {} {}", info.summary.name, state_line(&info.summary.stop));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Start { name, common } => {
            let info: FleetInfo = request(&common, "mur fleet start", api::START, &FleetRef { fleet: name })?;
            if common.json {
                print_json(&info)?;
            } else {
                println!("fleet {} {}", info.summary.name, state_line(&info.summary.stop));
                print_schedule(&info);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Trigger { name, common } => trigger(&common, name),
        Command::Run { name, job, looping, deadline, budget_usd, run_id, max_iterations, common } => {
            let request = fleet_store::RunRequest { fleet: name, job, looping, deadline, budget_usd, run_id };
            // The fleet-loops seed, §The bounds: "--max-iterations and loop.max_iterations are
            // ignored with a notice". The value goes nowhere: the request has no such field.
            let ignored =
                max_iterations.map(|_| format!("--max-iterations {}", mur_proto::fleet::MAX_ITERATIONS_NOTICE));
            follow_run(&common, &request, ignored)
        }
        Command::Status { name, common } => run_status(&common, RunPick::LatestOf(name)),
        Command::Log { name, since, common } => {
            // Page by page: a reply carries at most MAX_LOG_BYTES of events.
            let mut events: Vec<ChannelEvent> = Vec::new();
            let mut from = since;
            loop {
                let page: Vec<ChannelEvent> =
                    request(&common, "mur fleet log", api::LOG, &LogRequest { fleet: name.clone(), since: from })?;
                let Some(last) = page.last() else { break };
                from = Some(last.seq);
                events.extend(page);
            }
            if common.json {
                return print_json(&events).map(|()| ExitCode::SUCCESS);
            }
            for e in events {
                let text = crate::text::printable(&e.text).replace('\n', "\n    ");
                let mut line = format!("#{} {} {}: {text}", e.seq, e.author, e.kind);
                if let Some(r) = &e.run_id {
                    line.push_str(&format!(" [run {r}]"));
                }
                println!("{line}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `mur job …`
#[derive(clap::Subcommand, Debug)]
pub enum JobCommand {
    /// A run's state plus a liveness verdict (alive, dead: its coordinator stopped
    /// beating, or over). RUN_ID is a run id or a loop iteration's `<id>-<n>`.
    Status {
        /// The run id.
        run_id: String,
        #[command(flatten)]
        common: Common,
    },
}

/// `mur fleet approve` / `deny`: prints `<approved|denied> job <id> (step <ids>)`.
fn answer(
    common: &Common,
    what: &str,
    subject: &str,
    fleet: String,
    job: String,
    by: Option<String>,
) -> Result<ExitCode> {
    let by = by.or_else(|| std::env::var("USER").ok()).filter(|b| !b.is_empty()).unwrap_or_else(|| "cli".into());
    let job: Job = request(common, what, subject, &AnswerRequest { fleet, job, by })?;
    if common.json {
        print_json(&job)?;
    } else {
        let approval = job.approval.as_ref();
        let decision = approval.and_then(|a| a.decision).map_or("answered", |d| d.as_str());
        let steps = approval.map(|a| a.steps.join(", ")).unwrap_or_default();
        println!("{decision} job {} (step {steps}); the next run of the fleet takes it", job.id);
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs a `mur job` command.
pub fn job(cmd: JobCommand) -> Result<ExitCode> {
    let JobCommand::Status { run_id, common } = cmd;
    // Nothing else can name a run (a key of mur_fleets is made of it).
    if !mur_proto::fleet::is_run_ref(&run_id) {
        return Err(crate::Invalid(format!(
            "RUN_ID: must be letters, digits, '-' or '_' (a run id or <run id>-<n>), got {run_id:?}"
        ))
        .into());
    }
    run_status(&common, RunPick::Id(run_id))
}

/// Which run `run_status` shows.
enum RunPick {
    Id(String),
    LatestOf(String),
}

/// Prints a run's record and verdict; exit 0 when found, 2 when not.
fn run_status(common: &Common, pick: RunPick) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let client = common.conn.connect("mur job status").await?;
        let js = async_nats::jetstream::new(client.clone());
        let defs = js.get_key_value(fleet_store::FLEETS_BUCKET).await.context("mur_fleets")?;
        let read = |key: String| {
            let defs = defs.clone();
            async move {
                defs.get(&key)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|v| serde_json::from_slice::<fleet_store::RunRecord>(&v).ok())
            }
        };
        if let RunPick::LatestOf(fleet) = &pick
            && !common.json
            && let Ok(info) =
                call::<FleetInfo>(&client, api::SHOW, serde_json::to_vec(&FleetRef { fleet: fleet.clone() })?).await
        {
            print_schedule(&info);
        }
        let id = match &pick {
            RunPick::Id(id) => Some(id.clone()),
            RunPick::LatestOf(fleet) => {
                // One pass that deletes its consumer (issue #29 item 3).
                let keys = mur_nats::read::keys(&defs, "run.>").await.context("mur_fleets: keys")?;
                let mut latest: Option<fleet_store::RunRecord> = None;
                for key in keys {
                    if let Some(r) = read(key).await.filter(|r| &r.fleet == fleet)
                        && latest.as_ref().is_none_or(|l| r.started_at > l.started_at)
                    {
                        latest = Some(r);
                    }
                }
                latest.map(|r| r.run_id)
            }
        };
        let status = match id {
            Some(id) => {
                mur_nats::fleet::run_status(&js, &id, SystemClock.now_ms()).await.map_err(|e| anyhow::anyhow!(e))?
            }
            None => None,
        };
        let Some(status) = status else {
            let (code, what) = match pick {
                RunPick::Id(id) => (ErrorCode::NotFound, format!("no run {id}")),
                RunPick::LatestOf(fleet) => {
                    // A fleet that does not exist is said so, as every other fleet command does.
                    let show = serde_json::to_vec(&FleetRef { fleet: fleet.clone() })?;
                    match call::<FleetInfo>(&client, api::SHOW, show).await {
                        Err(e) => (crate::api_code(&e).unwrap_or(ErrorCode::NotFound), format!("{e:#}")),
                        Ok(_) => (ErrorCode::NotFound, format!("fleet {fleet} has no run yet")),
                    }
                }
            };
            return Ok(crate::refused(common.json, Some(code), "mur: ", &what));
        };
        if common.json {
            print_json(&status)?;
            return Ok(ExitCode::SUCCESS);
        }
        let r = &status.record;
        println!("run        {}", r.run_id);
        println!("fleet      {}", r.fleet);
        println!("state      {}{}", r.state, r.stop.as_ref().map(|s| format!(" ({s})")).unwrap_or_default());
        println!(
            "liveness   {}",
            match &status.liveness {
                fleet_store::Liveness::Alive { beat_age_ms } => format!("alive (heartbeat {beat_age_ms} ms ago)"),
                fleet_store::Liveness::Dead { beat_age_ms } =>
                    format!("dead (no heartbeat for {} s: its coordinator is gone)", beat_age_ms / 1000),
                fleet_store::Liveness::Over => "over".to_string(),
            }
        );
        println!("iterations {}", r.iterations);
        // The bounds line as the run printed it (`bounds: …`), under the same column.
        println!("bounds     {}", r.bounds.strip_prefix("bounds: ").unwrap_or(&r.bounds));
        println!("coordinator {}", r.coordinator);
        print_spend(r);
        print!("{}", crate::cluster::render_permits(&status.fanout));
        Ok(ExitCode::SUCCESS)
    })
}

/// The spend lines of `mur job status` (issue #11 §Cost): the run's, each job's, each
/// member's; the budget when one applies; and the run's notices.
fn print_spend(r: &fleet_store::RunRecord) {
    let budget = r.budget_usd.map(|b| format!(" of a ${b:.4} budget")).unwrap_or_default();
    println!("spend      {}{budget}", r.spend.summary());
    for (job, s) in &r.jobs {
        println!("  job {job} {}", s.summary());
    }
    for (member, s) in &r.members {
        println!("  member {member} {}", s.summary());
    }
    for n in &r.notices {
        println!("notice     {n}");
    }
}

/// `mur fleet run`: asks the leader to start the run, then follows it (issue #11 §Live
/// follow): milestone lines (the run's channel events), and a status line per member with
/// the run's permits in use and its spend — redrawn in place on a terminal, printed when it
/// changes otherwise, and with `--json` all of it as JSON lines on stdout, each with a
/// `type`: `run` (the record at the start), `event`, `status`, `end` (the final record).
fn follow_run(common: &Common, request: &fleet_store::RunRequest, notice: Option<String>) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        use futures::StreamExt;
        // Ctrl-C is ours from here on, not the default (death by SIGINT): before the run is
        // started it quits (130) and starts nothing; once it is started, it detaches (0). The
        // handler is registered by the first poll, now, so a Ctrl-C right after the run id
        // is printed is not lost.
        let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
        let _ = futures::FutureExt::now_or_never(&mut ctrl_c);
        let client = common.conn.connect("mur fleet run").await?;
        let js = async_nats::jetstream::new(client.clone());
        // Watch task records from before the run starts, so no step is missed.
        let tasks_kv = js.get_key_value(mur_proto::cluster::TASKS_BUCKET).await.context("mur_tasks")?;
        let mut task_updates = mur_nats::read::watch_changes(&tasks_kv, ">").await.context("mur_tasks: watch")?;
        // The run's permits, from a watch on the semaphore: every permit taken or given back.
        let fanout_kv = js.get_key_value(mur_proto::fanout::FANOUT_BUCKET).await.context("mur_fanout")?;
        let mut permit_updates = mur_nats::read::watch(&fanout_kv, ">").await.context("mur_fanout: watch")?;
        // The follow; however it ends, the watches' consumers are deleted before this
        // process ends (issue #29 item 3: they were left on the server for 30 s).
        let followed =
            async {
                let info: Option<FleetInfo> =
                    call(&client, api::SHOW, serde_json::to_vec(&FleetRef { fleet: request.fleet.clone() })?)
                        .await
                        .ok();
                let mut members = Vec::new();
                if let Some(f) = info.and_then(|i| mur_proto::Fleet::load_stored(&i.yaml).ok()) {
                    members.extend(f.router.clone());
                    members.extend(f.members.clone());
                }
                // The channel's last event before the run: the run's own come after it, so the
                // follower never pages through the fleet's history (which may never end).
                let mut seen = match js.get_stream(fleet_store::FLEET_STREAM).await {
                    Ok(mut stream) => stream.info().await.map_or(0, |i| i.state.last_sequence),
                    Err(_) => 0,
                };
                // The run records' bucket, opened before the run starts: once the run line is
                // printed the follower needs nothing more from the cluster to follow it.
                let defs = js.get_key_value(fleet_store::FLEETS_BUCKET).await?;
                let body = serde_json::to_vec(request)?;
                if futures::FutureExt::now_or_never(&mut ctrl_c).is_some() {
                    eprintln!("mur fleet run: interrupted; no run was started");
                    return Ok(ExitCode::from(130));
                }
                let span = client_span("run_fleet", fleet_store::RUN_SUBJECT, &request.fleet);
                let started: fleet_store::RunRecord =
                    match call_traced::<fleet_store::RunRecord>(&client, span.clone(), fleet_store::RUN_SUBJECT, body)
                        .await
                    {
                        Ok(r) => {
                            span.record("mur.run_id", r.run_id.as_str());
                            drop(span);
                            r
                        }
                        Err(e) => {
                            return Ok(crate::refused(
                                common.json,
                                crate::api_code(&e),
                                "mur fleet run: ",
                                &format!("refused: {e:#}"),
                            ));
                        }
                    };
                // The bounds line and the notices, once: the run's channel repeats them, and the
                // milestones leave those events out (issue #29: each was printed twice).
                eprintln!("{}", started.bounds);
                for n in started.notices.iter().chain(&notice) {
                    eprintln!("{}", fleet_store::notice_text(n));
                }
                if common.json {
                    print_typed("run", &started)?;
                } else {
                    println!("run {} started on coordinator {}", started.run_id, started.coordinator);
                }
                let mut follow = crate::follow::Follow::new(&started.run_id, members);
                // The spend the run started with (0, or what earlier iterations of an adopted run
                // spent): the first status line shows it, as every later one does.
                follow.set_spend(spend_of(&started));
                let mut said = vec![fleet_store::run_started_text(&started.run_id, &started.bounds)];
                said.extend(started.notices.iter().map(|n| fleet_store::notice_text(n)));
                let mut view = Live::new(common.json, follow, said, follow_every()?);
                let mut our_permits = std::collections::BTreeSet::new();
                let key = fleet_store::run_key(&started.run_id);
                // When the stream store last answered: a follower cut off from the cluster
                // for longer than a sender waits ends instead of following nothing forever.
                let mut answered_at = tokio::time::Instant::now();
                let mut tick = tokio::time::interval(std::time::Duration::from_millis(200));
                // A tick that overran (a slow coordinator) is not made up in a burst: the watches
                // are read between ticks, and must keep up (unread entries hold whole read
                // buffers of the connection: the client grew by a megabyte an iteration).
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    // In this order: the watches are read whenever they hold something, the tick's
                    // requests only when they are empty, so the follower never falls behind them.
                    tokio::select! {
                        biased;
                        _ = &mut ctrl_c => {
                            view.finish();
                            eprintln!("detached; run {} goes on (mur fleet log {})", started.run_id, started.fleet);
                            return Ok(ExitCode::SUCCESS);
                        }
                        Some(Ok(entry)) = task_updates.next() => {
                            if let Ok(r) = serde_json::from_slice::<mur_proto::cluster::TaskRecord>(&entry.value) {
                                let changed = view.follow.task(&r);
                                view.changed(changed)?;
                            }
                            continue;
                        }
                        Some(Ok(entry)) = permit_updates.next() => {
                            if entry.key.starts_with(mur_proto::fanout::SLOT_PREFIX) {
                                let ours = entry.operation == async_nats::jetstream::kv::Operation::Put
                                    && serde_json::from_slice::<mur_proto::fanout::Holder>(&entry.value)
                                        .is_ok_and(|h| h.step.run_id.starts_with(&started.run_id));
                                if ours {
                                    our_permits.insert(entry.key);
                                } else {
                                    our_permits.remove(&entry.key);
                                }
                                let changed = view.follow.set_permits(our_permits.len());
                                view.changed(changed)?;
                            }
                            continue;
                        }
                        _ = tick.tick() => {}
                    }
                    view.tick();
                    seen = milestones(&client, &started, seen, &mut view).await?;
                    // This run's blocked jobs only: a short reply, where the run's every job (the
                    // view needs no more) grew it to a whole page of a megabyte, asked for five
                    // times a second.
                    let jobs: Vec<Job> = call::<Page<Job>>(
                        &client,
                        api::JOBS,
                        serde_json::to_vec(&JobsRequest {
                            fleet: started.fleet.clone(),
                            all: false,
                            since: Some(started.run_id.clone()),
                            status: Some(mur_proto::fleet::JobStatus::Blocked),
                        })?,
                    )
                    .await
                    .map(|page| page.items)
                    .unwrap_or_default();
                    let blocked = !jobs.is_empty();
                    let changed = view.follow.set_blocked(blocked);
                    view.changed(changed)?;
                    let read = defs.get(&key).await;
                    if read.is_ok() {
                        answered_at = tokio::time::Instant::now();
                    } else if answered_at.elapsed() >= FOLLOW_PATIENCE {
                        view.finish();
                        return Ok(crate::refused(
                            common.json,
                            None,
                            "mur fleet run: ",
                            &unreachable_text(&started.run_id, &started.fleet),
                        ));
                    }
                    let record =
                        read.ok().flatten().and_then(|v| serde_json::from_slice::<fleet_store::RunRecord>(&v).ok());
                    if let Some(r) = &record {
                        let changed = view.follow.set_spend(spend_of(r));
                        view.changed(changed)?;
                    }
                    if let Some(r) = record.filter(fleet_store::RunRecord::is_over) {
                        // The run's stop event is written before its record: one that came between
                        // this tick's reading of the channel and of the record is read now.
                        milestones(&client, &started, seen, &mut view).await?;
                        // The steps' last records were stored before the run's: take those already here.
                        while let Some(Some(Ok(entry))) = futures::FutureExt::now_or_never(task_updates.next()) {
                            if let Ok(t) = serde_json::from_slice::<mur_proto::cluster::TaskRecord>(&entry.value) {
                                let changed = view.follow.task(&t);
                                view.changed(changed)?;
                            }
                        }
                        view.finish();
                        let stop = r.stop.clone().unwrap_or_default();
                        if common.json {
                            print_typed("end", &r)?;
                        }
                        let spent = format!("; spent {}", r.spend.summary());
                        // `completed`: a record of an older version.
                        if matches!(r.state.as_str(), "done" | "completed") {
                            eprintln!("run {} done ({stop}) after {}{spent}", r.run_id, iterations(r.iterations));
                            return Ok(ExitCode::SUCCESS);
                        }
                        eprintln!("run {} ended: {stop} after {}{spent}", r.run_id, iterations(r.iterations));
                        return Ok(ExitCode::from(1));
                    }
                }
            }
            .await;
        task_updates.close().await;
        permit_updates.close().await;
        followed
    })
}

/// Prints the run's channel events after sequence number `seen` as milestones; returns the
/// last sequence number read (`seen` when none was, or the channel could not be read).
async fn milestones(
    client: &async_nats::Client,
    run: &fleet_store::RunRecord,
    seen: u64,
    view: &mut Live,
) -> Result<u64> {
    let request = LogRequest { fleet: run.fleet.clone(), since: Some(seen) };
    let events: Vec<ChannelEvent> = call(client, api::LOG, serde_json::to_vec(&request)?).await.unwrap_or_default();
    for e in events.iter().filter(|e| e.run_id.as_deref().is_some_and(|r| r.starts_with(&run.run_id))) {
        view.milestone(e)?;
    }
    Ok(events.last().map_or(seen, |last| last.seq))
}

/// How long `mur fleet run` follows a run while the cluster's stream store does not answer
/// (its server is down or unreachable) before it gives up with exit status 2: as long as
/// `mur task send` resends a task the cluster does not answer, 30 s. The run itself is
/// the coordinator's and goes on if the cluster does. Before, the follower waited forever,
/// past the run's own deadline (issue #29, found on a fresh machine: a follower outlived
/// its server by 20 minutes and kept its test binary from ending).
const FOLLOW_PATIENCE: std::time::Duration = mur_nats::api::SUBMIT_PATIENCE;

/// What `mur fleet run` says when it gives up following (see [`FOLLOW_PATIENCE`]).
fn unreachable_text(run_id: &str, fleet: &str) -> String {
    format!(
        "the cluster has not answered for {} s; stopped following run {run_id}, which goes on if the cluster does \
         (mur fleet status {fleet})",
        FOLLOW_PATIENCE.as_secs()
    )
}

/// `1 iteration`, `2 iterations`.
fn iterations(n: u64) -> String {
    if n == 1 { "1 iteration".into() } else { format!("{n} iterations") }
}

/// A run's spend so far, USD, when its record reports one.
fn spend_of(r: &fleet_store::RunRecord) -> Option<f64> {
    Some(r.spend.usd)
}

/// Prints `value` as one JSON line with a `type` field first.
fn print_typed(kind: &str, value: &impl Serialize) -> Result<()> {
    let mut line = serde_json::Map::new();
    line.insert("type".into(), kind.into());
    if let serde_json::Value::Object(fields) = serde_json::to_value(value)? {
        line.extend(fields);
    }
    println!("{}", serde_json::Value::Object(line));
    Ok(())
}

/// The environment variable that sets the longest silence of `mur fleet run` off a
/// terminal, in whole seconds (default 15, [`crate::follow::Lines::EVERY`]).
pub const FOLLOW_EVERY_ENV: &str = "MUR_FOLLOW_EVERY_SECS";

/// The longest silence off a terminal: [`FOLLOW_EVERY_ENV`], else 15 s.
///
/// # Errors
/// [`crate::Invalid`] when the variable is not a whole number of seconds of at least 1.
fn follow_every() -> Result<std::time::Duration> {
    match std::env::var(FOLLOW_EVERY_ENV) {
        Err(_) => Ok(crate::follow::Lines::EVERY),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(secs) if secs >= 1 => Ok(std::time::Duration::from_secs(secs)),
            _ => Err(crate::Invalid(format!(
                "{FOLLOW_EVERY_ENV}: must be a whole number of seconds, at least 1, got {v:?}"
            ))
            .into()),
        },
    }
}

/// Where the live view goes: JSON lines, bars redrawn on a terminal (a spinner per member,
/// with the running ones' times), or plain lines ([`crate::follow::Lines`]: on each change
/// and at least every 15 s).
struct Live {
    follow: crate::follow::Follow,
    json: bool,
    bars: Option<(indicatif::MultiProgress, Vec<indicatif::ProgressBar>, indicatif::ProgressBar)>,
    lines: crate::follow::Lines,
    /// Channel texts printed already (the run's start with its bounds, its notices).
    said: Vec<String>,
}

impl Live {
    fn new(json: bool, follow: crate::follow::Follow, said: Vec<String>, every: std::time::Duration) -> Live {
        use std::io::IsTerminal;
        let bars = (!json && std::io::stderr().is_terminal()).then(|| {
            let multi = indicatif::MultiProgress::new();
            let summary = multi.add(Live::spinner("run"));
            (multi, Vec::new(), summary)
        });
        let mut live = Live { follow, json, bars, lines: crate::follow::Lines::new(every, SystemClock.now_ms()), said };
        let _ = live.changed(true);
        live
    }

    /// A spinner that redraws itself (indicatif's steady tick), labelled `prefix`.
    fn spinner(prefix: &str) -> indicatif::ProgressBar {
        let style = indicatif::ProgressStyle::with_template("{spinner} {prefix:12} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner());
        let bar = indicatif::ProgressBar::new_spinner().with_style(style);
        bar.set_prefix(prefix.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar
    }

    /// Shows the status when it changed.
    fn changed(&mut self, changed: bool) -> Result<()> {
        if !changed {
            return Ok(());
        }
        let status = self.follow.status();
        if self.json {
            return print_typed("status", &status);
        }
        if self.bars.is_some() {
            self.redraw();
        } else if let Some(line) = self.lines.changed(&status, SystemClock.now_ms()) {
            eprintln!("{line}");
        }
        Ok(())
    }

    /// Every tick of the follow loop (200 ms): the running members' times on a terminal;
    /// off one, the status again after an interval of silence ([`follow_every`]).
    fn tick(&mut self) {
        if self.json {
            return;
        }
        if self.bars.is_some() {
            self.redraw();
        } else if let Some(line) = self.lines.tick(&self.follow.status(), SystemClock.now_ms()) {
            eprintln!("{line}");
        }
    }

    /// Sets each member's spinner (one added per new member or step name) and the summary.
    fn redraw(&mut self) {
        let status = self.follow.status();
        let Some((multi, bars, summary)) = &mut self.bars else { return };
        let now = SystemClock.now_ms();
        for (i, m) in status.members.iter().enumerate() {
            if i == bars.len() {
                bars.push(multi.insert_before(summary, Live::spinner(&m.member)));
            }
            let time = m.started_at.map(|s| format!(" {}", crate::follow::elapsed(now.saturating_sub(s))));
            bars[i].set_message(format!("{}{} ({} done)", m.state.as_str(), time.unwrap_or_default(), m.steps_done));
        }
        summary.set_message(format!("permits {} in use · {}", status.permits_in_use, status.spend()));
    }

    /// Prints a milestone: a channel event of the run, unless it says what was printed
    /// already (the bounds line, a notice).
    fn milestone(&mut self, e: &ChannelEvent) -> Result<()> {
        if self.json {
            return print_typed("event", e);
        }
        if e.author == fleet_store::Author::System && self.said.contains(&e.text) {
            return Ok(());
        }
        let line = format!("{} {}: {}", e.author, e.kind, crate::text::printable(&e.text).replace('\n', "\n    "));
        match &self.bars {
            Some((multi, _, _)) => multi.println(line)?,
            None => {
                eprintln!("{line}");
                self.lines.printed(SystemClock.now_ms());
            }
        }
        Ok(())
    }

    /// Leaves the last status on the screen.
    fn finish(&mut self) {
        if let Some((_, bars, summary)) = &self.bars {
            for b in bars.iter().chain(std::iter::once(summary)) {
                b.finish();
            }
        }
    }
}

fn define(file: &PathBuf, common: &Common, subject: &str, what: &str) -> Result<ExitCode> {
    let yaml = read_file(file)?;
    let reply: DefineReply = request(common, what, subject, &DefineRequest { yaml })?;
    if common.json {
        print_json(&reply)?;
    } else {
        println!("{} fleet {}", reply.action.as_str(), reply.fleet);
        for n in &reply.notices {
            eprintln!("notice: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
