//! `mur run`: runs a capsule on this machine, one session taking tasks as its lifecycle
//! says (the launch task, A2A messages, completions); writes the session
//! folder (`MURMUR.md`, `trace.jsonl`, `out/result.txt`, `logs/`).

use anyhow::{Context, Result};
use mur_a2a::intake::{Intake, Submission};
use mur_a2a::{AgentInfo, server::Server};
use mur_nats::clock::SystemClock;
use mur_proto::ids::{Id, IdKind};
use mur_proto::task::ExitStatus;
use mur_worker::capsule::{self, Capsule};
use mur_worker::launch::{Setup, build_session_parts};
use mur_worker::local;
use mur_worker::session::Session;
use mur_worker::session::detach;
use mur_worker::tools::background::DetachSink;
use mur_worker::tools::{Toolbox, Tools};
use mur_worker::trace::FileSink;
use mur_worker::workdir::Layout;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// `mur run [DIR | --manifest FILE] [--task TEXT|FILE] [--workdir DIR] [--json]`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The capsule folder (holding murmur.yaml).
    #[arg(default_value = ".", conflicts_with = "manifest")]
    dir: PathBuf,
    /// The manifest file, instead of a folder.
    #[arg(long, value_name = "FILE")]
    manifest: Option<PathBuf>,
    /// The task: a file's path, or the text itself. Default: task.md, else input.txt, else empty.
    #[arg(long, value_name = "TEXT|FILE")]
    task: Option<String>,
    /// Put session files in DIR/.murmur/<session_id>/ and run commands in DIR
    /// (default: <capsule>/workdir/<session_id>/).
    #[arg(long, value_name = "DIR")]
    workdir: Option<PathBuf>,
    /// Replace the manifest's system prompt ("" clears it).
    #[arg(long, value_name = "TEXT")]
    system_prompt: Option<String>,
    /// Serve the A2A endpoint on HOST:PORT (default: 127.0.0.1 and a port chosen by the OS).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
    bind: std::net::SocketAddr,
    /// Require `Authorization: Bearer <token>` with the token in FILE (its first line; the
    /// same file `mur task send --token-file` reads). Needed to bind a non-loopback address.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    #[command(flatten)]
    http_auth: crate::cluster::HttpAuth,
    /// End cleanly after SECS without a task (default: wait forever).
    #[arg(long, value_name = "SECS")]
    idle_exit: Option<u64>,
    /// Resume an earlier session: a full id, a unique suffix, or a path to its folder or
    /// its trace.jsonl (looked up under --workdir, else <capsule>/workdir). Continues the
    /// conversation of its last context and reports every command it left detached and
    /// unaccounted for as one completion task.
    #[arg(long, value_name = "SESSION")]
    resume: Option<String>,
    /// Print JSON lines: first {url, session_id, ...} once the endpoint listens, last the
    /// result {session_id, session_dir, exit_status, result, ...}.
    #[arg(long)]
    json: bool,
}

/// The task given at launch and where it came from: `--task`, else `task.md`, else
/// `input.txt`; `None` when there is none (the capsule then waits for messages).
fn resolve_task(args: &Args, capsule_dir: &Path, workdir: &Path) -> Result<Option<(String, &'static str)>> {
    if let Some(t) = &args.task {
        let p = Path::new(t);
        if p.is_file() {
            let text = std::fs::read_to_string(p).with_context(|| format!("--task: reading {}", p.display()))?;
            return Ok(Some((text, "cli")));
        }
        return Ok(Some((t.clone(), "cli")));
    }
    for (dir, name, source) in [
        (workdir, "task.md", "task_md"),
        (capsule_dir, "task.md", "task_md"),
        (workdir, "input.txt", "input_txt"),
        (capsule_dir, "input.txt", "input_txt"),
    ] {
        let p = dir.join(name);
        // Anything there by that name is meant as the task: a folder is an error, not a
        // launch without a task (which would wait for messages).
        if p.exists() {
            let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
            return Ok(Some((text, source)));
        }
    }
    Ok(None)
}

