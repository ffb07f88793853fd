//! `mur`: the command-line front end. Thin: parse the command line, call the libraries,
//! print data on stdout and errors and progress on stderr.

mod capsule;
mod cluster;
mod fleet;
mod follow;
mod nats;
mod run;
mod task;
mod telemetry;
mod trace;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let telemetry = telemetry::init(match cli.command {
        Command::Coordinator(_) => "mur-coordinator",
        Command::Worker(_) => "mur-worker",
        _ => "mur",
    });
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Task(cmd) => task::run(cmd),
        Command::Fleet(cmd) => fleet::run(cmd),
        Command::Dev(args) => cluster::dev(args),
        Command::Coordinator(args) => cluster::coordinator(args),
        Command::Worker(args) => cluster::worker(args),
        Command::Cluster(cmd) => cluster::cluster(cmd),
        Command::Job(cmd) => fleet::job(cmd),
        Command::Capsule(cmd) => capsule::run(cmd),
        Command::Trace(cmd) => trace::run(cmd),
    };
    telemetry.shutdown();
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("mur: {err:#}");
            ExitCode::from(2)
        }
    }
}
