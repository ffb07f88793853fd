//! The watchers of `mur_tasks` and `mur_workers`, turning each change into scheduler
//! [`Input`]s, and the queue flags of capsule bundles.

use super::*;

/// The `Submitted` input of a record.
pub(super) fn submitted_input(record: &TaskRecord, revision: u64, queue_capsule: bool) -> Input {
    Input::Submitted {
        task_id: record.task_id.clone(),
        capsule: record.capsule.clone(),
        lane: record.lane,
        queue_capsule,
        seq: revision,
    }
}

/// What a record says beyond `Submitted`: released, started or ended.
pub(super) fn progress_input(record: &TaskRecord) -> Option<Input> {
    let task_id = record.task_id.clone();
    match record.state {
        TaskState::Submitted if record.attempt == 0 => None,
        TaskState::Submitted => Some(Input::Released { task_id }),
        TaskState::Working => match &record.worker {
            Some(worker_id) => Some(Input::Started { task_id, worker_id: worker_id.clone() }),
            None => Some(Input::Released { task_id }),
        },
        _ => Some(Input::Ended { task_id }),
    }
}

/// Whether each capsule is a `queue` capsule, read from the index when first needed and
/// again for each new task whose bundle is not in [`BundleFlags`] (a push may change it).
#[derive(Default)]
pub(super) struct QueueFlags {
    known: HashMap<String, bool>,
}

impl QueueFlags {
    /// The queue flag of the bundle `record` runs: from `bundles` when its digest is known
    /// there, else from the capsule's index entry (learned into `bundles` when the entry is
    /// that bundle's); the last flag read for the capsule when the index cannot be read.
    pub(super) async fn get(&mut self, index: &kv::Store, bundles: &BundleFlags, record: &TaskRecord) -> bool {
        if let Some(queue) = bundles.get(&record.capsule_digest) {
            return queue;
        }
        let capsule = record.capsule.as_str();
        match index.get(capsule).await {
            Ok(Some(value)) => {
                let entry = serde_json::from_slice::<CapsuleIndexEntry>(&value).ok();
                if let Some(entry) = entry.as_ref().filter(|e| e.digest == record.capsule_digest) {
                    bundles.learn(entry);
                } else if let Some(queue) = Self::from_history(index, bundles, record).await {
                    // Pushed over since the task was submitted (a restarted coordinator
                    // remembers no bundles): its own bundle's flag, from the index's history.
                    return queue;
                }
                let queue = entry.is_some_and(|e| e.queue);
                self.known.insert(capsule.to_string(), queue);
                queue
            }
            Ok(None) => false,
            // Keep the last answer when the index cannot be read now.
            Err(e) => {
                tracing::warn!(capsule, "capsule index unreadable, using the last known queue flag: {e}");
                self.known.get(capsule).copied().unwrap_or(false)
            }
        }
    }

    /// The flag of `record`'s bundle from the index's history of its capsule (the pushes
    /// it keeps, `mur_capsule_index`'s history setting), learned into `bundles`; `None`
    /// when the history no longer holds that bundle or cannot be read.
    async fn from_history(index: &kv::Store, bundles: &BundleFlags, record: &TaskRecord) -> Option<bool> {
        let pushes = mur_nats::bundle::history(index, &record.capsule).await.ok()?;
        let entry = pushes.iter().find(|e| e.digest == record.capsule_digest)?;
        bundles.learn(entry);
        Some(entry.queue)
    }
}

/// The queue flag (`lifecycle.task_acceptance: queue`) of each capsule bundle this process
/// has read from the index, by bundle digest, shared by its contexts. A digest is the
/// SHA-256 of one bundle's bytes, manifest included (`mur_worker::bundle`), so its flag
/// never changes: a task whose bundle is known here is put to the scheduler without a
/// capsule index read (issue #9: the submit's read serves the watch too). Holds at most
/// [`BundleFlags::KEPT`] digests; past that it starts over.
#[derive(Default)]
pub(crate) struct BundleFlags(Mutex<HashMap<String, bool>>);

