//! murmur's integration tests: one binary, one module per scenario.

/// The `openai` driver against a fake OpenAI server over a real socket.
mod openai;
/// `mur run` end to end with the scripted driver and real shell commands.
mod run;

/// `mur run` against fake providers: retries in the trace, provider errors in the result.
mod drivers;
/// Model calls against what third-party servers send: tool-call shapes, broken, stalled
/// and oversized streams, error bodies, the output cap's key (issue #28).
mod model_calls;

/// Capsules as MCP clients: the testkit's rmcp servers over stdio and streamable HTTP (issue #35).
mod mcp;

/// Hook programs: reopening, seeding, compaction, spend ceilings, staging, errors.
mod hooks;
/// Sandboxed capsules: filesystem, network and resource limits enforced by the kernel.
mod sandboxing;

/// Capsule lifecycle over HTTP: acceptance modes, lanes, idle exit, shutdown.
mod lifecycle;

/// JetStream: the testkit's server, the coordinator's resources, capsule bundles.
mod cluster;
/// The web console in a real browser (chromium through chromedriver), issue #38.
mod console;
/// Detached shell commands and resume: handles, completions, abandonment, loss reports.
mod detach;

/// `mur fleet …`: definitions, jobs, the kill-switch and the channel in JetStream.
mod fleet;
/// Fleet runs that outlive their coordinator: adopted or failed by the new leader (issue #11).
mod fleet_adopt;
/// Fleet cost: prices, per-task usage, budgets, local fleets (issue #11 §Cost).
mod fleet_cost;
/// Fleets with a `procedure:`: ranks, dependency outputs, on_failure, approvals.
mod fleet_procedure;
/// Fleet triggers firing unattended on the leader (issue #10).
mod fleet_trigger;

/// The cluster end to end: dispatch in lane order, queue capsules, many tasks.
mod dispatch;

/// The cluster survives: real processes killed with SIGKILL; takeover, nothing lost.
mod chaos;

/// Operating a cluster (issue #32): `/metrics`, `/healthz` and `/readyz` of real processes.
mod observe;
/// One task is one trace: spans of real processes exported over OTLP/HTTP to a fake collector.
mod otel;

/// The cluster-wide fan-out cap: the semaphore, and a fleet run while workers die.
mod fanout;

/// How a fleet loop ends on the cluster: marker, deadline, kill-switch.
mod fleet_loop;

/// Read-only calls and fleet loops leave no JetStream consumers behind (issue #29 item 3).
mod consumers;

/// Adversarial fan-out tests: stalled holders, cancels and deadlines in line, hostile caps.
mod break_fanout;

/// A2A endpoints authenticate: bearer tokens made, checked, revoked (issue #31).
mod a2a_auth;
/// `mur auth init`: per-role permissions enforced by nats-server, over TLS (issue #31).
mod roles;
/// TLS, credentials and refused connections against a real, configured nats-server (issue #31).
mod security;
