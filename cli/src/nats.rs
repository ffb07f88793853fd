//! The NATS connection options every cluster command takes: `--server URL` (or
//! `NATS_URL`), `--creds FILE`, and TLS (`--tls-ca`, `--tls-cert`, `--tls-key`,
//! `--tls-required`).

use anyhow::{Context, Result};
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
    /// Connects, naming the connection `name`.
    ///
    /// # Errors
    /// The server cannot be reached, or the credentials or certificates cannot be read.
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client> {
        let mut opts = async_nats::ConnectOptions::new().name(name).connection_timeout(Duration::from_secs(5));
        if let Some(creds) = &self.creds {
            opts = opts.credentials_file(creds).await.with_context(|| format!("--creds {}", creds.display()))?;
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls_required {
            opts = opts.require_tls(true);
        }
        let servers: Vec<&str> = self.server.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        // The client's error says its cause already (`IO error: Connection refused (os error
        // 111)`), and gives it again as its source: one line, said once.
        opts.connect(servers.as_slice()).await.map_err(|e| anyhow::anyhow!("{e}")).with_context(|| {
            format!("cannot reach NATS at {} (start a cluster with `mur dev`, or set --server / NATS_URL)", self.server)
        })
    }

    /// [`Connection::connect`] for long-running processes (`mur coordinator`, `mur
    /// worker`): while the server cannot be reached, says so once on stderr and tries
    /// again every second (services start in any order under docker-compose). A bad
    /// credentials or certificate file still fails at once.
    ///
    /// # Errors
    /// The credentials or certificates cannot be read.
    pub async fn connect_patiently(&self, name: &str) -> Result<async_nats::Client> {
        let mut said = false;
        loop {
            match self.connect(name).await {
                Ok(client) => return Ok(client),
                Err(e) if e.chain().any(|c| c.to_string().starts_with("--creds")) => return Err(e),
                Err(e) => {
                    if !said {
                        eprintln!("{name}: {e:#}; retrying every second");
                        said = true;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}
