//! Leadership: [`run`]'s loop between standing by (the API answered, the lease tried every
//! renewal interval) and leading (the restore, then the leader's loops) under the lease.

use super::*;

/// Runs the coordinator until `shutdown` resolves: sets up the resources, restores the
/// scheduler from the buckets, serves the `mur` micro service and dispatches tasks.
///
/// A leader whose restore fails (the replay's watch refused or timed out by the broker) does
/// not stop: it gives the lease back and stands by, trying again one renewal interval
/// (a third of the lease) later, twice that after a second failure in a row, and so on up
/// to 30 s ([`restore_retry_pause`]).
///
/// # Errors
/// [`Error::Resources`] when the streams and buckets cannot be set up, [`Error::Nats`] when
/// the service cannot start, [`Error::LoopEnded`] when a bucket watch of a leader ends on
/// its own (the connection is gone for good).
pub async fn run(client: async_nats::Client, config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    let instance = config.instance.clone();
    let js = jetstream::new(client.clone());
    let res = Arc::new(resources::ensure(&js, &config.settings).await?);

    // Every coordinator serves the API, a standby too: a submission only writes a record,
    // which the leader's watcher picks up, so intake goes on during a failover.
    let (no_actor, _) = mpsc::unbounded_channel();
    let (no_admissions, _) = mpsc::unbounded_channel();
    // One pass over every task record at a time in this process (the restore's, a list's, a
    // status'): several at once over a store of gigabytes outran this connection (the
    // server cut it off as a slow consumer, the lease's renewals timed out with it).
    let shared = ProcessShared {
        scans: Arc::new(tokio::sync::Semaphore::new(1)),
        intake: Arc::new(IntakeOrder::default()),
        bundles: Arc::new(BundleFlags::default()),
    };
    let intake = shared.intake.clone();
    let api_ctx = Arc::new(Ctx::new(&js, &res, &config, &shared, no_actor, no_admissions, None));
    let service = client
        .service_builder()
        .description("murmur coordinator: task intake, lane-ordered dispatch, queries")
        .start(cluster::SERVICE_NAME, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(nats("service mur: start"))?;
    let group = service.group(cluster::api::PREFIX);
    let mut endpoints = Vec::new();
    for kind in Endpoint::ALL.into_iter().chain(crate::fleet::api::Op::ALL.map(Endpoint::Fleet)) {
        let subject = kind.subject();
        let suffix = &subject[cluster::api::PREFIX.len() + 1..];
        let endpoint = group
            .endpoint_builder()
            .name(suffix.replace('.', "_"))
            .add(suffix)
            .await
            .map_err(nats(format!("service mur: endpoint {subject}")))?;
        endpoints.push(endpoint.map(move |request| (kind, request)).boxed());
    }
    let mut requests = futures::stream::select_all(endpoints);
    tracing::info!(instance = %instance, "coordinator serving {}", cluster::api::PREFIX);

    // Fleet runs this process carries out, across its terms as leader.
    let active_runs = crate::fleet::run::Active::default();
    let lease =
        Lease::new(res.leader.clone(), instance.clone(), Duration::from_secs(config.settings.leader_lease_secs));
    let mut shutdown = std::pin::pin!(shutdown);
    let mut standby_logged = false;
    // Restores failed in a row; after one, the next try waits (another coordinator may take
    // the lease meanwhile) rather than repeat the failure at once.
    let mut failed_restores = 0u32;
    let mut pause_first = None;
    let outcome = 'outer: loop {
        // Standby: try to take the lease now and every renewal interval.
        let held = loop {
            let pause = match pause_first.take() {
                Some(pause) => pause,
                None => {
                    match lease.try_acquire().await {
                        Ok(Some(held)) => break Arc::new(held),
                        Ok(None) => {
                            if !standby_logged {
                                let holder = Lease::holder(&res.leader).await.ok().flatten().map(|l| l.instance);
                                let holder = holder.as_deref().unwrap_or("another coordinator");
                                tracing::info!(target: ROLE_LOG_TARGET, "coordinator {instance} standing by: {holder} leads");
                                standby_logged = true;
                            }
                            if let Err(e) = lease.stand_by().await {
                                tracing::warn!(instance = %instance, "saying this coordinator stands by: {e}");
                            }
                        }
                        Err(e) => tracing::warn!(instance = %instance, "taking the lease: {e}"),
                    }
                    lease.renew_every()
                }
            };
            let wait = tokio::time::sleep(pause);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    () = &mut shutdown => break 'outer Ok(()),
                    () = &mut wait => break,
                    request = requests.next() => match request {
                        Some((kind, request)) => answer_as_standby(&api_ctx, &intake, kind, request),
                        None => break 'outer Err(Error::LoopEnded("the service")),
                    },
                }
            }
        };
        standby_logged = false;
        lease.stop_standing_by().await;
        tracing::info!(target: ROLE_LOG_TARGET, "coordinator {instance} leading (term {})", held.term);
        mur_nats::metrics::leader_change("leading");
        let kept = lease.keep(&held);
        tokio::pin!(kept);
        // The restore (a replay of every record, seconds over a store of gigabytes) runs
        // while the lease is renewed and the API is answered as a standby answers it: the
        // lease does not lapse under it, and callers do not wait for it. It is a task of its
        // own, so that its CPU (parsing every record) holds up neither this loop's requests
        // nor the renewals; dropped (stepping down, a shutdown), it is aborted.
        let mut restoring = tokio_util::task::AbortOnDropHandle::new(tokio::spawn({
            let (client, config, res, held) = (client.clone(), config.clone(), res.clone(), held.clone());
            let (active_runs, shared) = (active_runs.clone(), shared.clone());
            async move { lead(&client, &config, &res, held, &active_runs, &shared).await }
        }));
        let mut leading = loop {
            tokio::select! {
                () = &mut shutdown => {
                    lease.release(&held).await;
                    break 'outer Ok(());
                }
                lost = &mut kept => {
                    // The restore stops where it is (what it released, it released while the
                    // lease was valid: fencing); the next leader's replay takes over.
                    tracing::warn!(instance = %instance, "stepping down while restoring: {lost}");
                    continue 'outer;
                }
                restored = &mut restoring => match restored.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())) {
                    Ok(l) => {
                        failed_restores = 0;
                        break l;
                    }
                    Err(e) => {
                        // The restore only reads (a watch refused or timed out: a broker
                        // restarting, a store too cold to answer in time); nothing was
                        // released yet. Give the lease back and try again later rather than
                        // end the process.
                        failed_restores += 1;
                        let pause = restore_retry_pause(lease.renew_every(), failed_restores);
                        tracing::warn!(
                            instance = %instance,
                            failed_restores,
                            retry_in = ?pause,
                            "restoring failed, standing by to try again: {e}"
                        );
                        lease.release(&held).await;
                        pause_first = Some(pause);
                        continue 'outer;
                    }
                },
                request = requests.next() => match request {
                    Some((kind, request)) => answer_as_standby(&api_ctx, &intake, kind, request),
                    None => {
                        lease.release(&held).await;
                        break 'outer Err(Error::LoopEnded("the service"));
                    }
                },
            }
        };
        let stepped_down = loop {
            tokio::select! {
                () = &mut shutdown => {
                    leading.stop().await;
                    lease.release(&held).await;
                    break 'outer Ok(());
                }
                lost = &mut kept => break lost,
                ended = leading.loops.join_next() => {
                    let what = match ended {
                        Some(Ok(what)) => what,
                        Some(Err(_)) | None => "a coordinator loop",
                    };
                    leading.stop().await;
                    lease.release(&held).await;
                    break 'outer Err(Error::LoopEnded(what));
                }
                request = requests.next() => match request {
                    Some((kind, request)) => {
                        // The leader's own context: a submission goes straight to its
                        // scheduler.
                        let ctx = leading.ctx.clone();
                        tokio::spawn(async move { ctx.handle(kind, request).await });
                    }
                    None => {
                        leading.stop().await;
                        lease.release(&held).await;
                        break 'outer Err(Error::LoopEnded("the service"));
                    }
                },
            }
        };
        tracing::warn!(instance = %instance, "stepping down: {stepped_down}");
        mur_nats::metrics::leader_change("standby");
        leading.stop().await;
    };
    tracing::info!(instance = %instance, "coordinator stopping");
    drop(requests);
    lease.stop_standing_by().await;
    if let Err(e) = service.stop().await {
        tracing::warn!(instance = %instance, "stopping the service: {e}");
    }
    outcome
}

