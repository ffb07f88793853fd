//! One dispatch in its slot: in-progress acks, the IO of each step [`decide`] names, the
//! session's run and the terminal write, then the answer to the message.

use super::*;

/// Runs one dispatch in its slot, with in-progress acks while it works.
pub(super) async fn handle(sh: Arc<Shared>, msg: jetstream::Message, slot: OwnedSemaphorePermit) {
    let msg = Arc::new(msg);
    // The task's own stop: fired by a cancel (the note on `mur.cancel.<task_id>`, or the
    // record's `cancel_requested_at` seen at a progress tick) or by the shutdown grace.
    let cancel = sh.hard_stop.child_token();
    // Parsed once, here: a payload that is no dispatch is terminated by `run_dispatch`.
    let parsed = serde_json::from_slice::<Dispatch>(&msg.payload);
    let carried_traceparent =
        parsed.as_ref().ok().and_then(|d| d.released.as_ref()).map(|r| r.record.traceparent.clone());
    let task_id = parsed.as_ref().ok().map(|d| d.task_id.clone());
    let in_hand = sh.next_in_hand.fetch_add(1, Ordering::Relaxed);
    if let Some(id) = &task_id {
        sh.running.lock().expect("running lock").entry(id.clone()).or_default().insert(in_hand, cancel.clone());
    }
    // The session this delivery marked `working`, once it has; and the stop that says the
    // session was superseded ([`Hold::Superseded`]), fired before `cancel`.
    let session = Arc::new(std::sync::OnceLock::new());
    let superseded = CancellationToken::new();
    let progress = tokio::spawn({
        let msg = msg.clone();
        let every = sh.config.progress_every.unwrap_or(Duration::from_secs(10));
        let tasks = sh.tasks.clone();
        let task_id = task_id.clone();
        let (cancel, session, superseded) = (cancel.clone(), session.clone(), superseded.clone());
        async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    tracing::debug!(error = %e, "in-progress ack failed");
                }
                let Some(id) = &task_id else { continue };
                let Ok(Some((record, _))) = read(&tasks, id).await else { continue };
                match hold(&record, session.get()) {
                    Hold::GoOn => {}
                    Hold::CancelRequested => cancel.cancel(),
                    Hold::Superseded => {
                        if !superseded.is_cancelled() {
                            tracing::warn!(
                                task_id = %id,
                                state = record.state.as_str(),
                                holder = ?record.session_id,
                                "the task ended or runs elsewhere (taken over): this session stops and writes nothing of its end"
                            );
                        }
                        superseded.cancel();
                        cancel.cancel();
                    }
                }
            }
        }
    });
    let delivered = match msg.info() {
        Ok(i) => Delivered { number: i.delivered.max(1) as u64, stream_seq: Some(i.stream_sequence) },
        Err(_) => Delivered { number: 1, stream_seq: None },
    };
    let span = dispatch_span(&sh, &msg, task_id.as_ref(), carried_traceparent, delivered.number).await;
    let answer = run_dispatch(&sh, parsed, delivered, cancel, Claim { session, superseded }).instrument(span).await;
    progress.abort();
    if let Some(id) = &task_id {
        let mut running = sh.running.lock().expect("running lock");
        if let Some(tokens) = running.get_mut(id) {
            tokens.remove(&in_hand);
            if tokens.is_empty() {
                running.remove(id);
            }
        }
    }
    // The task is done with (its terminal record is written, or it goes back): its slot
    // is free while the answer is on its way, so the next pull request goes out now
    // rather than a round trip later (issue #9).
    drop(slot);
    sh.slot_freed.notify_one();
    let acked = match answer {
        Answer::Ack => msg.double_ack().await,
        Answer::Term => msg.ack_with(AckKind::Term).await,
        Answer::Nak(delay) => msg.ack_with(AckKind::Nak(Some(delay))).await,
        Answer::Leave => Ok(()),
    };
    if let Err(e) = acked {
        tracing::warn!(error = %e, ?answer, "answering a dispatch failed; it will be redelivered");
    }
}

/// What a delivery shares with its progress ticks: the session it marked `working`, and
/// the stop fired when the ticks find that session superseded ([`Hold::Superseded`]).
struct Claim {
    session: Arc<std::sync::OnceLock<SessionId>>,
    superseded: CancellationToken,
}

