//! How a process reaches the cluster's NATS servers: the server list, the credentials (one
//! of a credentials file, an nkey seed, a token, a user and password, in the options or in
//! the URL) and TLS, in one place ([`Options`]); the CLI's `--server` / `NATS_URL`,
//! `--creds`, `--nkey`, `--user`, `--password`, `--token`, `--tls-*` options fill it, for its
//! commands and for the services it starts (issue #31).
//!
//! Secrets never reach a message or a log line: URLs are [`redacted`], the `Debug` of
//! [`Options`] hides them, and the URLs handed to the client have their user part removed
//! (the client would log them whole at debug level; the credentials go to it as options).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long [`Options::connect`] waits for a server before it gives up on it.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

/// How to reach the cluster's NATS servers.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// Server URL(s), comma-separated: `nats://HOST:PORT`, `tls://HOST:PORT` (TLS
    /// required) or `HOST:PORT` (see [`servers`]); a URL may carry `USER:PASSWORD@` or
    /// `TOKEN@` (see [`Auth`]).
    pub servers: String,
    /// A NATS credentials file: a JWT and an nkey seed (`nsc`'s `.creds`), or an nkey seed
    /// alone (the files `mur auth init` writes: see [`Auth::from_creds_file`]).
    pub creds: Option<PathBuf>,
    /// A file holding an nkey user seed (`SU…`), bare or in a decorated block.
    pub nkey: Option<PathBuf>,
    /// User name, with [`Options::password`].
    pub user: Option<String>,
    /// Password, with [`Options::user`].
    pub password: Option<String>,
    /// An authentication token.
    pub token: Option<String>,
    /// CA certificate(s) to verify the server with (PEM).
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key (PEM), used together.
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// Refuse to connect without TLS.
    pub tls_required: bool,
}

impl std::fmt::Debug for Options {
    /// Everything but the secrets: the URLs redacted, the password and token as `***`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |s: &Option<String>| s.as_ref().map(|_| "***");
        f.debug_struct("Options")
            .field("servers", &redacted(&self.servers))
            .field("creds", &self.creds)
            .field("nkey", &self.nkey)
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("token", &hidden(&self.token))
            .field("tls_ca", &self.tls_ca)
            .field("tls_client", &self.tls_client)
            .field("tls_required", &self.tls_required)
            .finish()
    }
}

/// A server list or set of options that breaks a rule: the message names the option, the
/// URL (its password or token redacted) and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// The one way a connection authenticates, chosen from [`Options`] by [`Options::auth`].
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// No credentials.
    None,
    /// A JWT credentials file, read by the client.
    CredsFile(PathBuf),
    /// An nkey user seed (`SU…`), from the file named.
    Nkey {
        /// The seed.
        seed: String,
        /// Where it was read from (for messages).
        from: PathBuf,
    },
    /// A token.
    Token(String),
    /// A user and password.
    UserPassword(String, String),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Auth {
    /// What the connection presents, for messages, without the secret: `the credentials
    /// file ./worker.creds`, `user alice's password`, `a token`.
    pub fn describe(&self) -> String {
        match self {
            Auth::None => "no credentials".to_string(),
            Auth::CredsFile(path) => format!("the credentials file {}", path.display()),
            Auth::Nkey { from, .. } => format!("the nkey seed in {}", from.display()),
            Auth::Token(_) => "a token".to_string(),
            Auth::UserPassword(user, _) => format!("user {user:?} and a password"),
        }
    }

    /// What a `--creds FILE` holds: a JWT credentials file (it has a `-----BEGIN NATS USER
    /// JWT-----` block) goes to the client as it is; a file with an nkey seed alone (a
    /// decorated `NKEY SEED` block, or a bare `SU…` line: what `mur auth init` writes for
    /// the nkey users of its server configuration) authenticates with that seed.
    ///
    /// # Errors
    /// [`Error::Credentials`] when the file cannot be read or holds neither.
    pub fn from_creds_file(path: &Path) -> Result<Auth, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Credentials {
            option: "--creds / NATS_CREDS",
            path: path.to_path_buf(),
            source,
        })?;
        if text.contains("BEGIN NATS USER JWT") {
            return Ok(Auth::CredsFile(path.to_path_buf()));
        }
        Self::seed_in(&text, "--creds / NATS_CREDS", path)
    }

    /// The nkey user seed of a `--nkey FILE` (bare, or in a decorated block).
    ///
    /// # Errors
    /// [`Error::Credentials`] when the file cannot be read or holds no user seed.
    pub fn from_nkey_file(path: &Path) -> Result<Auth, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Credentials {
            option: "--nkey / NATS_NKEY",
            path: path.to_path_buf(),
            source,
        })?;
        Self::seed_in(&text, "--nkey / NATS_NKEY", path)
    }

    fn seed_in(text: &str, option: &'static str, path: &Path) -> Result<Auth, Error> {
        let seed = text.lines().map(str::trim).find(|l| l.starts_with("SU") && l.len() > 50);
        match seed {
            Some(seed) => Ok(Auth::Nkey { seed: seed.to_string(), from: path.to_path_buf() }),
            None => Err(Error::Credentials {
                option,
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "holds neither a NATS user JWT nor an nkey user seed (a line starting SU)",
                ),
            }),
        }
    }
}