impl BundleFlags {
    /// How many digests are kept at most.
    const KEPT: usize = 4096;

    /// Notes the flag of the bundle `entry` names.
    pub(super) fn learn(&self, entry: &CapsuleIndexEntry) {
        let mut flags = self.0.lock().expect("bundle flags lock");
        // Known already (every submit learns its bundle): nothing to copy.
        if flags.get(&entry.digest) == Some(&entry.queue) {
            return;
        }
        if flags.len() >= Self::KEPT && !flags.contains_key(&entry.digest) {
            flags.clear();
        }
        flags.insert(entry.digest.clone(), entry.queue);
    }

    /// The flag of bundle `digest`, if it is known here.
    pub(super) fn get(&self, digest: &str) -> Option<bool> {
        self.0.lock().expect("bundle flags lock").get(digest).copied()
    }
}

/// Feeds every change of `mur_tasks` to the scheduler.
pub(super) async fn watch_tasks(
    ctx: Arc<Ctx>,
    mut watch: kv::Watch,
    mut queue_flags: QueueFlags,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    'watch: loop {
        let entry = tokio::select! {
            _ = stopped.changed() => break 'watch,
            entry = watch.next() => entry,
        };
        let entry = match entry {
            Some(Ok(entry)) => entry,
            Some(Err(e)) => {
                tracing::warn!(instance = %ctx.instance, "mur_tasks watch: {e}");
                continue;
            }
            None => break 'watch,
        };
        let revision = entry.revision;
        'entry: {
            if entry.operation != kv::Operation::Put {
                // A task record deleted by hand: it will not run here.
                ctx.releasing.lock().expect("releasing lock").remove(entry.key.as_str());
                let _ = ctx.inputs.send(Input::Ended { task_id: TaskId::unchecked(entry.key.clone()) });
                break 'entry;
            }
            let Some(record) = ctx.record_of(&entry) else { break 'entry };
            let input = match progress_input(&record) {
                None => {
                    if ctx.note_waiting(entry.revision, record.clone()) {
                        // Taken in here: the intake gave its input to the scheduler already.
                        break 'entry;
                    }
                    let queue_capsule = queue_flags.get(&ctx.capsule_index, &ctx.bundles, &record).await;
                    submitted_input(&record, entry.revision, queue_capsule)
                }
                Some(input) => {
                    if record.state.is_terminal() {
                        ctx.take_waiting(&record.task_id);
                    }
                    let released = record.state == TaskState::Submitted && record.attempt >= 1;
                    let foreign = if record.state.is_terminal() {
                        ctx.releasing.lock().expect("releasing lock").remove(record.task_id.as_str());
                        false
                    } else {
                        released && ctx.releasing.lock().expect("releasing lock").insert(record.task_id.clone())
                    };
                    if foreign {
                        // Released by another coordinator: wait-then-release here (a duplicate
                        // `Submitted` for a task known here is ignored), and its dispatch again.
                        tracing::info!(instance = %ctx.instance, task_id = %record.task_id, "a task released by another coordinator: dispatching it again");
                        let queue_capsule = queue_flags.get(&ctx.capsule_index, &ctx.bundles, &record).await;
                        if ctx.inputs.send(submitted_input(&record, entry.revision, queue_capsule)).is_err() {
                            break 'watch;
                        }
                        let (ctx, released) = (ctx.clone(), Released { revision: entry.revision, record });
                        tokio::spawn(async move { ctx.dispatch_released(released).await });
                    }
                    input
                }
            };
            if ctx.inputs.send(input).is_err() {
                break 'watch;
            }
        }
        // Every input of revisions up to here is in the scheduler's channel: a submission
        // created after it may go there straight ([`IntakeOrder`]).
        ctx.intake.watched.fetch_max(revision, Ordering::SeqCst);
    }
    "the mur_tasks watch"
}

/// Live workers as the heartbeats in `mur_workers` show them.
pub(super) struct Workers {
    timeout_ms: u64,
    /// Live workers: slots and last heartbeat.
    live: HashMap<String, (u32, u64)>,
}