async fn run_dispatch(
    sh: &Shared,
    parsed: Result<Dispatch, serde_json::Error>,
    delivery: Delivered,
    cancel: CancellationToken,
    claim: Claim,
) -> Answer {
    // A fleet step's fan-out permit, once it holds one; given back whatever happened.
    let mut permit = None;
    let answer = run_dispatch_holding(sh, parsed, delivery, cancel, claim, &mut permit).await;
    if let Some(permit) = permit {
        permit.release().await;
    }
    answer
}

/// [`run_dispatch`]'s work: the IO of each [`Step`] [`decide`] names, until the dispatch
/// is answered or the task runs and ends; a fleet step's permit, once taken, is left in
/// `permit`.
async fn run_dispatch_holding(
    sh: &Shared,
    parsed: Result<Dispatch, serde_json::Error>,
    delivery: Delivered,
    cancel: CancellationToken,
    claim: Claim,
    permit: &mut Option<Arc<fanout::StepPermit>>,
) -> Answer {
    // The session's stop: the task's, or the loss of its fan-out permit (watched until the
    // dispatch is done with: `_dispatch_over` fires then).
    let session_cancel = cancel.child_token();
    let dispatch_over = CancellationToken::new();
    let _dispatch_over = dispatch_over.clone().drop_guard();
    let dispatch: Dispatch = match parsed {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "a dispatch that is not a Dispatch: terminated");
            return Answer::Term;
        }
    };
    let key = &dispatch.task_id;
    let stream_seq = delivery.stream_seq;
    // What a terminal record is fitted to ([`end_record`]).
    let max_payload = sh.client.server_info().max_payload;
    let worker_id = sh.config.worker_id.clone();
    // The record as the release wrote it, when the dispatch carries it: no read. The
    // compare-and-set to `working` is on its revision, so a record that changed since
    // (cancel requested, an earlier delivery took it) is read and looked at afresh.
    let mut known: Known<Arc<Capsule>, Takeover> = Known::new(dispatch.released.map(|r| (r.record, r.revision)));
    let (current, capsule, takeover, session_id, prepared) = loop {
        match decide(&known, delivery, sh.hard_stop.is_cancelled()) {
            Step::Answer(answer) => return answer,
            Step::Duplicate => {
                // Another message's delivery runs this task (or will take it over if its
                // worker dies: that message stays unacked until the end): this one was
                // published again after the stream's duplicate window. Dropped.
                tracing::warn!(
                    task_id = %key,
                    running = known.current().and_then(|(r, _)| r.dispatch_seq),
                    duplicate = stream_seq,
                    "a second dispatch of a task another dispatch is running: dropped"
                );
                return Answer::Ack;
            }
            Step::Read => {
                let read = read(&sh.tasks, key).await;
                match &read {
                    Ok(Some(_)) => {}
                    Ok(None) => tracing::warn!(task_id = %key, "a dispatch without a task record: terminated"),
                    Err(e) => tracing::warn!(task_id = %key, error = %e, "reading the task record failed"),
                }
                known.read(read);
            }
            Step::LoadCapsule(record) => {
                known.capsule = match load_capsule(sh, record).await {
                    Ok(capsule) => Fetch::Done(capsule),
                    Err(Loading::Transient(reason)) => {
                        // The broker did not answer (a restart under way): another delivery,
                        // after the nak delay, fetches again; the task does not fail for it.
                        tracing::warn!(task_id = %key, "{reason}; the dispatch goes back");
                        Fetch::Unavailable
                    }
                    Err(Loading::Failed(reason)) => Fetch::Failed(reason),
                };
            }
            Step::TakeOver(record) => {
                // The session that had the record `working` stopped answering for it (its
                // worker died): take over from its last checkpoint (issue #8 §Takeover).
                let previous = record.session_id.as_ref().map(SessionId::to_string).unwrap_or_default();
                let previous_worker = record.worker.clone().unwrap_or_default();
                known.takeover = match read_checkpoints(&sh.sessions, key).await {
                    Ok(r) => Fetch::Done(takeover_from(r, delivery.number, previous, previous_worker)),
                    Err(e) => {
                        tracing::warn!(task_id = %key, error = %e, "reading the task's checkpoints failed");
                        Fetch::Unavailable
                    }
                };
            }
            Step::WaitForPermit(record, step) => {
                // A delegated fleet step runs only while it holds a fan-out permit (issue
                // #11): wait in line for one, with in-progress acks still going out, until
                // it is free or the task is cancelled or out of time.
                let waited = hold_permit(sh, record, step, &cancel).await;
                known.permit = match waited {
                    Ok(held) => {
                        let (lost, stop, over) = (held.lost(), session_cancel.clone(), dispatch_over.clone());
                        tokio::spawn(async move {
                            tokio::select! {
                                () = lost.cancelled() => stop.cancel(),
                                () = over.cancelled() => {}
                            }
                        });
                        *permit = Some(held);
                        Permit::Held
                    }
                    Err(why) => {
                        // The record may have moved on during the wait: its end is
                        // written from a fresh read.
                        known.record = Record::Stale;
                        Permit::Ended(why)
                    }
                };
            }
            Step::End(end) => {
                let written = task_records::update(&sh.tasks, key, known.current(), |r| {
                    if !writable(r, stream_seq) {
                        return false;
                    }
                    if end.by_this_worker {
                        r.worker = Some(worker_id.clone());
                    }
                    end_record(r, end.exit, &end.result, end.error.as_deref(), max_payload);
                    true
                })
                .await;
                return finished(written, key, delivery);
            }
            Step::MarkWorking { record, capsule, carried } => {
                let capsule = capsule.clone();
                let source = format!("capsule:{}", record.capsule);
                let session_id = SessionId::generate();
                // The session folder is made on a blocking thread while the record goes to
                // `working` (issue #9: file creation kept off the async threads and the wait).
                let access = FleetAccess {
                    client: sh.client.clone(),
                    source,
                    permit: permit.clone(),
                    cancel: session_cancel.clone(),
                };
                let prepared = Prepared::start(sh, &capsule, &session_id, access);
                let mark_working = |r: &mut TaskRecord| {
                    if !writable(r, stream_seq) {
                        return false;
                    }
                    // A record another session had `working` is taken over: a new attempt
                    // (issue #29 item 9). The coordinator publishes dispatches again only of
                    // `submitted` records, so the number it put in the dispatch's message id
                    // is not reused.
                    if r.state == TaskState::Working && r.session_id.is_some() {
                        r.attempt += 1;
                    }
                    r.state = TaskState::Working;
                    r.worker = Some(worker_id.clone());
                    r.session_id = Some(session_id.clone());
                    r.dispatch_seq = stream_seq.or(r.dispatch_seq);
                    r.started_at = r.started_at.or(Some(SystemClock.now_ms()));
                    true
                };
                let working = match (carried, known.current()) {
                    // One try on the carried revision; a conflict means the record moved on.
                    (true, Some((mut record, revision))) => {
                        if !mark_working(&mut record) {
                            prepared.discard();
                            return Answer::Ack;
                        }
                        let json = match serde_json::to_vec(&record) {
                            Ok(json) => json,
                            Err(e) => {
                                tracing::warn!(task_id = %key, error = %e, "marking the task working failed");
                                prepared.discard();
                                return Answer::nak(delivery);
                            }
                        };
                        match sh.tasks.update(key, json.into(), revision).await {
                            Ok(revision) => Ok(Some((record, revision))),
                            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                                prepared.discard();
                                known.record = Record::Stale;
                                continue;
                            }
                            Err(e) => Err(task_records::Error::Unavailable {
                                what: format!("update {key}"),
                                source: e.into(),
                            }),
                        }
                    }
                    (_, current) => task_records::update(&sh.tasks, key, current, mark_working).await,
                };
                match working {
                    Ok(Some(c)) => {
                        let _ = claim.session.set(session_id.clone());
                        let takeover = match std::mem::replace(&mut known.takeover, Fetch::NotYet) {
                            Fetch::Done(takeover) => Some(takeover),
                            _ => None,
                        };
                        break (c, capsule, takeover, session_id, prepared);
                    }
                    Ok(None) => {
                        prepared.discard();
                        return Answer::Ack; // ended elsewhere meanwhile
                    }
                    Err(e) => {
                        tracing::warn!(task_id = %key, error = %e, "marking the task working failed");
                        prepared.discard();
                        return Answer::nak(delivery);
                    }
                }
            }
        }
    };
    let task = current.0.clone();
    let checkpointed = takeover.is_some();
    mur_nats::metrics::task_started(&task, delivery.number, checkpointed, SystemClock.now_ms());
    let checkpoints = Arc::new(KvCheckpoints {
        sessions: sh.sessions.clone(),
        js: sh.js.clone(),
        pending: std::sync::Mutex::new(Vec::new()),
        task_id: task.task_id.clone(),
        session_id: session_id.clone(),
        worker: worker_id.clone(),
        saved: AtomicBool::new(checkpointed),
        max_payload,
    });
    let (exit, result, error, usage, in_doubt) = match run_session(
        sh,
        &task,
        &capsule,
        &session_id,
        prepared,
        takeover,
        checkpoints.clone(),
        session_cancel.clone(),
        claim.superseded.clone(),
    )
    .await
    {
        Ok((exit, result, usage, in_doubt)) => (exit, result, None, usage, in_doubt),
        Err(e) => (ExitStatus::Failed, format!("error: {e}"), Some(e), None, 0),
    };
    // A step that lost its permit (its worker stalled past the lease) stopped, or ran on
    // without one: it writes no end; another delivery runs it again once it holds a
    // permit (issue #11 §The fan-out cap: the count never rises above the cap).
    if let Some(permit) = permit.as_ref()
        && !permit.still_held().await
    {
        tracing::warn!(task_id = %key, "the step's fan-out permit was lost: its end is not written; it runs again");
        return Answer::nak(delivery);
    }
    // Superseded: the task's end is the other session's to write (or written already).
    // This delivery writes nothing, purges no checkpoint (the other session's, if it
    // runs) and leaves the message alone (its delivery under way is the other session's).
    if claim.superseded.is_cancelled() {
        tracing::info!(task_id = %key, %session_id, "a superseded session stopped: no task_end, no terminal write");
        return Answer::Leave;
    }
    // The terminal record must be written (a nak would run the task again): keep trying
    // through a broker outage, with in-progress acks still going out, for up to a minute.
    let mut delays = mur_nats::backoff::delays(Duration::from_millis(100), Duration::from_secs(2));
    let give_up = tokio::time::Instant::now() + TERMINAL_WRITE_PATIENCE;
    let mut known = Some(current);
    // Set when the write finds the record `working` under another session: superseded
    // after the session's last look (it was taken over while this one ran to its end).
    let mut taken_over = false;
    let written = loop {
        let written = task_records::update(&sh.tasks, key, known.take(), |r| {
            if !ends_for(r, &session_id) {
                taken_over = !r.state.is_terminal();
                return false;
            }
            r.usage.clone_from(&usage);
            r.tool_calls_in_doubt = in_doubt;
            end_record(r, exit, &result, error.as_deref(), max_payload);
            true
        })
        .await;
        if written.is_ok() || tokio::time::Instant::now() >= give_up {
            break written;
        }
        tracing::warn!(task_id = %key, error = ?written.as_ref().err(), "writing the terminal record failed; retrying");
        tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(2))).await;
    };
    if taken_over && written.is_ok() {
        tracing::warn!(task_id = %key, %session_id, "the task was taken over by another session: its end is that session's to write");
        return Answer::Leave;
    }
    let answer = finished(written, key, delivery);
    if answer == Answer::Ack && checkpoints.saved.load(Ordering::Relaxed) {
        // Entries still in flight land before the purge, not after it.
        checkpoints.sync().await;
        drop_checkpoints(&sh.sessions, key).await;
    }
    answer
}

