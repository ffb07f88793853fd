//! The bookkeeping of detached shell commands, without IO: which commands run in the
//! background, the `completion` task each one's end produces, the `shell_abandoned` records
//! of a session that ends with commands still running, and — for a resume — which commands
//! of an earlier session were never accounted for and the one task reporting their loss.
//!
//! Rules (the session-loop seed, §Detached shell and §What a resume reports;
//! the runtime reference, §1 and "Detached shell"):
//! - a finished command becomes one task with origin `completion` (so lane `bg`) under the
//!   `contextId` it was started from, source `detached_shell`; its text names the work id,
//!   binary, command, status, exit code, duration and the log's path and size — never the
//!   output. A failure takes the same path as a success (status `error`);
//! - at session end every command still running gets `shell_abandoned` (the caller writes it
//!   to the trace and prints [`Abandoned::stderr_line`]); nothing is killed;
//! - a resume reports every `shell_detached` line of the resumed-from trace that has no
//!   `shell_completed`, `shell_abandoned` or `shell_lost` for its work id, all in one
//!   `completion` task with source `detached_lost`; it is a report of loss: no exit code, no
//!   output, unknown whether the command finished, nothing recovered.
//!
//! Nothing here generates ids or reads the clock: task ids and times are passed in. The
//! process side (running, draining to the log, killing) is `crate::tools::background`.
//! The module depends on nothing of the worker but [`TaskSpec`] (in
//! [`CompletionTask::into_spec`]), so the cluster can reuse it as it is.

use super::machine::TaskSpec;
use mur_proto::task::Origin;
use mur_proto::trace::{CallStatus, Event};
use serde_json::Value;
use std::time::{Duration, UNIX_EPOCH};

/// `task_start.source` of a detached command's completion task.
pub const COMPLETION_SOURCE: &str = "detached_shell";

/// `task_start.source` of a resume's loss report.
pub const LOSS_SOURCE: &str = "detached_lost";

/// A command running in the background.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Work {
    /// `wrk_…`.
    pub work_id: String,
    /// Resolved absolute path of the binary (or its bare name).
    pub binary: String,
    /// The command as the model gave it.
    pub command: String,
    /// The task that started it.
    pub task_id: String,
    /// That task's context: the completion task goes back to it.
    pub context_id: String,
    /// When the command started (Unix ms).
    pub started_at_ms: u64,
    /// When it moved to the background (Unix ms).
    pub detached_at_ms: u64,
}

/// A task the capsule generates for itself: a completion, or a resume's loss report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletionTask {
    /// The task's text (the first user message).
    pub text: String,
    /// The context it belongs to.
    pub context_id: String,
    /// Always [`Origin::Completion`], so the task waits in the `bg` lane.
    pub origin: Origin,
    /// [`COMPLETION_SOURCE`] or [`LOSS_SOURCE`].
    pub source: &'static str,
}

impl CompletionTask {
    /// The task as the loop runs it, under `task_id` (`tsk_…`).
    pub fn into_spec(self, task_id: String) -> TaskSpec {
        TaskSpec {
            task_id,
            context_id: self.context_id,
            text: self.text,
            origin: self.origin,
            source: self.source.to_string(),
        }
    }
}

/// A detached command that ended, with the task carrying its result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The command.
    pub work: Work,
    /// Exit code; 128+signal when a signal killed it, -1 when its status could not be read.
    pub exit_code: i32,
    /// Wall time from start to exit, ms.
    pub duration_ms: u64,
    /// Where its output went (`logs/<work_id>.log`).
    pub output_path: String,
    /// Bytes in that file.
    pub output_bytes: u64,
    /// `ok` for exit code 0, else `error`.
    pub status: CallStatus,
    /// The task to enqueue.
    pub task: CompletionTask,
}

