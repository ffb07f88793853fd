//! The process's one rustls crypto provider (ring), for every TLS connection murmur makes:
//! NATS (async-nats), HTTP (reqwest: model providers, A2A, MCP, OTLP).
//!
//! Issue #31: two providers were compiled in (ring through async-nats, aws-lc-rs through
//! reqwest's default features), so rustls could not choose one by itself and the first TLS
//! connection panicked (`Could not automatically determine the process-level
//! CryptoProvider`). The workspace now builds reqwest without a provider of its own
//! (`rustls-no-provider`), ring is the only one in the dependency tree (`.ci/run` checks),
//! and every binary calls [`install_crypto_provider`] first thing. The constructors in
//! murmur's libraries that build a TLS-capable client call it too, so a test or an embedding
//! program that forgets cannot panic.

/// Installs ring as the process's default rustls crypto provider. Idempotent and cheap after
/// the first call; when another provider was installed first (a program embedding murmur's
/// libraries chose its own), that one stays.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err only when a provider is installed already: that one is kept, as said above.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_installing_the_process_has_a_default_provider() {
        install_crypto_provider();
        install_crypto_provider();
        assert!(rustls::crypto::CryptoProvider::get_default().is_some());
    }
}
