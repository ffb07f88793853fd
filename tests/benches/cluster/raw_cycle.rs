//! The slow-model cycle with nothing of murmur in it: the broker's limit for the cluster's
//! protocol on this machine (issue #9, "close to the broker's limit").
//!
//! On a nats-server of its own with the cluster's streams, buckets and `workers` consumer
//! (`mur_coordinator::ensure`, the settings a cluster runs with), a minimal coordinator and
//! four minimal workers in this process exchange the same broker messages per task as the
//! cluster's path does, of the same sizes, and do nothing else:
//!
//! - submit: a request on `mur.api.task.submit`, answered after a direct get of the
//!   capsule's index entry and the record's create (`submitted`; at attempt 1 when a slot
//!   is free, its dispatch published at once, else at attempt 0);
//! - release: the coordinator's watch on `mur_tasks` brings each record; a waiting task
//!   is released when an end frees a slot (first in, first out): a compare-and-set to
//!   attempt 1, then its dispatch (carrying the record and revision) published on
//!   `mur.dispatch`, awaiting the stream's ack;
//! - run: a worker holds one batch-1 pull request per free slot on one inbox; a dispatch
//!   is marked `working` (a compare-and-set on the carried revision), its `task_start`
//!   trace line published, then the "model" is an exact 200 ms sleep (the timer the fake
//!   model and the scripted driver use), then three more trace lines, the terminal record
//!   (a compare-and-set), `task_end`, the slot freed and the dispatch double-acked.
//!
//! The benchmark's own watch on `mur_tasks` observes it, as it observes the cluster. The
//! figure is the ceiling the cluster's slow-model figure could reach here with every
//! session, file, HTTP call and check of murmur's costing nothing.
//!
//! [`Protocol::Minimal`] (`MUR_BENCH_RAW=minimal`) leaves out what the cycle could do
//! without: the index read, the release's compare-and-set (the dispatch alone releases)
//! and the trace lines: the broker's limit for any protocol that keeps a task record.

use super::{CpuMark, MODEL_DELAY, Watcher, submit_concurrently};
use async_nats::jetstream::{self, consumer::PullConsumer, kv};
use futures::StreamExt;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::TaskId;
use mur_proto::cluster::{self, CapsuleIndexEntry, Dispatch, Released, SubmitReply, SubmitRequest, TaskRecord, api};
use mur_proto::task::TaskState;
use mur_proto::{Id, IdKind};
use mur_tests::nats::NatsServer;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, Semaphore};
use tokio_util::task::AbortOnDropHandle;

/// A finished raw run: tasks ended per second (first submit → last end seen) and CPU per
/// task in ms (this process, nats-server) where `/proc` tells.
pub struct RawLoad {
    pub per_s: f64,
    pub cpu: Option<(f64, f64)>,
}

/// What the raw cycle sends per task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// The cluster's broker traffic (the module's list).
    Cluster,
    /// Records and the dispatch only: no index read, no release compare-and-set, no trace.
    Minimal,
}

/// The raw cluster: a server with the cluster's resources, the coordinator and workers
/// running on clients of their own.
pub struct RawCluster {
    /// The coordinator and the workers, stopped when dropped: first (fields drop in order),
    /// so that nothing of theirs is still waiting on the server when it stops.
    _loops: Vec<AbortOnDropHandle<()>>,
    nats: NatsServer,
    client: async_nats::Client,
}

impl RawCluster {
    /// Starts the server, the coordinator and `workers` workers of `slots` slots.
    pub async fn start(workers: usize, slots: usize, protocol: Protocol) -> RawCluster {
        let nats = NatsServer::start();
        let client = nats.connect().await;
        let js = jetstream::new(client.clone());
        mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await.expect("resources");
        // The capsule's index entry the coordinator reads at each submit.
        let index = js.get_key_value(cluster::CAPSULE_INDEX_BUCKET).await.expect("index");
        let entry = CapsuleIndexEntry {
            digest: "0f".repeat(32),
            version: "1.0.0".into(),
            pushed_at: SystemClock.now_ms(),
            bytes: 512,
            queue: false,
            model: None,
            description: None,
        };
        index.put("slow", serde_json::to_vec(&entry).unwrap().into()).await.expect("index entry");
        // Subscribed before the first submit can be sent.
        let coordinator_client = nats.connect().await;
        let requests = coordinator_client.subscribe(api::TASK_SUBMIT).await.expect("subscribe");
        coordinator_client.flush().await.expect("flush");
        let mut loops = vec![AbortOnDropHandle::new(tokio::spawn(coordinator(
            coordinator_client,
            requests,
            workers * slots,
            protocol,
        )))];
        for w in 0..workers {
            let worker = worker(nats.connect().await, format!("wkr-raw-{w}"), slots, protocol);
            loops.push(AbortOnDropHandle::new(tokio::spawn(worker)));
        }
        RawCluster { _loops: loops, nats, client }
    }