impl Completion {
    /// The `shell_completed` line, once the task was enqueued as `completion_task_id`.
    pub fn event(&self, completion_task_id: &str) -> Event {
        Event::ShellCompleted {
            work_id: self.work.work_id.clone(),
            binary: self.work.binary.clone(),
            command: self.work.command.clone(),
            exit_code: self.exit_code,
            duration_ms: self.duration_ms,
            output_path: self.output_path.clone(),
            output_bytes: self.output_bytes,
            status: self.status,
            completion_task_id: completion_task_id.to_string(),
        }
    }
}

/// A command still running when its session ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abandoned {
    /// `wrk_…`.
    pub work_id: String,
    /// Resolved absolute path of the binary (or its bare name).
    pub binary: String,
    /// The command as the model gave it.
    pub command: String,
    /// Time since the command started, ms.
    pub running_ms: u64,
}

impl Abandoned {
    /// The `shell_abandoned` line.
    pub fn event(&self) -> Event {
        Event::ShellAbandoned {
            work_id: self.work_id.clone(),
            binary: self.binary.clone(),
            command: self.command.clone(),
            running_ms: self.running_ms,
        }
    }

    /// The line printed on stderr, naming the work id:
    /// `shell_abandoned: wrk_… (<binary>: <command>) still running after <n> ms; its result is lost`.
    pub fn stderr_line(&self) -> String {
        format!(
            "shell_abandoned: {} ({}: {}) still running after {} ms; its result is lost",
            self.work_id,
            self.binary,
            cut(&self.command, 200),
            self.running_ms
        )
    }
}

/// A bookkeeping call that does not fit the registry.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// [`Detached::detach`] with a work id that is already running.
    #[error("detached work {0} is already running")]
    Duplicate(String),
    /// [`Detached::complete`] with a work id that is not running.
    #[error("no detached work {0} is running")]
    Unknown(String),
}

/// The commands of one session running in the background, in the order they were detached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Detached {
    running: Vec<Work>,
}

impl Detached {
    /// An empty registry.
    pub fn new() -> Self {
        Detached::default()
    }

    /// Records a command that moved to the background.
    ///
    /// # Errors
    /// [`Error::Duplicate`] when its work id is already running.
    pub fn detach(&mut self, work: Work) -> Result<(), Error> {
        if self.running.iter().any(|w| w.work_id == work.work_id) {
            return Err(Error::Duplicate(work.work_id));
        }
        self.running.push(work);
        Ok(())
    }

    /// The commands still running, oldest first.
    pub fn running(&self) -> &[Work] {
        &self.running
    }

    /// Whether nothing runs in the background.
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// The command `work_id` ended: removes it and builds its completion task. `exit_code`
    /// is 128+signal for a killed command; `output_path` is the log as the capsule sees it
    /// (`logs/<work_id>.log`) and `output_bytes` its size. The task's text lists the work
    /// id, binary, command, status, exit code, duration and the log's path and size, never
    /// the output.
    ///
    /// # Errors
    /// [`Error::Unknown`] when `work_id` is not running (never detached, or already ended).
    pub fn complete(
        &mut self,
        work_id: &str,
        exit_code: i32,
        duration_ms: u64,
        output_path: &str,
        output_bytes: u64,
    ) -> Result<Completion, Error> {
        let at =
            self.running.iter().position(|w| w.work_id == work_id).ok_or_else(|| Error::Unknown(work_id.into()))?;
        let work = self.running.remove(at);
        let status = if exit_code == 0 { CallStatus::Ok } else { CallStatus::Error };
        let text = format!(
            "A detached shell command has ended.\n\
             work_id: {}\n\
             binary: {}\n\
             command: {}\n\
             status: {}\n\
             exit_code: {exit_code}\n\
             duration_ms: {duration_ms}\n\
             output: {output_path} ({output_bytes} bytes)\n\
             Its output is not part of this message; it is in that file.",
            work.work_id,
            work.binary,
            work.command,
            if status == CallStatus::Ok { "ok" } else { "error" },
        );
        let task = CompletionTask {
            text,
            context_id: work.context_id.clone(),
            origin: Origin::Completion,
            source: COMPLETION_SOURCE,
        };
        Ok(Completion {
            work,
            exit_code,
            duration_ms,
            output_path: output_path.to_string(),
            output_bytes,
            status,
            task,
        })
    }

