//! The capsule's A2A surface: the HTTP endpoint ([`server`]) over a task [`Backend`], the
//! agent [`card`], the in-memory task [`intake`] that `mur run` serves (the coordinator's
//! backend, in its own crate, speaks to the cluster instead), and — with the `client`
//! feature — a small client for `mur task send`.
//!
//! Protocol: A2A 1.0 over JSON-RPC 2.0 (the specification at a2a-protocol.org and the
//! normative `specification/a2a.proto` of `a2aproject/A2A`), with the 0.3 method names and
//! shapes also served for older clients, as the official SDKs do. Behaviour on top of the
//! protocol (acceptance, lanes, origins, states) is the runtime reference, §5 and
//! the session-loop seed, §Capsule lifecycle and §Queue lanes.

pub mod auth;
pub mod backend;
pub mod card;
#[cfg(feature = "client")]
pub mod client;
pub mod intake;
pub mod jsonrpc;
pub mod server;
pub mod tls;
pub mod v03;
pub mod v1;

pub use backend::Backend;
pub use card::{AgentCard, AgentInfo};
#[cfg(feature = "client")]
pub use client::Client;
pub use server::Server;

/// The service parameter naming the protocol version a request uses (1.0 §3.2.6, §3.6).
pub const VERSION_HEADER: &str = "A2A-Version";

/// The request header carrying a task's origin (the session-loop seed, §Queue lanes).
pub const ORIGIN_HEADER: &str = "x-murmur-task-origin";

/// A2A 1.0, the version this endpoint prefers.
pub const VERSION_1_0: &str = "1.0";

/// A2A 0.3, also served.
pub const VERSION_0_3: &str = "0.3";
