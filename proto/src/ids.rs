//! Prefixed identifiers: `ses_`, `tsk_`, `ctx_`, `wrk_`, `msg_`, `evt_` followed by a
//! UUIDv7 in undashed lowercase hex (32 chars), as the runtime reference, §5 gives.
//! UUIDv7 ids sort by creation time, so "the latest session" is the greatest id.

use std::fmt;

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
}
