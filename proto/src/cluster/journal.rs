//! The tool-call journal of a running task (issue #34): what the turn in flight did,
//! appended to `mur_sessions` before each effect — the model's response before any of its
//! tool calls runs, each call's start before it starts, each call's result when it ends —
//! and its replay when another worker takes the task over ([`Replay`], pure).
//!
//! Keys (all under [`journal_prefix`], never rewritten but by a rerun's own start):
//! `jrnl.<task>.<turn>.m` a model response, `jrnl.<task>.<turn>.<index>.s` a call's
//! start, `jrnl.<task>.<turn>.<index>.r` its result. `turn` is the 0-based model call, as
//! `inference.turn` counts it; `index` the call's place in the response.
//!
//! What a takeover makes of them ([`Replay`]): a journaled response is not asked again; a
//! call with a journaled result is not run again, its result is reused; a call started
//! without a result is *in doubt*: run again with the same idempotency key when its tool
//! is declared `idempotent`, otherwise answered with [`in_doubt_text`].

use super::*;
use crate::message::Block;
use crate::trace::ProviderUsage;
use std::collections::BTreeMap;

/// Why a journaled model response stopped (the driver's stop reason, stored).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum Stop {
    /// The model asked for tools.
    ToolCall,
    /// The model finished.
    EndTurn,
    /// The output cap cut the reply short.
    MaxTokens,
    /// The provider reported an error in-band.
    Error(String),
    /// A stop reason the runtime does not know.
    Other(String),
}

/// What was done with a call found in doubt (the `tool_call_in_doubt` line's `action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InDoubtAction {
    /// The tool is declared idempotent: it ran again with the same idempotency key.
    Rerun,
    /// It was not run again: the model was told it may or may not have taken effect.
    Reported,
}

impl InDoubtAction {
    /// `rerun` or `reported`.
    pub fn as_str(self) -> &'static str {
        match self {
            InDoubtAction::Rerun => "rerun",
            InDoubtAction::Reported => "reported",
        }
    }
}

/// One journal entry, under [`Entry::key`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "entry", rename_all = "snake_case")]
pub enum Entry {
    /// The model's response to turn `turn`, before any of its tool calls runs.
    ModelResponse {
        /// The task (`tsk_…`).
        task_id: String,
        /// The model call (0-based).
        turn: u32,
        /// The session that made the call.
        session_id: String,
        /// Its worker.
        worker: String,
        /// The reply's text and tool-call blocks, in order.
        content: Vec<Block>,
        /// Why it stopped.
        stop: Stop,
        /// Usage as the provider reported it.
        #[serde(default)]
        usage: ProviderUsage,
        /// When it was written, unix milliseconds.
        at_ms: u64,
    },
    /// Tool call `index` of turn `turn` is about to start.
    ToolStart {
        /// The task.
        task_id: String,
        /// The model call that asked for it.
        turn: u32,
        /// Its place in the response (0-based).
        index: u32,
        /// The provider's call id.
        call_id: String,
        /// The tool's name.
        tool: String,
        /// Its idempotency key ([`tool_call_key`]).
        key: String,
        /// The session that starts it.
        session_id: String,
        /// Its worker.
        worker: String,
        /// When it was written, unix milliseconds.
        at_ms: u64,
    },
    /// Tool call `index` of turn `turn` ended with this result (or was answered in doubt).
    ToolResult {
        /// The task.
        task_id: String,
        /// The model call that asked for it.
        turn: u32,
        /// Its place in the response (0-based).
        index: u32,
        /// The provider's call id.
        call_id: String,
        /// The tool's name.
        tool: String,
        /// The text fed back to the model.
        text: String,
        /// Whether the call failed.
        is_error: bool,
        /// Set when the call was found in doubt at a takeover and this is what was done.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        in_doubt: Option<InDoubtAction>,
        /// The session that wrote it.
        session_id: String,
        /// Its worker.
        worker: String,
        /// When it was written, unix milliseconds.
        at_ms: u64,
    },
}

/// Room kept in a journal value besides a result's text, when a text is clipped to fit
/// one message ([`Entry::fit`]).
const CLIP_NOTE: &str = "\n… [clipped by the journal: the whole result did not fit one message]";

