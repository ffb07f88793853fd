//! The restore at the start of a term: the buckets read up to their last entries, the
//! scheduler rebuilt from them, released dispatches published again, the loops started.

use super::*;

/// Takes up the leader's duties under `held`: restores the scheduler from the buckets,
/// republishes released dispatches, and starts the watchers, the actor, the
/// dead-letter loop and the fleet loops (run requests, adoption of dead runs, triggers;
/// `active_runs`: the fleet runs this process carries out).
pub(super) async fn lead(
    client: &async_nats::Client,
    config: &Config,
    res: &Resources,
    held: Arc<Held>,
    active_runs: &crate::fleet::run::Active,
    shared: &ProcessShared,
) -> Result<Leading, Error> {
    let ProcessShared { scans, intake, .. } = shared;
    let instance = config.instance.clone();
    let js = jetstream::new(client.clone());
    // The watchers start before anything is read, so no change falls between the replay
    // and the live feed.
    let mut task_watch = mur_nats::read::watch(&res.tasks, ">").await.map_err(nats("mur_tasks: watch"))?;
    let mut worker_watch = mur_nats::read::watch(&res.workers, ">").await.map_err(nats("mur_workers: watch"))?;
    let turn = scans.acquire().await.map_err(|_| Error::LoopEnded("the record scans"))?;
    let (task_entries, replayed_up_to) = caught_up(&res.tasks, &mut task_watch, |entry| !ended_or_gone(entry)).await?;
    drop(turn);
    let (worker_entries, _) = caught_up(&res.workers, &mut worker_watch, |_| true).await?;

    let (inputs, input_rx) = mpsc::unbounded_channel();
    let (admissions, admission_rx) = mpsc::unbounded_channel();
    let ctx = Arc::new(Ctx::new(&js, res, config, shared, inputs, admissions, Some(held)));
    // The watch goes on from the replay's last entry.
    intake.watched.store(replayed_up_to, Ordering::SeqCst);

    // The replay.
    let mut replay = Vec::new();
    let mut queue_flags = QueueFlags::default();
    for entry in &task_entries {
        let Some(record) = ctx.record_of(entry) else { continue };
        if record.state.is_terminal() {
            continue;
        }
        let queue_capsule = queue_flags.get(&ctx.capsule_index, &ctx.bundles, &record).await;
        replay.push(submitted_input(&record, entry.revision, queue_capsule));
        if record.state == TaskState::Submitted && record.attempt >= 1 {
            // Released by the last leader; its dispatch goes out again (the scheduler's
            // `Republish` for its `Released`).
            ctx.releasing.lock().expect("releasing lock").insert(record.task_id.clone());
        }
        replay.extend(progress_input(&record));
    }
    let mut workers = Workers::new(config.worker_timeout);
    let now = SystemClock.now_ms();
    for entry in &worker_entries {
        replay.extend(workers.observe(entry, now));
    }
    let replayed = replay.len();
    let (scheduler, outputs) = Scheduler::restore(replay);
    tracing::info!(
        instance = %instance,
        tasks = task_entries.len(),
        inputs = replayed,
        workers = worker_entries.len(),
        in_flight = scheduler.snapshot().in_flight.len(),
        "coordinator restored"
    );
    // The republished dispatches first, then the releases due (the scheduler's order).
    for output in outputs {
        ctx.carry_out(output).await;
    }

    let (stop, stopped) = watch::channel(false);
    let mut loops: JoinSet<&'static str> = JoinSet::new();
    loops.spawn(actor(ctx.clone(), scheduler, input_rx, admission_rx, stopped.clone()));
    loops.spawn(watch_tasks(ctx.clone(), task_watch, queue_flags, stopped.clone()));
    loops.spawn(watch_workers(ctx.clone(), worker_watch, workers, stopped.clone()));
    loops.spawn(crate::dead_letter::run(
        js.clone(),
        res.dead_letter_consumer.clone(),
        res.tasks.clone(),
        instance.clone(),
        stopped.clone(),
    ));
    let fleet_env = crate::fleet::run::Env {
        client: client.clone(),
        fleets: crate::fleet::api::Fleets::new(js.clone(), res, instance.clone()),
        tasks: res.tasks.clone(),
        task_ended: ctx.task_ended.clone(),
        capsule_index: res.capsule_index.clone(),
        instance: instance.clone(),
        settings: config.fleet.clone(),
        active: active_runs.clone(),
    };
    loops.spawn(crate::fleet::adopt::serve(fleet_env.clone(), stopped.clone()));
    loops.spawn(crate::fleet::trigger::serve(fleet_env.clone(), stopped.clone()));
    loops.spawn(crate::fleet::run::serve(fleet_env, stopped.clone()));
    Ok(Leading { ctx, loops, stop })
}