/// How long a coordinator whose restore failed `failures` times in a row waits before it
/// tries to lead again: the lease's renewal interval, doubled per failure after the first,
/// at most [`RESTORE_RETRY_MAX`]. Each failed try leaves the watch it opened to the broker,
/// which keeps the consumer until its 30 s inactivity threshold: a pause growing to that
/// keeps such leftovers to a few, and the log to a line every 30 s.
fn restore_retry_pause(renew_every: Duration, failures: u32) -> Duration {
    renew_every.saturating_mul(1 << failures.saturating_sub(1).min(8)).min(RESTORE_RETRY_MAX).max(renew_every)
}

/// The longest pause between a coordinator's tries to restore ([`restore_retry_pause`]).
const RESTORE_RETRY_MAX: Duration = Duration::from_secs(30);

/// The loops of a leading coordinator.
pub(super) struct Leading {
    pub(super) ctx: Arc<Ctx>,
    pub(super) loops: JoinSet<&'static str>,
    pub(super) stop: watch::Sender<bool>,
}

impl Leading {
    pub(super) async fn stop(&mut self) {
        let _ = self.stop.send(true);
        while self.loops.join_next().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_failed_restore_is_retried_after_the_renewal_interval_doubling_up_to_30_s() {
        let renew = Duration::from_millis(3333);
        let pauses: Vec<u128> = (1..=7).map(|n| restore_retry_pause(renew, n).as_millis()).collect();
        assert_eq!(pauses, [3333, 6666, 13332, 26664, 30000, 30000, 30000]);
        assert_eq!(restore_retry_pause(renew, u32::MAX), Duration::from_secs(30));
        // A lease so long that its renewal interval is over 30 s: never sooner than it.
        assert_eq!(restore_retry_pause(Duration::from_secs(40), 3), Duration::from_secs(40));
    }
}
