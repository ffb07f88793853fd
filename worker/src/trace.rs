//! Writing the session trace: stamps each [`Event`] with the common header (session id,
//! timestamp, `evt_` id, parent id) and hands the [`Line`] to a [`Sink`] — a
//! `trace.jsonl` file for `mur run`, the trace stream on the cluster, memory in tests.
//!
//! Parent ids follow the tree of `reference/murmur-runtime.md` §1: session → task →
//! turn (`inference`) → call events (`tool_call`, `shell`).

use crate::clock::Clock;
use mur_proto::ids::{Id, IdKind};
use mur_proto::trace::{Event, Line};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A trace write failed; the session cannot go on without its record.
#[derive(Debug, thiserror::Error)]
#[error("writing the trace failed: {0}")]
pub struct Error(pub String);

/// Where trace lines go.
pub trait Sink: Send {
    /// Appends one line.
    ///
    /// # Errors
    /// [`Error`] when the line could not be stored.
    fn write(&mut self, line: &Line) -> Result<(), Error>;
}

/// Appends JSON lines to a file, one `write` per line.
pub struct FileSink {
    file: std::fs::File,
    buf: Vec<u8>,
}

impl FileSink {
    /// Opens (creating) `path` for appending.
    ///
    /// # Errors
    /// [`Error`] when the file cannot be opened.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error(format!("{}: {e}", path.display())))?;
        Ok(FileSink { file, buf: Vec::with_capacity(512) })
    }
}

impl Sink for FileSink {
    fn write(&mut self, line: &Line) -> Result<(), Error> {
        self.buf.clear();
        serde_json::to_writer(&mut self.buf, line).map_err(|e| Error(e.to_string()))?;
        self.buf.push(b'\n');
        self.file.write_all(&self.buf).map_err(|e| Error(e.to_string()))
    }
}

/// Keeps lines in memory (tests, and callers that forward them elsewhere).
#[derive(Clone, Default)]
pub struct MemorySink(pub Arc<Mutex<Vec<Line>>>);

impl MemorySink {
    /// A copy of the lines written so far.
    pub fn lines(&self) -> Vec<Line> {
        self.0.lock().expect("trace memory sink poisoned").clone()
    }
}

impl Sink for MemorySink {
    fn write(&mut self, line: &Line) -> Result<(), Error> {
        self.0.lock().expect("trace memory sink poisoned").push(line.clone());
        Ok(())
    }
}

/// Writes to several sinks; fails if any fails.
pub struct Tee(pub Vec<Box<dyn Sink>>);

impl Sink for Tee {
    fn write(&mut self, line: &Line) -> Result<(), Error> {
        for s in &mut self.0 {
            s.write(line)?;
        }
        Ok(())
    }
}

/// Stamps events and tracks parents.
pub struct Tracer {
    sink: Box<dyn Sink>,
    clock: Arc<dyn Clock>,
    session_id: String,
    session_event: Option<String>,
    task_event: Option<String>,
    turn_event: Option<String>,
}

impl Tracer {
    /// A tracer for `session_id` writing to `sink`.
    pub fn new(session_id: String, sink: Box<dyn Sink>, clock: Arc<dyn Clock>) -> Self {
        Tracer { sink, clock, session_id, session_event: None, task_event: None, turn_event: None }
    }

    /// The session id stamped on every line.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Writes `event` and returns its `event_id`.
    ///
    /// # Errors
    /// [`Error`] from the sink.
    pub fn emit(&mut self, event: Event) -> Result<String, Error> {
        let event_id = Id::generate(IdKind::Event);
        let parent_id = match &event {
            Event::SessionStart { .. } => None,
            Event::TaskStart { .. } | Event::SessionEnd { .. } => self.session_event.clone(),
            Event::Inference { .. }
            | Event::TaskEnd { .. }
            | Event::ModelAttempt { .. }
            | Event::TaskReopened { .. }
            | Event::ContextSeed { .. }
            | Event::Compaction { .. }
            | Event::CompactionDeclined { .. }
            | Event::SpendCeilingReached { .. }
            | Event::HookDispatchError { .. } => self.task_event.clone().or_else(|| self.session_event.clone()),
            Event::ToolCall { .. } | Event::Shell { .. } => {
                self.turn_event.clone().or_else(|| self.task_event.clone()).or_else(|| self.session_event.clone())
            }
        };
        match &event {
            Event::SessionStart { .. } => self.session_event = Some(event_id.clone()),
            Event::TaskStart { .. } => {
                self.task_event = Some(event_id.clone());
                self.turn_event = None;
            }
            Event::Inference { .. } => self.turn_event = Some(event_id.clone()),
            _ => {}
        }
        let is_task_end = matches!(event, Event::TaskEnd { .. });
        let line = Line {
            event,
            session_id: self.session_id.clone(),
            timestamp: self.clock.now_ms(),
            event_id: event_id.clone(),
            parent_id,
        };
        self.sink.write(&line)?;
        if is_task_end {
            self.task_event = None;
            self.turn_event = None;
        }
        Ok(event_id)
    }
}
