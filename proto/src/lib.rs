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
pub mod lanes;
pub mod manifest;
pub mod message;
pub mod page;
pub mod task;
pub mod trace;

pub use fleet::Fleet;
pub use ids::{Id, IdKind};
pub use manifest::Manifest;
pub use message::{Block, Message, Role};
pub use task::{ExitStatus, Lane, Origin};
