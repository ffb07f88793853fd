//! Hook programs as child processes (to be written: issue #4).

use super::{Builtin, Fault, Hooks, InferenceGate, Reply};
use async_trait::async_trait;
use mur_proto::hook::Event;
use mur_proto::manifest::Hook;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where hook programs run and log.
#[derive(Clone)]
pub struct Config {
    /// The capsule folder: hooks' working directory; relative commands resolve here.
    pub capsule_dir: PathBuf,
    /// `logs/` of the session: `hook-<name>.log` files go here.
    pub logs_dir: PathBuf,
    /// Built-in hooks by command (`builtin:compact`).
    pub builtins: HashMap<String, Arc<dyn Builtin>>,
    /// Model calls on hooks' behalf; `None` disables `$MURMUR_INFERENCE_URL`.
    pub gate: Option<Arc<dyn InferenceGate>>,
}

/// The manifest's hooks, run as processes.
pub struct ProcessHooks {
    hooks: Vec<Hook>,
    config: Config,
}

impl ProcessHooks {
    /// Hooks for `hooks` (manifest order).
    pub fn new(hooks: Vec<Hook>, config: Config) -> Self {
        ProcessHooks { hooks, config }
    }
}

#[async_trait]
impl Hooks for ProcessHooks {
    async fn dispatch(&self, _session_id: &str, _event: &Event) -> Vec<Reply> {
        let _ = (&self.hooks, &self.config.capsule_dir);
        Vec::new()
    }
    fn take_faults(&self) -> Vec<Fault> {
        Vec::new()
    }
    async fn drain(&self, _deadline: Duration) -> Vec<Fault> {
        Vec::new()
    }
}