/// Reads a fresh watch ([`mur_nats::read::watch`]) up to the entry that was the bucket's last when it
/// started (or later), and returns the entries of what it read that `keep` accepts: the
/// bucket's current state, or the part of it the caller needs (entries not kept are dropped
/// as they are read).
async fn caught_up(
    store: &kv::Store,
    watch: &mut mur_nats::read::Watch,
    keep: impl Fn(&kv::Entry) -> bool,
) -> Result<(Vec<kv::Entry>, u64), Error> {
    // A key written while it is read comes again later (and after the watcher's consumer
    // was reset, its older revisions too — always before its newest): the last entry read
    // of a key is its state. A task cancelled during a restore used to be replayed from its
    // earlier `submitted` entry, its `canceled` one dropped as ended: the scheduler then
    // released it, the release was refused, and its slot stayed taken for good.
    let mut latest = Latest::default();
    let mut last = 0;
    read_current(store, watch, |entry| {
        let (key, revision) = (entry.key.clone(), entry.revision);
        last = last.max(revision);
        latest.read(key, revision, keep(&entry).then_some(entry));
    })
    .await?;
    Ok((latest.into_sorted(), last))
}

/// The last entry read of each key, when it is one to keep: what a pass over a bucket's
/// stream leaves once the entries of keys written during the pass have come again.
struct Latest<T> {
    by_key: HashMap<String, (u64, T)>,
}

impl<T> Default for Latest<T> {
    fn default() -> Self {
        Latest { by_key: HashMap::new() }
    }
}

impl<T> Latest<T> {
    /// An entry of `key` at `revision`: `Some` to keep it, `None` for one that is not kept
    /// (a delete, an ended record). Either way it replaces what the key's earlier entries
    /// left.
    pub(super) fn read(&mut self, key: String, revision: u64, item: Option<T>) {
        match item {
            Some(item) => {
                self.by_key.insert(key, (revision, item));
            }
            None => {
                self.by_key.remove(&key);
            }
        }
    }

    /// What is kept, oldest revision first.
    fn into_sorted(self) -> Vec<T> {
        let mut kept: Vec<(u64, T)> = self.by_key.into_values().collect();
        kept.sort_by_key(|(revision, _)| *revision);
        kept.into_iter().map(|(_, item)| item).collect()
    }
}

/// Hands `visit` each entry a fresh watch ([`mur_nats::read::watch`]) reads, up to the entry that
/// was the bucket's last when it started (or later): the latest revision of every key, in
/// one pass over the bucket's stream, nothing held here.
pub(super) async fn read_current(
    store: &kv::Store,
    watch: &mut mur_nats::read::Watch,
    mut visit: impl FnMut(kv::Entry),
) -> Result<(), Error> {
    // Messages are never removed from these streams except by newer revisions, so a
    // stream empty now was empty when the watcher started: it has nothing to replay.
    let info = store.stream.get_info().await.map_err(nats(format!("{}: info", store.name)))?;
    if info.state.messages == 0 {
        return Ok(());
    }
    while let Some(entry) = watch.next().await {
        let entry = entry.map_err(nats(format!("{}: watch", store.name)))?;
        let last = entry.delta == 0;
        visit(entry);
        if last {
            return Ok(());
        }
    }
    Err(Error::LoopEnded("a bucket watch"))
}

/// Whether a `mur_tasks` entry is one the restart replay skips: a delete or purge marker,
/// or a record that has ended. Only the record's `state` is read, so an ended record is
/// looked at and dropped, not held until the replay is over: a store of thousands of ended
/// tasks with long results made a restarting coordinator hold them all at once (390 MiB
/// resident over 300 MB of results; issue #9). A record whose state cannot be read is
/// kept, for [`Ctx::record_of`] to report.
fn ended_or_gone(entry: &kv::Entry) -> bool {
    #[derive(Deserialize)]
    struct StateOnly {
        state: TaskState,
    }
    entry.operation != kv::Operation::Put
        || serde_json::from_slice::<StateOnly>(&entry.value).is_ok_and(|r| r.state.is_terminal())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_written_during_a_pass_is_what_its_last_entry_says() {
        let mut latest = Latest::default();
        // a: submitted, then cancelled during the pass (an ended entry is not kept);
        // b: untouched; c: written twice; d: deleted, then created again.
        for (key, revision, item) in [
            ("a", 1, Some("a submitted")),
            ("b", 2, Some("b submitted")),
            ("c", 3, Some("c submitted")),
            ("d", 4, None),
            ("a", 5, None),
            ("c", 6, Some("c released")),
            ("d", 7, Some("d submitted")),
        ] {
            latest.read(key.to_string(), revision, item);
        }
        assert_eq!(latest.into_sorted(), ["b submitted", "c released", "d submitted"]);
    }
}
