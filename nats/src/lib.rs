//! The NATS/JetStream adapters that more than one of murmur's crates use: the worker, the
//! coordinator and the CLI depend on this crate, and never on each other for these.
//!
//! - [`api`]: the client and reply scheme of the coordinator's NATS API (`mur.api.*`);
//! - [`trace_context`]: W3C trace context in NATS headers;
//! - [`bundle`]: the capsule index (`mur_capsule_index`) reads and its compare-and-set write;
//! - [`fanout`]: the cluster-wide fan-out semaphore;
//! - [`read`]: one-pass reads of a bucket's current state that leave no consumer behind;
//! - [`tasks`]: typed access to `mur_tasks`: read a record, the one compare-and-set loop;
//! - [`fleet`]: a fleet run's status and its coordinator's heartbeat in `mur_fleets`;
//! - [`fleet_tools`]: the built-in fleet tools' calls (the worker's and the MCP server's);
//! - [`backoff`]: the one backoff (exponential, capped, with jitter) of every retry loop;
//! - [`clock`]: wall-clock time behind a trait;
//! - [`connect`]: the connection options (server list, credentials, TLS);
//! - [`identity`]: who called an API request, as nats-server states it (`Nats-Request-Info`);
//! - [`health`]: a process's readiness (`/readyz`);
//! - [`metrics`]: the metrics instruments every process records to (issue #32);
//! - [`server_bin`]: where the `nats-server` binary is found (`mur dev`, the testkit);
//! - [`tls`]: the process's one rustls crypto provider;
//! - [`tokens`]: A2A bearer tokens in `mur_tokens`, and the keyring endpoints check them with.

pub mod api;
pub mod backoff;
pub mod bundle;
pub mod clock;
pub mod connect;
pub mod fanout;
pub mod fleet;
pub mod fleet_tools;
pub mod health;
pub mod identity;
pub mod metrics;
pub mod read;
pub mod server_bin;
pub mod tasks;
pub mod tls;
pub mod tokens;
pub mod trace_context;
