//! The NATS connection options every cluster command takes: `--server URL` (or
//! `NATS_URL`), `--creds FILE`, and TLS (`--tls-ca`, `--tls-cert`, `--tls-key`,
//! `--tls-required`), filling [`mur_nats::connect::Options`].

use anyhow::Result;
use mur_nats::connect;
use std::path::PathBuf;
use std::time::Duration;

/// Default NATS URL: the one `mur dev` serves.
pub const DEFAULT_URL: &str = "nats://127.0.0.1:4222";

/// How to reach the cluster's NATS servers.
#[derive(clap::Args, Debug, Clone)]
pub struct Connection {
    /// NATS server URL(s), comma-separated.
    #[arg(long = "server", env = "NATS_URL", value_name = "URL", default_value = DEFAULT_URL, global = true)]
    pub server: String,
    /// A NATS credentials file (JWT + nkey seed).
    #[arg(long, env = "NATS_CREDS", value_name = "FILE", global = true)]
    pub creds: Option<PathBuf>,
    /// CA certificate(s) to verify the server with (PEM).
    #[arg(long, value_name = "FILE", global = true)]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), with --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key", global = true)]
    pub tls_cert: Option<PathBuf>,
    /// Client key (PEM), with --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert", global = true)]
    pub tls_key: Option<PathBuf>,
    /// Refuse to connect without TLS.
    #[arg(long, global = true)]
    pub tls_required: bool,
}

impl Connection {
    /// The connection options these flags say.
    pub fn options(&self) -> connect::Options {
        connect::Options {
            servers: self.server.clone(),
            creds: self.creds.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_client: self.tls_cert.clone().zip(self.tls_key.clone()),
            tls_required: self.tls_required,
        }
    }

    /// Connects, naming the connection `name`.
    ///
    /// # Errors
    /// The server cannot be reached, or the credentials or certificates cannot be read; a
    /// server list breaking [`connect::servers`]' rule is [`crate::Invalid`].
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client> {
        self.options().connect(name).await.map_err(said)
    }

    /// [`Connection::connect`], tried again while no server answers (one restarting) until
    /// `give_up` ([`connect::Options::connect_until`]); `retrying` gets each error that will
    /// be retried, as the CLI says it, and the wait before the next try.
    ///
    /// # Errors
    /// As [`Connection::connect`]: at once when trying again cannot help, else once
    /// `give_up` has come.
    pub async fn connect_until(
        &self,
        name: &str,
        give_up: tokio::time::Instant,
        mut retrying: impl FnMut(&anyhow::Error, Duration),
    ) -> Result<async_nats::Client> {
        let options = self.options();
        options
            .connect_until(name, give_up, |e, delay| {
                let said = match e {
                    connect::Error::Unreachable { servers, reason, .. } => unreachable(servers, reason),
                    other => anyhow::anyhow!("{other}"),
                };
                retrying(&said, delay);
            })
            .await
            .map_err(said)
    }

    /// [`Connection::connect`] for long-running processes (`mur coordinator`, `mur
    /// worker`): while the server cannot be reached, says so once on stderr and tries
    /// again every second (services start in any order under docker-compose). A bad
    /// credentials file or server list still fails at once.
    ///
    /// # Errors
    /// The credentials cannot be read, or the server list breaks its rule.
    pub async fn connect_patiently(&self, name: &str) -> Result<async_nats::Client> {
        let options = self.options();
        let mut told = false;
        loop {
            match options.connect(name).await {
                Ok(client) => return Ok(client),
                Err(e @ connect::Error::Unreachable { .. }) => {
                    if !told {
                        eprintln!("{name}: {:#}; retrying every second", said(e));
                        told = true;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return Err(said(e)),
            }
        }
    }
}

/// A connection error as the CLI says it: the flag at fault, or what to start; a server
/// list breaking its rule is [`crate::Invalid`] (`--json` reports `invalid_request`).
fn said(e: connect::Error) -> anyhow::Error {
    match e {
        connect::Error::Servers(invalid) => crate::Invalid(invalid.0).into(),
        connect::Error::Credentials { path, source } => {
            anyhow::Error::new(source).context(format!("--creds {}", path.display()))
        }
        connect::Error::Unreachable { servers, reason, .. } => unreachable(&servers, &reason),
    }
}

/// No server of `servers` answered: where the CLI looked, what to do, and the client's
/// `reason`.
fn unreachable(servers: &str, reason: &str) -> anyhow::Error {
    anyhow::anyhow!("{reason}")
        .context(format!("cannot reach NATS at {servers} (start a cluster with `mur dev`, or set --server / NATS_URL)"))
}
