//! A2A bearer tokens in the cluster (issue #31 §A2A endpoints authenticate): made, listed
//! and revoked in [`TOKENS_BUCKET`], and the [`Keyring`] an endpoint checks requests
//! against, kept current by a watch of the bucket ([`follow`]).
//!
//! A token is `mur_` and 64 hex digits (256 bits from the operating system's random
//! source). The bucket keeps its SHA-256 only: a reader of the bucket (every role may read
//! it) learns names and grants, not tokens; a 256-bit random token needs no slow hash. A
//! check hashes the presented token once and compares it with every stored digest in
//! constant time ([`subtle`]), so the time taken says nothing about how close a guess was.

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use mur_proto::cluster::{TOKEN_NAME_RULE, TOKENS_BUCKET, TokenRecord, is_valid_token_name};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use subtle::ConstantTimeEq;

/// What every token starts with (a scanner looking for leaked secrets can match it).
pub const TOKEN_PREFIX: &str = "mur_";

/// Errors of the token store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The name breaks [`TOKEN_NAME_RULE`].
    #[error("token name {0:?}: {TOKEN_NAME_RULE}")]
    Name(String),
    /// `create` of a name in use.
    #[error("a token named {0:?} exists: revoke it first (`mur auth token revoke {0}`) or pick another name")]
    Exists(String),
    /// `revoke` of a name not in use.
    #[error("no token named {0:?} (`mur auth token ls` lists them)")]
    NotFound(String),
    /// The operating system's random source failed.
    #[error("no random bytes for a token: {0}")]
    Random(String),
    /// The bucket could not be read or written.
    #[error("{TOKENS_BUCKET}: {what}: {source}")]
    Store {
        /// What failed.
        what: &'static str,
        /// The client's error.
        #[source]
        source: async_nats::Error,
    },
}

fn store_err(what: &'static str) -> impl FnOnce(async_nats::Error) -> Error {
    move |source| Error::Store { what, source }
}

/// A fresh token: [`TOKEN_PREFIX`] and 32 random bytes in hex.
///
/// # Errors
/// [`Error::Random`] when the operating system gives no random bytes.
pub fn generate() -> Result<String, Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| Error::Random(e.to_string()))?;
    Ok(format!("{TOKEN_PREFIX}{}", hex::encode(bytes)))
}

/// SHA-256 of a token's text.
pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Each known token's record and the digest it is checked against, by name.
type Tokens = HashMap<String, (TokenRecord, [u8; 32])>;

/// The tokens an endpoint accepts, shared by its requests; cheap to clone.
#[derive(Clone, Default)]
pub struct Keyring {
    tokens: Arc<RwLock<Tokens>>,
}

impl std::fmt::Debug for Keyring {
    /// Names only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tokens = self.tokens.read().expect("keyring");
        f.debug_struct("Keyring").field("names", &tokens.keys().collect::<Vec<_>>()).finish()
    }
}

impl Keyring {
    /// An empty keyring.
    pub fn new() -> Keyring {
        Keyring::default()
    }

    /// A keyring of one token given as text (`mur run --token-file`), named `name`, for
    /// every capsule, admin scope.
    pub fn of_token(name: &str, token: &str) -> Keyring {
        let keyring = Keyring::new();
        let sha = digest(token);
        keyring.insert(TokenRecord {
            name: name.to_string(),
            sha256: hex::encode(sha),
            capsules: Vec::new(),
            scope: Default::default(),
            created_at: 0,
        });
        keyring
    }

    /// Adds or replaces a token by name; one whose digest is not 64 hex digits is left out
    /// (it could match nothing).
    pub fn insert(&self, record: TokenRecord) {
        let mut sha = [0u8; 32];
        if hex::decode_to_slice(&record.sha256, &mut sha).is_err() {
            return;
        }
        self.tokens.write().expect("keyring").insert(record.name.clone(), (record, sha));
    }

    /// Forgets the token `name`.
    pub fn remove(&self, name: &str) {
        self.tokens.write().expect("keyring").remove(name);
    }

    /// Whether no token is known.
    pub fn is_empty(&self) -> bool {
        self.tokens.read().expect("keyring").is_empty()
    }

    /// The record of the token whose text is `token`, if one is known. Every stored digest
    /// is compared, in constant time.
    pub fn check(&self, token: &str) -> Option<TokenRecord> {
        let presented = digest(token);
        let tokens = self.tokens.read().expect("keyring");
        let mut found = None;
        for (record, sha) in tokens.values() {
            if bool::from(sha.ct_eq(&presented)) {
                found = Some(record);
            }
        }
        found.cloned()
    }
}

/// The token bucket, made when missing (history 1: a revoked token's record goes at once).
///
/// # Errors
/// [`Error::Store`] when the bucket can be neither read nor made.
pub async fn store(js: &jetstream::Context) -> Result<kv::Store, Error> {
    if let Ok(store) = js.get_key_value(TOKENS_BUCKET).await {
        return Ok(store);
    }
    js.create_key_value(kv::Config {
        bucket: TOKENS_BUCKET.to_string(),
        description: "murmur: A2A bearer tokens (SHA-256 only), key = token name".to_string(),
        history: 1,
        ..Default::default()
    })
    .await
    .map_err(|e| store_err("create the bucket")(e.into()))
}