/// Waits for a fan-out permit for `task` (it is then renewed in the background).
async fn hold_permit(
    sh: &Shared,
    task: &TaskRecord,
    step: &mur_proto::fanout::FleetStep,
    cancel: &CancellationToken,
) -> Result<Arc<fanout::StepPermit>, PermitWait> {
    let holder = mur_proto::fanout::Holder {
        task_id: task.task_id.clone(),
        worker: sh.config.worker_id.clone(),
        step: step.clone(),
        since: SystemClock.now_ms(),
    };
    let deadline = task
        .deadline_at
        .map(|at| tokio::time::Instant::now() + Duration::from_millis(at.saturating_sub(SystemClock.now_ms())));
    // The deadline ends the wait through the wait's own stop, so the wait removes its
    // ticket on the way out: a ticket left behind would keep its place in line, and hold
    // back a freed permit, until its lease ran out.
    let wait = cancel.child_token();
    let out_of_time = Arc::new(AtomicBool::new(false));
    let timer = tokio::spawn({
        let (wait, out_of_time) = (wait.clone(), out_of_time.clone());
        async move {
            sleep_until(deadline).await;
            out_of_time.store(true, Ordering::SeqCst);
            wait.cancel();
        }
    });
    // A broker error waits in line again within this delivery, with the one backoff, until
    // the deadline or a cancel ends the wait (issue #29 item 3: a nak here used up one of
    // the dispatch's deliveries, and a broker refusing consumers dead-lettered steps); the
    // in-progress acks go on meanwhile.
    let mut delays = mur_nats::backoff::delays(Duration::from_millis(250), Duration::from_secs(4));
    let result = loop {
        match fanout::StepPermit::acquire(&sh.fanout, holder.clone(), &wait).await {
            Err(fanout::Error::Cancelled) => break Err(fanout::Error::Cancelled),
            Err(e) => {
                tracing::warn!(task_id = %task.task_id, error = %e, "waiting for a fan-out permit failed; waiting again");
                tokio::select! {
                    () = wait.cancelled() => break Err(fanout::Error::Cancelled),
                    () = tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(4))) => {}
                }
            }
            done => break done,
        }
    };
    timer.abort();
    match result {
        Ok(p) => Ok(p),
        Err(_) if !cancel.is_cancelled() && out_of_time.load(Ordering::SeqCst) => Err(PermitWait::Deadline),
        Err(_) => Err(PermitWait::Cancelled),
    }
}