impl Entry {
    /// The task the entry belongs to.
    pub fn task_id(&self) -> &str {
        match self {
            Entry::ModelResponse { task_id, .. }
            | Entry::ToolStart { task_id, .. }
            | Entry::ToolResult { task_id, .. } => task_id,
        }
    }

    /// Its key in [`SESSIONS_BUCKET`]: `jrnl.<task>.<turn>.m`, `….<turn>.<index>.s` or
    /// `….<turn>.<index>.r`.
    pub fn key(&self) -> String {
        match self {
            Entry::ModelResponse { task_id, turn, .. } => format!("{}{turn}.m", journal_prefix(task_id)),
            Entry::ToolStart { task_id, turn, index, .. } => format!("{}{turn}.{index}.s", journal_prefix(task_id)),
            Entry::ToolResult { task_id, turn, index, .. } => format!("{}{turn}.{index}.r", journal_prefix(task_id)),
        }
    }

    /// The entry as JSON within `max_payload` bytes (less [`SESSION_VALUE_MARGIN`]): a
    /// result whose text would not fit has its text clipped (on a character boundary)
    /// with a note saying so — the replay then reuses the clipped text. Other entries are
    /// written whole (a model response larger than a message fails its write).
    ///
    /// # Errors
    /// The JSON encoder's, never expected for these types.
    pub fn fit(mut self, max_payload: usize) -> Result<Vec<u8>, serde_json::Error> {
        let room = max_payload.saturating_sub(SESSION_VALUE_MARGIN);
        let mut json = serde_json::to_vec(&self)?;
        while json.len() > room {
            let Entry::ToolResult { text, .. } = &mut self else { break };
            let body = text.strip_suffix(CLIP_NOTE).unwrap_or(text).len();
            if body == 0 {
                break;
            }
            // Cut what is over; again while escaping keeps it over (rarely more than once).
            let mut cut = body.saturating_sub(json.len() - room + CLIP_NOTE.len());
            while cut > 0 && !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            text.push_str(CLIP_NOTE);
            json = serde_json::to_vec(&self)?;
        }
        Ok(json)
    }
}

/// `jrnl.<task_id>.`: the prefix of every journal key of a task.
pub fn journal_prefix(task_id: &str) -> String {
    format!("jrnl.{task_id}.")
}

/// The idempotency key of tool call `index` (0-based, its place in the response) of model
/// call `turn` (0-based) of `task_id`: `<task_id>.<turn>.<index>`. The same on every
/// attempt of the call, so a tool can deduplicate against the outside world; given to
/// command tools and shell commands as `MUR_TOOL_CALL_ID` and to hooks as
/// `idempotency_key`.
pub fn tool_call_key(task_id: &str, turn: u32, index: u32) -> String {
    format!("{task_id}.{turn}.{index}")
}

/// The environment variable that carries a tool call's idempotency key
/// ([`tool_call_key`]) to the command it runs.
pub const TOOL_CALL_ID_VAR: &str = "MUR_TOOL_CALL_ID";

/// The result the model gets for a call found in doubt that is not run again: the worker
/// running it died, and it may or may not have taken effect.
pub fn in_doubt_text(tool: &str, key: &str, worker: &str) -> String {
    format!(
        "in doubt: the worker running this call of {tool} ({worker}) died before it reported a result, so it \
         may or may not have taken effect. It was not run again. Check whether it took effect before you retry \
         it (its idempotency key was {key}), or report that you could not tell."
    )
}

/// A model response as the journal holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct JournaledResponse {
    /// The reply's blocks.
    pub content: Vec<Block>,
    /// Why it stopped.
    pub stop: Stop,
    /// Provider usage.
    pub usage: ProviderUsage,
    /// The worker that made the call.
    pub worker: String,
}

