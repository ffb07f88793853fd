//! The wiring of one session around the loop, shared by `mur run` and the cluster worker:
//! the tracer on a given [`Sink`], the inference gate (spend, compaction position), the
//! hook processes with their builtins and the gate, and the [`SessionConfig`].

use crate::capsule::Capsule;
use crate::driver::Driver;
use crate::hooks::{self, InferenceGate, process::ProcessHooks};
use crate::session::SessionConfig;
use crate::session::runner::Parts;
use crate::session::spend::{Gate, Position, Spend};
use crate::tokens;
use crate::tools::{CallContext, Toolbox};
use crate::trace::{Sink, Tracer};
use crate::workdir::Layout;
use mur_nats::clock::SystemClock;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// What a session is built from.
pub struct Setup<'a> {
    /// The loaded capsule.
    pub capsule: &'a Capsule,
    /// The capsule folder, absolute.
    pub capsule_dir: &'a Path,
    /// Where the session's files go (already created).
    pub layout: &'a Layout,
    /// `ses_…`.
    pub session_id: &'a str,
    /// The capsule's driver ([`Capsule::driver`]).
    pub driver: Arc<dyn Driver>,
    /// The session's tools.
    pub tools: Arc<Toolbox>,
    /// Where trace lines go.
    pub sink: Box<dyn Sink>,
    /// A system prompt replacing the manifest's (`mur run --system-prompt`).
    pub system_prompt: Option<&'a str>,
    /// The session this one resumes, if any.
    pub resumed_from: Option<String>,
    /// The session's sandbox ([`crate::sandbox::for_session`]): its commands and hooks
    /// start confined by it.
    pub sandbox: Option<Arc<crate::sandbox::Confinement>>,
}

/// Builds the session's configuration and parts as `mur run` does: a [`Tracer`] on
/// `setup.sink`, the spend [`Gate`], [`ProcessHooks`] with the builtins and the gate, and a
/// [`SessionConfig`] writing `out/result.txt` and `logs/` in the layout. Pass the pair to
/// [`crate::session::Session::start`].
pub fn build_session_parts(setup: Setup<'_>) -> (SessionConfig, Parts) {
    let Setup { capsule, capsule_dir, layout, session_id, driver, tools, sink, system_prompt, resumed_from, sandbox } =
        setup;
    let clock = Arc::new(SystemClock);
    let estimator = tokens::for_model(driver.kind(), capsule.manifest.inference.model.as_deref());
    let tracer = Arc::new(Mutex::new(Tracer::new(session_id.to_string(), sink, clock.clone())));
    let inf = &capsule.manifest.inference;
    let spend = Arc::new(Spend::new(inf.max_session_tokens));
    let position = Arc::new(Position::default());
    let model = inf.model.clone().unwrap_or_default();
    let gate: Arc<dyn InferenceGate> = Arc::new(Gate {
        driver: driver.clone(),
        tracer: tracer.clone(),
        spend: spend.clone(),
        estimator: estimator.clone(),
        model: model.clone(),
        system_prompt: inf.compaction.system_prompt.clone(),
        max_tokens: inf.max_tokens,
        position: position.clone(),
    });
    let hooks = Arc::new(ProcessHooks::new(
        capsule.manifest.hooks.clone(),
        hooks::process::Config {
            capsule_dir: capsule_dir.to_path_buf(),
            logs_dir: layout.logs_dir(),
            builtins: hooks::builtin::registry(gate.clone(), layout.workdir.clone()),
            gate: Some(gate),
            workdir: Some(layout.workdir.clone()),
            sandbox: sandbox.clone(),
        },
    ));
    let prompt = capsule.system_prompt(system_prompt);
    let cfg = SessionConfig {
        manifest: capsule.manifest.clone(),
        model,
        model_label: capsule.model_label(),
        system_prompt: prompt.text,
        system_prompt_source: prompt.source,
        system_prompt_sha256: prompt.sha256,
        call_context: CallContext {
            capsule_dir: capsule_dir.to_path_buf(),
            workdir: layout.workdir.clone(),
            logs_dir: layout.workdir_logs(),
            sandbox,
            tool_call_id: None,
        },
        result_path: Some(layout.result()),
        logs_dir: Some(layout.logs_dir()),
        resumed_from,
    };
    let parts = Parts { driver, tools, hooks, tracer, clock, estimator, spend, position };
    (cfg, parts)
}
