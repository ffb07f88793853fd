//! The coordinator: task intake and lane-ordered dispatch, fleet loops, the kill-switch.
//!
//! So far it sets up the cluster's JetStream resources ([`resources::ensure`]); intake and
//! dispatch follow.

pub mod resources;

pub use resources::{Resources, Settings, ensure};
