//! The session loop: [`machine`] decides (pure), [`runner`] performs (async IO through the
//! driver, tools and trace sink traits).

pub mod compaction;
pub mod detach;
pub mod machine;
pub mod runner;
pub mod seed;
pub mod spend;

pub use machine::{Action, Outcome, TaskMachine, TaskSpec};
pub use runner::{
    Checkpoints, Durable, Journal, Resumed, Session, SessionConfig, Takeover, TaskReport, TurnCheckpoint, Unstored,
};
