//! Who called: the authenticated identity of an API request, as nats-server states it
//! (issue #31: an approval, a denial, a `fleet stop`/`start` and a job's source are recorded
//! with the credential's name, never a name the caller claims).
//!
//! NATS does not tell a subscriber who published a message, except across accounts: when a
//! request crosses a service import whose import has `share: true`, nats-server sets the
//! `Nats-Request-Info` header to the requester's account and user (for an nkey user, its
//! public key), replacing any header of that name the requester sent. `mur auth init`
//! writes a configuration where the roles' account `MUR` imports the API subjects that
//! record a name ([`IDENTITY_SUBJECTS`]) from an account `MUR_ID` whose one user is the
//! coordinator's identity connection; that user's file (`identity.creds`) also holds which
//! public key is which name ([`Identities`]). A coordinator given that file serves those
//! subjects on the identity connection only, so each such request it answers carries the
//! broker's statement of who sent it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The header nats-server sets on a request that crosses a service import.
pub const REQUEST_INFO_HEADER: &str = "Nats-Request-Info";

/// The API subjects whose handler records who called: served on the identity connection
/// when the coordinator has one. `mur auth init` exports and imports exactly these.
pub const IDENTITY_SUBJECTS: [&str; 5] =
    ["mur.api.fleet.approve", "mur.api.fleet.deny", "mur.api.fleet.stop", "mur.api.fleet.start", "mur.api.fleet.send"];

/// The block of an identity file naming each public key.
const BEGIN: &str = "-----BEGIN MURMUR IDENTITIES-----";
const END: &str = "------END MURMUR IDENTITIES------";

/// Which name each nkey user goes by: `public key → name`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identities {
    names: BTreeMap<String, String>,
}

/// Why an identity file or a request's identity was refused.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file cannot be read.
    #[error("--identity {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file breaks its format.
    #[error("--identity {path}: {rule}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The rule, with the line.
        rule: String,
    },
    /// A request came without the broker's statement of who sent it.
    #[error(
        "this coordinator records who calls {subject} from nats-server's {REQUEST_INFO_HEADER} header, and the \
         request had none (the server's configuration lacks the service import `mur auth init` writes)"
    )]
    Missing {
        /// The subject called.
        subject: String,
    },
    /// The header does not parse.
    #[error("{REQUEST_INFO_HEADER}: {0}")]
    Malformed(String),
}

impl Identities {
    /// The identities `text` names, in the block [`Identities::block`] writes: one `KEY NAME`
    /// line each.
    ///
    /// # Errors
    /// [`Error::Format`] for a line that is not a public nkey user key and a name, or a key
    /// named twice.
    pub fn parse(text: &str, path: &Path) -> Result<Identities, Error> {
        let format = |rule: String| Error::Format { path: path.to_path_buf(), rule };
        let mut names = BTreeMap::new();
        let mut inside = false;
        for (n, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
            if line == BEGIN {
                inside = true;
                continue;
            }
            if line == END {
                inside = false;
                continue;
            }
            if !inside || line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(key), Some(name), None) = (words.next(), words.next(), words.next()) else {
                return Err(format(format!("line {n}: must be a public nkey and a name, got {line:?}")));
            };
            if !is_user_key(key) {
                return Err(format(format!("line {n}: {key:?} is not a public nkey user key (U…, 56 characters)")));
            }
            if names.insert(key.to_string(), name.to_string()).is_some() {
                return Err(format(format!("line {n}: {key} is named twice")));
            }
        }
        Ok(Identities { names })
    }

    /// Reads an identity file (`identity.creds`: the identity connection's seed, then the
    /// names).
    ///
    /// # Errors
    /// [`Error::Read`], or [`Identities::parse`]'s.
    pub fn from_file(path: &Path) -> Result<Identities, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read { path: path.to_path_buf(), source })?;
        Identities::parse(&text, path)
    }

    /// `name` goes by `key`.
    pub fn insert(&mut self, key: impl Into<String>, name: impl Into<String>) {
        self.names.insert(key.into(), name.into());
    }

    /// The block an identity file holds, for [`Identities::parse`].
    pub fn block(&self) -> String {
        let mut out = format!("{BEGIN}\n");
        for (key, name) in &self.names {
            out.push_str(&format!("{key} {name}\n"));
        }
        out.push_str(END);
        out.push('\n');
        out
    }

    /// The name of the caller of a request on `subject` with `headers`, from the header
    /// nats-server set: the name of its nkey user, else (a user the file does not name) the
    /// user as the server states it — a user name, or the public key. Never a name the
    /// caller wrote: the server replaces a header of this name that the caller sent.
    ///
    /// # Errors
    /// [`Error::Missing`] without the header, [`Error::Malformed`] when it does not parse
    /// or names no user.
    pub fn caller(&self, subject: &str, headers: Option<&async_nats::HeaderMap>) -> Result<String, Error> {
        let info = headers
            .and_then(|h| h.get(REQUEST_INFO_HEADER))
            .ok_or_else(|| Error::Missing { subject: subject.to_string() })?;
        #[derive(serde::Deserialize)]
        struct Info {
            #[serde(default)]
            user: String,
        }
        let info: Info = serde_json::from_str(info.as_str()).map_err(|e| Error::Malformed(e.to_string()))?;
        if info.user.is_empty() {
            return Err(Error::Malformed(
                "names no user (the import lacks `share: true`, or the server has no authentication)".into(),
            ));
        }
        Ok(self.names.get(&info.user).cloned().unwrap_or(info.user))
    }
}

/// Whether `key` is shaped as a public nkey user key.
fn is_user_key(key: &str) -> bool {
    key.len() == 56 && key.starts_with('U') && key.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4";

    #[test]
    fn a_named_key_is_its_name_and_an_unnamed_user_is_what_the_server_says() {
        let mut ids = Identities::default();
        ids.insert(KEY, "approver");
        let text = format!("-----BEGIN USER NKEY SEED-----\nSUxxx\n------END USER NKEY SEED------\n\n{}", ids.block());
        let ids = Identities::parse(&text, Path::new("identity.creds")).unwrap();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(REQUEST_INFO_HEADER, format!(r#"{{"acc":"MUR","user":"{KEY}","rtt":1}}"#).as_str());
        assert_eq!(ids.caller("s", Some(&headers)).unwrap(), "approver");
        headers.insert(REQUEST_INFO_HEADER, r#"{"acc":"MUR","user":"alice"}"#);
        assert_eq!(ids.caller("s", Some(&headers)).unwrap(), "alice");
    }

    #[test]
    fn a_request_without_the_servers_statement_is_refused() {
        let ids = Identities::default();
        let e = ids.caller("mur.api.fleet.approve", None).unwrap_err();
        assert!(e.to_string().contains("had none"), "{e}");
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(REQUEST_INFO_HEADER, r#"{"acc":"MUR"}"#);
        assert!(matches!(ids.caller("s", Some(&headers)), Err(Error::Malformed(_))));
    }

    #[test]
    fn a_line_that_is_not_a_key_and_a_name_is_refused_naming_it() {
        let text = format!("{BEGIN}\nnot-a-key bob\n{END}\n");
        let e = Identities::parse(&text, Path::new("f")).unwrap_err().to_string();
        assert!(e.contains("line 2: \"not-a-key\" is not a public nkey user key"), "{e}");
        let text = format!("{BEGIN}\n{KEY} a b\n{END}\n");
        assert!(Identities::parse(&text, Path::new("f")).is_err());
    }
}
