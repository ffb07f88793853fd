//! The manifest's hooks run as child processes, or handed to built-ins (issue #4;
//! the runtime reference, §3 "Execution", checklist H1, H3, H4, H6–H9, H13, H14).
//!
//! - Matching: a hook receives an event when its binding is the event's, or when it has
//!   no binding and the event is not `on-stage` (H3).
//! - Blocking hooks are called inline, one after another in manifest order, every matching
//!   one (H1); [`Hooks::dispatch`] returns one [`Reply`] per blocking hook called.
//! - Async hooks each have a bounded FIFO queue ([`QUEUE_CAPACITY`] events) served by one
//!   task, so a hook never runs concurrently with itself (H7); a full queue drops the event
//!   as a `queue-overflow` fault (H8, `on_overflow: drop`); an error is an `error` or
//!   `timeout` fault; answers are discarded. [`Hooks::drain`] closes the queues and waits
//!   for them within one shared deadline; a hook still busy then is a `timeout` fault with
//!   event `drain` (H9), and its process is killed.
//! - A command `builtin:<name>` is not started: it is looked up in [`Config::builtins`].
//! - Any other command is a program (see `child.rs`): one process per event, or with
//!   `persistent: true` one process per session, started on the first event, restarted
//!   (state lost) on the event after it died or timed out.
//! - Each call has `timeout_secs` (H6). Errors, faults, restarts and the hook's stderr go to
//!   `logs/hook-<name>.log` (H4).
//! - With a [`Config::gate`], hook programs get `$MURMUR_INFERENCE_URL` (see `gate.rs`,
//!   H14), served from the first event on.

use super::child::{self, Exchanged, Label, Launch, Persistent, Stop};
use super::gate::GateServer;
use super::log::HookLog;
use super::{Builtin, Error, Fault, Hooks, InferenceGate, Reply};
use async_trait::async_trait;
use mur_proto::hook::{Answer, Envelope, Event, VERSION};
use mur_proto::manifest::{Binding, ExecutionMode, Hook};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OnceCell, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Events an async hook's queue holds (the runtime reference, §3 "Async": FIFO
/// queue depth 1024).
pub const QUEUE_CAPACITY: usize = 1024;

/// How long the hooks still busy at the drain deadline get to be killed and reaped before
/// their tasks are abandoned.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Where hook programs run and log.
#[derive(Clone)]
pub struct Config {
    /// The capsule folder: hooks' working directory and `HOME`; relative commands resolve
    /// here.
    pub capsule_dir: PathBuf,
    /// `logs/` of the session: `hook-<name>.log` files go here.
    pub logs_dir: PathBuf,
    /// Built-in hooks by command (`builtin:compact`).
    pub builtins: HashMap<String, Arc<dyn Builtin>>,
    /// Model calls on hooks' behalf; `None` disables `$MURMUR_INFERENCE_URL`.
    pub gate: Option<Arc<dyn InferenceGate>>,
    /// The session's workdir, given to hook programs as `$MURMUR_WORKDIR` (where the
    /// capsule's commands run and its files are).
    pub workdir: Option<PathBuf>,
    /// The session's sandbox (`sandbox:`): hook programs start confined by it, like the
    /// capsule's commands; `None` runs them unconfined.
    pub sandbox: Option<Arc<crate::sandbox::Confinement>>,
}

/// The manifest's hooks, run as processes (or built-ins), for one session.
///
/// Dropping it stops calls under way (their process groups are killed) and persistent
/// processes; [`Hooks::drain`] does the same in order and waits for them.
pub struct ProcessHooks {
    inner: Arc<Inner>,
    queues: Mutex<Queues>,
    queue_capacity: usize,
}

/// What the async queue tasks share with the dispatcher.
struct Inner {
    /// One per manifest hook, in manifest order.
    runners: Vec<Arc<Runner>>,
    config: Config,
    /// The inference endpoint, started on the first hook process launched with a gate;
    /// `None` inside when it could not be started.
    gate: OnceCell<Option<GateServer>>,
    /// The confinement of hook programs when the session's sandbox does not reach the
    /// endpoint ([`crate::sandbox::Confinement::reaching`]): made once; `Err` when it cannot
    /// be (hooks then run under the session's rules, without `$MURMUR_INFERENCE_URL`).
    reaching_gate: std::sync::OnceLock<Result<Option<Arc<crate::sandbox::Confinement>>, String>>,
    faults: Mutex<Vec<Fault>>,
    /// Hook programs started sandboxed, for their `sandbox` trace lines.
    sandboxed: Mutex<Vec<super::Sandboxed>>,
    /// Raised to abandon the calls under way (drain stragglers, drop).
    stop: watch::Sender<bool>,
}

