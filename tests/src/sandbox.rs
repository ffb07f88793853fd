//! A cluster in one test process: a real nats-server (from [`crate::nats`]), a coordinator
//! and workers running as tokio tasks (the conventions, §7 item 11), capsules pushed as
//! bundles, and helpers that wait on task records with a deadline.

use crate::nats::NatsServer;
use futures::StreamExt;
use mur_proto::cluster::{SubmitReply, SubmitRequest, TASKS_BUCKET, TaskRecord, api};
use mur_proto::task::Origin;
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A running cluster.
pub struct Sandbox {
    /// The server (dropped last).
    pub nats: NatsServer,
    /// A client connected to it.
    pub client: async_nats::Client,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    dir: tempfile::TempDir,
    /// For [`Sandbox::start_secured`]: the folder `mur auth init --tls` wrote.
    roles: Option<tempfile::TempDir>,
}

impl Sandbox {
    /// `mur fleet ARGS` against this cluster (`USER` is `tester`).
    pub fn fleet(&self, args: &[&str]) -> crate::mur::Run {
        crate::mur::Run::of(&mut self.fleet_command(args))
    }

    /// `mur fleet ARGS`, expected to succeed.
    pub fn fleet_ok(&self, args: &[&str]) -> crate::mur::Run {
        let run = self.fleet(args);
        assert_eq!(run.code, 0, "mur fleet {args:?}: {run:?}");
        run
    }

    /// `mur fleet ARGS` off the async runtime's threads: for commands that wait on the
    /// cluster in this process (`mur fleet run`).
    pub async fn fleet_blocking(&self, args: &[&str]) -> crate::mur::Run {
        crate::mur::run_blocking(self.fleet_command(args)).await
    }