/// What `--resume` found in the session it resumes (the session-loop seed, §What a resume
/// reports about the session before it).
struct Resume {
    dir: PathBuf,
    session_id: String,
    session_start_event: Option<String>,
    context_id: Option<String>,
    contexts: std::collections::HashMap<String, Vec<mur_proto::message::Message>>,
    lost: Vec<detach::LostWork>,
}

fn find_resume(session: &str, base: &Path) -> Result<Resume> {
    let dir = mur_worker::workdir::find_session(base, Some(session)).map_err(|e| anyhow::anyhow!("--resume: {e}"))?;
    let text = std::fs::read_to_string(dir.join("trace.jsonl"))
        .with_context(|| format!("--resume: reading {}", dir.display()))?;
    let values: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let first = values.first().ok_or_else(|| anyhow::anyhow!("--resume: {} has an empty trace", dir.display()))?;
    let session_id = first["session_id"].as_str().unwrap_or_default().to_string();
    let context_id = values
        .iter()
        .rev()
        .find(|v| v["event_type"] == "task_start")
        .and_then(|v| v["context_id"].as_str())
        .map(str::to_string);
    Ok(Resume {
        session_start_event: first["event_id"].as_str().map(str::to_string),
        contexts: local::load_contexts(&dir.join("contexts")),
        lost: detach::unmatched(text.lines()),
        dir,
        session_id,
        context_id,
    })
}

