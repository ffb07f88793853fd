//! Writing the session trace: stamps each [`Event`] with the common header (session id,
//! timestamp, `evt_` id, parent id) and hands the [`Line`] to a [`Sink`] — a
//! `trace.jsonl` file for `mur run`, the trace stream on the cluster, memory in tests.
//!
//! Parent ids follow the tree of the runtime reference, §1: session → task →
//! turn (`inference`) → call events (`tool_call`, `shell`, `shell_detached`). The later
//! records of detached work (`shell_completed`, `shell_abandoned`, `shell_lost`) hang under
//! the task running when they are written, or the session between tasks.

use mur_nats::clock::Clock;
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
            | Event::TaskTakeover { .. }
            | Event::SessionSuperseded { .. }
            | Event::ContextSeed { .. }
            | Event::Compaction { .. }
            | Event::CompactionDeclined { .. }
            | Event::SpendCeilingReached { .. }
            | Event::HookDispatchError { .. }
            | Event::ShellCompleted { .. }
            | Event::ShellAbandoned { .. }
            | Event::ShellLost { .. } => self.task_event.clone().or_else(|| self.session_event.clone()),
            Event::ToolCall { .. }
            | Event::Shell { .. }
            | Event::ShellDetached { .. }
            | Event::Sandbox { .. }
            | Event::ToolCallInDoubt { .. }
            | Event::JournalReplay { .. } => {
                self.turn_event.clone().or_else(|| self.task_event.clone()).or_else(|| self.session_event.clone())
            }
        };
        match &event {
            Event::SessionStart { .. } => self.session_event = Some(event_id.clone()),
            Event::TaskStart { .. } => {
                self.task_event = Some(event_id.clone());
                self.turn_event = None;
            }
            // A response replayed from the journal stands for the turn's `inference` line.
            Event::Inference { .. } => self.turn_event = Some(event_id.clone()),
            Event::JournalReplay { what, .. } if what == "model_response" => self.turn_event = Some(event_id.clone()),
            _ => {}
        }
        let is_task_end = matches!(event, Event::TaskEnd { .. } | Event::SessionSuperseded { .. });
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

#[cfg(test)]
mod tests {
    use super::*;
    use mur_nats::clock::SystemClock;
    use mur_proto::task::{Lane, Origin};
    use mur_proto::trace::{CallStatus, Decision, ProviderUsage};

    fn task_start() -> Event {
        Event::TaskStart {
            task_id: "tsk_1".into(),
            context_id: "ctx_1".into(),
            source: "cli".into(),
            message_parts_bytes: 1,
            origin: Origin::User,
            lane: Lane::User,
            trace_id: None,
        }
    }

    fn inference() -> Event {
        Event::Inference {
            turn: 0,
            task_id: "tsk_1".into(),
            input_tokens: 1,
            output_tokens: 1,
            decision: Decision::ToolCall,
            tool_name: Some("sh".into()),
            duration_ms: 1,
            usage: ProviderUsage::default(),
            origin: None,
        }
    }

    fn session_start() -> Event {
        Event::SessionStart {
            capsule_name: "c".into(),
            capsule_version: "1".into(),
            model: "scripted".into(),
            driver: "scripted".into(),
            max_turns: 1,
            capabilities: vec![],
            tools_declared: vec![],
            system_prompt_source: "none".into(),
            system_prompt_sha256: None,
            resumed_from: None,
            context_id: None,
        }
    }

    fn task_end() -> Event {
        Event::TaskEnd {
            task_id: "tsk_1".into(),
            exit_status: mur_proto::task::ExitStatus::Ok,
            duration_ms: 1,
            turns: 1,
            input_tokens: 1,
            output_tokens: 1,
            tool_calls: 1,
            shell_calls: 1,
            reopen_count: 0,
        }
    }

    fn completed() -> Event {
        Event::ShellCompleted {
            work_id: "wrk_1".into(),
            binary: "sh".into(),
            command: "sleep 1".into(),
            exit_code: 0,
            duration_ms: 1000,
            output_path: "logs/wrk_1.log".into(),
            output_bytes: 0,
            status: CallStatus::Ok,
            completion_task_id: "tsk_2".into(),
        }
    }

    #[test]
    fn shell_detached_hangs_under_its_turn_and_later_records_under_the_task_or_session() {
        let sink = MemorySink::default();
        let mut t = Tracer::new("ses_1".into(), Box::new(sink.clone()), Arc::new(SystemClock));
        let session = t.emit(session_start()).unwrap();
        let task = t.emit(task_start()).unwrap();
        let turn = t.emit(inference()).unwrap();
        t.emit(Event::ShellDetached {
            turn: 0,
            task_id: "tsk_1".into(),
            work_id: "wrk_1".into(),
            binary: "sh".into(),
            command: "sleep 1".into(),
            grace_ms: 0,
        })
        .unwrap();
        t.emit(completed()).unwrap();
        t.emit(task_end()).unwrap();
        t.emit(completed()).unwrap();
        t.emit(Event::ShellAbandoned {
            work_id: "wrk_2".into(),
            binary: "sh".into(),
            command: "sleep 9".into(),
            running_ms: 5,
        })
        .unwrap();
        let lines = sink.lines();
        let parents: Vec<(&str, Option<String>)> =
            lines.iter().map(|l| (l.event.event_type(), l.parent_id.clone())).collect();
        assert_eq!(
            parents,
            [
                ("session_start", None),
                ("task_start", Some(session.clone())),
                ("inference", Some(task.clone())),
                ("shell_detached", Some(turn)),
                ("shell_completed", Some(task.clone())),
                ("task_end", Some(task)),
                ("shell_completed", Some(session.clone())),
                ("shell_abandoned", Some(session)),
            ]
        );
    }
}