#[derive(Default)]
struct Queues {
    /// By runner index.
    open: HashMap<usize, Queue>,
    /// Set by drain: later async events are dropped as faults.
    drained: bool,
}

struct Queue {
    tx: mpsc::Sender<Envelope>,
    /// Events accepted and not yet handled.
    pending: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

/// One hook and its state.
struct Runner {
    hook: Hook,
    log: HookLog,
    /// Held for the whole of each call, so a hook is never called concurrently with
    /// itself; holds its persistent process.
    slot: tokio::sync::Mutex<Slot>,
    /// Raised by the inference endpoint when a spend ceiling refuses this hook's call;
    /// lowered at the start of each event.
    spend_refused: Arc<AtomicBool>,
    /// The event under way, for stderr lines.
    label: Label,
}

#[derive(Default)]
struct Slot {
    process: Option<Persistent>,
    /// A previous persistent process died or was killed: the next start is a restart.
    lost: bool,
}

impl ProcessHooks {
    /// Hooks for `hooks` (manifest order), with async queues of [`QUEUE_CAPACITY`].
    pub fn new(hooks: Vec<Hook>, config: Config) -> Self {
        let runners = hooks
            .into_iter()
            .map(|hook| {
                Arc::new(Runner {
                    log: HookLog::new(&config.logs_dir, &hook.name),
                    hook,
                    slot: tokio::sync::Mutex::new(Slot::default()),
                    spend_refused: Arc::new(AtomicBool::new(false)),
                    label: Label::default(),
                })
            })
            .collect();
        let inner = Inner {
            runners,
            config,
            gate: OnceCell::new(),
            reaching_gate: std::sync::OnceLock::new(),
            faults: Mutex::new(Vec::new()),
            sandboxed: Mutex::new(Vec::new()),
            stop: watch::Sender::new(false),
        };
        ProcessHooks { inner: Arc::new(inner), queues: Mutex::new(Queues::default()), queue_capacity: QUEUE_CAPACITY }
    }

    /// The same hooks with async queues holding `capacity` events (at least 1).
    pub fn with_queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity.max(1);
        self
    }

    /// Hands `envelope` to async hook `index`'s queue (started on first use), or records why
    /// it was dropped.
    fn enqueue(&self, index: usize, envelope: Envelope) {
        let runner = &self.inner.runners[index];
        let event = envelope.event.binding().as_str();
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if queues.drained {
            self.inner.fault(runner, event, "error", "event arrived after the hooks were drained; dropped".into());
            return;
        }
        let capacity = self.queue_capacity;
        let queue = queues.open.entry(index).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(capacity);
            let pending = Arc::new(AtomicUsize::new(0));
            let task = tokio::spawn(serve_queue(
                self.inner.clone(),
                index,
                rx,
                pending.clone(),
                Stop::hooks(self.inner.stop.subscribe()),
            ));
            Queue { tx, pending, task }
        });
        queue.pending.fetch_add(1, Ordering::SeqCst);
        if let Err(e) = queue.tx.try_send(envelope) {
            queue.pending.fetch_sub(1, Ordering::SeqCst);
            let (arm, message) = match e {
                mpsc::error::TrySendError::Full(_) => {
                    ("queue-overflow", format!("the queue is full ({capacity} events); event dropped"))
                }
                mpsc::error::TrySendError::Closed(_) => ("error", "the hook's queue is closed; event dropped".into()),
            };
            self.inner.fault(runner, event, arm, message);
        }
    }
}

impl Drop for ProcessHooks {
    fn drop(&mut self) {
        self.inner.stop.send_replace(true);
    }
}

impl Inner {
    /// Records a fault of `runner` and writes it to its log.
    fn fault(&self, runner: &Runner, event: &str, arm: &str, message: String) {
        runner.log.write(event, arm, &message);
        self.faults.lock().unwrap_or_else(|e| e.into_inner()).push(Fault {
            hook: runner.hook.name.clone(),
            event: event.to_string(),
            arm: arm.to_string(),
            message,
        });
    }