/// The span one delivery runs in, so the task's spans (`invoke_agent` and below) join the
/// submitter's trace (issue #7 §Trace context): a child of the dispatch's `traceparent`
/// header, or of the record's when the header is missing (a dispatch republished by a
/// restarted coordinator carries none): the one in the record the dispatch carries, else
/// the stored record's. `carried` is the carried record's `traceparent` when the dispatch
/// carries the record: then it is the answer, `None` included (a task submitted without
/// trace context), and nothing is read; the stored record is read only for a dispatch
/// without its record and without the header (issue #9: that read was a broker round trip
/// on every dispatch of an untraced task).
async fn dispatch_span(
    sh: &Shared,
    msg: &jetstream::Message,
    task_id: Option<&TaskId>,
    carried: Option<Option<String>>,
    delivery: u64,
) -> tracing::Span {
    let headers = msg.headers.as_ref();
    let stored = match (task_id, carried) {
        (_, Some(carried)) => carried,
        (Some(id), None) if trace_context::extract(headers).is_none() => {
            read(&sh.tasks, id).await.ok().flatten().and_then(|(record, _)| record.traceparent)
        }
        _ => None,
    };
    trace_context::consumer(
        cluster::DISPATCH_SUBJECT,
        headers,
        stored.as_deref(),
        task_id.map(TaskId::as_str),
        delivery,
    )
}

