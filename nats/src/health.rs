//! Readiness of a long-running murmur process (issue #32 §Health): what `/readyz` on the
//! `--metrics` listener of `mur coordinator`, `mur worker` and `mur dev` answers.
//!
//! A process is ready when its NATS connection is up and every stream behind the
//! cluster's streams, key-value buckets and object store exists ([`cluster_streams`], one
//! `$JS.API.STREAM.NAMES` request). A coordinator also says whether it leads or stands by,
//! read from the leader lease (`mur_leader`); a standby is ready too, since every
//! coordinator serves the API (a submission only writes a record) and a standby takes the
//! lease within one lease when the leader goes.

use async_nats::connection::State;
use futures::TryStreamExt as _;
use mur_proto::cluster::{self, LeaderLease};
use mur_proto::{fanout, fleet_store};
use serde::Serialize;
use std::time::Duration;

/// How long one readiness check may take: a server that does not answer within it is
/// reported as unreachable rather than left to the client's request timeout.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// The JetStream streams every murmur process needs: the dispatch, trace and fleet
/// streams, and the streams behind the buckets (`KV_<bucket>`) and the capsule store
/// (`OBJ_<store>`), as the coordinator creates them at start.
pub fn cluster_streams() -> Vec<String> {
    let kv = [
        cluster::TASKS_BUCKET,
        cluster::WORKERS_BUCKET,
        cluster::SESSIONS_BUCKET,
        cluster::CAPSULE_INDEX_BUCKET,
        cluster::LEADER_BUCKET,
        fanout::FANOUT_BUCKET,
        fleet_store::FLEETS_BUCKET,
        fleet_store::JOBS_BUCKET,
    ];
    let mut names = vec![
        cluster::DISPATCH_STREAM.to_string(),
        cluster::TRACE_STREAM.to_string(),
        fleet_store::FLEET_STREAM.to_string(),
        format!("OBJ_{}", cluster::CAPSULES_STORE),
    ];
    names.extend(kv.iter().map(|b| format!("KV_{b}")));
    names
}

/// What a coordinator is doing, as the leader lease says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// It holds the lease: it runs the scheduler (or is restoring it).
    Leading,
    /// Another coordinator holds the lease, or none does yet: it answers the API and tries
    /// to take the lease every renewal interval.
    StandingBy,
}

/// One readiness check's answer: the body of `/readyz` (JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Readiness {
    /// Whether the process is ready: connected, nothing missing.
    pub ready: bool,
    /// The NATS connection: `connected`, `disconnected` or `pending` (connecting).
    pub nats: &'static str,
    /// The streams of [`cluster_streams`] the server does not have (empty when it could not
    /// be asked: see `error`).
    pub missing: Vec<String>,
    /// Why the server could not be asked, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// For a coordinator: whether it leads or stands by. Either way it is ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// For a coordinator: the coordinator holding the lease, when one does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
    /// For a coordinator: the lease's term, when one holds it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub term: Option<u64>,
}

/// What a process checks for its readiness.
#[derive(Clone, Debug)]
pub struct Probe {
    client: async_nats::Client,
    /// The coordinator instance whose role is reported (`None` for a worker).
    coordinator: Option<String>,
}

impl Probe {
    /// A probe of a worker: the connection and the streams.
    pub fn worker(client: async_nats::Client) -> Probe {
        Probe { client, coordinator: None }
    }

    /// A probe of the coordinator named `instance` (its `--id`): the connection, the
    /// streams, and its role from the leader lease.
    pub fn coordinator(client: async_nats::Client, instance: impl Into<String>) -> Probe {
        Probe { client, coordinator: Some(instance.into()) }
    }

    /// Checks now, within [`CHECK_TIMEOUT`]. Never fails: what went wrong is in the
    /// answer (`ready: false`, `error`).
    pub async fn check(&self) -> Readiness {
        let nats = match self.client.connection_state() {
            State::Connected => "connected",
            State::Disconnected => "disconnected",
            State::Pending => "pending",
        };
        let mut readiness =
            Readiness { ready: false, nats, missing: Vec::new(), error: None, role: None, leader: None, term: None };
        if nats != "connected" {
            return readiness;
        }
        match tokio::time::timeout(CHECK_TIMEOUT, self.ask()).await {
            Ok(Ok((missing, lease))) => {
                readiness.ready = missing.is_empty();
                readiness.missing = missing;
                if let Some(instance) = &self.coordinator {
                    let leads = lease.as_ref().is_some_and(|l| &l.instance == instance);
                    readiness.role = Some(if leads { Role::Leading } else { Role::StandingBy });
                    readiness.term = lease.as_ref().map(|l| l.term);
                    readiness.leader = lease.map(|l| l.instance);
                }
            }
            Ok(Err(e)) => readiness.error = Some(e),
            Err(_) => readiness.error = Some(format!("the server did not answer within {CHECK_TIMEOUT:?}")),
        }
        readiness
    }

    /// The streams missing, and for a coordinator the lease.
    async fn ask(&self) -> Result<(Vec<String>, Option<LeaderLease>), String> {
        let js = async_nats::jetstream::new(self.client.clone());
        let present: Vec<String> =
            js.stream_names().try_collect().await.map_err(|e| format!("listing the streams: {e}"))?;
        let missing: Vec<String> = cluster_streams().into_iter().filter(|s| !present.contains(s)).collect();
        let lease = match &self.coordinator {
            Some(_) if !missing.contains(&format!("KV_{}", cluster::LEADER_BUCKET)) => {
                let kv = js.get_key_value(cluster::LEADER_BUCKET).await.map_err(|e| format!("mur_leader: {e}"))?;
                let value = kv.get(cluster::LEADER_KEY).await.map_err(|e| format!("mur_leader: {e}"))?;
                value.and_then(|v| serde_json::from_slice::<LeaderLease>(&v).ok())
            }
            _ => None,
        };
        Ok((missing, lease))
    }
}
