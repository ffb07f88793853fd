//! `mur`: the command-line front end. Thin: parse the command line, call the libraries,
//! print data on stdout and errors and progress on stderr.

mod auth;
mod capsule;
mod cluster;
mod fleet;
mod follow;
mod health;
mod mcp;
mod nats;
mod observe;
mod run;
mod task;
mod telemetry;
mod text;
mod trace;

use clap::{Parser, Subcommand};
use mur_proto::cluster::{ApiError, ErrorCode};
use std::process::ExitCode;

/// mimalloc, not glibc's malloc: a worker's sessions allocate from many threads at once, and
/// glibc's arenas took 13 % of a loaded cluster's CPU, part of it waiting on their locks
/// (issue #9's profile of the slow-model run).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// murmur runs LLM agent capsules and fleets of them, on one machine or a cluster.
#[derive(Parser, Debug)]
#[command(name = "mur", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a capsule on this machine: one session, taking tasks as its lifecycle says.
    Run(run::Args),
    /// Run the embedded cluster: nats-server, a coordinator and workers in one process.
    Dev(cluster::DevArgs),
    /// Run a coordinator: task intake and lane-ordered dispatch.
    Coordinator(cluster::CoordinatorArgs),
    /// Run a worker: pulls capsule tasks and runs their sessions.
    Worker(cluster::WorkerArgs),
    /// A fleet run's state and liveness: `mur job status RUN_ID`.
    #[command(subcommand)]
    Job(fleet::JobCommand),
    /// Look at the cluster: `mur cluster status`.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Push and list capsule bundles on the cluster.
    #[command(subcommand)]
    Capsule(capsule::Command),
    /// Define fleets, queue their jobs, stop and start them, read their channels.
    #[command(subcommand)]
    Fleet(fleet::Command),
    /// Send tasks to capsules and follow them.
    #[command(subcommand)]
    Task(task::Command),
    /// Read a session's trace.jsonl.
    #[command(subcommand)]
    Trace(trace::Command),
    /// Serve the cluster to MCP clients: `mur mcp serve` (stdio).
    #[command(subcommand)]
    Mcp(mcp::Command),
    /// Ask a process's /readyz or /healthz: exit 0 when it answers 2xx, 1 when not (health
    /// checks in images without curl).
    Health(health::Args),
    /// Secure a cluster: `mur auth init DIR` writes a nats-server configuration with one
    /// user per role and their credentials files.
    #[command(subcommand)]
    Auth(auth::Command),
}

