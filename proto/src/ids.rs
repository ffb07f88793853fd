//! Prefixed identifiers: `ses_`, `tsk_`, `ctx_`, `wrk_`, `msg_`, `evt_` followed by a
//! UUIDv7 in undashed lowercase hex (32 chars), as the runtime reference, §5 gives.
//! UUIDv7 ids sort by creation time, so "the latest session" is the greatest id.
//! Also the typed ids the cluster's records carry ([`TaskId`], [`SessionId`],
//! [`WorkerId`]): on the wire each is the plain string it wraps.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What an [`Id`] names; each kind has its own prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdKind {
    /// `ses_`: one launch of a capsule (one `trace.jsonl`).
    Session,
    /// `tsk_`: one task run by a session.
    Task,
    /// `ctx_`: a conversation that tasks may share.
    Context,
    /// `wrk_`: a detached shell command.
    Work,
    /// `msg_`: a message.
    Message,
    /// `evt_`: one trace line.
    Event,
}

impl IdKind {
    /// The prefix, underscore included (`"ses_"`).
    pub const fn prefix(self) -> &'static str {
        match self {
            IdKind::Session => "ses_",
            IdKind::Task => "tsk_",
            IdKind::Context => "ctx_",
            IdKind::Work => "wrk_",
            IdKind::Message => "msg_",
            IdKind::Event => "evt_",
        }
    }
}

/// Constructors for prefixed ids. An id is carried as a plain `String` on the wire.
pub struct Id;

impl Id {
    /// A fresh id of `kind`: prefix + 32 lowercase hex digits of a UUIDv7.
    pub fn generate(kind: IdKind) -> String {
        format!("{}{}", kind.prefix(), uuid::Uuid::now_v7().simple())
    }

    /// Whether `s` is a well-formed id of `kind` (prefix + exactly 32 lowercase hex digits).
    pub fn is_valid(kind: IdKind, s: &str) -> bool {
        s.strip_prefix(kind.prefix())
            .is_some_and(|hex| hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    }
}

/// A string refused as a typed id: which field it was for and the rule it broke.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: must be {rule}, got {value:?}")]
pub struct IdError {
    /// The field the id was for (`task_id`, `session_id`, `worker_id`).
    pub field: &'static str,
    /// The rule, for people (`a task id (tsk_ and 32 lowercase hex digits)`).
    pub rule: &'static str,
    /// The refused string.
    pub value: String,
}

/// Defines a typed id: a newtype over `String`, serialized as the bare string (so the wire
/// format is the string's), checked by `FromStr`/`TryFrom` against `$valid`, and looked up
/// in maps by `&str` (`Borrow<str>`).
macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, field = $field:literal, rule = $rule:literal, valid = $valid:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// The field name and rule [`IdError`] names when a string is refused.
            pub const FIELD: &'static str = $field;
            /// The rule a well-formed id keeps, for people.
            pub const RULE: &'static str = $rule;

            /// `s` checked against [`Self::RULE`]; the error names [`Self::FIELD`] and the rule.
            pub fn parse(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                let valid: fn(&str) -> bool = $valid;
                if valid(&s) { Ok(Self(s)) } else { Err(IdError { field: $field, rule: $rule, value: s }) }
            }

            /// `s` taken as it is, unchecked: an id murmur read back from its own records or
            /// a request it passes on unchanged (deserializing does the same, so records
            /// written before ids were typed still read), and tests' short ids.
            pub fn unchecked(s: impl Into<String>) -> Self {
                Self(s.into())
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The id's string.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::parse(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                Self::parse(s)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = IdError;
            fn try_from(s: &str) -> Result<Self, IdError> {
                Self::parse(s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl From<&$name> for String {
            fn from(id: &$name) -> String {
                id.0.clone()
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                self == other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }
    };
}

typed_id!(
    /// A task's id, `tsk_` and 32 lowercase hex digits ([`IdKind::Task`]): the key of its
    /// record in `mur_tasks`.
    TaskId,
    field = "task_id",
    rule = "a task id (tsk_ and 32 lowercase hex digits)",
    valid = |s| Id::is_valid(IdKind::Task, s)
);

typed_id!(
    /// A session's id, `ses_` and 32 lowercase hex digits ([`IdKind::Session`]): one launch
    /// of a capsule.
    SessionId,
    field = "session_id",
    rule = "a session id (ses_ and 32 lowercase hex digits)",
    valid = |s| Id::is_valid(IdKind::Session, s)
);

typed_id!(
    /// A worker's id, unique in the cluster: `wkr_` and a UUIDv7 by default, or what the
    /// operator names it (`mur worker --id`). It is the worker's key in `mur_workers`, so
    /// it keeps that bucket's key rule: no prefix, 1 to [`MAX_WORKER_ID_CHARS`] of ASCII
    /// letters, digits, `-`, `_`, `=` and `.`, with no empty dot-separated part.
    WorkerId,
    field = "worker_id",
    rule = "a worker id (1 to 128 of A-Z a-z 0-9 - _ = ., no leading, trailing or double dot)",
    valid = is_valid_worker_id
);

/// The longest [`WorkerId`], characters.
pub const MAX_WORKER_ID_CHARS: usize = 128;

fn is_valid_worker_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_WORKER_ID_CHARS
        && s.split('.').all(|part| !part.is_empty())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'=' | b'.'))
}