    /// The session ends at `now_ms` (Unix ms): every command still running is abandoned,
    /// oldest first, and the registry is emptied. Nothing is killed; the caller stops
    /// listening for their ends.
    pub fn abandon_all(&mut self, now_ms: u64) -> Vec<Abandoned> {
        self.running
            .drain(..)
            .map(|w| Abandoned {
                running_ms: now_ms.saturating_sub(w.started_at_ms),
                work_id: w.work_id,
                binary: w.binary,
                command: w.command,
            })
            .collect()
    }
}

/// A command an earlier session detached and never accounted for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostWork {
    /// The session that detached it (the `session_id` of its `shell_detached` line).
    pub original_session_id: String,
    /// `wrk_…`.
    pub work_id: String,
    /// Resolved absolute path of the binary (or its bare name).
    pub binary: String,
    /// The command as the model gave it.
    pub command: String,
    /// The task that started it.
    pub task_id: String,
    /// The `timestamp` of its `shell_detached` line (Unix ms).
    pub detached_at_ms: u64,
}

impl LostWork {
    /// The `shell_lost` line for the original session's trace, written by session
    /// `reconciled_by_session` whose loss report is task `reconciled_task_id`.
    pub fn event(&self, reconciled_by_session: &str, reconciled_task_id: &str) -> Event {
        Event::ShellLost {
            original_session_id: self.original_session_id.clone(),
            work_id: self.work_id.clone(),
            binary: self.binary.clone(),
            command: self.command.clone(),
            detached_at_ms: self.detached_at_ms,
            reconciled_by_session: reconciled_by_session.to_string(),
            reconciled_task_id: reconciled_task_id.to_string(),
        }
    }
}

/// The commands a trace leaves unaccounted for: every `shell_detached` line with neither a
/// `shell_completed`, a `shell_abandoned` nor a `shell_lost` line for its work id, in the
/// order they were detached. `trace` is the lines of a `trace.jsonl`; lines that are not
/// JSON objects (the cut last line of a runtime killed mid-write) or lack a field are
/// skipped.
pub fn unmatched<'a>(trace: impl IntoIterator<Item = &'a str>) -> Vec<LostWork> {
    let mut open: Vec<LostWork> = Vec::new();
    for line in trace {
        let Ok(v) = serde_json::from_str::<Value>(line) else { continue };
        let field = |name: &str| v.get(name).and_then(Value::as_str).map(str::to_string);
        let Some(work_id) = field("work_id") else { continue };
        match v.get("event_type").and_then(Value::as_str) {
            Some("shell_detached") => {
                let (Some(binary), Some(command)) = (field("binary"), field("command")) else { continue };
                open.retain(|w| w.work_id != work_id);
                open.push(LostWork {
                    original_session_id: field("session_id").unwrap_or_default(),
                    work_id,
                    binary,
                    command,
                    task_id: field("task_id").unwrap_or_default(),
                    detached_at_ms: v.get("timestamp").and_then(Value::as_u64).unwrap_or(0),
                });
            }
            Some("shell_completed" | "shell_abandoned" | "shell_lost") => open.retain(|w| w.work_id != work_id),
            _ => {}
        }
    }
    open
}

