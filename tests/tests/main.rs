//! murmur's integration tests: one binary, one module per scenario.

/// `mur run` end to end with the scripted driver and real shell commands.
mod run;
