//! A cluster of real processes for the chaos tests (issue #8): a nats-server from
//! [`crate::nats`], and `mur coordinator` / `mur worker` children of the test that can be
//! stopped with SIGTERM or killed with SIGKILL at chosen points. Each child's stderr goes
//! to a file in the cluster's folder, printed when a wait fails.

use crate::nats::NatsServer;
use futures::StreamExt;
use mur_proto::cluster::{self, SubmitReply, SubmitRequest, TaskRecord, api};
use mur_proto::task::Origin;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A nats-server plus murmur processes started by the test.
pub struct Procs {
    /// The server.
    pub nats: NatsServer,
    /// A client of the test's own.
    pub client: async_nats::Client,
    dir: tempfile::TempDir,
    config: PathBuf,
    env: Vec<(String, String)>,
    /// The folder `mur auth init --tls` wrote, for a cluster started by
    /// [`Procs::start_secured`]: each process gets its role's credentials from it.
    roles: Option<tempfile::TempDir>,
}

/// A `mur` child process; killed (SIGKILL) when dropped.
pub struct Proc {
    /// Its name in the cluster (worker id, or `coordinator-N`).
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl Procs {
    /// Starts a server and writes the cluster config `config` (`config.yaml`, the
    /// coordinator's `--config`, e.g. `"jetstream:\n  ack_wait_secs: 2\n"`). Starts no
    /// murmur process.
    pub async fn start(config: &str) -> Procs {
        let nats = NatsServer::start();
        let client = nats.connect().await;
        Self::start_on(nats, client, config)
    }

    /// [`Procs::start`] on a server the test started (with a configuration of its own:
    /// TLS, authorization) and a client of the test's connected to it; the `mur` processes
    /// get their credentials and TLS options from [`Procs::set_env`] (`NATS_CA`,
    /// `NATS_CREDS`, …).
    pub fn start_on(nats: NatsServer, client: async_nats::Client, config: &str) -> Procs {
        let dir = tempfile::Builder::new().prefix("mur-procs-").tempdir().expect("temp dir");
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, config).expect("write config.yaml");
        Procs { nats, client, dir, config: path, env: Vec::new(), roles: None }
    }

    /// [`Procs::start`] with authentication and TLS on, as an operator sets them up: `mur
    /// auth init --tls` into the cluster's folder, nats-server with the configuration it
    /// wrote; the coordinators get `coordinator.creds` and `--identity identity.creds`, the
    /// workers `worker.creds`, `mur` commands `admin.creds` (unless [`Procs::set_env`] says
    /// otherwise), every process the CA; the test's own client is admin's.
    pub async fn start_secured(config: &str) -> Procs {
        let roles_dir = tempfile::Builder::new().prefix("mur-roles-").tempdir().expect("temp dir");
        let roles = roles_dir.path();
        let out = crate::mur::mur().args(["auth", "init"]).arg(roles).arg("--tls").output().expect("mur auth init");
        assert!(out.status.success(), "mur auth init: {}", String::from_utf8_lossy(&out.stderr));
        let conf = std::fs::read_to_string(roles.join("nats-server.conf")).expect("nats-server.conf");
        let nats = NatsServer::start_with_config(&conf);
        let admin = mur_nats::connect::Options {
            creds: Some(roles.join("admin.creds")),
            tls_ca: Some(roles.join("ca.pem")),
            ..mur_nats::connect::Options::default()
        };
        let client = nats.connect_with(&admin).await;
        let mut procs = Self::start_on(nats, client, config);
        procs.set_env("NATS_CA", &roles.join("ca.pem").display().to_string());
        procs.set_env("NATS_CREDS", &roles.join("admin.creds").display().to_string());
        procs.roles = Some(roles_dir);
        procs
    }

