//! A task's session: its folder and tools made while the record goes to `working`
//! ([`Prepared`]), then the run ([`run_session`]).

use super::*;

/// A session's tools and its folder in the making: the folder (`Layout::create`),
/// `MURMUR.md` and `trace.jsonl` are created on a blocking thread (issue #9: file creation
/// is the worker's largest cost per task, and it overlaps the record's compare-and-set).
pub(super) struct Prepared {
    layout: Layout,
    tools: Arc<Toolbox>,
    sink: DetachSink,
    notices: mpsc::UnboundedReceiver<crate::tools::background::DetachNotice>,
    files: tokio::task::JoinHandle<Result<FileSink, String>>,
}

impl Prepared {
    /// Starts making `<workdir>/sessions/<session_id>/` for `capsule`'s session, whose
    /// fleet tools reach the cluster with `access`.
    pub(super) fn start(sh: &Shared, capsule: &Capsule, session_id: &SessionId, access: FleetAccess) -> Prepared {
        let dir = sh.config.workdir.join("sessions").join(session_id.as_str());
        // Like `mur run` without --workdir: commands run in the session folder itself.
        let layout = Layout { workdir: dir.clone(), session_dir: dir };
        let (sink, notices) = DetachSink::channel();
        let grace = Duration::from_secs(capsule.manifest.lifecycle.shell_grace_secs);
        let tools = Arc::new(
            Toolbox::from_manifest(&capsule.manifest).with_detach(grace, sink.clone()).with_fleet_access(access),
        );
        let onboarding = capsule::onboarding(&capsule.manifest, &capsule.model_label(), &layout, &tools.specs());
        let files = tokio::task::spawn_blocking({
            let layout = layout.clone();
            move || {
                layout.create().map_err(|e| e.to_string())?;
                std::fs::write(layout.murmur_md(), onboarding)
                    .map_err(|e| format!("{}: {e}", layout.murmur_md().display()))?;
                FileSink::open(&layout.trace()).map_err(|e| e.to_string())
            }
        });
        Prepared { layout, tools, sink, notices, files }
    }

    /// The session will not run (the record moved on): its folder is removed once made.
    pub(super) fn discard(self) {
        let Prepared { layout, files, .. } = self;
        tokio::spawn(async move {
            let _ = files.await;
            let dir = layout.session_dir;
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
        });
    }
}

