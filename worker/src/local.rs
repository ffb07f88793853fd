//! The local host of a capsule: what `mur run` does around the session loop — the task
//! intake and its lifecycle (the session-loop seed, §Capsule lifecycle), idle exit, clean
//! shutdown, cancellation, and conversations per context id.
//!
//! | `task_acceptance` | `after_task` | what the host does |
//! |---|---|---|
//! | `none` | `exit` | runs the task given at launch (`task.md`, `--task`) if any, then exits; every message is rejected |
//! | `single` | `exit` | runs one task (the one given at launch, else the first message), then exits |
//! | `queue` | `exit` | runs tasks one at a time in lane order until none waits, then exits |
//! | `queue` | `sleep` | runs tasks one at a time and waits for more until the host stops it (`--idle-exit`, SIGTERM) |
//!
//! Tasks the capsule generates for itself (a detached command's completion, a resume's
//! loss report) are enqueued past admission and always run before the host exits, under
//! every mode (the session-loop seed, §What a resume reports).
//!
//! When the host stops (a signal, a fatal end), a task still waiting never runs: it ends
//! `canceled`, its status message saying why, so its sender is not left waiting on a
//! task that stays `submitted`.

use crate::session::detach::{Detached, Work};
use crate::session::{Session, TaskReport};
use crate::tools::background::{DetachNotice, DetachSink};
use crate::trace;
use mur_a2a::intake::{Intake, Next, Submission};
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::manifest::{AfterTask, Conversation, TaskAcceptance};
use mur_proto::message::Message;
use mur_proto::task::{ExitStatus, Origin};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

/// How the host runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// `lifecycle.task_acceptance`.
    pub acceptance: TaskAcceptance,
    /// `lifecycle.after_task`.
    pub after_task: AfterTask,
    /// `lifecycle.conversation`.
    pub conversation: Conversation,
    /// End after this long without a task (`--idle-exit`); `None` waits forever.
    pub idle_exit: Option<Duration>,
    /// Where each context's conversation is kept (`<session>/contexts/<ctx>/history.json`,
    /// written after every task that ends `ok`), if anywhere.
    pub contexts_dir: Option<std::path::PathBuf>,
    /// Conversations to continue, by context id (a resumed session's).
    pub contexts: HashMap<String, Vec<Message>>,
}

/// Reads every `contexts/<ctx>/history.json` under `dir`.
pub fn load_contexts(dir: &std::path::Path) -> HashMap<String, Vec<Message>> {
    let mut out = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for e in entries.flatten() {
        let path = e.path().join("history.json");
        if let Ok(text) = std::fs::read_to_string(&path)
            && let Ok(history) = serde_json::from_str::<Vec<Message>>(&text)
        {
            out.insert(e.file_name().to_string_lossy().into_owned(), history);
        }
    }
    out
}

