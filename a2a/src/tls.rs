//! HTTPS for an A2A endpoint (issue #31 §A2A endpoints authenticate: `--http-tls-cert`,
//! `--http-tls-key`): a rustls server configuration from PEM files, on ring (the workspace's
//! one crypto provider), and a listener that hands axum connections whose TLS handshake
//! is done. Handshakes run in their own tasks, each bounded by [`HANDSHAKE_TIMEOUT`], so a
//! client that stalls one holds up nobody else.

use axum::Router;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How long a client may take over its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections handshaken and not yet taken by the server.
const READY_BACKLOG: usize = 64;

/// A certificate or key that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The certificate file holds no certificate, or cannot be read.
    #[error("--http-tls-cert {path}: {reason}")]
    Cert {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The key file holds no private key, or cannot be read.
    #[error("--http-tls-key {path}: {reason}")]
    Key {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// rustls refused the pair (a key that does not match the certificate, say).
    #[error("--http-tls-cert / --http-tls-key: {0}")]
    Config(String),
}

/// A server configuration serving the certificate chain in `cert` (PEM, leaf first) with
/// the private key in `key` (PEM: PKCS#8, PKCS#1 or SEC1), HTTP/2 and HTTP/1.1 offered.
///
/// # Errors
/// [`Error`] naming the file and the reason.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, Error> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| Error::Cert { path: cert.display().to_string(), reason: e.to_string() })?;
    if certs.is_empty() {
        return Err(Error::Cert { path: cert.display().to_string(), reason: "no CERTIFICATE block".into() });
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| Error::Key { path: key.display().to_string(), reason: e.to_string() })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| Error::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A listener whose connections have finished their TLS handshake.
pub struct TlsListener {
    addr: SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Accepts on `listener` and handshakes with `config`, from a task spawned on the
    /// current runtime (stopped when this is dropped).
    ///
    /// # Errors
    /// When the listener has no local address.
    pub fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> io::Result<TlsListener> {
        let addr = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let (tx, ready) = mpsc::channel(READY_BACKLOG);
        let accepting = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(pair) => pair,
                    Err(e) => {
                        tracing::debug!(error = %e, "https accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "tls handshake failed"),
                        Err(_) => tracing::debug!(%peer, "tls handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { addr, ready, accepting })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(pair) => pair,
            // The accepting task ended (it does not, but for its abort): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

/// Serves `router` on `listener`, over TLS with `tls` when given, until `shutdown`
/// resolves (open requests are let finish).
///
/// # Errors
/// When the listener fails.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    match tls {
        None => axum::serve(listener, router).with_graceful_shutdown(shutdown).await,
        Some(config) => axum::serve(TlsListener::new(listener, config)?, router).with_graceful_shutdown(shutdown).await,
    }
}