    /// `$MURMUR_INFERENCE_URL` for `hook`, starting the endpoint on first use; `None`
    /// without a gate or when the endpoint could not be started.
    async fn inference_url(&self, hook: &str) -> Option<String> {
        let gate = self.config.gate.as_ref()?;
        let server = self
            .gate
            .get_or_init(|| async {
                let flags = self.runners.iter().map(|r| (r.hook.name.clone(), r.spend_refused.clone())).collect();
                match GateServer::start(gate.clone(), flags).await {
                    Ok(server) => Some(server),
                    Err(e) => {
                        tracing::warn!(
                            error = %e,
                            "cannot serve the hook inference endpoint; hooks get no $MURMUR_INFERENCE_URL"
                        );
                        None
                    }
                }
            })
            .await;
        server.as_ref().map(|s| s.url(hook))
    }
}

/// The task serving async hook `index`'s queue: one event at a time, in order, until the
/// queue is closed and empty or `stop` is raised.
async fn serve_queue(
    inner: Arc<Inner>,
    index: usize,
    mut rx: mpsc::Receiver<Envelope>,
    pending: Arc<AtomicUsize>,
    mut stop: Stop,
) {
    let runner = inner.runners[index].clone();
    loop {
        let envelope = tokio::select! {
            biased;
            () = stop.stopped() => return,
            next = rx.recv() => match next {
                Some(envelope) => envelope,
                None => return,
            },
        };
        let event = envelope.event.binding().as_str();
        let Some((answer, _)) = runner.call(&inner, envelope, &mut stop).await else {
            return;
        };
        if let Err(e) = answer {
            // Already logged by the call.
            inner.faults.lock().unwrap_or_else(|e| e.into_inner()).push(Fault {
                hook: runner.hook.name.clone(),
                event: event.to_string(),
                arm: e.arm().to_string(),
                message: e.to_string(),
            });
        }
        pending.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Runner {
    /// Whether this hook receives events of `binding`.
    fn receives(&self, binding: Binding) -> bool {
        match self.hook.binding {
            Some(b) => b == binding,
            None => binding != Binding::OnStage,
        }
    }

    fn is_builtin(&self) -> bool {
        self.hook.command.first().is_some_and(|c| c.starts_with("builtin:"))
    }

    /// Delivers one event: the answer (errors logged) and whether a spend ceiling refused
    /// one of the hook's model calls meanwhile; `None` when `stop` was raised first.
    async fn call(&self, inner: &Inner, envelope: Envelope, stop: &mut Stop) -> Option<(Result<Answer, Error>, bool)> {
        let mut slot = self.slot.lock().await;
        let event = envelope.event.binding().as_str();
        let started = std::time::Instant::now();
        *self.label.lock().unwrap_or_else(|e| e.into_inner()) = event.to_string();
        self.spend_refused.store(false, Ordering::SeqCst);
        let answer = if self.is_builtin() {
            self.call_builtin(inner, &envelope, stop).await?
        } else {
            match encode(&envelope) {
                Err(e) => Err(e),
                Ok(line) if self.hook.persistent => {
                    self.call_persistent(&mut slot, inner, &envelope, &line, stop).await?
                }
                Ok(line) => match self.launch(inner, &envelope).await {
                    Err(e) => Err(e),
                    Ok(launch) => {
                        child::run_once(&launch, &line, self.hook.timeout_secs, &self.log, &self.label, stop).await?
                    }
                },
            }
        };
        if let Err(e) = &answer {
            self.log.write(event, "error", &e.to_string());
        }
        mur_nats::metrics::hook_call(&self.hook.name, event, started.elapsed());
        Some((answer, self.spend_refused.load(Ordering::SeqCst)))
    }

    async fn launch(&self, inner: &Inner, envelope: &Envelope) -> Result<Launch, Error> {
        let mut url = inner.inference_url(&self.hook.name).await;
        let mut sandbox = inner.config.sandbox.clone();
        // A sandboxed hook reaches the inference endpoint and nothing more than the
        // session's rules allow: `none` becomes the endpoint's address alone.
        if let (Some(session), Some(addr)) = (&sandbox, inner.gate.get().and_then(|g| g.as_ref()).map(|g| g.addr())) {
            match inner
                .reaching_gate
                .get_or_init(|| session.reaching(addr).map(|c| c.map(Arc::new)).map_err(|e| e.to_string()))
            {
                Ok(Some(c)) => sandbox = Some(c.clone()),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "sandboxed hooks cannot be let reach the inference endpoint; they get no $MURMUR_INFERENCE_URL"
                    );
                    url = None;
                }
            }
        }
        let mut launch = Launch::new(&self.hook, &inner.config.capsule_dir, &envelope.session_id, url)?;
        if let Some(w) = &inner.config.workdir {
            launch.env.push(("MURMUR_WORKDIR", w.clone().into_os_string()));
        }
        if let Some(c) = &sandbox {
            inner.sandboxed.lock().unwrap_or_else(|e| e.into_inner()).push(super::Sandboxed {
                hook: self.hook.name.clone(),
                event: envelope.event.binding().as_str().to_string(),
                rules: c.applied().clone(),
            });
        }
        launch.sandbox = sandbox;
        Ok(launch)
    }

    async fn call_builtin(&self, inner: &Inner, envelope: &Envelope, stop: &mut Stop) -> Option<Result<Answer, Error>> {
        let name = &self.hook.command[0];
        let Some(builtin) = inner.config.builtins.get(name) else {
            return Some(Err(Error::Spawn(format!("no built-in hook named {name:?}"))));
        };
        let secs = self.hook.timeout_secs;
        tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(secs), builtin.handle(envelope)) => Some(match r {
                Ok(answer) => answer.map_err(Error::Builtin),
                Err(_) => Err(Error::Timeout(secs)),
            }),
            () = stop.stopped() => None,
        }
    }

    /// One event for a persistent hook: starts (or restarts) its process, exchanges one
    /// line within `timeout_secs`. A process that died, timed out or sent an overlong line
    /// is stopped and replaced on the next event.
    async fn call_persistent(
        &self,
        slot: &mut Slot,
        inner: &Inner,
        envelope: &Envelope,
        line: &[u8],
        stop: &mut Stop,
    ) -> Option<Result<Answer, Error>> {
        let event = envelope.event.binding().as_str();
        if slot.process.is_none() {
            let launch = match self.launch(inner, envelope).await {
                Ok(launch) => launch,
                Err(e) => return Some(Err(e)),
            };
            if slot.lost {
                self.log.write(
                    event,
                    "restart",
                    "starting the persistent hook again; the state of its previous process is lost",
                );
            }
            match Persistent::start(&launch, self.log.clone(), self.label.clone()) {
                Ok(process) => {
                    slot.process = Some(process);
                    slot.lost = false;
                }
                Err(e) => return Some(Err(e)),
            }
        }
        let secs = self.hook.timeout_secs;
        let process = slot.process.as_mut().expect("started above");
        let step = tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(secs), process.exchange(line)) => Some(r.ok()),
            () = stop.stopped() => None,
        };
        let lost = |slot: &mut Slot| {
            slot.lost = true;
            slot.process.take().expect("started above")
        };
        Some(match step {
            None => {
                lost(slot).stop().await;
                return None;
            }
            Some(None) => {
                lost(slot).stop().await;
                Err(Error::Timeout(secs))
            }
            Some(Some(Exchanged::Answer(answer))) => Ok(answer),
            Some(Some(Exchanged::Bad(message))) => Err(Error::BadAnswer(message)),
            Some(Some(Exchanged::Overlong)) => {
                lost(slot).stop().await;
                Err(Error::BadAnswer(format!("the answer line is longer than {} bytes", child::ANSWER_LIMIT)))
            }
            Some(Some(Exchanged::Closed(cause))) => Err(Error::Died(lost(slot).died(&cause).await)),
        })
    }

    /// Stops the persistent process, if any.
    async fn stop_process(&self) {
        let process = self.slot.lock().await.process.take();
        if let Some(process) = process {
            process.stop().await;
        }
    }
}

