//! The testkit: helpers shared by murmur's integration tests — a temporary capsule folder,
//! a runner for the built `mur` binary, readers for trace files, fake model servers that
//! speak the real wire formats over real sockets, and real `nats-server` processes.

pub mod capsule;
pub mod fake_anthropic;
pub mod fake_openai;
pub mod fake_otlp;
pub mod mcp;
pub mod mur;
pub mod nats;
pub mod permits;
pub mod procs;
pub mod sandbox;
pub mod tls;
/// The exact sleep, the worker's own (`delay_ms` of a scripted reply uses it too).
pub use mur_worker::timer;
