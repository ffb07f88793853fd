//! The NATS connection options every cluster command takes: `--server URL` (or
//! `NATS_URL`), the credentials (`--creds FILE`, `--nkey FILE`, `--user` / `--password`,
//! `--token`), and TLS (`--tls-ca`, `--tls-cert`, `--tls-key`, `--tls-required`), filling
//! [`mur_nats::connect::Options`].

use anyhow::Result;
use mur_nats::connect;
use std::path::PathBuf;
use std::time::Duration;

/// Default NATS URL: the one `mur dev` serves.
pub const DEFAULT_URL: &str = "nats://127.0.0.1:4222";

/// How to reach the cluster's NATS servers. The environment variables are the ones the
/// `nats` CLI reads, so one environment serves both.
#[derive(clap::Args, Clone)]
pub struct Connection {
    /// NATS server URL(s), comma-separated; `tls://` requires TLS; `USER:PASSWORD@` or
    /// `TOKEN@` before the host authenticates.
    #[arg(long = "server", env = "NATS_URL", value_name = "URL", default_value = DEFAULT_URL, global = true)]
    pub server: String,
    /// A NATS credentials file: JWT + nkey seed, or a seed alone (`mur auth init` writes one
    /// per role).
    #[arg(long, env = "NATS_CREDS", value_name = "FILE", global = true)]
    pub creds: Option<PathBuf>,
    /// A file holding an nkey user seed (SU…).
    #[arg(long, env = "NATS_NKEY", value_name = "FILE", global = true)]
    pub nkey: Option<PathBuf>,
    /// User name, with --password.
    #[arg(long, env = "NATS_USER", value_name = "NAME", global = true)]
    pub user: Option<String>,
    /// Password, with --user (prefer NATS_PASSWORD: a command line is visible to other users).
    #[arg(long, env = "NATS_PASSWORD", value_name = "PASSWORD", global = true, hide_env_values = true)]
    pub password: Option<String>,
    /// Authentication token (prefer NATS_TOKEN: a command line is visible to other users).
    #[arg(long, env = "NATS_TOKEN", value_name = "TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// CA certificate(s) to verify the server with (PEM).
    #[arg(long, env = "NATS_CA", value_name = "FILE", global = true)]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), with --tls-key.
    #[arg(long, env = "NATS_CERT", value_name = "FILE", requires = "tls_key", global = true)]
    pub tls_cert: Option<PathBuf>,
    /// Client key (PEM), with --tls-cert.
    #[arg(long, env = "NATS_KEY", value_name = "FILE", requires = "tls_cert", global = true)]
    pub tls_key: Option<PathBuf>,
    /// Refuse to connect without TLS.
    #[arg(long, global = true)]
    pub tls_required: bool,
}

impl std::fmt::Debug for Connection {
    /// [`connect::Options`]' Debug: no secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.options().fmt(f)
    }
}

impl Connection {
    /// The options of the environment (`NATS_CREDS`, `NATS_CA`, … as the flags read them)
    /// with the server list `server`: for commands whose `--server` is their own option
    /// (`mur trace show --server`).
    pub fn from_env(server: &str) -> Connection {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let text = |name: &str| var(name).map(|v| v.to_string_lossy().into_owned());
        Connection {
            server: server.to_string(),
            creds: var("NATS_CREDS").map(PathBuf::from),
            nkey: var("NATS_NKEY").map(PathBuf::from),
            user: text("NATS_USER"),
            password: text("NATS_PASSWORD"),
            token: text("NATS_TOKEN"),
            tls_ca: var("NATS_CA").map(PathBuf::from),
            tls_cert: var("NATS_CERT").map(PathBuf::from),
            tls_key: var("NATS_KEY").map(PathBuf::from),
            tls_required: false,
        }
    }

    /// The connection options these flags say.
    pub fn options(&self) -> connect::Options {
        connect::Options {
            servers: self.server.clone(),
            creds: self.creds.clone(),
            nkey: self.nkey.clone(),
            user: self.user.clone(),
            password: self.password.clone(),
            token: self.token.clone(),
            tls_ca: self.tls_ca.clone(),
            tls_client: self.tls_cert.clone().zip(self.tls_key.clone()),
            tls_required: self.tls_required,
        }
    }

    /// Connects, naming the connection `name`.
    ///
    /// # Errors
    /// The server cannot be reached, refuses the credentials, or TLS fails; the credentials
    /// or certificates cannot be read; a server list or options breaking
    /// [`connect::Options::auth`]'s or [`connect::servers`]' rule is [`crate::Invalid`].
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
    /// again every second (services start in any order under docker-compose). Everything
    /// else fails at once, said once: refused credentials (issue #31: the same credentials
    /// would be refused again, and a loop hammering the server helps nobody), a TLS
    /// failure, a bad credentials file or server list.
    ///
    /// # Errors
    /// As [`Connection::connect`], except an unreachable server.
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
/// list or options breaking a rule is [`crate::Invalid`] (`--json` reports `invalid_request`).
fn said(e: connect::Error) -> anyhow::Error {
    match e {
        connect::Error::Invalid(invalid) => crate::Invalid(invalid.0).into(),
        connect::Error::Credentials { option, path, source } => {
            anyhow::Error::new(source).context(format!("{option} {}", path.display()))
        }
        e @ (connect::Error::Refused { .. } | connect::Error::Tls { .. }) => anyhow::Error::new(e),
        connect::Error::Unreachable { servers, reason, .. } => unreachable(&servers, &reason),
    }
}

/// No server of `servers` answered: where the CLI looked, what to do, and the client's
/// `reason`.
fn unreachable(servers: &str, reason: &str) -> anyhow::Error {
    anyhow::anyhow!("{reason}")
        .context(format!("cannot reach NATS at {servers} (start a cluster with `mur dev`, or set --server / NATS_URL)"))
}
