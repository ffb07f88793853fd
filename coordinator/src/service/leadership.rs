//! Leadership: [`run`]'s loop over the coordinator's role, `Role::Standby` (the API
//! answered, the lease tried every renewal interval) or `Role::Leader` (a term under the
//! lease: the restore, then the leader's loops); each role's function says the next one.

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
    run_with_identity(client, None, config, shutdown).await
}

/// [`run`], serving the endpoints that record who called
/// ([`mur_nats::identity::IDENTITY_SUBJECTS`]) on `identity`'s connection rather than
/// `client`'s when it is given: each such request then carries nats-server's statement of
/// its sender, and the name recorded is that sender's (issue #31). Without it they are
/// served on `client` and record the name the request gives.
///
/// # Errors
/// As [`run`].
pub async fn run_with_identity(
    client: async_nats::Client,
    identity: Option<Identity>,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
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
        identities: identity.as_ref().map(|i| Arc::new(i.names.clone())),
        scans: Arc::new(tokio::sync::Semaphore::new(1)),
        intake: Arc::new(IntakeOrder::default()),
        bundles: Arc::new(BundleFlags::default()),
    };
    let api_ctx = Arc::new(Ctx::new(&js, &res, &config, &shared, no_actor, no_admissions, None));
    let service = client
        .service_builder()
        .description("murmur coordinator: task intake, lane-ordered dispatch, queries")
        .start(cluster::SERVICE_NAME, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(nats("service mur: start"))?;
    let group = service.group(cluster::api::PREFIX);
    // The identity connection's service: the endpoints that record who called.
    let identity_service = match &identity {
        Some(identity) => Some(
            identity
                .client
                .service_builder()
                .description("murmur coordinator: the API calls that record who called")
                .start(cluster::SERVICE_NAME, env!("CARGO_PKG_VERSION"))
                .await
                .map_err(nats("service mur (identity connection): start"))?,
        ),
        None => None,
    };
    let identity_group = identity_service.as_ref().map(|s| s.group(cluster::api::PREFIX));
    let mut endpoints = Vec::new();
    for kind in Endpoint::ALL.into_iter().chain(crate::fleet::api::Op::ALL.map(Endpoint::Fleet)) {
        let subject = kind.subject();
        let suffix = &subject[cluster::api::PREFIX.len() + 1..];
        let on = match &identity_group {
            Some(identity_group) if mur_nats::identity::IDENTITY_SUBJECTS.contains(&subject) => identity_group,
            _ => &group,
        };
        let endpoint = on
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
    let process = Process {
        client: &client,
        config: &config,
        res: &res,
        lease: &lease,
        api_ctx: &api_ctx,
        active_runs: &active_runs,
        shared: &shared,
    };
    let mut memory = Memory::default();
    let mut role = Role::Standby { pause: None };
    let outcome = loop {
        let next = match role {
            Role::Standby { pause } => process.stand_by(pause, &mut memory, &mut shutdown, &mut requests).await,
            Role::Leader { held } => process.lead_term(held, &mut memory, &mut shutdown, &mut requests).await,
        };
        match next {
            Next::Become(next) => role = next,
            Next::Stop(outcome) => break outcome,
        }
    };
    tracing::info!(instance = %instance, "coordinator stopping");
    drop(requests);
    lease.stop_standing_by().await;
    if let Err(e) = service.stop().await {
        tracing::warn!(instance = %instance, "stopping the service: {e}");
    }
    if let Some(service) = identity_service
        && let Err(e) = service.stop().await
    {
        tracing::warn!(instance = %instance, "stopping the identity connection's service: {e}");
    }
    outcome
}

/// What this coordinator is, from one turn of [`run`]'s loop to the next.
enum Role {
    /// Without the lease: the API is answered as a standby answers it, and the lease is
    /// tried after `pause` (at once when `None`), then every renewal interval.
    Standby {
        /// The wait before the first try (after a failed restore, [`restore_retry_pause`]).
        pause: Option<Duration>,
    },
    /// Holding the lease for a term: restoring, then leading until the lease is lost.
    Leader {
        /// The lease held.
        held: Arc<Held>,
    },
}

/// How a role ended: another role, or the coordinator's stop with its outcome.
enum Next {
    /// Go on in this role.
    Become(Role),
    /// Stop the coordinator with this outcome.
    Stop(Result<(), Error>),
}

/// What [`run`] remembers across roles.
#[derive(Default)]
struct Memory {
    /// Whether this standby term has said so (once per term).
    standby_logged: bool,
    /// Restores failed in a row; after one, the next try waits (another coordinator may
    /// take the lease meanwhile) rather than repeat the failure at once.
    failed_restores: u32,
}

/// The requests of every endpoint of the `mur` micro service, with their endpoint.
type Requests = futures::stream::SelectAll<futures::stream::BoxStream<'static, (Endpoint, Request)>>;

/// What every role of this process uses.
struct Process<'a> {
    client: &'a async_nats::Client,
    config: &'a Config,
    res: &'a Arc<Resources>,
    lease: &'a Lease,
    /// The API's context, answering as a standby answers.
    api_ctx: &'a Arc<Ctx>,
    /// Fleet runs this process carries out, across its terms as leader.
    active_runs: &'a crate::fleet::run::Active,
    shared: &'a ProcessShared,
}