/// What to do with one tool call of the turn being replayed ([`Replay::tool`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolStep {
    /// The journal knows nothing of it: run it (start journaled first).
    Run,
    /// It ended before: reuse its result, run nothing.
    Reuse {
        /// The text fed back to the model.
        text: String,
        /// Whether the call failed.
        is_error: bool,
    },
    /// It started and never reported; its tool is idempotent: run it again, same key.
    Rerun {
        /// The worker that started it.
        previous_worker: String,
    },
    /// It started and never reported; its tool is not idempotent: answer it with
    /// [`in_doubt_text`], run nothing.
    Report {
        /// The worker that started it.
        previous_worker: String,
        /// The result to give the model.
        text: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
enum Call {
    Started { tool: String, call_id: String, worker: String },
    Ended { tool: String, call_id: String, text: String, is_error: bool },
}

/// A task's journal folded for a takeover: what each turn's response and calls came to.
/// Pure: fed the entries read back, asked per turn and per call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replay {
    responses: BTreeMap<u32, JournaledResponse>,
    calls: BTreeMap<(u32, u32), Call>,
    in_doubt: u32,
}

impl Replay {
    /// Folds `entries` (any order of keys; a later entry of the same key replaces an
    /// earlier one, as the bucket keeps the last). Entries of other tasks are ignored.
    pub fn fold(task_id: &str, entries: impl IntoIterator<Item = Entry>) -> Replay {
        let mut replay = Replay::default();
        for e in entries {
            if e.task_id() != task_id {
                continue;
            }
            replay.apply(e);
        }
        replay
    }

    fn apply(&mut self, entry: Entry) {
        match entry {
            Entry::ModelResponse { turn, content, stop, usage, worker, .. } => {
                self.responses.insert(turn, JournaledResponse { content, stop, usage, worker });
            }
            Entry::ToolStart { turn, index, call_id, tool, worker, .. } => {
                // A start after a result is a rerun's own: the result stays until it ends.
                if !matches!(self.calls.get(&(turn, index)), Some(Call::Ended { .. })) {
                    self.calls.insert((turn, index), Call::Started { tool, call_id, worker });
                }
            }
            Entry::ToolResult { turn, index, call_id, tool, text, is_error, in_doubt, .. } => {
                if in_doubt.is_some() {
                    self.in_doubt += 1;
                }
                self.calls.insert((turn, index), Call::Ended { tool, call_id, text, is_error });
            }
        }
    }

    /// Whether the journal holds nothing.
    pub fn is_empty(&self) -> bool {
        self.responses.is_empty() && self.calls.is_empty()
    }

    /// The journaled response of model call `turn`: reuse it, ask nothing.
    pub fn response(&self, turn: u32) -> Option<&JournaledResponse> {
        self.responses.get(&turn)
    }

    /// What to do with call `index` (`call_id`, of `tool`) of turn `turn`, whose tool is
    /// `idempotent` or not. An entry recorded for another call id or tool (never expected:
    /// a replayed response asks for the same calls) is in doubt, never reused or ignored.
    ///
    /// Entries of a turn whose response is not journaled are ignored: no call runs before
    /// its response is acknowledged, so a start found there (sent with the response, which
    /// the store then refused) is of a call that never ran. Once a later attempt journals
    /// the turn's new response, such a start counts again (in doubt: never run twice).
    pub fn tool(&self, turn: u32, index: u32, call_id: &str, tool: &str, idempotent: bool, key: &str) -> ToolStep {
        if !self.responses.contains_key(&turn) {
            return ToolStep::Run;
        }
        let in_doubt = |worker: &str| {
            if idempotent {
                ToolStep::Rerun { previous_worker: worker.to_string() }
            } else {
                ToolStep::Report { previous_worker: worker.to_string(), text: in_doubt_text(tool, key, worker) }
            }
        };
        match self.calls.get(&(turn, index)) {
            None => ToolStep::Run,
            Some(Call::Ended { tool: t, call_id: c, text, is_error }) if t == tool && c == call_id => {
                ToolStep::Reuse { text: text.clone(), is_error: *is_error }
            }
            Some(Call::Ended { .. }) => in_doubt("an earlier worker"),
            Some(Call::Started { worker, .. }) => in_doubt(worker),
        }
    }

