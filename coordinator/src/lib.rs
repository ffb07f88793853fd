//! The coordinator: task intake and lane-ordered dispatch over NATS JetStream (fleet loops
//! and the kill-switch follow). [`scheduler`] is the pure dispatch state machine,
//! [`resources`] sets up the cluster's streams and buckets, [`service`] is the NATS
//! adapter that runs them, [`http`] the A2A HTTP endpoint that takes tasks for it, [`console`] the web console it
//! serves at `/ui/`.

pub mod console;
pub mod dead_letter;
pub mod fleet;
pub mod gauges;
pub mod http;
pub mod lease;
pub mod resources;
pub mod scheduler;
pub mod service;

pub use resources::{Resources, Settings, ensure};