    fn fleet_command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = crate::mur::mur();
        cmd.arg("fleet").args(args).env("NATS_URL", self.nats.url()).env("USER", "tester");
        cmd
    }

    /// Starts a server, a coordinator and `workers` workers with `slots` slots each.
    pub async fn start(workers: usize, slots: u32) -> Sandbox {
        let nats = NatsServer::start();
        let client = nats.connect().await;
        let js = async_nats::jetstream::new(client.clone());
        mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await.expect("resources");
        let mut sandbox = Sandbox {
            nats,
            client,
            stop: CancellationToken::new(),
            tasks: Vec::new(),
            dir: tempfile::tempdir().unwrap(),
            roles: None,
        };
        sandbox.add_coordinator().await;
        for i in 0..workers {
            sandbox.add_worker(&format!("wkr-test-{i}"), slots).await;
        }
        sandbox.wait_ready(workers).await;
        sandbox
    }

    /// [`Sandbox::start`] with authentication and TLS on (issue #31): nats-server with the
    /// configuration `mur auth init --tls` wrote, the coordinator on `coordinator.creds` with
    /// its identity connection, each worker on `worker.creds`, [`Sandbox::client`] on
    /// `client.creds`, [`Sandbox::push`] on `admin.creds`; every connection over TLS. Needs
    /// the `mur` binary ([`crate::mur::mur`]).
    pub async fn start_secured(workers: usize, slots: u32) -> Sandbox {
        let roles = tempfile::Builder::new().prefix("mur-roles-").tempdir().expect("temp dir");
        let out = crate::mur::mur().args(["auth", "init"]).arg(roles.path()).arg("--tls").output().expect("mur");
        assert!(out.status.success(), "mur auth init: {}", String::from_utf8_lossy(&out.stderr));
        let conf = std::fs::read_to_string(roles.path().join("nats-server.conf")).expect("nats-server.conf");
        let nats = NatsServer::start_with_config(&conf);
        let admin = nats.connect_with(&role_options(roles.path(), "admin")).await;
        let js = async_nats::jetstream::new(admin);
        mur_coordinator::ensure(&js, &mur_coordinator::Settings::default()).await.expect("resources");
        let client = nats.connect_with(&role_options(roles.path(), "client")).await;
        let mut sandbox = Sandbox {
            nats,
            client,
            stop: CancellationToken::new(),
            tasks: Vec::new(),
            dir: tempfile::tempdir().unwrap(),
            roles: Some(roles),
        };
        sandbox.add_coordinator().await;
        for i in 0..workers {
            sandbox.add_worker(&format!("wkr-test-{i}"), slots).await;
        }
        sandbox.wait_ready(workers).await;
        sandbox
    }

    /// A new connection as `role` (`coordinator`, `worker`, `admin`, …): that role's
    /// credentials over TLS in a secured sandbox, a plain one otherwise.
    pub async fn connect_as(&self, role: &str) -> async_nats::Client {
        match &self.roles {
            Some(roles) => self.nats.connect_with(&role_options(roles.path(), role)).await,
            None => self.nats.connect().await,
        }
    }

    /// Waits until the coordinator answers and `workers` workers are registered.
    pub async fn wait_ready(&self, workers: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let answered =
                mur_nats::api::call::<mur_proto::page::Page<TaskRecord>>(&self.client, api::TASK_LIST, Vec::new())
                    .await
                    .is_ok();
            let js = async_nats::jetstream::new(self.client.clone());
            let registered = match js.get_key_value(mur_proto::cluster::WORKERS_BUCKET).await {
                Ok(kv) => match kv.keys().await {
                    Ok(keys) => keys.count().await,
                    Err(_) => 0,
                },
                Err(_) => 0,
            };
            if answered && registered >= workers {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "cluster not ready: coordinator {answered}, workers {registered}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts another coordinator on the same server.
    pub async fn add_coordinator(&mut self) {
        let client = self.connect_as("coordinator").await;
        let identity = match &self.roles {
            Some(roles) => {
                let file = roles.path().join("identity.creds");
                let names = mur_nats::identity::Identities::from_file(&file).expect("identity.creds");
                let options = mur_nats::connect::Options {
                    creds: Some(file),
                    tls_ca: Some(roles.path().join("ca.pem")),
                    ..mur_nats::connect::Options::default()
                };
                let client = self.nats.connect_with(&options).await;
                Some(mur_coordinator::service::Identity { client, names })
            }
            None => None,
        };
        let stop = self.stop.clone();
        self.tasks.push(tokio::spawn(async move {
            let config = mur_coordinator::service::Config::default();
            let stopped = async move { stop.cancelled().await };
            if let Err(e) = mur_coordinator::service::run_with_identity(client, identity, config, stopped).await {
                panic!("coordinator: {e}");
            }
        }));
    }

    /// Starts a worker.
    pub async fn add_worker(&mut self, id: &str, slots: u32) {
        self.add_worker_with(id, slots, |_| {}).await;
    }

    /// Starts a worker whose config `configure` changes first (`require_sandbox`, say).
    pub async fn add_worker_with(
        &mut self,
        id: &str,
        slots: u32,
        configure: impl FnOnce(&mut mur_worker::service::Config),
    ) {
        let client = self.connect_as("worker").await;
        let stop = self.stop.clone();
        let mut config = mur_worker::service::Config::new(self.dir.path().join(id));
        config.worker_id = id.to_string();
        config.slots = slots;
        configure(&mut config);
        self.tasks.push(tokio::spawn(async move {
            if let Err(e) = mur_worker::service::run(client, config, async move { stop.cancelled().await }).await {
                panic!("worker: {e}");
            }
        }));
    }

    /// Pushes the capsule folder `dir`.
    pub async fn push(&self, dir: &Path) {
        // A secured sandbox's client may not push: admin does.
        let client = if self.roles.is_some() { self.connect_as("admin").await } else { self.client.clone() };
        let js = async_nats::jetstream::new(client);
        let store = js.get_object_store(mur_proto::cluster::CAPSULES_STORE).await.unwrap();
        let index = js.get_key_value(mur_proto::cluster::CAPSULE_INDEX_BUCKET).await.unwrap();
        let bundle = mur_worker::bundle::pack(dir).expect("pack");
        mur_worker::bundle::push(&store, &index, &bundle).await.expect("push");
    }

    /// Submits a task over the NATS API; returns its id.
    pub async fn submit(&self, capsule: &str, text: &str, origin: Origin) -> String {
        let request = SubmitRequest::new(capsule, text, origin);
        let reply: SubmitReply =
            mur_nats::api::call(&self.client, api::TASK_SUBMIT, serde_json::to_vec(&request).unwrap())
                .await
                .expect("submit");
        reply.task_id.into_string()
    }

    /// Every task record, newest first: one `task.list` page (its items).
    pub async fn tasks(&self) -> Vec<TaskRecord> {
        mur_nats::api::call::<mur_proto::page::Page<TaskRecord>>(&self.client, api::TASK_LIST, Vec::new())
            .await
            .expect("task.list")
            .items
    }

    /// The record of `task_id`.
    pub async fn record(&self, task_id: &str) -> TaskRecord {
        let js = async_nats::jetstream::new(self.client.clone());
        let kv = js.get_key_value(TASKS_BUCKET).await.unwrap();
        let entry = kv.get(task_id).await.unwrap().expect("record exists");
        serde_json::from_slice(&entry).unwrap()
    }

    /// Waits until every task in `ids` is terminal, at most `timeout`; returns the records
    /// in the order of `ids`.
    pub async fn wait_all(&self, ids: &[String], timeout: Duration) -> Vec<TaskRecord> {
        let js = async_nats::jetstream::new(self.client.clone());
        let kv = js.get_key_value(TASKS_BUCKET).await.unwrap();
        let mut watch = kv.watch_all().await.unwrap();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut all = Vec::new();
            for id in ids {
                let r = self.record(id).await;
                if !r.state.is_terminal() {
                    break;
                }
                all.push(r);
            }
            if all.len() == ids.len() {
                return all;
            }
            // Wait for any change of the bucket, with the deadline.
            match tokio::time::timeout_at(deadline, watch.next()).await {
                Ok(_) => {}
                Err(_) => panic!("tasks not terminal within {timeout:?}: {} of {} done", all.len(), ids.len()),
            }
        }
    }

    /// Stops the coordinator and the workers.
    pub async fn shutdown(self) {
        self.stop.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(40), t).await;
        }
    }
}

/// The connection options of `role` in the folder `mur auth init --tls` wrote: its
/// credentials file and the CA.
fn role_options(roles: &Path, role: &str) -> mur_nats::connect::Options {
    mur_nats::connect::Options {
        creds: Some(roles.join(format!("{role}.creds"))),
        tls_ca: Some(roles.join("ca.pem")),
        ..mur_nats::connect::Options::default()
    }
}