    /// Calls found in doubt by earlier takeovers of the task (their results were written
    /// with `in_doubt`).
    pub fn in_doubt_so_far(&self) -> u32 {
        self.in_doubt
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TASK: &str = "tsk_1";

    fn response(turn: u32) -> Entry {
        Entry::ModelResponse {
            task_id: TASK.into(),
            turn,
            session_id: "ses_a".into(),
            worker: "wkr-a".into(),
            content: vec![Block::ToolCall { id: format!("c{turn}"), name: "pay".into(), input: json!({"n": turn}) }],
            stop: Stop::ToolCall,
            usage: ProviderUsage::default(),
            at_ms: 1,
        }
    }

    fn start(turn: u32, index: u32, worker: &str) -> Entry {
        Entry::ToolStart {
            task_id: TASK.into(),
            turn,
            index,
            call_id: format!("c{turn}"),
            tool: "pay".into(),
            key: tool_call_key(TASK, turn, index),
            session_id: "ses_a".into(),
            worker: worker.into(),
            at_ms: 2,
        }
    }

    fn result(turn: u32, index: u32, text: &str, in_doubt: Option<InDoubtAction>) -> Entry {
        Entry::ToolResult {
            task_id: TASK.into(),
            turn,
            index,
            call_id: format!("c{turn}"),
            tool: "pay".into(),
            text: text.into(),
            is_error: false,
            in_doubt,
            session_id: "ses_a".into(),
            worker: "wkr-a".into(),
            at_ms: 3,
        }
    }

    #[test]
    fn keys_name_the_task_the_turn_and_the_call() {
        assert_eq!(response(3).key(), "jrnl.tsk_1.3.m");
        assert_eq!(start(3, 1, "w").key(), "jrnl.tsk_1.3.1.s");
        assert_eq!(result(3, 1, "ok", None).key(), "jrnl.tsk_1.3.1.r");
        assert!(response(3).key().starts_with(&journal_prefix(TASK)));
        assert_eq!(tool_call_key(TASK, 3, 1), "tsk_1.3.1");
    }

    #[test]
    fn entries_round_trip_as_json() {
        for e in [response(0), start(0, 0, "w"), result(0, 0, "done", Some(InDoubtAction::Reported))] {
            let json = serde_json::to_vec(&e).unwrap();
            assert_eq!(serde_json::from_slice::<Entry>(&json).unwrap(), e);
        }
        let v: serde_json::Value = serde_json::to_value(result(0, 0, "x", Some(InDoubtAction::Rerun))).unwrap();
        assert_eq!((v["entry"].as_str(), v["in_doubt"].as_str()), (Some("tool_result"), Some("rerun")));
    }

    /// The replay table: for each journal a takeover may find, what it does with the
    /// turn's model call and with its call, for a tool idempotent or not.
    #[test]
    fn a_takeover_replays_the_journal_and_never_reasks_or_reruns_what_ended() {
        use ToolStep::*;
        let report = |w: &str| Report { previous_worker: w.into(), text: in_doubt_text("pay", "tsk_1.0.0", w) };
        let rerun = |w: &str| Rerun { previous_worker: w.into() };
        let reuse = Reuse { text: "paid".into(), is_error: false };
        // (journal, response reused?, step when not idempotent, step when idempotent)
        let table: Vec<(Vec<Entry>, bool, ToolStep, ToolStep)> = vec![
            // Nothing journaled: the model is asked, the call runs.
            (vec![], false, Run, Run),
            // (a) the response journaled, the call not started: reuse the response, run it.
            (vec![response(0)], true, Run, Run),
            // (b) started, no result: in doubt.
            (vec![response(0), start(0, 0, "wkr-a")], true, report("wkr-a"), rerun("wkr-a")),
            // (c) ended: its result is reused whatever the tool.
            (vec![response(0), start(0, 0, "wkr-a"), result(0, 0, "paid", None)], true, reuse.clone(), reuse.clone()),
            // An in-doubt answer written by an earlier takeover is a result like another.
            (
                vec![response(0), start(0, 0, "wkr-a"), result(0, 0, "paid", Some(InDoubtAction::Reported))],
                true,
                reuse.clone(),
                reuse.clone(),
            ),
            // A rerun's start after a result (its worker died again) keeps the result.
            (
                vec![response(0), start(0, 0, "wkr-a"), result(0, 0, "paid", None), start(0, 0, "wkr-b")],
                true,
                reuse.clone(),
                reuse,
            ),
            // A second takeover of a rerun that never ended: in doubt again, on the last worker.
            (vec![response(0), start(0, 0, "wkr-a"), start(0, 0, "wkr-b")], true, report("wkr-b"), rerun("wkr-b")),
        ];
        for (i, (journal, reused, plain, idempotent)) in table.into_iter().enumerate() {
            let replay = Replay::fold(TASK, journal);
            assert_eq!(replay.response(0).is_some(), reused, "row {i}");
            let key = tool_call_key(TASK, 0, 0);
            assert_eq!(replay.tool(0, 0, "c0", "pay", false, &key), plain, "row {i}");
            assert_eq!(replay.tool(0, 0, "c0", "pay", true, &key), idempotent, "row {i}");
            // Other turns and calls know nothing.
            assert_eq!(replay.response(1), None, "row {i}");
            assert_eq!(replay.tool(0, 1, "c0", "pay", false, &key), Run, "row {i}");
        }
    }

    #[test]
    fn a_start_without_its_turns_response_is_of_a_call_that_never_ran() {
        // The response and the start were sent together; the store kept only the start.
        let replay = Replay::fold(TASK, [start(0, 0, "wkr-a")]);
        let key = tool_call_key(TASK, 0, 0);
        assert_eq!(replay.response(0), None);
        assert_eq!(replay.tool(0, 0, "c0", "pay", false, &key), ToolStep::Run);
        // Once a response of the turn is journaled, the start is in doubt again.
        let replay = Replay::fold(TASK, [start(0, 0, "wkr-a"), response(0)]);
        assert!(matches!(replay.tool(0, 0, "c0", "pay", false, &key), ToolStep::Report { .. }));
    }

    #[test]
    fn an_entry_for_another_call_or_task_is_never_reused() {
        let replay = Replay::fold(TASK, [response(0), start(0, 0, "wkr-a"), result(0, 0, "paid", None)]);
        let key = tool_call_key(TASK, 0, 0);
        assert!(matches!(replay.tool(0, 0, "other", "pay", false, &key), ToolStep::Report { .. }));
        assert!(matches!(replay.tool(0, 0, "c0", "refund", true, &key), ToolStep::Rerun { .. }));
        let elsewhere = Replay::fold("tsk_2", [response(0), start(0, 0, "wkr-a")]);
        assert!(elsewhere.is_empty());
    }

    #[test]
    fn earlier_in_doubt_answers_are_counted() {
        let replay = Replay::fold(
            TASK,
            [
                result(0, 0, "x", Some(InDoubtAction::Reported)),
                result(1, 0, "y", None),
                result(2, 0, "z", Some(InDoubtAction::Rerun)),
            ],
        );
        assert_eq!(replay.in_doubt_so_far(), 2);
    }

    #[test]
    fn a_result_too_large_for_a_message_is_clipped_with_a_note() {
        let big = "é".repeat(400_000);
        let json = result(0, 0, &big, None).fit(256 * 1024).unwrap();
        assert!(json.len() <= 256 * 1024 - SESSION_VALUE_MARGIN, "{}", json.len());
        let Entry::ToolResult { text, .. } = serde_json::from_slice(&json).unwrap() else { panic!() };
        assert!(text.ends_with(CLIP_NOTE) && text.starts_with("éé"));
        let small = result(0, 0, "paid", None);
        assert_eq!(serde_json::from_slice::<Entry>(&small.clone().fit(1 << 20).unwrap()).unwrap(), small);
    }

    #[test]
    fn the_in_doubt_text_tells_the_model_it_may_or_may_not_have_taken_effect() {
        let text = in_doubt_text("pay", "tsk_1.0.0", "wkr-a");
        assert!(text.contains("may or may not have taken effect"), "{text}");
        assert!(text.contains("wkr-a") && text.contains("tsk_1.0.0") && text.contains("not run again"), "{text}");
    }
}