impl TaskId {
    /// A fresh task id ([`Id::generate`]).
    pub fn generate() -> TaskId {
        TaskId(Id::generate(IdKind::Task))
    }
}

impl SessionId {
    /// A fresh session id ([`Id::generate`]).
    pub fn generate() -> SessionId {
        SessionId(Id::generate(IdKind::Session))
    }
}

impl WorkerId {
    /// A fresh worker id: `wkr_` and 32 lowercase hex digits of a UUIDv7.
    pub fn generate() -> WorkerId {
        WorkerId(format!("wkr_{}", uuid::Uuid::now_v7().simple()))
    }
}

impl fmt::Display for IdKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.prefix())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_prefix_and_32_hex_digits() {
        for kind in [IdKind::Session, IdKind::Task, IdKind::Context, IdKind::Work, IdKind::Message, IdKind::Event] {
            let id = Id::generate(kind);
            assert!(id.starts_with(kind.prefix()), "{id}");
            assert_eq!(id.len(), kind.prefix().len() + 32, "{id}");
            assert!(Id::is_valid(kind, &id), "{id}");
        }
    }

    #[test]
    fn ids_sort_by_creation() {
        let a = Id::generate(IdKind::Session);
        let b = Id::generate(IdKind::Session);
        assert!(a < b);
    }

    #[test]
    fn malformed_ids_are_invalid() {
        assert!(!Id::is_valid(IdKind::Session, "ses_123"));
        assert!(!Id::is_valid(IdKind::Session, "tsk_0123456789abcdef0123456789abcdef"));
        assert!(!Id::is_valid(IdKind::Session, "ses_0123456789ABCDEF0123456789abcdef"));
    }

    #[test]
    fn malformed_typed_ids_are_refused_naming_the_field_and_the_rule() {
        let err = "tsk_123".parse::<TaskId>().unwrap_err();
        assert_eq!(err.to_string(), r#"task_id: must be a task id (tsk_ and 32 lowercase hex digits), got "tsk_123""#);
        let session = SessionId::generate();
        let err = TaskId::try_from(session.as_str()).unwrap_err();
        assert_eq!((err.field, err.rule), ("task_id", TaskId::RULE));
        let err = SessionId::try_from(TaskId::generate().into_string()).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("session_id: must be a session id (ses_ and 32 lowercase hex digits), got {:?}", err.value)
        );
        for bad in ["", "a b", ".w", "w.", "w..1", "w/1", "w*", &"w".repeat(MAX_WORKER_ID_CHARS + 1)] {
            let err = bad.parse::<WorkerId>().unwrap_err();
            assert_eq!(err.to_string(), format!("worker_id: must be {}, got {bad:?}", WorkerId::RULE));
        }
    }

    #[test]
    fn well_formed_typed_ids_parse_and_travel_as_their_string() {
        let task = TaskId::generate();
        assert_eq!(task.as_str().parse::<TaskId>().unwrap(), task);
        assert_eq!(serde_json::to_string(&task).unwrap(), format!("{:?}", task.as_str()));
        assert_eq!(serde_json::from_str::<TaskId>(&format!("{:?}", task.as_str())).unwrap(), task);
        assert!(SessionId::generate().as_str().parse::<SessionId>().is_ok());
        for good in ["dev-worker-0", "w", "wkr_0193", "rack1.node-2", WorkerId::generate().as_str()] {
            assert_eq!(good.parse::<WorkerId>().unwrap().as_str(), good);
        }
        // Maps keyed by a typed id look up by `&str`.
        let map = std::collections::HashMap::from([(task.clone(), 1)]);
        assert_eq!(map.get(task.as_str()), Some(&1));
    }
}