    /// Submits `n` tasks from 32 concurrent callers and waits for their ends, as the
    /// cluster's figure does.
    pub async fn run(&self, watcher: &Watcher, n: usize) -> RawLoad {
        let before = watcher.ended_count();
        let cpu_before = CpuMark::now(self.nats.pid());
        let t0 = Instant::now();
        let submitter = submit_concurrently(&self.client, "slow", n);
        watcher.wait_count(before + n).await;
        let elapsed = t0.elapsed();
        let cpu = CpuMark::now(self.nats.pid()).per_task_since(&cpu_before, n);
        submitter.await.expect("submitter");
        RawLoad { per_s: n as f64 / elapsed.as_secs_f64(), cpu }
    }

    /// The benchmark's client on this server.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }
}

/// What the coordinator's submit handler and its watch share.
struct Queue {
    free: usize,
    waiting: VecDeque<(String, u64, TaskRecord)>,
}

async fn coordinator(
    client: async_nats::Client,
    mut requests: async_nats::Subscriber,
    slots: usize,
    protocol: Protocol,
) {
    let js = jetstream::new(client.clone());
    let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.expect("mur_tasks");
    let index = js.get_key_value(cluster::CAPSULE_INDEX_BUCKET).await.expect("index");
    let queue = Arc::new(Mutex::new(Queue { free: slots, waiting: VecDeque::new() }));
    let mut watch = tasks.watch_all().await.expect("watch");
    // Everything this coordinator starts stops with it (the benchmark aborts it, then stops
    // the server): the submit handlers and the releases live in join sets it owns.
    let _submits = AbortOnDropHandle::new(tokio::spawn({
        let (js, tasks, queue) = (js.clone(), tasks.clone(), queue.clone());
        async move {
            let mut handlers = tokio::task::JoinSet::new();
            while let Some(request) = requests.next().await {
                while handlers.try_join_next().is_some() {}
                let (js, tasks, index, queue, client) =
                    (js.clone(), tasks.clone(), index.clone(), queue.clone(), client.clone());
                handlers.spawn(async move {
                    let submit = SubmitRequest::parse(&request.payload).expect("a submit request");
                    let digest = match protocol {
                        Protocol::Minimal => "0f".repeat(32),
                        Protocol::Cluster => {
                            // The coordinator's own read (`bundle::latest`).
                            let entry = mur_worker::bundle::latest(&index, &submit.capsule).await.expect("index read");
                            entry.expect("index entry").digest
                        }
                    };
                    let task_id = Id::generate(IdKind::Task);
                    let mut record =
                        TaskRecord::submitted(TaskId::unchecked(task_id.clone()), submit, digest, SystemClock.now_ms());
                    let admitted = {
                        let mut q = queue.lock().unwrap();
                        let admit = q.free > 0 && q.waiting.is_empty();
                        q.free -= usize::from(admit);
                        admit
                    };
                    record.attempt = u32::from(admitted);
                    let revision =
                        tasks.create(&task_id, serde_json::to_vec(&record).unwrap().into()).await.expect("create");
                    let reply =
                        SubmitReply { task_id: TaskId::unchecked(task_id.clone()), state: TaskState::Submitted };
                    if let Some(inbox) = request.reply {
                        client.publish(inbox, serde_json::to_vec(&reply).unwrap().into()).await.expect("reply");
                    }
                    if admitted {
                        dispatch(&js, Released { revision, record }).await;
                    }
                });
            }
        }
    }));
    let mut releasing = tokio::task::JoinSet::new();
    while let Some(Ok(entry)) = watch.next().await {
        while releasing.try_join_next().is_some() {}
        let Ok(record) = serde_json::from_slice::<TaskRecord>(&entry.value) else { continue };
        let mut releases = Vec::new();
        {
            let mut q = queue.lock().unwrap();
            if record.state.is_terminal() {
                q.free += 1;
            } else if record.state == TaskState::Submitted && record.attempt == 0 {
                q.waiting.push_back((entry.key.clone(), entry.revision, record));
            }
            while q.free > 0
                && let Some(next) = q.waiting.pop_front()
            {
                q.free -= 1;
                releases.push(next);
            }
        }
        for (key, revision, mut record) in releases {
            let (js, tasks) = (js.clone(), tasks.clone());
            releasing.spawn(async move {
                record.attempt = 1;
                let revision = match protocol {
                    Protocol::Minimal => revision,
                    Protocol::Cluster => {
                        let json = serde_json::to_vec(&record).unwrap();
                        tasks.update(&key, json.into(), revision).await.expect("release")
                    }
                };
                dispatch(&js, Released { revision, record }).await;
            });
        }
    }
}

