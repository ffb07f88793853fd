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
        let servers = servers(&self.server)?;
        // The client's error says its cause already (`IO error: Connection refused (os error
        // 111)`), and gives it again as its source: one line, said once.
        opts.connect(servers.as_slice()).await.map_err(|e| anyhow::anyhow!("{e}")).with_context(|| {
            format!(
                "cannot reach NATS at {} (start a cluster with `mur dev`, or set --server / NATS_URL)",
                redacted(&self.server)
            )
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

/// The URLs of a `--server` list (comma-separated), each checked for a scheme the client
/// speaks: `nats://`, `tls://` (TLS required), or none (`host:port` is `nats://`). This
/// build has no WebSocket transport, so `ws://` and `wss://` are refused too; the most
/// likely mistake, an `http://` URL, says where an HTTP URL goes instead (issue #29: it
/// said it could not reach NATS, as though the server were down).
///
/// # Errors
/// [`crate::Invalid`] naming the option, the URL (its password or token redacted) and the
/// schemes accepted.
pub fn servers(list: &str) -> Result<Vec<&str>, crate::Invalid> {
    let servers: Vec<&str> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if servers.is_empty() {
        return Err(crate::Invalid(format!(
            "--server / NATS_URL: must name a NATS server (nats://HOST:PORT), got {list:?}"
        )));
    }
    for url in &servers {
        let Some((scheme, _)) = url.split_once("://") else { continue };
        if !matches!(scheme.to_ascii_lowercase().as_str(), "nats" | "tls") {
            let http = if matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https") {
                "; an HTTP URL is a capsule's or coordinator's A2A endpoint, for `mur task send --url URL`"
            } else {
                ""
            };
            return Err(crate::Invalid(format!(
                "--server / NATS_URL: {}: the scheme must be nats:// or tls:// (or none: HOST:PORT means nats://), \
                 got {scheme}://{http}",
                redacted(url)
            )));
        }
    }
    Ok(servers)
}

/// `urls` (one or a comma-separated list) with the password or token of each URL's user
/// part replaced by `***` (`nats://alice:***@host:4222`, `nats://***@host`): never printed.
pub fn redacted(urls: &str) -> String {
    urls.split(',')
        .map(|url| {
            let (scheme, rest) = url.split_once("://").map_or(("", url), |(s, r)| (s, r));
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let Some(at) = rest[..authority_end].rfind('@') else { return url.to_string() };
            let user = match rest[..at].split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_string(),
            };
            let scheme = if scheme.is_empty() { String::new() } else { format!("{scheme}://") };
            format!("{scheme}{user}{}", &rest[at..])
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_list_takes_nats_and_tls_urls_and_bare_addresses() {
        assert_eq!(
            servers(" nats://a:4222, tls://b:4443 ,c:4222").unwrap(),
            ["nats://a:4222", "tls://b:4443", "c:4222"]
        );
        assert_eq!(servers("NATS://a").unwrap(), ["NATS://a"]);
    }

    #[test]
    fn a_url_of_another_scheme_is_refused_naming_the_schemes_that_work() {
        assert_eq!(
            servers("http://127.0.0.1:4222").unwrap_err().0,
            "--server / NATS_URL: http://127.0.0.1:4222: the scheme must be nats:// or tls:// (or none: HOST:PORT \
             means nats://), got http://; an HTTP URL is a capsule's or coordinator's A2A endpoint, for \
             `mur task send --url URL`"
        );
        assert_eq!(
            servers("nats://a:4222,ws://bob:pw@b:80").unwrap_err().0,
            "--server / NATS_URL: ws://bob:***@b:80: the scheme must be nats:// or tls:// (or none: HOST:PORT means \
             nats://), got ws://"
        );
        assert_eq!(
            servers(" , ").unwrap_err().0,
            "--server / NATS_URL: must name a NATS server (nats://HOST:PORT), got \" , \""
        );
    }

    #[test]
    fn a_password_or_token_in_a_url_is_never_printed() {
        assert_eq!(redacted("nats://alice:s3cret@h:4222"), "nats://alice:***@h:4222");
        assert_eq!(redacted("nats://s3cret-token@h:4222/x@y"), "nats://***@h:4222/x@y");
        assert_eq!(redacted("alice:s3cret@h:4222,tls://h2"), "alice:***@h:4222,tls://h2");
        assert_eq!(redacted("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }
}