    /// Sets `key` = `value` in the environment of every `mur` process started after this
    /// (e.g. `OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.push((key.to_string(), value.to_string()));
    }

    /// A `mur` command against the cluster's server, with the cluster's environment.
    pub fn command(&self) -> Command {
        let mut cmd = crate::mur::mur();
        cmd.env("NATS_URL", self.nats.url()).envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// `mur ARGS` against the cluster, off the async runtime's threads.
    pub async fn mur(&self, args: &[&str]) -> crate::mur::Run {
        let mut cmd = self.command();
        cmd.args(args);
        crate::mur::run_blocking(cmd).await
    }

    /// `mur ARGS` against the cluster on this thread, expected to succeed; its stdout.
    /// For tests whose cluster runs in other processes only (nothing here to block).
    pub fn mur_sync(&self, args: &[&str]) -> String {
        let out = self.command().args(args).output().expect("spawn mur");
        assert!(out.status.success(), "mur {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `mur ARGS` against the cluster, expected to succeed.
    pub async fn mur_ok(&self, args: &[&str]) -> crate::mur::Run {
        let run = self.mur(args).await;
        assert_eq!(run.code, 0, "mur {args:?}: {run:?}");
        run
    }

    /// The cluster's folder (workers' workdirs, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn spawn(&self, name: &str, args: &[&str]) -> Proc {
        let mut cmd = self.command();
        cmd.env("MUR_LOG", "info");
        if let Some(roles) = &self.roles {
            let roles = roles.path();
            match args.first().copied() {
                Some("coordinator") => {
                    cmd.env("NATS_CREDS", roles.join("coordinator.creds"))
                        .env("MUR_IDENTITY", roles.join("identity.creds"));
                }
                Some("worker") => {
                    cmd.env("NATS_CREDS", roles.join("worker.creds"));
                }
                _ => {}
            }
        }
        self.spawn_command(name, cmd, args)
    }

    fn spawn_command(&self, name: &str, mut cmd: Command, args: &[&str]) -> Proc {
        let log = self.dir.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = cmd.args(args).stdout(Stdio::null()).stderr(file).spawn().expect("spawn mur");
        Proc { name: name.to_string(), child, log }
    }

    /// Starts `mur coordinator --config config.yaml --id NAME`.
    pub fn coordinator(&self, name: &str) -> Proc {
        let config = self.config.to_string_lossy().into_owned();
        self.spawn(name, &["coordinator", "--config", &config, "--id", name])
    }

    /// [`Procs::coordinator`] with more arguments (`--metrics 127.0.0.1:0`).
    pub fn coordinator_with(&self, name: &str, more: &[&str]) -> Proc {
        let config = self.config.to_string_lossy().into_owned();
        let mut args = vec!["coordinator", "--config", &config, "--id", name];
        args.extend_from_slice(more);
        self.spawn(name, &args)
    }

    /// Starts `mur coordinator --config config.yaml --id NAME` with the log filter a user
    /// gets (`MUR_LOG` unset), where [`Procs::coordinator`] logs everything at `info`.
    pub fn coordinator_with_default_logs(&self, name: &str) -> Proc {
        let config = self.config.to_string_lossy().into_owned();
        let mut cmd = self.command();
        cmd.env_remove("MUR_LOG");
        self.spawn_command(name, cmd, &["coordinator", "--config", &config, "--id", name])
    }

    /// Starts `mur coordinator` as [`Procs::coordinator`] does, with its A2A endpoint on a
    /// free port; returns it and the endpoint's base URL (`http://127.0.0.1:PORT`), read
    /// from its log.
    pub async fn coordinator_with_http(&self, name: &str) -> (Proc, String) {
        let config = self.config.to_string_lossy().into_owned();
        let proc = self.spawn(name, &["coordinator", "--config", &config, "--id", name, "--http", "127.0.0.1:0"]);
        let base = until("the coordinator's A2A endpoint", Duration::from_secs(30), || async {
            let log = proc.log();
            let rest = &log[log.find("a2a endpoints at ")? + "a2a endpoints at ".len()..];
            Some(rest[..rest.find("/capsules/")?].to_string())
        })
        .await;
        (proc, base)
    }

    /// Starts `mur worker --id ID --slots N` with its workdir in the cluster's folder.
    pub fn worker(&self, id: &str, slots: u32) -> Proc {
        self.worker_with(id, slots, &[])
    }

    /// [`Procs::worker`] with more arguments (`--keep-sessions 2`).
    pub fn worker_with(&self, id: &str, slots: u32, more: &[&str]) -> Proc {
        let workdir = self.dir.path().join(id).to_string_lossy().into_owned();
        let slots = slots.to_string();
        let mut args = vec!["worker", "--id", id, "--slots", &slots, "--workdir", &workdir];
        args.extend_from_slice(more);
        self.spawn(id, &args)
    }

    /// Pushes the capsule folder `dir` (waits for the buckets the coordinator creates).
    pub async fn push(&self, dir: &Path) {
        let js = async_nats::jetstream::new(self.client.clone());
        let (store, index) = until("the capsule store exists", Duration::from_secs(30), || async {
            let store = js.get_object_store(cluster::CAPSULES_STORE).await.ok()?;
            let index = js.get_key_value(cluster::CAPSULE_INDEX_BUCKET).await.ok()?;
            Some((store, index))
        })
        .await;
        let bundle = mur_worker::bundle::pack(dir).expect("pack");
        mur_worker::bundle::push(&store, &index, &bundle).await.expect("push");
    }

    /// Waits until `n` workers are registered in `mur_workers`.
    pub async fn wait_workers(&self, n: usize) {
        let js = async_nats::jetstream::new(self.client.clone());
        until(&format!("{n} workers registered"), Duration::from_secs(30), || async {
            let kv = js.get_key_value(cluster::WORKERS_BUCKET).await.ok()?;
            let count = kv.keys().await.ok()?.count().await;
            (count >= n).then_some(())
        })
        .await;
    }

    /// Submits a task over the NATS API, retrying while no coordinator answers; returns
    /// its id.
    pub async fn submit(&self, capsule: &str, text: &str, origin: Origin) -> String {
        let request = SubmitRequest::new(capsule, text, origin);
        let body = serde_json::to_vec(&request).unwrap();
        until("a coordinator takes the submission", Duration::from_secs(30), || async {
            mur_nats::api::call::<SubmitReply>(&self.client, api::TASK_SUBMIT, body.clone())
                .await
                .ok()
                .map(|r| r.task_id.into_string())
        })
        .await
    }

    /// The record of `task_id`, if any.
    pub async fn record(&self, task_id: &str) -> Option<TaskRecord> {
        let js = async_nats::jetstream::new(self.client.clone());
        let kv = js.get_key_value(cluster::TASKS_BUCKET).await.ok()?;
        let entry = kv.get(task_id).await.ok()??;
        serde_json::from_slice(&entry).ok()
    }

    /// Waits until `task_id`'s record satisfies `ok`, at most `timeout`.
    pub async fn wait_record(&self, task_id: &str, timeout: Duration, ok: impl Fn(&TaskRecord) -> bool) -> TaskRecord {
        until(&format!("the record of {task_id}"), timeout, || async { self.record(task_id).await.filter(|r| ok(r)) })
            .await
    }

    /// Every trace line of the cluster (stream `MUR_TRACE`) whose `task_id` is `task_id`,
    /// in stream order.
    pub async fn trace_of(&self, task_id: &str) -> Vec<Value> {
        let all = crate::nats::stream_json(&self.client, cluster::TRACE_STREAM, None).await;
        all.into_iter().filter(|line| line["task_id"] == task_id).collect()
    }
}

impl Proc {
    /// SIGKILL: no goodbye, no ack, nothing flushed.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for the exit (at most `timeout`); returns the exit code.
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        self.send(libc::SIGTERM);
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                panic!("{} did not exit within {timeout:?}:\n{}", self.name, self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGSTOP: the process stops answering (its leases and heartbeats lapse) without
    /// dying; [`Proc::resume`] wakes it.
    pub fn pause(&self) {
        self.send(libc::SIGSTOP);
    }

    /// SIGCONT: wakes a process [`Proc::pause`] stopped.
    pub fn resume(&self) {
        self.send(libc::SIGCONT);
    }

    /// Sends `signal` by pid; panics on an error other than the process being gone already.
    fn send(&self, signal: i32) {
        mur_worker::signal::signal_pid(self.child.id(), signal)
            .unwrap_or_else(|e| panic!("signal {signal} to {} (pid {}): {e}", self.name, self.child.id()));
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// What it wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The base URL (`http://ADDR`) of the `--metrics` listener of a process started with
    /// it, read from its log (`metrics at http://ADDR/metrics`), waiting for it at most
    /// 30 s.
    pub async fn metrics_url(&self) -> String {
        let what = format!("the --metrics listener of {}", self.name);
        until(&what, Duration::from_secs(30), || async {
            let log = self.log();
            let rest = &log[log.find("metrics at ")? + "metrics at ".len()..];
            Some(rest[..rest.find("/metrics")?].to_string())
        })
        .await
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `probe` until it gives a value, at most `timeout` (a condition with a deadline,
/// never a fixed sleep).
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The state letter of `pid` (`Z` for a zombie), `None` once it is gone.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
}

/// Whether `pid` has ended (gone, or a zombie not yet reaped).
pub fn proc_gone(pid: u32) -> bool {
    matches!(proc_state(pid), None | Some('Z'))
}

/// Stores `n` tasks of the capsule `old` that ended `completed` long ago, each with a
/// result of `result_bytes` bytes, straight into `tasks` (`mur_tasks`), 16 writes at a
/// time: a store whose replay, list and status take a while.
///
/// # Panics
/// When a write fails.
pub async fn store_ended_tasks(tasks: &async_nats::jetstream::kv::Store, n: usize, result_bytes: usize) {
    let result = "x".repeat(result_bytes);
    futures::stream::iter(0..n)
        .for_each_concurrent(16, |_| {
            let (tasks, result) = (tasks.clone(), &result);
            async move {
                let id = mur_proto::TaskId::generate();
                let request = SubmitRequest::new("old", "hi", Origin::User);
                let mut record = TaskRecord::submitted(id.clone(), request, "0f".repeat(32), 1_700_000_000_000);
                record.state = mur_proto::task::TaskState::Completed;
                record.exit_status = Some(mur_proto::task::ExitStatus::Ok);
                record.result = Some(result.clone());
                let value = serde_json::to_vec(&record).expect("a record serializes");
                tasks.put(id.as_str(), value.into()).await.expect("store an ended record");
            }
        })
        .await;
}