async fn dispatch(js: &jetstream::Context, released: Released) {
    let task_id = released.record.task_id.clone();
    let body = Dispatch { task_id, attempt: 1, released: Some(released) };
    js.publish(cluster::DISPATCH_SUBJECT, serde_json::to_vec(&body).unwrap().into())
        .await
        .expect("publish")
        .await
        .expect("dispatch ack");
}

async fn worker(client: async_nats::Client, worker_id: String, slots: usize, protocol: Protocol) {
    let js = jetstream::new(client.clone());
    let tasks = js.get_key_value(cluster::TASKS_BUCKET).await.expect("mur_tasks");
    let consumer: PullConsumer =
        js.get_consumer_from_stream(cluster::DISPATCH_CONSUMER, cluster::DISPATCH_STREAM).await.expect("consumer");
    let inbox = async_nats::Subject::from(client.new_inbox());
    let mut answers = client.subscribe(inbox.clone()).await.expect("subscribe");
    let free = Arc::new(Semaphore::new(slots));
    let freed = Arc::new(Notify::new());
    let mut waiting = 0usize;
    // The dispatches in hand, stopped with this worker.
    let mut running = tokio::task::JoinSet::new();
    loop {
        while running.try_join_next().is_some() {}
        while waiting < free.available_permits() {
            let request = jetstream::consumer::pull::BatchConfig {
                batch: 1,
                expires: Some(Duration::from_secs(30)),
                ..Default::default()
            };
            consumer.request_batch(request, inbox.clone()).await.expect("pull request");
            waiting += 1;
        }
        let message = tokio::select! {
            m = answers.next() => m.expect("pull subscription"),
            () = freed.notified() => continue,
        };
        let status = message.status.unwrap_or(async_nats::StatusCode::OK);
        if status == async_nats::StatusCode::IDLE_HEARTBEAT {
            continue;
        }
        waiting -= 1;
        if status != async_nats::StatusCode::OK {
            continue;
        }
        let msg = jetstream::Message { message, context: js.clone() };
        let slot = free.clone().try_acquire_owned().expect("a free slot");
        let (tasks, client, worker_id, freed) = (tasks.clone(), client.clone(), worker_id.clone(), freed.clone());
        running.spawn(async move {
            run(&tasks, &client, &worker_id, &msg, protocol == Protocol::Cluster).await;
            drop(slot);
            freed.notify_one();
            // The task is ended (its record is what the benchmark counts); a lost ack only
            // redelivers a dispatch of an ended task, as in the cluster.
            let _ = msg.double_ack().await;
        });
    }
}

/// One dispatch: `working`, the trace lines (when `traced`) around an exact 200 ms
/// "model", the end.
async fn run(tasks: &kv::Store, client: &async_nats::Client, worker_id: &str, msg: &jetstream::Message, traced: bool) {
    let dispatch: Dispatch = serde_json::from_slice(&msg.payload).expect("a dispatch");
    let Released { mut record, revision } = dispatch.released.expect("the released record");
    let session_id = Id::generate(IdKind::Session);
    record.state = TaskState::Working;
    record.worker = Some(worker_id.to_string());
    record.session_id = Some(session_id.to_string());
    record.dispatch_seq = msg.info().ok().map(|i| i.stream_sequence);
    record.started_at = Some(SystemClock.now_ms());
    let key = record.task_id.clone();
    let revision = tasks.update(&key, serde_json::to_vec(&record).unwrap().into(), revision).await.expect("working");
    let subject = async_nats::Subject::from(cluster::trace_subject(&session_id));
    let trace = |event: &'static str| {
        // A trace line of the size the cluster's are (~380 bytes).
        let json = serde_json::json!({
            "ts": SystemClock.now_ms(), "session_id": session_id.as_str(), "task_id": key.as_str(),
            "event_type": event, "source": "task", "capsule": "slow",
            "detail": "x".repeat(200),
        });
        let (client, subject) = (client.clone(), subject.clone());
        async move {
            if traced {
                client.publish(subject, serde_json::to_vec(&json).unwrap().into()).await.expect("trace");
            }
        }
    };
    trace("task_start").await;
    mur_tests::timer::sleep(MODEL_DELAY).await;
    for event in ["model_response", "turn_end", "session_end"] {
        trace(event).await;
    }
    record.state = TaskState::Completed;
    record.exit_status = Some(mur_proto::task::ExitStatus::Ok);
    record.result = Some("done".into());
    record.ended_at = Some(SystemClock.now_ms());
    tasks.update(&key, serde_json::to_vec(&record).unwrap().into(), revision).await.expect("end");
    trace("task_end").await;
}