/// Makes the token `name` for `capsules` (empty: every capsule) with `scope`; returns the
/// token's text, which is stored nowhere (its SHA-256 is) and cannot be shown again.
///
/// # Errors
/// [`Error::Name`], [`Error::Exists`], [`Error::Random`], [`Error::Store`].
pub async fn create(
    store: &kv::Store,
    name: &str,
    capsules: &[String],
    scope: mur_proto::cluster::Scope,
    now_ms: u64,
) -> Result<String, Error> {
    if !is_valid_token_name(name) {
        return Err(Error::Name(name.to_string()));
    }
    let token = generate()?;
    let record = TokenRecord {
        name: name.to_string(),
        sha256: hex::encode(digest(&token)),
        capsules: capsules.to_vec(),
        scope,
        created_at: now_ms,
    };
    let body = serde_json::to_vec(&record).expect("a token record serializes");
    match store.create(name, body.into()).await {
        Ok(_) => Ok(token),
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Err(Error::Exists(name.to_string())),
        Err(e) => Err(store_err("write")(e.into())),
    }
}

/// Every token's record, by name.
///
/// # Errors
/// [`Error::Store`] when the bucket cannot be read.
pub async fn list(store: &kv::Store) -> Result<Vec<TokenRecord>, Error> {
    let mut records: HashMap<String, Option<TokenRecord>> = HashMap::new();
    crate::read::latest(store, ">", |entry| {
        let record = match entry.operation {
            kv::Operation::Put => serde_json::from_slice(&entry.value).ok(),
            _ => None,
        };
        records.insert(entry.key, record);
    })
    .await
    .map_err(|e| store_err("read")(e.into()))?;
    let mut records: Vec<TokenRecord> = records.into_values().flatten().collect();
    records.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(records)
}

/// Revokes the token `name`: its record is purged, and every endpoint following the bucket
/// refuses the token from the moment its watch sees the purge (milliseconds).
///
/// # Errors
/// [`Error::NotFound`] when no token has the name; [`Error::Store`].
pub async fn revoke(store: &kv::Store, name: &str) -> Result<(), Error> {
    if !is_valid_token_name(name) {
        return Err(Error::Name(name.to_string()));
    }
    match store.entry(name).await.map_err(|e| store_err("read")(e.into()))? {
        Some(entry) if entry.operation == kv::Operation::Put => {}
        _ => return Err(Error::NotFound(name.to_string())),
    }
    store.purge(name).await.map_err(|e| store_err("purge")(e.into()))
}

/// Applies one entry of the bucket to `keyring`.
fn apply(keyring: &Keyring, entry: &kv::Entry) {
    match entry.operation {
        kv::Operation::Put => match serde_json::from_slice::<TokenRecord>(&entry.value) {
            Ok(record) if record.name == entry.key => keyring.insert(record),
            // A record that does not read as one grants nothing.
            _ => keyring.remove(&entry.key),
        },
        kv::Operation::Delete | kv::Operation::Purge => keyring.remove(&entry.key),
    }
}

/// A keyring holding every token of `store` now, kept current from a spawned task that
/// watches the bucket until `stop` is cancelled (a broken watch is opened again, and the
/// bucket read again, a second later).
///
/// # Errors
/// [`Error::Store`] when the first read or watch fails.
pub async fn follow(store: kv::Store, stop: tokio_util::sync::CancellationToken) -> Result<Keyring, Error> {
    let keyring = Keyring::new();
    // The watch is opened before the read, so nothing written between them is missed:
    // the read's entries are applied first, then the watch's, in order.
    let watch = store.watch_all().await.map_err(|e| store_err("watch")(e.into()))?;
    load(&store, &keyring).await?;
    let kept = keyring.clone();
    tokio::spawn(async move {
        let mut watch = Some(watch);
        loop {
            if let Some(mut w) = watch.take() {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        next = w.next() => match next {
                            Some(Ok(entry)) => apply(&kept, &entry),
                            _ => break,
                        },
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            match store.watch_all().await {
                Ok(w) => {
                    let fresh = Keyring::new();
                    if load(&store, &fresh).await.is_ok() {
                        *kept.tokens.write().expect("keyring") = fresh.tokens.read().expect("keyring").clone();
                    }
                    watch = Some(w);
                }
                Err(e) => tracing::warn!(error = %e, "{TOKENS_BUCKET}: watch failed; tokens kept as last read"),
            }
        }
    });
    Ok(keyring)
}

async fn load(store: &kv::Store, keyring: &Keyring) -> Result<(), Error> {
    crate::read::latest(store, ">", |entry| apply(keyring, &entry)).await.map_err(|e| store_err("read")(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_256_random_bits_in_hex_after_the_prefix() {
        let a = generate().unwrap();
        let b = generate().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert_eq!(a.len(), TOKEN_PREFIX.len() + 64);
    }

    #[test]
    fn the_keyring_knows_a_token_by_its_text_and_forgets_a_removed_one() {
        let token = generate().unwrap();
        let keyring = Keyring::of_token("local", &token);
        assert_eq!(keyring.check(&token).map(|r| r.name), Some("local".to_string()));
        assert!(keyring.check("mur_wrong").is_none());
        assert!(!format!("{keyring:?}").contains(&token));
        keyring.remove("local");
        assert!(keyring.check(&token).is_none());
        assert!(keyring.is_empty());
    }
}
