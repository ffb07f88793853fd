//! A2A bearer tokens (issue #31 §A2A endpoints authenticate): what `mur auth token create`
//! stores in [`TOKENS_BUCKET`] — never the token, only its SHA-256 — and the rules a token
//! grants: the capsules it may reach and what it may do there.

use super::*;

/// KV bucket of A2A tokens ([`TokenRecord`]); key = the token's name.
pub const TOKENS_BUCKET: &str = "mur_tokens";

/// The rule of a token's name (it is the key in [`TOKENS_BUCKET`], and what the logs and
/// `mur auth token ls` show).
pub const TOKEN_NAME_RULE: &str = "must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit";

/// Whether `name` may name a token ([`TOKEN_NAME_RULE`]; the capsule names' rule).
pub fn is_valid_token_name(name: &str) -> bool {
    is_valid_name(name)
}

/// What a token may do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Send, cancel, get, list, follow (and `/mcp`).
    #[default]
    Admin,
    /// Get, list and follow tasks only (a console's view): no send, no cancel.
    Read,
}

impl Scope {
    /// `admin` or `read`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Scope::Admin => "admin",
            Scope::Read => "read",
        }
    }
}

/// What a request does, as a token's [`Scope`] judges it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Reads: get, list, follow a task; the card.
    Read,
    /// Changes: send (start a task), cancel.
    Write,
}

/// One token in [`TOKENS_BUCKET`]: its name, the SHA-256 of the token (the token itself is
/// shown once, at creation, and kept nowhere), and what it grants.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// The token's name (the bucket's key).
    pub name: String,
    /// SHA-256 of the token's text, lowercase hex.
    pub sha256: String,
    /// The capsules it may reach; empty = every capsule.
    #[serde(default)]
    pub capsules: Vec<String>,
    /// What it may do there.
    #[serde(default)]
    pub scope: Scope,
    /// When it was made, unix milliseconds.
    pub created_at: u64,
}

/// Why a token may not do what a request asks (HTTP 403).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// The token names other capsules.
    #[error("token {name:?} is not valid for capsule {capsule:?}")]
    Capsule {
        /// The token's name.
        name: String,
        /// The capsule asked for.
        capsule: String,
    },
    /// A read-only token asked to send or cancel.
    #[error("token {name:?} is read-only: it may get, list and follow tasks, not send or cancel them")]
    ReadOnly {
        /// The token's name.
        name: String,
    },
    /// A token limited to some capsules asked for the whole cluster (`/mcp`).
    #[error(
        "token {name:?} is limited to capsules {capsules:?}: the whole cluster needs a token made without --capsule"
    )]
    NotClusterWide {
        /// The token's name.
        name: String,
        /// Its capsules.
        capsules: Vec<String>,
    },
}

impl TokenRecord {
    /// Whether the token may reach every capsule.
    pub fn is_cluster_wide(&self) -> bool {
        self.capsules.is_empty()
    }

    /// Whether the token may do `access` on `capsule` (`None`: the whole cluster, as
    /// `/mcp` reaches it).
    ///
    /// # Errors
    /// [`Denied`] naming the rule the token breaks.
    pub fn allows(&self, capsule: Option<&str>, access: Access) -> Result<(), Denied> {
        match capsule {
            Some(capsule) if !self.capsules.is_empty() && !self.capsules.iter().any(|c| c == capsule) => {
                return Err(Denied::Capsule { name: self.name.clone(), capsule: capsule.to_string() });
            }
            None if !self.is_cluster_wide() => {
                return Err(Denied::NotClusterWide { name: self.name.clone(), capsules: self.capsules.clone() });
            }
            _ => {}
        }
        if access == Access::Write && self.scope == Scope::Read {
            return Err(Denied::ReadOnly { name: self.name.clone() });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(capsules: &[&str], scope: Scope) -> TokenRecord {
        TokenRecord {
            name: "ci".into(),
            sha256: "00".into(),
            capsules: capsules.iter().map(|c| c.to_string()).collect(),
            scope,
            created_at: 0,
        }
    }

    #[test]
    fn a_token_reaches_its_capsules_only_and_a_read_token_cannot_send() {
        let a = token(&["a"], Scope::Admin);
        assert_eq!(a.allows(Some("a"), Access::Write), Ok(()));
        assert!(matches!(a.allows(Some("b"), Access::Read), Err(Denied::Capsule { .. })));
        assert!(matches!(a.allows(None, Access::Read), Err(Denied::NotClusterWide { .. })));
        let all = token(&[], Scope::Admin);
        assert_eq!(all.allows(Some("b"), Access::Write), Ok(()));
        assert_eq!(all.allows(None, Access::Write), Ok(()));
        let read = token(&[], Scope::Read);
        assert_eq!(read.allows(Some("b"), Access::Read), Ok(()));
        let err = read.allows(Some("b"), Access::Write).unwrap_err();
        assert!(err.to_string().contains("read-only"), "{err}");
    }

    #[test]
    fn token_names_follow_the_capsule_names_rule() {
        assert!(is_valid_token_name("ci-bot_1"));
        assert!(!is_valid_token_name(""));
        assert!(!is_valid_token_name("Has.Dot"));
        assert!(!is_valid_token_name(&"x".repeat(65)));
    }
}