/// Runs `task` in a new session `session_id` (taking it over from a checkpoint when
/// `takeover` says so), in the folder `prepared` makes, and returns its exit status, its
/// result, its token usage and its tool calls found in doubt (issue #34). The session
/// stops when `cancel` fires; when `superseded` fired first, it stops without `task_end`
/// ([`Durable::superseded`]): the task is another session's.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_session(
    sh: &Shared,
    task: &TaskRecord,
    capsule: &Capsule,
    session_id: &SessionId,
    prepared: Prepared,
    takeover: Option<Takeover>,
    checkpoints: Arc<KvCheckpoints>,
    cancel: CancellationToken,
    superseded: CancellationToken,
) -> Result<(ExitStatus, String, Option<mur_proto::cost::Usage>, u32), String> {
    let missing = crate::preflight::missing(&task.needs, std::env::var_os("PATH").as_deref());
    if !missing.is_empty() {
        prepared.discard();
        return Ok((ExitStatus::Failed, crate::preflight::refusal(&missing), None, 0));
    }
    // The task's token usage, tallied from its trace for the terminal record (issue #11).
    let tally = crate::usage::UsageTally::default();
    let Prepared { layout, tools, sink, notices, files } = prepared;
    let file = files.await.map_err(|e| format!("making the session folder: {e}"))??;
    let capsule_dir = std::path::absolute(&capsule.dir).map_err(|e| e.to_string())?;
    // Fails closed before any command runs: no sandbox block under --require-sandbox, or a
    // rule the kernel cannot enforce (issue #37).
    let folders = crate::sandbox::Folders {
        workdir: layout.workdir.clone(),
        session_dir: layout.session_dir.clone(),
        capsule_dir: capsule_dir.clone(),
    };
    let sandbox = match crate::sandbox::for_session(&capsule.manifest, &folders, sh.config.require_sandbox) {
        Ok(sandbox) => sandbox,
        Err(e) => return Ok((ExitStatus::Failed, e.to_string(), None, 0)),
    };
    let driver = capsule.driver(&layout.workdir).map_err(|e| e.to_string())?;
    if task.origin == Origin::Completion {
        detached::fetch_logs(&sh.capsules, &task.text, &layout.session_dir).await;
    }
    let session_done = CancellationToken::new();
    let host = detached::Host {
        client: sh.client.clone(),
        store: sh.capsules.clone(),
        capsule: task.capsule.clone(),
        task_id: task.task_id.to_string(),
        context_id: task.context_id.clone(),
        session_id: session_id.clone(),
        session_dir: layout.session_dir.clone(),
    };
    // Done with on every way out of here, so the host does not wait past the session.
    let _session_over = session_done.clone().drop_guard();
    // The folder is finished once the session has ended and no detached command runs in it
    // (the host returns then); only then may retention remove it.
    // A folder whose detached commands the worker's stop abandoned keeps their only output:
    // it is not counted.
    let (retention, dir, stopping) = (sh.retention.clone(), layout.session_dir.clone(), sh.detached_stop.clone());
    let serving = host.serve(notices, sink.clone(), session_done.clone(), sh.detached_stop.clone());
    sh.detached.spawn(async move {
        serving.await;
        if !stopping.is_cancelled() {
            retention.finished(dir);
        }
    });
    let (published, publisher) = TracePublisher::start(sh.client.clone(), cluster::trace_subject(session_id));
    let (cfg, parts) = build_session_parts(Setup {
        capsule,
        capsule_dir: &capsule_dir,
        layout: &layout,
        session_id,
        driver,
        tools,
        sink: Box::new(Tee(vec![Box::new(file), Box::new(published), Box::new(tally.clone())])),
        system_prompt: None,
        resumed_from: takeover.as_ref().map(|t| t.previous_session_id.clone()),
        sandbox,
    });
    let resumed = takeover.as_ref().is_some_and(|t| t.checkpoint.is_some());
    let base = if resumed { None } else { Some(prior_conversation(sh, task, capsule).await?) };
    let prior = base.as_ref().map(|b| b.messages.clone()).unwrap_or_default();
    let outcome = async {
        let mut session = Session::start(cfg, parts).await.map_err(|e| e.to_string())?;
        let spec = TaskSpec {
            task_id: task.task_id.to_string(),
            context_id: task.context_id.clone(),
            text: task.text.clone(),
            origin: task.origin,
            source: TASK_SOURCE.to_string(),
        };
        // The deadline a fleet step inherited from its loop (unix ms → the runtime's clock).
        let deadline = task.deadline_at.map(|at| {
            let left = at.saturating_sub(SystemClock.now_ms());
            tokio::time::Instant::now() + Duration::from_millis(left)
        });
        let journal: Arc<dyn Journal> = checkpoints.clone();
        let durable = Durable { takeover, checkpoints, journal: Some(journal), deadline, superseded: Some(superseded) };
        let report = session.run_task_durable(spec, prior, cancel.clone(), durable).await;
        let outcome = match report {
            Ok(r) => {
                if r.outcome.exit_status == ExitStatus::Ok && !r.superseded && continues_context(task, capsule) {
                    save_conversation(sh, task, &r.history, base.as_ref()).await;
                }
                (r.outcome.exit_status, r.outcome.result, r.tool_calls_in_doubt)
            }
            Err(e) => (ExitStatus::Failed, format!("error: {e}"), 0),
        };
        if matches!(outcome.0, ExitStatus::Canceled | ExitStatus::DeadlineExceeded) {
            // murmur itself stops a cancelled task's commands, whole process groups.
            sink.kill_all().await;
        }
        if let Err(e) = session.end_until(None, &cancel).await {
            tracing::warn!(%session_id, error = %e, "ending the session failed");
        }
        Ok(outcome)
    }
    .await;
    session_done.cancel();
    // The session and its sink are gone: every line is queued; send them all.
    publisher.finish().await;
    outcome.map(|(exit, result, in_doubt)| (exit, result, tally.usage(), in_doubt))
}
