//! How a process reaches the cluster's NATS servers: the server list, a credentials file
//! and TLS, in one place ([`Options`]); the CLI's `--server` / `NATS_URL`, `--creds`,
//! `--tls-*` options fill it, for its commands and for the services it starts.

use std::path::PathBuf;
use std::time::Duration;

/// How long [`Options::connect`] waits for a server before it gives up on it.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

/// How to reach the cluster's NATS servers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Server URL(s), comma-separated: `nats://HOST:PORT`, `tls://HOST:PORT` (TLS
    /// required) or `HOST:PORT` (see [`servers`]).
    pub servers: String,
    /// A NATS credentials file (JWT + nkey seed).
    pub creds: Option<PathBuf>,
    /// CA certificate(s) to verify the server with (PEM).
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key (PEM), used together.
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// Refuse to connect without TLS.
    pub tls_required: bool,
}

/// A server list that breaks [`servers`]' rule: the message names the option, the URL (its
/// password or token redacted) and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// Why [`Options::connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server list breaks [`servers`]' rule.
    #[error(transparent)]
    Servers(#[from] Invalid),
    /// The credentials file cannot be read: retrying will not help.
    #[error("--creds {}", path.display())]
    Credentials {
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// No server of the list could be reached. The client's error says its cause already
    /// (`IO error: Connection refused (os error 111)`), and gives it again as its source,
    /// so only its text is kept: one line, said once.
    #[error("cannot reach NATS at {servers}: {reason}")]
    Unreachable {
        /// The server list, redacted.
        servers: String,
        /// The client's error text.
        reason: String,
        /// Whether trying again may succeed: no server answered (the connection refused or
        /// timed out, a name not resolved), as while a server restarts — not a server that
        /// refused the credentials or the TLS handshake.
        transient: bool,
    },
}

impl Error {
    /// Whether trying again may succeed ([`Error::Unreachable`]'s `transient`): never for a
    /// bad server list or credentials file.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unreachable { transient: true, .. })
    }
}

impl Options {
    /// Connects, naming the connection `name` (it shows in the server's connection list).
    ///
    /// # Errors
    /// [`Error::Servers`], [`Error::Credentials`], [`Error::Unreachable`].
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client, Error> {
        let mut opts = async_nats::ConnectOptions::new().name(name).connection_timeout(CONNECTION_TIMEOUT);
        if let Some(creds) = &self.creds {
            opts = opts
                .credentials_file(creds)
                .await
                .map_err(|source| Error::Credentials { path: creds.clone(), source })?;
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls_client {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls_required {
            opts = opts.require_tls(true);
        }
        let servers = servers(&self.servers)?;
        opts.connect(servers.as_slice()).await.map_err(|e| Error::Unreachable {
            servers: redacted(&self.servers),
            reason: e.to_string(),
            transient: matches!(
                e.kind(),
                async_nats::ConnectErrorKind::Io
                    | async_nats::ConnectErrorKind::TimedOut
                    | async_nats::ConnectErrorKind::Dns
            ),
        })
    }

    /// [`Options::connect`], tried again while no server answers ([`Error::is_transient`]:
    /// a server restarting, or not up yet) until `give_up`, after the waits of the one
    /// backoff with jitter ([`crate::backoff`]) [`crate::api::submit`] uses too, so that a
    /// command that submits (`mur task send`) rides out a broker restart as it rides out a
    /// coordinator's (issue #29 item 7). `retrying` is told each error that will be
    /// retried and the wait before the next try (the CLI says it on stderr).
    ///
    /// # Errors
    /// As [`Options::connect`]: at once when the error is not transient, else the last
    /// error once the next try would start at or after `give_up`.
    pub async fn connect_until(
        &self,
        name: &str,
        give_up: tokio::time::Instant,
        mut retrying: impl FnMut(&Error, Duration),
    ) -> Result<async_nats::Client, Error> {
        let mut delays = crate::backoff::delays(crate::api::SUBMIT_FIRST_DELAY, crate::api::SUBMIT_MAX_DELAY);
        loop {
            match self.connect(name).await {
                Ok(client) => return Ok(client),
                Err(e) if e.is_transient() => {
                    let delay = delays.next().unwrap_or(crate::api::SUBMIT_MAX_DELAY);
                    if tokio::time::Instant::now() + delay >= give_up {
                        return Err(e);
                    }
                    retrying(&e, delay);
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The URLs of a server list (comma-separated), each checked for a scheme the client
/// speaks: `nats://`, `tls://` (TLS required), or none (`host:port` is `nats://`). This
/// build has no WebSocket transport, so `ws://` and `wss://` are refused too; the most
/// likely mistake, an `http://` URL, says where an HTTP URL goes instead (issue #29: it
/// said it could not reach NATS, as though the server were down).
///
/// # Errors
/// [`Invalid`] naming the option, the URL (its password or token redacted) and the
/// schemes accepted.
pub fn servers(list: &str) -> Result<Vec<&str>, Invalid> {
    let servers: Vec<&str> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if servers.is_empty() {
        return Err(Invalid(format!("--server / NATS_URL: must name a NATS server (nats://HOST:PORT), got {list:?}")));
    }
    for url in &servers {
        let Some((scheme, _)) = url.split_once("://") else { continue };
        if !matches!(scheme.to_ascii_lowercase().as_str(), "nats" | "tls") {
            let http = if matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https") {
                "; an HTTP URL is a capsule's or coordinator's A2A endpoint, for `mur task send --url URL`"
            } else {
                ""
            };
            return Err(Invalid(format!(
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