/// The one task a resume of session `resumed_from` enqueues under `context_id` for the
/// commands in `lost`, or `None` when nothing was lost. It names each command (work id,
/// binary, command, when it was detached) and says what it is: a report of loss, with no
/// exit code and no output, where whether the command finished is unknown and nothing was
/// recovered.
pub fn loss_report(lost: &[LostWork], resumed_from: &str, context_id: &str) -> Option<CompletionTask> {
    if lost.is_empty() {
        return None;
    }
    let mut text = format!(
        "Report of loss: session {resumed_from} ended without recording how {} of its detached shell \
         commands ended.\n",
        lost.len()
    );
    for w in lost {
        text.push_str(&format!(
            "- {} ({}: {}), detached at {} ({} Unix ms)\n",
            w.work_id,
            w.binary,
            w.command,
            httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_millis(w.detached_at_ms)),
            w.detached_at_ms
        ));
    }
    text.push_str(
        "The runtime that ran them stopped without accounting for them. There is no exit code, no output \
         and no log file for these commands, and whether they finished is unknown. Nothing was recovered \
         and nothing was adopted; a command still running is left to run out on its own.",
    );
    Some(CompletionTask { text, context_id: context_id.to_string(), origin: Origin::Completion, source: LOSS_SOURCE })
}

