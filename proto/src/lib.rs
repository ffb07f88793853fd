//! murmur's wire and file formats: capsule manifests, messages, trace events, task
//! vocabulary and ids, the cluster's resource names and API records, fleet definitions and
//! jobs. Pure: no IO, no async, no clock reads (callers pass time in).

pub mod cluster;
pub mod cost;
pub mod fanout;
pub mod fleet;
pub mod fleet_store;
pub mod hook;
pub mod ids;
mod int;
pub mod lanes;
pub mod manifest;
pub mod message;
pub mod page;
pub mod task;
pub mod trace;

/// `text` without a leading UTF-8 byte order mark: YAML allows one (YAML 1.2 §5.2) and
/// editors on Windows write one, but `serde_yaml_ng` reads it as content and then reports
/// "more than one document". Every YAML file murmur reads (manifests, replies files, fleet
/// definitions, the cluster config) goes through this first.
pub fn without_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

pub use fleet::Fleet;
pub use ids::{Id, IdError, IdKind, SessionId, TaskId, WorkerId};
pub use manifest::Manifest;
pub use message::{Block, Message, Role};
pub use task::{ExitStatus, Lane, Origin};