/// Why [`Options::connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server list or the options break a rule.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// A credentials or seed file cannot be read or holds no credentials: retrying will not
    /// help.
    #[error("{option} {}", path.display())]
    Credentials {
        /// The option that named the file.
        option: &'static str,
        /// The file.
        path: PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// The server refused the credentials (or their absence): retrying with the same ones
    /// will not help, so callers report it once and stop.
    #[error(
        "NATS at {servers} refused the connection: {reason}; it was offered {offered}: check --creds / \
         NATS_CREDS, --nkey, --user / --password, --token or the USER:PASSWORD@ of --server, and that the \
         server's configuration lists this user"
    )]
    Refused {
        /// The server list, redacted.
        servers: String,
        /// The client's error text.
        reason: String,
        /// [`Auth::describe`] of what was offered.
        offered: String,
    },
    /// TLS could not be set up or the handshake failed (a CA file that does not verify the
    /// server, a missing client certificate, a server without TLS under `--tls-required`):
    /// retrying will not help.
    #[error(
        "TLS to NATS at {servers} failed: {reason} (check --tls-ca, --tls-cert / --tls-key, --tls-required and \
         the tls:// of --server against the server's tls block)"
    )]
    Tls {
        /// The server list, redacted.
        servers: String,
        /// The client's error text.
        reason: String,
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
    /// The one way to authenticate these options say. A credentials file, an nkey seed
    /// file, a token, a user and password (in the options, or as `USER:PASSWORD@` /
    /// `TOKEN@` in the URLs) exclude one another: two of them are refused rather than one
    /// silently chosen. The URLs of a list must agree on their user part.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming both options; [`Error::Credentials`] for a file that
    /// cannot be read.
    pub fn auth(&self) -> Result<Auth, Error> {
        let mut chosen: Vec<(&str, Auth)> = Vec::new();
        if let Some(path) = &self.creds {
            chosen.push(("--creds / NATS_CREDS", Auth::from_creds_file(path)?));
        }
        if let Some(path) = &self.nkey {
            chosen.push(("--nkey / NATS_NKEY", Auth::from_nkey_file(path)?));
        }
        if let Some(token) = &self.token {
            chosen.push(("--token / NATS_TOKEN", Auth::Token(token.clone())));
        }
        match (&self.user, &self.password) {
            (Some(user), Some(password)) => {
                chosen.push(("--user / --password", Auth::UserPassword(user.clone(), password.clone())))
            }
            (None, None) => {}
            _ => {
                return Err(
                    Invalid("--user / NATS_USER and --password / NATS_PASSWORD: give both or neither".into()).into()
                );
            }
        }
        if let Some(from_url) = url_auth(&self.servers)? {
            chosen.push(("the USER:PASSWORD@ or TOKEN@ of --server / NATS_URL", from_url));
        }
        match chosen.len() {
            0 => Ok(Auth::None),
            1 => Ok(chosen.pop().expect("one").1),
            _ => {
                Err(Invalid(format!("{} and {}: give one way to authenticate, not two", chosen[0].0, chosen[1].0))
                    .into())
            }
        }
    }

    /// Connects, naming the connection `name` (it shows in the server's connection list).
    ///
    /// # Errors
    /// [`Error::Invalid`], [`Error::Credentials`], [`Error::Refused`], [`Error::Tls`],
    /// [`Error::Unreachable`].
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client, Error> {
        crate::tls::install_crypto_provider();
        let servers = servers(&self.servers)?;
        let auth = self.auth()?;
        let mut opts = async_nats::ConnectOptions::new().name(name).connection_timeout(CONNECTION_TIMEOUT);
        opts = match &auth {
            Auth::None => opts,
            Auth::CredsFile(path) => opts.credentials_file(path).await.map_err(|source| Error::Credentials {
                option: "--creds / NATS_CREDS",
                path: path.clone(),
                source,
            })?,
            Auth::Nkey { seed, .. } => opts.nkey(seed.clone()),
            Auth::Token(token) => opts.token(token.clone()),
            Auth::UserPassword(user, password) => opts.user_and_password(user.clone(), password.clone()),
        };
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls_client {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls_required {
            opts = opts.require_tls(true);
        }
        // The credentials went in as options; the client gets the URLs without them.
        let bare: Vec<String> = servers.iter().map(|url| without_user(url)).collect();
        opts.connect(bare.as_slice()).await.map_err(|e| {
            let servers = redacted(&self.servers);
            let reason = e.to_string();
            use async_nats::ConnectErrorKind as Kind;
            match e.kind() {
                // Its text repeats the server's (`authorization violation: nats: authorization
                // violation`): the kind says it.
                Kind::AuthorizationViolation => {
                    Error::Refused { servers, reason: e.kind().to_string(), offered: auth.describe() }
                }
                Kind::Authentication => Error::Refused { servers, reason, offered: auth.describe() },
                Kind::Tls => Error::Tls { servers, reason },
                _ if is_tls_failure(&e) => Error::Tls { servers, reason },
                kind => Error::Unreachable {
                    servers,
                    reason,
                    transient: matches!(kind, Kind::Io | Kind::TimedOut | Kind::Dns),
                },
            }
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

/// Whether a connection error came from the TLS handshake (rustls refused the server's
/// certificate, or the server ours): the client reports those as I/O errors.
fn is_tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if err.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io.get_ref().is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// The user part of the URLs of a list, as [`Auth`]: `USER:PASSWORD@` (percent-decoded) or
/// `TOKEN@`; `None` when no URL has one.
///
/// # Errors
/// [`Invalid`] when two URLs of the list carry different user parts.
fn url_auth(list: &str) -> Result<Option<Auth>, Invalid> {
    let mut found: Option<(&str, Auth)> = None;
    for url in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some(userinfo) = userinfo(url) else { continue };
        let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        let auth = match userinfo.split_once(':') {
            Some((user, password)) => Auth::UserPassword(decode(user), decode(password)),
            None => Auth::Token(decode(userinfo)),
        };
        match &found {
            Some((_, first)) if *first != auth => {
                return Err(Invalid(format!(
                    "--server / NATS_URL: {} and {} carry different credentials: the client has one set for \
                     every server",
                    redacted(found.as_ref().map_or("", |f| f.0)),
                    redacted(url)
                )));
            }
            Some(_) => {}
            None => found = Some((url, auth)),
        }
    }
    Ok(found.map(|(_, auth)| auth))
}

/// The `USER:PASSWORD` or `TOKEN` before the `@` of a URL's authority, if any.
fn userinfo(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    authority.rfind('@').map(|at| &authority[..at])
}

/// `url` without its user part: `nats://alice:pw@h:4222` → `nats://h:4222`.
fn without_user(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").map_or(("", url), |(s, r)| (s, r));
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else { return url.to_string() };
    let scheme = if scheme.is_empty() { String::new() } else { format!("{scheme}://") };
    format!("{scheme}{}", &rest[at + 1..])
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
    fn a_user_and_password_or_a_token_in_a_url_authenticate_and_leave_the_url() {
        let options = |servers: &str| Options { servers: servers.into(), ..Options::default() };
        assert_eq!(
            options("nats://alice:p%40ss@h:4222").auth().unwrap(),
            Auth::UserPassword("alice".into(), "p@ss".into())
        );
        assert_eq!(options("tok3n@h:4222,tok3n@h2").auth().unwrap(), Auth::Token("tok3n".into()));
        assert_eq!(options("nats://h:4222").auth().unwrap(), Auth::None);
        assert_eq!(without_user("nats://alice:pw@h:4222/x@y"), "nats://h:4222/x@y");
        assert_eq!(without_user("tok@h:4222"), "h:4222");
        let two = options("nats://a:one@h1,nats://a:two@h2").auth().unwrap_err().to_string();
        assert!(two.contains("nats://a:***@h1 and nats://a:***@h2 carry different credentials"), "{two}");
        assert!(!two.contains(":one@") && !two.contains(":two@"), "{two}");
    }

    #[test]
    fn two_ways_to_authenticate_are_refused_naming_both() {
        let both = Options { servers: "nats://alice:pw@h".into(), token: Some("t".into()), ..Options::default() };
        assert_eq!(
            both.auth().unwrap_err().to_string(),
            "--token / NATS_TOKEN and the USER:PASSWORD@ or TOKEN@ of --server / NATS_URL: give one way to \
             authenticate, not two"
        );
        let half = Options { servers: "h".into(), user: Some("alice".into()), ..Options::default() };
        assert!(half.auth().unwrap_err().to_string().contains("give both or neither"));
    }

    #[test]
    fn a_creds_file_with_a_seed_alone_authenticates_with_the_nkey_and_a_jwt_file_goes_to_the_client() {
        let dir = tempfile::tempdir().unwrap();
        let seed = "SUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4";
        let decorated = dir.path().join("seed.creds");
        std::fs::write(&decorated, format!("-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"))
            .unwrap();
        assert_eq!(
            Auth::from_creds_file(&decorated).unwrap(),
            Auth::Nkey { seed: seed.into(), from: decorated.clone() }
        );
        let jwt = dir.path().join("nsc.creds");
        std::fs::write(&jwt, format!("-----BEGIN NATS USER JWT-----\neyJ0eXAi\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")).unwrap();
        assert_eq!(Auth::from_creds_file(&jwt).unwrap(), Auth::CredsFile(jwt.clone()));
        let empty = dir.path().join("empty.creds");
        std::fs::write(&empty, "nothing").unwrap();
        let e = Auth::from_creds_file(&empty).unwrap_err();
        assert_eq!(e.to_string(), format!("--creds / NATS_CREDS {}", empty.display()));
        // The seed never shows in the description nor in Debug.
        let auth = Auth::from_creds_file(&decorated).unwrap();
        assert!(!format!("{auth:?} {}", auth.describe()).contains(seed));
    }

    #[test]
    fn the_debug_of_options_shows_no_secret() {
        let o = Options {
            servers: "nats://alice:s3cret@h".into(),
            password: Some("s3cret".into()),
            token: Some("s3cret".into()),
            ..Options::default()
        };
        assert!(!format!("{o:?}").contains("s3cret"), "{o:?}");
    }

    #[test]
    fn a_password_or_token_in_a_url_is_never_printed() {
        assert_eq!(redacted("nats://alice:s3cret@h:4222"), "nats://alice:***@h:4222");
        assert_eq!(redacted("nats://s3cret-token@h:4222/x@y"), "nats://***@h:4222/x@y");
        assert_eq!(redacted("alice:s3cret@h:4222,tls://h2"), "alice:***@h:4222,tls://h2");
        assert_eq!(redacted("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }
}