impl Process<'_> {
    /// Stands by: answers the API and tries to take the lease now (after `pause`, when
    /// given) and every renewal interval, until it holds it (then [`Role::Leader`]).
    async fn stand_by<F: Future<Output = ()>>(
        &self,
        mut pause: Option<Duration>,
        memory: &mut Memory,
        shutdown: &mut std::pin::Pin<&mut F>,
        requests: &mut Requests,
    ) -> Next {
        let instance = &self.config.instance;
        loop {
            let pause = match pause.take() {
                Some(pause) => pause,
                None => {
                    match self.lease.try_acquire().await {
                        Ok(Some(held)) => return Next::Become(Role::Leader { held: Arc::new(held) }),
                        Ok(None) => {
                            if !memory.standby_logged {
                                let holder = Lease::holder(&self.res.leader).await.ok().flatten().map(|l| l.instance);
                                let holder = holder.as_deref().unwrap_or("another coordinator");
                                tracing::info!(target: ROLE_LOG_TARGET, "coordinator {instance} standing by: {holder} leads");
                                memory.standby_logged = true;
                            }
                            if let Err(e) = self.lease.stand_by().await {
                                tracing::warn!(instance = %instance, "saying this coordinator stands by: {e}");
                            }
                        }
                        Err(e) => tracing::warn!(instance = %instance, "taking the lease: {e}"),
                    }
                    self.lease.renew_every()
                }
            };
            let wait = tokio::time::sleep(pause);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    () = shutdown.as_mut() => return Next::Stop(Ok(())),
                    () = &mut wait => break,
                    request = requests.next() => match request {
                        Some((kind, request)) => answer_as_standby(self.api_ctx, &self.shared.intake, kind, request),
                        None => return Next::Stop(Err(Error::LoopEnded("the service"))),
                    },
                }
            }
        }
    }

    /// One term under `held`: the restore, then the leader's loops, until the lease is
    /// lost (then [`Role::Standby`]), the restore fails (standby, trying again after
    /// [`restore_retry_pause`]), or the coordinator stops.
    async fn lead_term<F: Future<Output = ()>>(
        &self,
        held: Arc<Held>,
        memory: &mut Memory,
        shutdown: &mut std::pin::Pin<&mut F>,
        requests: &mut Requests,
    ) -> Next {
        let (instance, lease) = (&self.config.instance, self.lease);
        memory.standby_logged = false;
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
            let (client, config, res, held) =
                (self.client.clone(), self.config.clone(), self.res.clone(), held.clone());
            let (active_runs, shared) = (self.active_runs.clone(), self.shared.clone());
            async move { lead(&client, &config, &res, held, &active_runs, &shared).await }
        }));
        let mut leading = loop {
            tokio::select! {
                () = shutdown.as_mut() => {
                    lease.release(&held).await;
                    return Next::Stop(Ok(()));
                }
                lost = &mut kept => {
                    // The restore stops where it is (what it released, it released while the
                    // lease was valid: fencing); the next leader's replay takes over.
                    tracing::warn!(instance = %instance, "stepping down while restoring: {lost}");
                    return Next::Become(Role::Standby { pause: None });
                }
                restored = &mut restoring => match restored.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())) {
                    Ok(l) => {
                        memory.failed_restores = 0;
                        break l;
                    }
                    Err(e) => {
                        // The restore only reads (a watch refused or timed out: a broker
                        // restarting, a store too cold to answer in time); nothing was
                        // released yet. Give the lease back and try again later rather than
                        // end the process.
                        memory.failed_restores += 1;
                        let failed_restores = memory.failed_restores;
                        let pause = restore_retry_pause(lease.renew_every(), failed_restores);
                        tracing::warn!(
                            instance = %instance,
                            failed_restores,
                            retry_in = ?pause,
                            "restoring failed, standing by to try again: {e}"
                        );
                        lease.release(&held).await;
                        return Next::Become(Role::Standby { pause: Some(pause) });
                    }
                },
                request = requests.next() => match request {
                    Some((kind, request)) => answer_as_standby(self.api_ctx, &self.shared.intake, kind, request),
                    None => {
                        lease.release(&held).await;
                        return Next::Stop(Err(Error::LoopEnded("the service")));
                    }
                },
            }
        };
        let stepped_down = loop {
            tokio::select! {
                () = shutdown.as_mut() => {
                    leading.stop().await;
                    lease.release(&held).await;
                    return Next::Stop(Ok(()));
                }
                lost = &mut kept => break lost,
                ended = leading.loops.join_next() => {
                    let what = match ended {
                        Some(Ok(what)) => what,
                        Some(Err(_)) | None => "a coordinator loop",
                    };
                    leading.stop().await;
                    lease.release(&held).await;
                    return Next::Stop(Err(Error::LoopEnded(what)));
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
                        return Next::Stop(Err(Error::LoopEnded("the service")));
                    }
                },
            }
        };
        tracing::warn!(instance = %instance, "stepping down: {stepped_down}");
        mur_nats::metrics::leader_change("standby");
        leading.stop().await;
        Next::Become(Role::Standby { pause: None })
    }
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
