//! The coordinator: task intake and lane-ordered dispatch, fleet loops, the kill-switch.
//! So far the pure dispatch state machine ([`scheduler`]); the NATS adapter and the rest
//! arrive with the cluster issue (#7).

pub mod scheduler;