/// The envelope as one line of compact JSON.
fn encode(envelope: &Envelope) -> Result<Vec<u8>, Error> {
    let mut line = serde_json::to_vec(envelope).map_err(|e| Error::Spawn(format!("cannot encode the event: {e}")))?;
    line.push(b'\n');
    Ok(line)
}

#[async_trait]
impl Hooks for ProcessHooks {
    async fn dispatch_until(&self, session_id: &str, event: &Event, cancel: &CancellationToken) -> Vec<Reply> {
        let binding = event.binding();
        let envelope = |runner: &Runner| Envelope {
            version: VERSION,
            session_id: session_id.to_string(),
            hook: runner.hook.name.clone(),
            event: event.clone(),
        };
        let mut replies = Vec::new();
        let mut stop = Stop::task(self.inner.stop.subscribe(), cancel.clone());
        for runner in self.inner.runners.iter().filter(|r| r.receives(binding)) {
            if runner.hook.execution_mode != ExecutionMode::Blocking {
                continue;
            }
            let stopped = || {
                let why = if cancel.is_cancelled() {
                    Error::Canceled
                } else {
                    Error::Died("the hooks are being stopped".into())
                };
                (Err(why), false)
            };
            // A cancelled task starts no further hook; one under way is killed.
            let (answer, spend_refused) = if cancel.is_cancelled() {
                stopped()
            } else {
                match runner.call(&self.inner, envelope(runner), &mut stop).await {
                    Some(out) => out,
                    None => stopped(),
                }
            };
            replies.push(Reply { hook: runner.hook.name.clone(), answer, spend_refused });
        }
        for (index, runner) in self.inner.runners.iter().enumerate() {
            if runner.hook.execution_mode == ExecutionMode::Async && runner.receives(binding) {
                self.enqueue(index, envelope(runner));
            }
        }
        replies
    }