/// The answer after the terminal write: ack when the record is terminal (ours or not).
fn finished(written: Result<Option<(TaskRecord, u64)>, task_records::Error>, key: &str, delivery: Delivered) -> Answer {
    match written {
        Ok(written) => {
            if let Some((record, _)) = written.filter(|(r, _)| r.state.is_terminal()) {
                mur_nats::metrics::task_ended(&record);
            }
            Answer::Ack
        }
        Err(e) => {
            tracing::warn!(task_id = %key, error = %e, "writing the terminal record failed");
            Answer::nak(delivery)
        }
    }
}

/// Ends `r` with `exit`, its `result` and `error`, clipped to fit a message of
/// `max_payload` bytes ([`TaskRecord::fit`]): a terminal record the server refuses would
/// leave the task `working` until its dispatch dead-letters.
fn end_record(r: &mut TaskRecord, exit: ExitStatus, result: &str, error: Option<&str>, max_payload: usize) {
    r.state = exit.task_state();
    r.exit_status = Some(exit);
    r.result = Some(result.to_string());
    r.error = error.map(str::to_string);
    r.ended_at = Some(SystemClock.now_ms());
    if r.fit(max_payload) {
        tracing::info!(task_id = %r.task_id, max_payload, "the result was clipped to fit the task record");
    }
}