/// `s` cut to at most `max` characters, with `…` when something was cut.
pub(crate) fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::task::Lane;
    use mur_proto::trace::Line;

    fn work(id: &str, task: &str, context: &str) -> Work {
        Work {
            work_id: id.into(),
            binary: "/bin/sh".into(),
            command: format!("sleep 30 # {id}"),
            task_id: task.into(),
            context_id: context.into(),
            started_at_ms: 1_000,
            detached_at_ms: 11_000,
        }
    }

    #[test]
    fn a_completion_is_a_bg_task_in_the_starting_context_naming_the_result_but_not_the_output() {
        let mut d = Detached::new();
        d.detach(work("wrk_a", "tsk_1", "ctx_1")).unwrap();
        let c = d.complete("wrk_a", 0, 3_004, "logs/wrk_a.log", 12).unwrap();
        assert!(d.is_empty());
        assert_eq!(c.status, CallStatus::Ok);
        assert_eq!(c.task.context_id, "ctx_1");
        assert_eq!(c.task.origin, Origin::Completion);
        assert_eq!(c.task.origin.lane(), Lane::Bg);
        assert_eq!(c.task.source, "detached_shell");
        assert_eq!(
            c.task.text,
            "A detached shell command has ended.\nwork_id: wrk_a\nbinary: /bin/sh\ncommand: sleep 30 # wrk_a\n\
             status: ok\nexit_code: 0\nduration_ms: 3004\noutput: logs/wrk_a.log (12 bytes)\n\
             Its output is not part of this message; it is in that file."
        );
        let spec = c.task.clone().into_spec("tsk_9".into());
        assert_eq!(
            (spec.task_id.as_str(), spec.context_id.as_str(), spec.origin, spec.source.as_str()),
            ("tsk_9", "ctx_1", Origin::Completion, "detached_shell")
        );
        assert_eq!(
            c.event("tsk_9"),
            Event::ShellCompleted {
                work_id: "wrk_a".into(),
                binary: "/bin/sh".into(),
                command: "sleep 30 # wrk_a".into(),
                exit_code: 0,
                duration_ms: 3_004,
                output_path: "logs/wrk_a.log".into(),
                output_bytes: 12,
                status: CallStatus::Ok,
                completion_task_id: "tsk_9".into(),
            }
        );
    }

    #[test]
    fn a_failure_takes_the_same_path_with_status_error() {
        let mut d = Detached::new();
        d.detach(work("wrk_a", "tsk_1", "ctx_1")).unwrap();
        d.detach(work("wrk_b", "tsk_1", "ctx_1")).unwrap();
        let failed = d.complete("wrk_a", 3, 5, "logs/wrk_a.log", 0).unwrap();
        let killed = d.complete("wrk_b", 137, 5, "logs/wrk_b.log", 0).unwrap();
        for (c, code) in [(&failed, 3), (&killed, 137)] {
            assert_eq!(c.status, CallStatus::Error);
            assert_eq!(c.task.origin, Origin::Completion);
            assert!(c.task.text.contains(&format!("status: error\nexit_code: {code}\n")), "{}", c.task.text);
        }
    }

    #[test]
    fn each_of_several_commands_completes_once_into_its_own_context() {
        let mut d = Detached::new();
        d.detach(work("wrk_a", "tsk_1", "ctx_1")).unwrap();
        d.detach(work("wrk_b", "tsk_2", "ctx_2")).unwrap();
        assert_eq!(d.detach(work("wrk_a", "tsk_3", "ctx_3")), Err(Error::Duplicate("wrk_a".into())));
        let b = d.complete("wrk_b", 0, 1, "logs/wrk_b.log", 0).unwrap();
        let a = d.complete("wrk_a", 0, 1, "logs/wrk_a.log", 0).unwrap();
        assert_eq!((a.task.context_id.as_str(), b.task.context_id.as_str()), ("ctx_1", "ctx_2"));
        assert_eq!(d.complete("wrk_a", 0, 1, "logs/wrk_a.log", 0), Err(Error::Unknown("wrk_a".into())));
        assert_eq!(Error::Unknown("wrk_a".into()).to_string(), "no detached work wrk_a is running");
    }

    #[test]
    fn abandon_all_reports_every_running_command_once_with_its_running_time() {
        let mut d = Detached::new();
        d.detach(work("wrk_a", "tsk_1", "ctx_1")).unwrap();
        d.detach(Work { started_at_ms: 4_000, ..work("wrk_b", "tsk_1", "ctx_1") }).unwrap();
        d.detach(work("wrk_c", "tsk_1", "ctx_1")).unwrap();
        d.complete("wrk_c", 0, 1, "logs/wrk_c.log", 0).unwrap();
        let gone = d.abandon_all(20_000);
        let ids: Vec<(&str, u64)> = gone.iter().map(|a| (a.work_id.as_str(), a.running_ms)).collect();
        assert_eq!(ids, [("wrk_a", 19_000), ("wrk_b", 16_000)]);
        assert!(d.is_empty());
        assert!(d.abandon_all(30_000).is_empty(), "abandoned once");
        assert_eq!(
            gone[0].event(),
            Event::ShellAbandoned {
                work_id: "wrk_a".into(),
                binary: "/bin/sh".into(),
                command: "sleep 30 # wrk_a".into(),
                running_ms: 19_000
            }
        );
        assert_eq!(
            gone[0].stderr_line(),
            "shell_abandoned: wrk_a (/bin/sh: sleep 30 # wrk_a) still running after 19000 ms; its result is lost"
        );
    }

    fn line(event: Event, session: &str, timestamp: u64) -> String {
        serde_json::to_string(&Line {
            event,
            session_id: session.into(),
            timestamp,
            event_id: "evt_1".into(),
            parent_id: Some("evt_0".into()),
        })
        .unwrap()
    }

    fn detached(id: &str) -> Event {
        Event::ShellDetached {
            turn: 0,
            task_id: "tsk_1".into(),
            work_id: id.into(),
            binary: "/bin/sh".into(),
            command: format!("sleep 30 # {id}"),
            grace_ms: 10_000,
        }
    }

    #[test]
    fn unmatched_keeps_only_detached_lines_that_never_ended() {
        let mut d = Detached::new();
        for id in ["wrk_done", "wrk_gone"] {
            d.detach(work(id, "tsk_1", "ctx_1")).unwrap();
        }
        let done = d.complete("wrk_done", 0, 1, "logs/wrk_done.log", 0).unwrap().event("tsk_2");
        let gone = d.abandon_all(5).remove(0).event();
        let reported = LostWork {
            original_session_id: "ses_old".into(),
            work_id: "wrk_reported".into(),
            binary: "/bin/sh".into(),
            command: "x".into(),
            task_id: "tsk_1".into(),
            detached_at_ms: 1,
        }
        .event("ses_mid", "tsk_5");
        let trace = [
            line(detached("wrk_done"), "ses_old", 100),
            line(detached("wrk_lost1"), "ses_old", 200),
            line(detached("wrk_gone"), "ses_old", 300),
            line(detached("wrk_reported"), "ses_old", 350),
            line(detached("wrk_lost2"), "ses_old", 400),
            line(done, "ses_old", 500),
            line(gone, "ses_old", 600),
            line(reported, "ses_mid", 700),
            r#"{"event_type":"shell_completed","work_id":"wrk_lo"#.to_string(),
        ];
        let lost = unmatched(trace.iter().map(String::as_str));
        assert_eq!(
            lost,
            [
                LostWork {
                    original_session_id: "ses_old".into(),
                    work_id: "wrk_lost1".into(),
                    binary: "/bin/sh".into(),
                    command: "sleep 30 # wrk_lost1".into(),
                    task_id: "tsk_1".into(),
                    detached_at_ms: 200,
                },
                LostWork {
                    original_session_id: "ses_old".into(),
                    work_id: "wrk_lost2".into(),
                    binary: "/bin/sh".into(),
                    command: "sleep 30 # wrk_lost2".into(),
                    task_id: "tsk_1".into(),
                    detached_at_ms: 400,
                },
            ]
        );
        // Once each is marked lost, a second resume finds nothing.
        let mut again: Vec<String> = trace.to_vec();
        again.extend(lost.iter().map(|w| line(w.event("ses_new", "tsk_7"), "ses_new", 800)));
        assert!(unmatched(again.iter().map(String::as_str)).is_empty());
        // The shell_lost line keeps the original session beside the writer's header.
        let Event::ShellLost { original_session_id, reconciled_by_session, reconciled_task_id, detached_at_ms, .. } =
            lost[0].event("ses_new", "tsk_7")
        else {
            panic!()
        };
        assert_eq!(
            (original_session_id.as_str(), reconciled_by_session.as_str(), reconciled_task_id.as_str(), detached_at_ms),
            ("ses_old", "ses_new", "tsk_7", 200)
        );
    }

    #[test]
    fn a_clean_trace_has_nothing_to_report() {
        assert!(unmatched(["", "not json", r#"{"event_type":"shell"}"#]).is_empty());
        assert_eq!(loss_report(&[], "ses_old", "ctx_1"), None);
    }

    #[test]
    fn the_loss_report_is_one_completion_task_naming_each_command_and_saying_nothing_was_recovered() {
        let trace = [line(detached("wrk_a"), "ses_old", 1_700_000_000_000), line(detached("wrk_b"), "ses_old", 1)];
        let lost = unmatched(trace.iter().map(String::as_str));
        let task = loss_report(&lost, "ses_old", "ctx_1").unwrap();
        assert_eq!(
            (task.origin, task.source, task.context_id.as_str()),
            (Origin::Completion, "detached_lost", "ctx_1")
        );
        assert_eq!(
            task.text,
            "Report of loss: session ses_old ended without recording how 2 of its detached shell commands ended.\n\
             - wrk_a (/bin/sh: sleep 30 # wrk_a), detached at Tue, 14 Nov 2023 22:13:20 GMT (1700000000000 Unix ms)\n\
             - wrk_b (/bin/sh: sleep 30 # wrk_b), detached at Thu, 01 Jan 1970 00:00:00 GMT (1 Unix ms)\n\
             The runtime that ran them stopped without accounting for them. There is no exit code, no output and \
             no log file for these commands, and whether they finished is unknown. Nothing was recovered and \
             nothing was adopted; a command still running is left to run out on its own."
        );
    }

    #[test]
    fn cut_keeps_at_most_the_given_characters() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("abcd", 3), "abc…");
        assert_eq!(cut("ééé€", 2), "éé…");
    }
}
