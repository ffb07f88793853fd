//! The testkit: helpers shared by murmur's integration tests — a temporary capsule folder,
//! a runner for the built `mur` binary, readers for trace files, and fake model servers
//! that speak the real wire formats over real sockets.

pub mod capsule;
pub mod fake_openai;
pub mod mur;