impl Workers {
    pub(super) fn new(timeout: Duration) -> Workers {
        Workers { timeout_ms: millis(timeout), live: HashMap::new() }
    }

    /// The input a change of a worker's key means, if any.
    pub(super) fn observe(&mut self, entry: &kv::Entry, now: u64) -> Option<Input> {
        let worker_id = entry.key.clone();
        if entry.operation != kv::Operation::Put {
            return self.live.remove(&worker_id).map(|_| Input::WorkerGone { worker_id });
        }
        let info = match serde_json::from_slice::<WorkerInfo>(&entry.value) {
            Ok(info) => info,
            Err(e) => {
                tracing::warn!(worker_id, "skipping a malformed worker registration: {e}");
                return None;
            }
        };
        if cluster::heartbeat_expired(info.heartbeat_at, now, self.timeout_ms) {
            return self.live.remove(&worker_id).map(|_| Input::WorkerGone { worker_id });
        }
        match self.live.insert(worker_id.clone(), (info.slots, info.heartbeat_at)) {
            Some((slots, _)) if slots == info.slots => None,
            _ => Some(Input::WorkerUp { worker_id, slots: info.slots }),
        }
    }

    /// The workers whose heartbeat is too old at `now`.
    fn expire(&mut self, now: u64) -> Vec<Input> {
        let timeout = self.timeout_ms;
        let mut gone: Vec<String> = self
            .live
            .iter()
            .filter(|(_, (_, beat))| cluster::heartbeat_expired(*beat, now, timeout))
            .map(|(id, _)| id.clone())
            .collect();
        gone.sort();
        gone.into_iter()
            .map(|worker_id| {
                self.live.remove(&worker_id);
                Input::WorkerGone { worker_id }
            })
            .collect()
    }
}

/// Feeds worker arrivals and departures to the scheduler.
pub(super) async fn watch_workers(
    ctx: Arc<Ctx>,
    mut watch: kv::Watch,
    mut workers: Workers,
    mut stopped: watch::Receiver<bool>,
) -> &'static str {
    let mut tick = tokio::time::interval(HEARTBEAT_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let inputs = tokio::select! {
            _ = stopped.changed() => break,
            _ = tick.tick() => workers.expire(SystemClock.now_ms()),
            entry = watch.next() => match entry {
                Some(Ok(entry)) => workers.observe(&entry, SystemClock.now_ms()).into_iter().collect(),
                Some(Err(e)) => {
                    tracing::warn!(instance = %ctx.instance, "mur_workers watch: {e}");
                    Vec::new()
                }
                None => break,
            },
        };
        for input in inputs {
            tracing::info!(instance = %ctx.instance, ?input, "worker change");
            if ctx.inputs.send(input).is_err() {
                return "the mur_workers watch";
            }
        }
    }
    "the mur_workers watch"
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::cluster::CapsuleIndexEntry;

    fn entry(digest: &str, queue: bool) -> CapsuleIndexEntry {
        CapsuleIndexEntry {
            digest: digest.into(),
            version: "1.0.0".into(),
            pushed_at: 0,
            bytes: 1,
            queue,
            model: None,
            description: None,
        }
    }

    #[test]
    fn a_bundles_queue_flag_is_known_by_its_digest_and_the_memory_starts_over_past_its_bound() {
        let bundles = BundleFlags::default();
        assert_eq!(bundles.get("aa"), None);
        bundles.learn(&entry("aa", true));
        bundles.learn(&entry("bb", false));
        assert_eq!((bundles.get("aa"), bundles.get("bb")), (Some(true), Some(false)));
        for i in 2..BundleFlags::KEPT {
            bundles.learn(&entry(&format!("{i:064x}"), false));
        }
        assert_eq!(bundles.get("aa"), Some(true), "{} digests fit", BundleFlags::KEPT);
        bundles.learn(&entry("aa", true));
        assert_eq!(bundles.get("bb"), Some(false), "learning a known digest again forgets nothing");
        bundles.learn(&entry("cc", true));
        assert_eq!((bundles.get("aa"), bundles.get("cc")), (None, Some(true)), "one more starts over");
    }
}