    fn take_faults(&self) -> Vec<Fault> {
        std::mem::take(&mut *self.inner.faults.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn take_sandboxed(&self) -> Vec<super::Sandboxed> {
        std::mem::take(&mut *self.inner.sandboxed.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Closes every async queue and waits until all are empty, `deadline` in all. A hook
    /// still busy then is a fault `{event: "drain", arm: "timeout"}` (returned here, in
    /// manifest order) and its call is killed. Then every persistent process, blocking or
    /// async, is stopped. Errors of the events handled meanwhile stay for
    /// [`Hooks::take_faults`]. Async events dispatched afterwards are dropped as faults.
    async fn drain(&self, deadline: Duration) -> Vec<Fault> {
        let until = tokio::time::Instant::now() + deadline;
        let mut queues: Vec<(usize, Queue)> = {
            let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
            queues.drained = true;
            queues.open.drain().collect()
        };
        queues.sort_by_key(|(index, _)| *index);
        // Close every queue before waiting on any: the deadline is shared.
        let waiting: Vec<_> = queues
            .into_iter()
            .map(|(index, Queue { tx, pending, task })| {
                drop(tx);
                (index, pending, task)
            })
            .collect();
        let mut faults = Vec::new();
        let mut stragglers = Vec::new();
        for (index, pending, mut task) in waiting {
            let runner = &self.inner.runners[index];
            match tokio::time::timeout_at(until, &mut task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    let message = format!("the hook's queue task failed: {e}");
                    runner.log.write("drain", "error", &message);
                    faults.push(Fault {
                        hook: runner.hook.name.clone(),
                        event: "drain".into(),
                        arm: "error".into(),
                        message,
                    });
                }
                Err(_) => {
                    let left = pending.load(Ordering::SeqCst);
                    let message = format!(
                        "{left} event(s) not handled by the drain deadline ({} ms); the hook was stopped",
                        deadline.as_millis()
                    );
                    runner.log.write("drain", "timeout", &message);
                    faults.push(Fault {
                        hook: runner.hook.name.clone(),
                        event: "drain".into(),
                        arm: "timeout".into(),
                        message,
                    });
                    stragglers.push(task);
                }
            }
        }
        if !stragglers.is_empty() {
            self.inner.stop.send_replace(true);
            for mut task in stragglers {
                if tokio::time::timeout(STOP_GRACE, &mut task).await.is_err() {
                    task.abort();
                }
            }
            self.inner.stop.send_replace(false);
        }
        for runner in &self.inner.runners {
            runner.stop_process().await;
        }
        faults
    }
}
