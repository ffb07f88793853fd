//! `mur run`: runs a capsule on this machine, one session, one task; writes the session
//! folder (`MURMUR.md`, `trace.jsonl`, `out/result.txt`, `logs/`).

use anyhow::{Context, Result};
use mur_proto::ids::{Id, IdKind};
use mur_proto::task::{ExitStatus, Origin};
use mur_worker::capsule::{self, Capsule};
use mur_worker::clock::SystemClock;
use mur_worker::session::{Session, SessionConfig, TaskSpec};
use mur_worker::tokens;
use mur_worker::tools::{CallContext, Toolbox, Tools};
use mur_worker::trace::{FileSink, Tracer};
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
    /// Print one JSON object as the last line: session_id, session_dir, exit_status, ...
    #[arg(long)]
    json: bool,
}

/// Where the task text came from, and the text.
fn resolve_task(args: &Args, capsule_dir: &Path, workdir: &Path) -> Result<(String, &'static str)> {
    if let Some(t) = &args.task {
        let p = Path::new(t);
        if p.is_file() {
            let text = std::fs::read_to_string(p).with_context(|| format!("--task: reading {}", p.display()))?;
            return Ok((text, "cli"));
        }
        return Ok((t.clone(), "cli"));
    }
    for (dir, name, source) in [
        (workdir, "task.md", "task_md"),
        (capsule_dir, "task.md", "task_md"),
        (workdir, "input.txt", "input_txt"),
        (capsule_dir, "input.txt", "input_txt"),
    ] {
        let p = dir.join(name);
        if p.is_file() {
            let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
            return Ok((text, source));
        }
    }
    Ok((String::new(), "cli"))
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = args.manifest.clone().unwrap_or_else(|| args.dir.clone());
    let env = |k: &str| std::env::var(k).ok();
    let capsule = Capsule::load(&path, &env)?;
    let driver = capsule.driver()?;
    let tools: Arc<Toolbox> = Arc::new(Toolbox::from_manifest(&capsule.manifest));
    let workdir = match &args.workdir {
        Some(w) => {
            std::fs::create_dir_all(w).with_context(|| format!("--workdir {}", w.display()))?;
            Some(std::path::absolute(w)?)
        }
        None => None,
    };
    let capsule_dir = std::path::absolute(&capsule.dir)?;
    let session_id = Id::generate(IdKind::Session);
    let layout = Layout::new(&capsule_dir, workdir.as_deref(), &session_id);
    layout.create()?;
    let model_label = capsule.model_label();
    std::fs::write(layout.murmur_md(), capsule::onboarding(&capsule.manifest, &model_label, &layout, tools.specs()))?;
    let (text, source) = resolve_task(&args, &capsule_dir, &layout.workdir)?;
    let prompt = capsule.system_prompt(args.system_prompt.as_deref());

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = runtime.block_on(async {
        let clock = Arc::new(SystemClock);
        let tracer = Tracer::new(session_id.clone(), Box::new(FileSink::open(&layout.trace())?), clock.clone());
        let cfg = SessionConfig {
            manifest: capsule.manifest.clone(),
            model: capsule.manifest.inference.model.clone().unwrap_or_default(),
            model_label,
            system_prompt: prompt.text,
            system_prompt_source: prompt.source,
            system_prompt_sha256: prompt.sha256,
            call_context: CallContext {
                capsule_dir: capsule_dir.clone(),
                workdir: layout.workdir.clone(),
                logs_dir: layout.workdir_logs(),
            },
            result_path: Some(layout.result()),
            resumed_from: None,
        };
        let estimator = tokens::for_model(driver.kind(), capsule.manifest.inference.model.as_deref());
        let mut session = Session::start(cfg, driver, tools, tracer, clock, estimator)?;
        let task = TaskSpec {
            task_id: Id::generate(IdKind::Task),
            context_id: Id::generate(IdKind::Context),
            text,
            origin: Origin::User,
            source: source.to_string(),
        };
        let report = session.run_task(task, Vec::new()).await?;
        let totals = session.totals();
        session.end(None)?;
        anyhow::Ok((report, totals))
    })?;
    let (report, totals) = report;
    let exit = report.outcome.exit_status;
    eprintln!(
        "session {session_id} ended {exit}: {} turn(s), {} tool call(s); {}",
        totals.turns,
        totals.tool_calls,
        layout.session_dir.display()
    );
    if args.json {
        let line = serde_json::json!({
            "session_id": session_id,
            "session_dir": layout.session_dir,
            "task_id": report.task.task_id,
            "context_id": report.task.context_id,
            "exit_status": exit,
            "result": report.outcome.result,
            "turns": totals.turns,
            "tool_calls": totals.tool_calls,
        });
        println!("{line}");
    } else {
        println!("{}", report.outcome.result);
    }
    Ok(if exit == ExitStatus::Ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