fn save_context(dir: &std::path::Path, context_id: &str, history: &[Message]) {
    // A context id is one path segment (A2A callers choose it): refuse anything else.
    if context_id.is_empty() || context_id.contains(['/', '\\']) || context_id.starts_with('.') {
        return;
    }
    let folder = dir.join(context_id);
    let write = std::fs::create_dir_all(&folder).and_then(|()| {
        let tmp = folder.join("history.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(history).unwrap_or_default())?;
        std::fs::rename(&tmp, folder.join("history.json"))
    });
    if let Err(e) = write {
        tracing::warn!(error = %e, context_id, "could not save the conversation");
    }
}

/// What the host did.
#[derive(Debug, Default)]
pub struct Summary {
    /// Every task run, in order.
    pub tasks: Vec<TaskReport>,
    /// Why the host stopped: `idle`, `shutdown`, `done`, `fatal`.
    pub stopped: &'static str,
}

impl Summary {
    /// The exit status of the last task (`ok` when none ran).
    pub fn exit_status(&self) -> ExitStatus {
        self.tasks.last().map_or(ExitStatus::Ok, |t| t.outcome.exit_status)
    }
}

/// The detached shell commands of a session (the session-loop seed, §Detached shell):
/// the shell tools' sink (to kill a cancelled task's commands) and the notices it sends.
pub struct Background {
    /// The sink the shell tools were given.
    pub sink: DetachSink,
    /// Its notices: a command moved to the background, a command ended.
    pub notices: UnboundedReceiver<DetachNotice>,
}

/// Bookkeeping of detached work for one session.
struct Host {
    registry: Detached,
    notices: Option<UnboundedReceiver<DetachNotice>>,
    sink: Option<DetachSink>,
}

impl Host {
    /// Handles one notice: a detached command is registered under the task that ran it;
    /// an ended one becomes a completion task in its context, in the bg lane, and a
    /// `shell_completed` line.
    fn handle(
        &mut self,
        notice: DetachNotice,
        current: Option<(&str, &str)>,
        session: &Session,
        intake: &Intake,
    ) -> Result<(), trace::Error> {
        let now = SystemClock.now_ms();
        match notice {
            DetachNotice::Detached(w) => {
                let (task_id, context_id) = current.unwrap_or(("", ""));
                let _ = self.registry.detach(Work {
                    work_id: w.work_id,
                    binary: w.binary,
                    command: w.command,
                    task_id: task_id.to_string(),
                    context_id: context_id.to_string(),
                    started_at_ms: now.saturating_sub(w.running_ms),
                    detached_at_ms: now,
                });
            }
            DetachNotice::Completed { work_id, exit_code, duration_ms, output_path, output_bytes } => {
                if let Ok(done) = self.registry.complete(&work_id, exit_code, duration_ms, &output_path, output_bytes) {
                    let record = intake.enqueue(Submission {
                        text: done.task.text.clone(),
                        context_id: Some(done.task.context_id.clone()),
                        message_id: None,
                        origin: done.task.origin,
                        source: done.task.source.to_string(),
                    });
                    session.record(done.event(&record.id))?;
                }
            }
        }
        Ok(())
    }

    /// Handles every notice already sent.
    fn drain(&mut self, current: Option<(&str, &str)>, session: &Session, intake: &Intake) -> Result<(), trace::Error> {
        while let Some(n) = self.notices.as_mut().and_then(|rx| rx.try_recv().ok()) {
            self.handle(n, current, session, intake)?;
        }
        Ok(())
    }

    async fn next_notice(&mut self) -> Option<DetachNotice> {
        match self.notices.as_mut() {
            Some(rx) => rx.recv().await,
            None => std::future::pending().await,
        }
    }
}

/// Runs tasks from `intake` on `session` until the lifecycle says stop, `shutdown`
/// resolves (the running task is cancelled and recorded `canceled`), or the idle time
/// passes. Detached commands that end while the host lives come back as completion
/// tasks; those still running when it stops are recorded `shell_abandoned` (trace and
/// stderr) and left to run. Does not end the session: the caller calls [`Session::end`].
///
/// # Errors
/// [`trace::Error`] when the trace cannot be written.
pub async fn serve(
    session: &mut Session,
    intake: Arc<Intake>,
    options: &Options,
    background: Option<Background>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Summary, trace::Error> {
    let (sink, notices) = match background {
        Some(b) => (Some(b.sink), Some(b.notices)),
        None => (None, None),
    };
    let mut work = Host { registry: Detached::new(), notices, sink };
    let result = serve_tasks(session, &intake, options, &mut work, shutdown).await;
    for gone in work.registry.abandon_all(SystemClock.now_ms()) {
        eprintln!("{}", gone.stderr_line());
        session.record(gone.event())?;
    }
    result
}

async fn serve_tasks(
    session: &mut Session,
    intake: &Arc<Intake>,
    options: &Options,
    work: &mut Host,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Summary, trace::Error> {
    let mut summary = Summary::default();
    let mut contexts: HashMap<String, Vec<Message>> = options.contexts.clone();
    // Contexts handed in (a resumed session's) are continued whatever the conversation mode.
    let resumed: std::collections::HashSet<String> = options.contexts.keys().cloned().collect();
    let stop = CancellationToken::new();
    let stop_on_signal = stop.clone();
    let watch_intake = Arc::clone(intake);
    let signal = tokio::spawn(async move {
        shutdown.await;
        // Stop first: the loop that sees the intake closed knows it was the signal.
        stop_on_signal.cancel();
        watch_intake.close();
    });
    // `none` with nothing given at launch has nothing to do.
    if options.acceptance == TaskAcceptance::None && intake.waiting() == 0 {
        intake.close();
    }
    loop {
        if stop.is_cancelled() {
            summary.stopped = "shutdown";
            break;
        }
        let idle = options.idle_exit.unwrap_or(Duration::MAX / 4);
        let next = tokio::select! {
            () = stop.cancelled() => { summary.stopped = "shutdown"; break; }
            Some(notice) = work.next_notice() => {
                work.handle(notice, None, session, intake)?;
                continue;
            }
            n = intake.next_or_idle(idle) => n,
        };
        let record = match next {
            Next::Task(t) => *t,
            Next::Idle => {
                summary.stopped = "idle";
                break;
            }
            Next::Closed => {
                summary.stopped = if stop.is_cancelled() { "shutdown" } else { "done" };
                break;
            }
        };
        let _ = intake.mark_working(&record.id);
        let cancel = stop.child_token();
        let on_cancel = cancel.clone();
        let watched = Arc::clone(intake);
        let id = record.id.clone();
        let watcher = tokio::spawn(async move {
            watched.cancelled(&id).await;
            on_cancel.cancel();
        });
        let threaded = options.conversation == Conversation::Threaded
            || record.origin == Origin::Completion
            || resumed.contains(&record.context_id);
        let prior = if threaded { contexts.get(&record.context_id).cloned().unwrap_or_default() } else { Vec::new() };
        let report = session.run_task_until(record.spec(), prior, cancel).await;
        watcher.abort();
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                let _ = intake.finish(&record.id, ExitStatus::Failed, &format!("error: {e}"));
                cancel_waiting(intake, "error");
                signal.abort();
                return Err(e);
            }
        };
        let _ = intake.finish(&record.id, report.outcome.exit_status, &report.outcome.result);
        work.drain(Some((&record.id, &record.context_id)), session, intake)?;
        if report.outcome.exit_status == ExitStatus::Canceled
            && let Some(sink) = &work.sink
        {
            // murmur itself stops a cancelled task's commands, whole process groups.
            for w in work.registry.running().iter().filter(|w| w.task_id == record.id) {
                sink.kill(&w.work_id).await;
            }
        }
        if report.outcome.exit_status == ExitStatus::Ok {
            if let Some(dir) = &options.contexts_dir {
                save_context(dir, &report.task.context_id, &report.history);
            }
            contexts.insert(report.task.context_id.clone(), report.history.clone());
        }
        let fatal = report.fatal;
        summary.tasks.push(report);
        if fatal {
            summary.stopped = "fatal";
            break;
        }
        let more_waiting = intake.waiting() > 0;
        let keep_going = match (options.acceptance, options.after_task) {
            (TaskAcceptance::Queue, AfterTask::Sleep) => true,
            _ => more_waiting,
        };
        if !keep_going {
            summary.stopped = "done";
            break;
        }
    }
    cancel_waiting(intake, summary.stopped);
    signal.abort();
    Ok(summary)
}

/// Nothing runs a task still waiting once the host stops (`stopped`: `shutdown`, `fatal`,
/// `error`, …): it ends `canceled`, its sender told why, not `submitted` for good; a line
/// on stderr names each.
fn cancel_waiting(intake: &Intake, stopped: &str) {
    let why = format!("canceled: the capsule stopped ({stopped}) before the task started");
    for waiting in intake.cancel_waiting(&why) {
        eprintln!("task {} canceled: the capsule stopped ({stopped}) before it started", waiting.id);
    }
}

/// A submission for a task given at launch (`--task`, `task.md`): origin `user`.
pub fn launch_task(text: String, source: &str) -> Submission {
    Submission { text, context_id: None, message_id: None, origin: Origin::User, source: source.to_string() }
}