/// Appends the `shell_lost` lines to the trace of the session that detached the commands,
/// so a second resume reports nothing.
fn mark_lost(resume: &Resume, by_session: &str, task_id: &str) -> Result<()> {
    let mut sink = FileSink::open(&resume.dir.join("trace.jsonl"))?;
    for lost in &resume.lost {
        let line = mur_proto::trace::Line {
            event: lost.event(by_session, task_id),
            session_id: resume.session_id.clone(),
            timestamp: mur_nats::clock::Clock::now_ms(&SystemClock),
            event_id: Id::generate(IdKind::Event),
            parent_id: resume.session_start_event.clone(),
        };
        mur_worker::trace::Sink::write(&mut sink, &line)?;
    }
    Ok(())
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = args.manifest.clone().unwrap_or_else(|| args.dir.clone());
    let env = |k: &str| std::env::var(k).ok();
    let capsule = Capsule::load(&path, &env)?;
    for named in mur_worker::bundle::named_outside(&capsule.manifest) {
        eprintln!(
            "note: {named} is outside the capsule folder: mur run reads it, `mur capsule push` refuses it \
             (a worker gets only the folder)"
        );
    }
    for unusable in mur_worker::bundle::unusable_programs(&capsule.dir, &capsule.manifest) {
        eprintln!("note: {unusable}: it will not start (`mur capsule push` refuses it)");
    }
    let (sink, notices) = DetachSink::channel();
    let grace = std::time::Duration::from_secs(capsule.manifest.lifecycle.shell_grace_secs);
    let tools: Arc<Toolbox> = Arc::new(Toolbox::from_manifest(&capsule.manifest).with_detach(grace, sink.clone()));
    let capsule_dir = std::path::absolute(&capsule.dir)?;
    let resume = match &args.resume {
        Some(s) => {
            let base = match &args.workdir {
                Some(w) => std::path::absolute(w)?,
                None => capsule_dir.join("workdir"),
            };
            Some(find_resume(s, &base)?)
        }
        None => None,
    };
    let workdir = match (&args.workdir, &resume) {
        (Some(w), _) => {
            std::fs::create_dir_all(w).with_context(|| format!("--workdir {}", w.display()))?;
            Some(std::path::absolute(w)?)
        }
        // A resumed session works in the folder of the session it resumes.
        (None, Some(r)) => Some(if r.dir.parent().and_then(Path::file_name) == Some(".murmur".as_ref()) {
            r.dir.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_else(|| r.dir.clone())
        } else {
            r.dir.clone()
        }),
        (None, None) => None,
    };
    let session_id = Id::generate(IdKind::Session);
    let layout = Layout::new(&capsule_dir, workdir.as_deref(), &session_id);
    let driver = capsule.driver(&layout.workdir)?;
    layout.create()?;
    // Before any command runs: a rule the kernel cannot enforce stops the run here.
    let folders = mur_worker::sandbox::Folders {
        workdir: layout.workdir.clone(),
        session_dir: layout.session_dir.clone(),
        capsule_dir: capsule_dir.clone(),
    };
    let sandbox = mur_worker::sandbox::for_session(&capsule.manifest, &folders, false)?;
    let model_label = capsule.model_label();
    std::fs::write(layout.murmur_md(), capsule::onboarding(&capsule.manifest, &model_label, &layout, &tools.specs()))?;
    let launch = resolve_task(&args, &capsule_dir, &layout.workdir)?;
    let guard = endpoint_guard(&args)?;
    let tls = args.http_auth.tls()?;

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = runtime.block_on(async {
        let (cfg, parts) = build_session_parts(Setup {
            capsule: &capsule,
            capsule_dir: &capsule_dir,
            layout: &layout,
            session_id: &session_id,
            driver,
            tools,
            sink: Box::new(FileSink::open(&layout.trace())?),
            system_prompt: args.system_prompt.as_deref(),
            resumed_from: resume.as_ref().map(|r| r.session_id.clone()),
            sandbox,
        });
        let shutdown = shutdown_signal();
        let mut session = Session::start(cfg, parts).await?;
        let lifecycle = &capsule.manifest.lifecycle;
        let intake = Arc::new(Intake::new(lifecycle.task_acceptance, lifecycle.queue_depth));
        let resumed_context = resume.as_ref().and_then(|r| r.context_id.clone());
        if let Some((text, source)) = launch {
            let mut task = local::launch_task(text, source);
            task.context_id = resumed_context.clone();
            intake.enqueue(task);
        }
        if let Some(r) = &resume {
            let context = resumed_context.clone().unwrap_or_else(|| Id::generate(IdKind::Context));
            if let Some(report) = detach::loss_report(&r.lost, &r.session_id, &context) {
                let record = intake.enqueue(Submission {
                    text: report.text,
                    context_id: Some(report.context_id),
                    message_id: None,
                    origin: report.origin,
                    source: report.source.to_string(),
                });
                mark_lost(r, &session_id, &record.id)?;
            }
        }
        let listener =
            tokio::net::TcpListener::bind(args.bind).await.with_context(|| format!("--bind {}", args.bind))?;
        let server =
            Server::start_with(listener, intake.clone(), AgentInfo::from_manifest(&capsule.manifest), guard, tls)?;
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "url": server.url(),
                    "session_id": session_id,
                    "session_dir": layout.session_dir,
                    "pid": std::process::id(),
                    "name": capsule.manifest.name,
                    "version": capsule.manifest.version,
                })
            );
        }
        let options = local::Options {
            acceptance: lifecycle.task_acceptance,
            after_task: lifecycle.after_task,
            conversation: lifecycle.conversation,
            idle_exit: args.idle_exit.map(std::time::Duration::from_secs),
            contexts_dir: Some(layout.session_dir.join("contexts")),
            contexts: resume.as_ref().map(|r| r.contexts.clone()).unwrap_or_default(),
        };
        let background = local::Background { sink, notices };
        let summary = local::serve(&mut session, intake.clone(), &options, Some(background), shutdown).await?;
        let totals = session.totals();
        // A signal while the session ends (its `on-session-end` hook, the async hooks'
        // drain) cuts the end short: the hook under way is killed, no other is waited for,
        // and `session_end` is still written.
        let end_stop = tokio_util::sync::CancellationToken::new();
        let _end_watch = tokio_util::task::AbortOnDropHandle::new(tokio::spawn({
            let (signal, end_stop) = (shutdown_signal(), end_stop.clone());
            async move {
                signal.await;
                eprintln!("mur run: interrupted while the session ends; its hooks are stopped");
                end_stop.cancel();
            }
        }));
        session.end_until(None, &end_stop).await?;
        // The senders of tasks canceled at the stop learn it before the endpoint goes (a
        // second signal does not wait).
        tokio::select! {
            _ = intake.wait_untold(UNTOLD_GRACE) => {}
            () = end_stop.cancelled() => {}
        }
        let _ = server.shutdown().await;
        anyhow::Ok((summary, totals))
    })?;
    let (summary, totals) = report;
    let exit = summary.exit_status();
    let last = summary.tasks.last();
    eprintln!(
        "session {session_id} ended {exit} ({}): {} task(s), {} turn(s), {} tool call(s); {}",
        summary.stopped,
        summary.tasks.len(),
        totals.turns,
        totals.tool_calls,
        layout.session_dir.display()
    );
    if args.json {
        let line = serde_json::json!({
            "session_id": session_id,
            "session_dir": layout.session_dir,
            "task_id": last.map(|t| t.task.task_id.clone()),
            "context_id": last.map(|t| t.task.context_id.clone()),
            "exit_status": exit,
            "result": last.map(|t| t.outcome.result.clone()),
            "tasks": summary.tasks.len(),
            "stopped": summary.stopped,
            "turns": totals.turns,
            "tool_calls": totals.tool_calls,
        });
        println!("{line}");
    } else if let Some(t) = last {
        println!("{}", t.outcome.result);
    }
    Ok(if exit == ExitStatus::Ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Who may call `mur run`'s endpoint (issue #31): the token of `--token-file`; nobody
/// checked on loopback without one; a non-loopback `--bind` without one is refused unless
/// `--insecure-no-auth`.
fn endpoint_guard(args: &Args) -> Result<mur_a2a::auth::Guard> {
    use mur_a2a::auth::{Guard, Mode};
    if let Some(path) = &args.token_file {
        let text = std::fs::read_to_string(path).with_context(|| format!("--token-file {}", path.display()))?;
        let token = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default();
        if token.len() < 16 {
            return Err(crate::Invalid(format!(
                "--token-file {}: the token must be at least 16 characters (`mur auth token create` makes one, or \
                 `head -c 32 /dev/urandom | xxd -p -c 64`)",
                path.display()
            ))
            .into());
        }
        return Ok(Guard::new(Mode::Required, mur_nats::tokens::Keyring::of_token("token-file", token)));
    }
    if args.http_auth.insecure_no_auth || args.bind.ip().is_loopback() {
        if !args.bind.ip().is_loopback() {
            eprintln!("warning: --bind {} serves without authentication (--insecure-no-auth)", args.bind);
        }
        return Ok(Guard::off());
    }
    Err(crate::Invalid(format!(
        "--bind {}: not a loopback address, and no token to check requests against: give --token-file FILE (a \
         secret of 16 characters or more; senders pass the same file to `mur task send --token-file`), or pass \
         --insecure-no-auth to serve without authentication (only behind an authenticating proxy)",
        args.bind
    ))
    .into())
}

/// How long a stopping `mur run` keeps its endpoint up for the senders of the tasks it
/// canceled (waiting ones) to read their end: `--wait` reads every 200 ms.
const UNTOLD_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Resolves on SIGTERM or Ctrl-C. The handlers are installed when this is called (not
/// when the future is first polled), so a signal that arrives early is not lost.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    let int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt());
    async move {
        let term = async {
            match term {
                Ok(mut t) => {
                    t.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        let int = async {
            match int {
                Ok(mut i) => {
                    i.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            () = term => {}
            () = int => {}
        }
    }
}
