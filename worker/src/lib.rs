//! The worker side of murmur: the session loop of one capsule and everything it drives.
//!
//! The loop itself ([`session::machine`]) is a pure state machine; the model
//! ([`driver::Driver`]), tools ([`tools::Tools`]), trace sink ([`trace::Sink`]) and clock
//! ([`clock::Clock`]) sit behind traits, so `mur run` (local files) and the cluster worker
//! (NATS) share one loop, and the loop is tested without sockets.

pub mod bundle;
pub mod capsule;
pub mod driver;
pub mod hooks;
pub mod launch;
pub mod local;
pub mod preflight;
pub mod sandbox;
pub mod service;
pub mod session;
pub mod signal;
pub mod timer;
pub mod tokens;
pub mod tools;
pub mod trace;
pub mod usage;
pub mod workdir;
