//! Spend ceilings and model calls on hooks' behalf (the context seed, the spend-ceiling
//! row; issue #4): `inference.max_session_tokens` bounds the tokens a session may spend,
//! counted with the runtime's own estimates (input + output of every call). A call that
//! would go past it is refused before it is sent, for the loop and for hooks alike.

use crate::driver::{Driver, ModelRequest};
use crate::hooks::{InferenceError, InferenceGate, InferenceRequest};
use crate::tokens::Estimator;
use crate::trace::Tracer;
use async_trait::async_trait;
use mur_proto::message::{Message, join_text};
use mur_proto::trace::{Decision, Event};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The session's token spend and its ceiling.
#[derive(Debug, Default)]
pub struct Spend {
    ceiling: Option<u64>,
    used: AtomicU64,
}

/// A refused call: what was used, what it asked for, the ceiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Tokens spent so far.
    pub used: u64,
    /// Tokens the call would add (its input).
    pub requested: u64,
    /// The ceiling.
    pub ceiling: u64,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "session used {} of {} tokens (inference.max_session_tokens); the next call needs {}",
            self.used, self.ceiling, self.requested
        )
    }
}

impl Spend {
    /// A tracker with `ceiling` (none: unbounded).
    pub fn new(ceiling: Option<u64>) -> Self {
        Spend { ceiling, used: AtomicU64::new(0) }
    }

    /// Checks a call carrying `input_tokens` before it is sent.
    ///
    /// # Errors
    /// [`Refusal`] when `used + input_tokens` would exceed the ceiling.
    pub fn check(&self, input_tokens: u64) -> Result<(), Refusal> {
        let used = self.used.load(Ordering::SeqCst);
        match self.ceiling {
            Some(ceiling) if used + input_tokens > ceiling => Err(Refusal { used, requested: input_tokens, ceiling }),
            _ => Ok(()),
        }
    }

    /// Records a call's input and output tokens.
    pub fn add(&self, tokens: u64) {
        self.used.fetch_add(tokens, Ordering::SeqCst);
    }

    /// Tokens spent so far.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }
}

/// What a hook's model call is tagged with on the trace.
#[derive(Debug, Default)]
pub struct Position {
    /// The running task.
    pub task_id: Mutex<Option<String>>,
    /// The current turn.
    pub turn: AtomicU32,
}

/// Makes model calls for hooks with the capsule's own driver, under the spend ceiling,
/// tracing each as an `inference` line with origin `hook:<name>`.
pub struct Gate {
    /// The capsule's driver.
    pub driver: Arc<dyn Driver>,
    /// The session's tracer.
    pub tracer: Arc<Mutex<Tracer>>,
    /// The session's spend.
    pub spend: Arc<Spend>,
    /// Token estimates.
    pub estimator: Arc<dyn Estimator>,
    /// Model name sent to the provider.
    pub model: String,
    /// Default system prompt of hook calls (`inference.compaction.system_prompt`).
    pub system_prompt: Option<String>,
    /// Default output cap (`inference.max_tokens`).
    pub max_tokens: u32,
    /// Where the session is, for tagging.
    pub position: Arc<Position>,
}

impl Gate {
    fn emit(&self, event: Event) {
        if let Err(e) = self.tracer.lock().expect("tracer lock").emit(event) {
            tracing::warn!(error = %e, "could not trace a hook's model call");
        }
    }
}

#[async_trait]
impl InferenceGate for Gate {
    async fn run_inference(&self, hook: &str, request: InferenceRequest) -> Result<String, InferenceError> {
        let system = request.system.or_else(|| self.system_prompt.clone()).unwrap_or_default();
        let input_tokens = self.estimator.count(&system)
            + request
                .messages
                .iter()
                .map(|m| self.estimator.count(&serde_json::to_string(m).unwrap_or_default()))
                .sum::<u64>();
        let task_id = self.position.task_id.lock().expect("position lock").clone();
        if let Err(r) = self.spend.check(input_tokens) {
            self.emit(Event::SpendCeilingReached {
                task_id: task_id.clone(),
                origin: format!("hook:{hook}"),
                used_tokens: r.used,
                requested_tokens: r.requested,
                ceiling_tokens: r.ceiling,
            });
            return Err(InferenceError::SpendCeiling(r.to_string()));
        }
        let task_text = request.messages.iter().next_back().map(Message::text).unwrap_or_default();
        let req = ModelRequest {
            model: &self.model,
            system: &system,
            messages: &request.messages,
            tools: &[],
            max_tokens: request.max_tokens.unwrap_or(self.max_tokens),
            task_text: &task_text,
            history_epoch: 0,
        };
        let t0 = Instant::now();
        let reply = self.driver.call(&req).await.map_err(|e| InferenceError::Driver(e.to_string()))?;
        let assistant = Message::assistant(reply.content);
        let output_tokens = self.estimator.count(&serde_json::to_string(&assistant).unwrap_or_default());
        self.spend.add(input_tokens + output_tokens);
        self.emit(Event::Inference {
            turn: self.position.turn.load(Ordering::SeqCst),
            task_id: task_id.unwrap_or_default(),
            input_tokens,
            output_tokens,
            decision: Decision::Text,
            tool_name: None,
            duration_ms: t0.elapsed().as_millis() as u64,
            usage: reply.usage,
            origin: Some(format!("hook:{hook}")),
        });
        Ok(join_text(&assistant.content))
    }
}