/// Lets SIGPIPE end the process, as it ends `ls` or `cat`: `mur task ls | head -1` stops
/// quietly when `head` has read its line, instead of panicking on the failed print (Rust
/// ignores SIGPIPE by default). Only for the commands that read and print: the ones that run
/// sessions (`run`, `dev`, `worker`, `coordinator`) write to hook and tool processes, where
/// a child that exits early must be an error to handle, not the end of murmur.
fn print_until_the_reader_leaves(command: &Command) {
    let prints = matches!(
        command,
        Command::Task(_)
            | Command::Fleet(_)
            | Command::Cluster(_)
            | Command::Job(_)
            | Command::Capsule(_)
            | Command::Trace(_)
    );
    if prints {
        // SAFETY: signal(2) with SIG_DFL installs no handler of ours; it runs before any
        // other thread exists.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
}

fn main() -> ExitCode {
    // Before any thread or connection: the one TLS provider (issue #31).
    mur_nats::tls::install_crypto_provider();
    let json = json_requested(std::env::args_os().skip(1));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version go to stdout as clap prints them; a refused command line is a
        // JSON error too when `--json` is on it.
        Err(e) if json && e.use_stderr() => {
            // clap's message up to its usage hint: the rule and its context
            // (`[possible values: …]`), on one line.
            let text = e.render().to_string();
            let said: Vec<&str> = text.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
            let said = said.join(" ");
            report_json(said.strip_prefix("error: ").unwrap_or(&said), Some(ErrorCode::InvalidRequest));
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    print_until_the_reader_leaves(&cli.command);
    let serve = |listener: &Option<String>| {
        if listener.is_some() { telemetry::Metrics::Serve } else { telemetry::Metrics::Export }
    };
    let metrics = match &cli.command {
        Command::Coordinator(a) => serve(&a.metrics),
        Command::Worker(a) => serve(&a.metrics),
        Command::Dev(a) => serve(&a.metrics),
        _ => telemetry::Metrics::Off,
    };
    let telemetry = telemetry::init(
        match cli.command {
            Command::Coordinator(_) => "mur-coordinator",
            Command::Worker(_) => "mur-worker",
            _ => "mur",
        },
        metrics,
    );
    let registry = telemetry.registry();
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Task(cmd) => task::run(cmd),
        Command::Fleet(cmd) => fleet::run(cmd),
        Command::Dev(args) => cluster::dev(args, registry),
        Command::Coordinator(args) => cluster::coordinator(args, registry),
        Command::Worker(args) => cluster::worker(args, registry),
        Command::Cluster(cmd) => cluster::cluster(cmd),
        Command::Job(cmd) => fleet::job(cmd),
        Command::Capsule(cmd) => capsule::run(cmd),
        Command::Trace(cmd) => trace::run(cmd),
        Command::Mcp(cmd) => mcp::run(cmd),
        Command::Auth(cmd) => auth::run(cmd),
        Command::Health(args) => health::run(args),
    };
    telemetry.shutdown();
    match result {
        Ok(code) => code,
        Err(err) => report(&err, json),
    }
}

/// Whether `--json` is on the command line (before a `--`, after which every argument is a
/// value). Read from the arguments, not the parsed command, so that a command line clap
/// refuses is answered in JSON too. One taken as the value of an option that accepts
/// values starting with `-` (`mur fleet set-loop F --done-when --json`) counts as well: that
/// command's failure is then said in JSON.
fn json_requested(args: impl IntoIterator<Item = std::ffi::OsString>) -> bool {
    args.into_iter().take_while(|a| a != "--").any(|a| a == "--json")
}

/// Says why a command failed, on stderr: `mur: <what went wrong>`, or with `--json` one
/// JSON object a script can read (the last line on stderr: progress lines, such as a
/// submission's retries, may come before it), `{"error": "<what went wrong>", "code": <code>}`, where
/// `code` is the coordinator's error code (`"not_found"`, `"invalid_request"`, …;
/// `proto::cluster::ErrorCode`) when it refused the request, `"invalid_request"` for a
/// command line clap or the CLI ([`Invalid`]) refused, and `null` otherwise (no server, a
/// file unreadable, …).
/// Returns exit status 2.
fn report(err: &anyhow::Error, json: bool) -> ExitCode {
    refused(json, api_code(err), "mur: ", &format!("{err:#}"))
}

/// A refusal a command says itself rather than return as an error (it has printed part of
/// its answer already, or words it its own way): `<prefix><message>` on stderr, or with
/// `--json` [`report`]'s object with `message` and `code`. Returns exit status 2.
pub(crate) fn refused(json: bool, code: Option<ErrorCode>, prefix: &str, message: &str) -> ExitCode {
    if json {
        report_json(message, code);
    } else {
        eprintln!("{prefix}{message}");
    }
    ExitCode::from(2)
}

/// The error code in `err`'s chain: the coordinator's when it refused the request,
/// `invalid_request` for a command line the CLI refused itself ([`Invalid`]).
pub(crate) fn api_code(err: &anyhow::Error) -> Option<ErrorCode> {
    let invalid = || err.chain().any(|e| e.is::<Invalid>()).then_some(ErrorCode::InvalidRequest);
    err.chain().find_map(|e| e.downcast_ref::<ApiError>()).map(|e| e.code).or_else(invalid)
}

/// A command line the CLI refuses itself, past what clap checks (an argument's own rule,
/// such as a run id's characters): said as is, and under `--json` with the code
/// `invalid_request`, as a command line clap refuses.
#[derive(Debug)]
pub(crate) struct Invalid(pub(crate) String);

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Invalid {}

/// [`report`]'s JSON object.
fn report_json(error: &str, code: Option<ErrorCode>) {
    eprintln!("{}", serde_json::json!({"error": error, "code": code.map(ErrorCode::as_str)}));
}
