//! What `mur_sessions` holds: per-turn checkpoints and threaded conversations, and their
//! keys (issue #8 §Checkpoints, §Takeover).

use super::*;

/// One per-turn checkpoint of a running task in [`SESSIONS_BUCKET`], under
/// [`checkpoint_key`] (issue #8 §Checkpoints; the design, §A task's way, step 4): what the
/// turns since the previous checkpoint added to the conversation, never the whole history
/// again, so a long task costs linear bytes. The first checkpoint of an attempt, and any
/// after the history was replaced (compaction, a reopen), has `replace: true` and carries
/// every message. A takeover reads the task's checkpoints in order
/// ([`Checkpoint::fold`]) and resumes after the last one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The task (`tsk_…`).
    pub task_id: TaskId,
    /// The session that wrote it (`ses_…`).
    pub session_id: String,
    /// The worker that wrote it.
    pub worker: String,
    /// Model calls made when it was written (the task's `turns` counter).
    pub turn: u32,
    /// `messages` is the whole history, not an addition to it.
    pub replace: bool,
    /// The messages added since the previous checkpoint (or all of them, see `replace`).
    pub messages: Vec<crate::message::Message>,
    /// The task's counters so far.
    pub counters: CheckpointCounters,
    /// The last request's input plus output tokens (the compaction check's figure).
    pub session_tokens: u64,
    /// Reopens granted so far, as `(hook, reason)`, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reopens: Vec<(String, String)>,
    /// When it was written, unix milliseconds.
    pub at_ms: u64,
    /// Which part this is of a checkpoint written in [`Checkpoint::parts`] parts, from 0
    /// (absent: 0). See [`Checkpoint::split`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part: u32,
    /// How many parts the turn's checkpoint was written in, when one message could not
    /// hold it (absent: 0, a whole checkpoint).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub parts: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Room kept in a `mur_sessions` value for the message's subject and headers when one is
/// fitted to the server's `max_payload` ([`Checkpoint::split`], [`StoredConversation`]).
pub const SESSION_VALUE_MARGIN: usize = 4 * 1024;

/// `messages` in consecutive runs whose JSON arrays each take at most `room` bytes after
/// `overhead` bytes of their own; a message larger than that alone is a run of its own
/// (its write fails, as it would have whole). One run when all fit; never an empty run
/// unless `messages` is empty.
pub fn split_messages(
    messages: Vec<crate::message::Message>,
    overhead: usize,
    room: usize,
) -> Vec<Vec<crate::message::Message>> {
    let mut runs = vec![Vec::new()];
    let mut used = overhead + 2;
    for m in messages {
        let size = serde_json::to_vec(&m).map_or(usize::MAX, |j| j.len()) + 1;
        let run = runs.last_mut().expect("never empty");
        if !run.is_empty() && used.saturating_add(size) > room {
            runs.push(Vec::new());
            used = overhead + 2;
        }
        used = used.saturating_add(size);
        runs.last_mut().expect("never empty").push(m);
    }
    runs
}

/// The counters a [`Checkpoint`] carries (those of `task_end`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointCounters {
    /// Model calls made.
    pub turns: u32,
    /// Sum of input tokens.
    pub input_tokens: u64,
    /// Sum of output tokens.
    pub output_tokens: u64,
    /// Tool calls made.
    pub tool_calls: u32,
    /// Shell commands run.
    pub shell_calls: u32,
}

/// Where a task resumes: the folded checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct Resume {
    /// The last checkpoint (its `messages` replaced by the whole history).
    pub last: Checkpoint,
}

impl Checkpoint {
    /// Folds checkpoints read in write order into the state after the last one: the whole
    /// history and the last counters. `None` for no checkpoints, or when the first one is
    /// not a `replace` (the chain is broken: start over). A checkpoint written in parts
    /// counts once all its parts are read, in order; one whose parts stop short (its
    /// worker died while writing them) is left out, so the task resumes after the turn
    /// before it.
    pub fn fold(checkpoints: impl IntoIterator<Item = Checkpoint>) -> Option<Resume> {
        let mut state: Option<Checkpoint> = None;
        let mut pending: Option<Checkpoint> = None;
        for c in checkpoints {
            let whole = if c.parts > 1 {
                match pending.take() {
                    Some(mut p) if c.part == p.part + 1 && c.turn == p.turn && c.session_id == p.session_id => {
                        p.messages.extend(c.messages);
                        p.part = c.part;
                        p
                    }
                    // A first part (any pending one before it stopped short), or a stray.
                    _ if c.part == 0 => c,
                    _ => continue,
                }
            } else {
                pending = None;
                c
            };
            if whole.parts > 1 && whole.part + 1 < whole.parts {
                pending = Some(whole);
                continue;
            }
            let c = Checkpoint { part: 0, parts: 0, ..whole };
            state = match state {
                _ if c.replace => Some(c),
                None => return None,
                Some(mut s) => {
                    s.messages.extend(c.messages);
                    Some(Checkpoint { messages: s.messages, ..c })
                }
            };
        }
        state.map(|last| Resume { last })
    }

    /// The checkpoint as the values to write, each within `max_payload` bytes (less
    /// [`SESSION_VALUE_MARGIN`]), with their keys: itself under [`checkpoint_key`] when it
    /// fits, else its messages split over parts (`part` 0, 1, … of `parts`, all with its
    /// counters, `replace` on the first only) under [`checkpoint_part_key`]. Written in
    /// this order, [`Checkpoint::fold`] reads them back as one.
    ///
    /// # Errors
    /// The JSON encoder's, never expected for these types.
    pub fn split(self, max_payload: usize) -> Result<Vec<(String, Vec<u8>)>, serde_json::Error> {
        let room = max_payload.saturating_sub(SESSION_VALUE_MARGIN);
        let key = checkpoint_key(&self.task_id, self.turn);
        let json = serde_json::to_vec(&self)?;
        if json.len() <= room {
            return Ok(vec![(key, json)]);
        }
        let Checkpoint { messages, replace, .. } = self;
        let shell = Checkpoint { messages: Vec::new(), part: u32::MAX, parts: u32::MAX, replace: false, ..self };
        let overhead = serde_json::to_vec(&shell)?.len();
        let runs = split_messages(messages, overhead, room);
        let parts = runs.len() as u32;
        runs.into_iter()
            .zip(0..)
            .map(|(messages, part)| {
                let c = Checkpoint { messages, part, parts, replace: replace && part == 0, ..shell.clone() };
                Ok((checkpoint_part_key(&c.task_id, c.turn, part), serde_json::to_vec(&c)?))
            })
            .collect()
    }
}

/// A context's conversation as [`context_key`] holds it: the messages themselves (a JSON
/// array) when they fit one message, else a head naming the parts they were written in,
/// under [`conversation_part_key`] (written before the head, so a head read always finds
/// its parts).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StoredConversation {
    /// The whole conversation.
    Whole(Vec<crate::message::Message>),
    /// The conversation in `parts` parts of generation `generation`.
    Parts {
        /// Names this write's parts apart from an earlier write's (a `uuid` v7, simple form).
        generation: String,
        /// How many parts.
        parts: u32,
    },
}

impl StoredConversation {
    /// The values to write for `messages` under `key` ([`context_key`]), each within
    /// `max_payload` bytes (less [`SESSION_VALUE_MARGIN`]), in write order: the parts,
    /// then the head; or the whole under `key` when it fits.
    ///
    /// # Errors
    /// The JSON encoder's, never expected for these types.
    pub fn split(
        key: &str,
        messages: Vec<crate::message::Message>,
        max_payload: usize,
    ) -> Result<Vec<(String, Vec<u8>)>, serde_json::Error> {
        let room = max_payload.saturating_sub(SESSION_VALUE_MARGIN);
        let json = serde_json::to_vec(&messages)?;
        if json.len() <= room {
            return Ok(vec![(key.to_string(), json)]);
        }
        let generation = uuid::Uuid::now_v7().simple().to_string();
        let runs = split_messages(messages, 0, room);
        let mut out = Vec::with_capacity(runs.len() + 1);
        for (run, part) in runs.iter().zip(0u32..) {
            out.push((conversation_part_key(key, &generation, part), serde_json::to_vec(run)?));
        }
        let head = StoredConversation::Parts { generation, parts: runs.len() as u32 };
        out.push((key.to_string(), serde_json::to_vec(&head)?));
        Ok(out)
    }

    /// The part keys of a head (none for a whole conversation).
    pub fn part_keys(&self, key: &str) -> Vec<String> {
        match self {
            StoredConversation::Whole(_) => Vec::new(),
            StoredConversation::Parts { generation, parts } => {
                (0..*parts).map(|part| conversation_part_key(key, generation, part)).collect()
            }
        }
    }
}

/// The [`SESSIONS_BUCKET`] key of a task's checkpoint after `turn` turns:
/// `ckpt.<task_id>.<turn>`; all of a task's share the prefix [`checkpoint_prefix`].
pub fn checkpoint_key(task_id: &TaskId, turn: u32) -> String {
    format!("{}{turn}", checkpoint_prefix(task_id))
}

/// The key of part `part` of a checkpoint written in parts: [`checkpoint_key`] for part 0,
/// `ckpt.<task_id>.<turn>.<part>` after it (under the same [`checkpoint_prefix`]).
pub fn checkpoint_part_key(task_id: &TaskId, turn: u32, part: u32) -> String {
    if part == 0 { checkpoint_key(task_id, turn) } else { format!("{}.{part}", checkpoint_key(task_id, turn)) }
}

/// `ckpt.<task_id>.`: the prefix of every checkpoint key of a task.
pub fn checkpoint_prefix(task_id: &TaskId) -> String {
    format!("ckpt.{task_id}.")
}

/// The [`SESSIONS_BUCKET`] key of a context's conversation in a capsule:
/// `ctx.<capsule>.<context_id>` (context ids are key-safe, see [`is_valid_context_id`]).
/// Written when a task of a threaded conversation ends `ok`, read when the next starts.
pub fn context_key(capsule: &str, context_id: &str) -> String {
    format!("ctx.{capsule}.{context_id}")
}

/// The key of part `part` of generation `generation` of the conversation under `key`
/// ([`context_key`]): `<key>=<generation>.<part>`. No context id holds a `=`
/// ([`is_valid_context_id`]), so no context's key is another's part.
pub fn conversation_part_key(key: &str, generation: &str, part: u32) -> String {
    format!("{key}={generation}.{part}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Message;

    fn checkpoint(turn: u32, replace: bool, texts: &[String]) -> Checkpoint {
        Checkpoint {
            task_id: TaskId::unchecked("tsk_1"),
            session_id: "ses_1".into(),
            worker: "w1".into(),
            turn,
            replace,
            messages: texts.iter().map(Message::user).collect(),
            counters: CheckpointCounters { turns: turn, ..Default::default() },
            session_tokens: 0,
            reopens: Vec::new(),
            at_ms: u64::from(turn),
            part: 0,
            parts: 0,
        }
    }

    fn read_back(values: &[(String, Vec<u8>)]) -> Vec<Checkpoint> {
        values.iter().map(|(_, json)| serde_json::from_slice(json).unwrap()).collect()
    }

    #[test]
    fn a_checkpoint_larger_than_a_message_is_written_in_parts_that_fold_back_into_it() {
        let max = 1 << 20;
        let big: Vec<String> = (0..5).map(|i| format!("{i}{}", "x".repeat(300_000))).collect();
        let first = checkpoint(1, true, &big[..1]);
        assert_eq!(first.clone().split(max).unwrap().len(), 1, "a checkpoint that fits is one value");
        let second = checkpoint(2, false, &big[1..]);
        let values = second.clone().split(max).unwrap();
        let keys: Vec<&str> = values.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["ckpt.tsk_1.2", "ckpt.tsk_1.2.1"]);
        assert!(values.iter().all(|(_, json)| json.len() <= max - SESSION_VALUE_MARGIN));
        let parts = read_back(&values);
        assert_eq!((parts[0].part, parts[0].parts, parts[1].part, parts[1].parts), (0, 2, 1, 2));
        assert_eq!(parts.iter().map(|p| p.messages.len()).sum::<usize>(), 4);
        // A replace on its first part only.
        let replaced = read_back(&checkpoint(3, true, &big).split(max).unwrap());
        assert_eq!(replaced.iter().map(|p| p.replace).collect::<Vec<_>>(), [true, false]);

        let mut chain = read_back(&first.split(max).unwrap());
        chain.extend(parts.clone());
        let resumed = Checkpoint::fold(chain.clone()).unwrap().last;
        assert_eq!(resumed.messages.len(), 5);
        assert_eq!(resumed.messages[4].text(), big[4]);
        assert_eq!((resumed.turn, resumed.part, resumed.parts), (2, 0, 0));

        // Its worker died between the parts: the turn is left out, the task resumes after turn 1.
        let cut: Vec<Checkpoint> = chain[..2].to_vec();
        let resumed = Checkpoint::fold(cut.clone()).unwrap().last;
        assert_eq!((resumed.turn, resumed.messages.len()), (1, 1));
        // … and a later attempt's checkpoints after the stump still fold.
        let mut later = cut;
        later.push(checkpoint(2, false, &["again".to_string()]));
        let resumed = Checkpoint::fold(later).unwrap().last;
        assert_eq!((resumed.turn, resumed.messages.len()), (2, 2));
    }

    #[test]
    fn a_conversation_larger_than_a_message_is_stored_as_parts_under_a_head() {
        let max = 1 << 20;
        let key = context_key("chat", "ctx_1");
        let small = vec![Message::user("hi")];
        let values = StoredConversation::split(&key, small.clone(), max).unwrap();
        assert_eq!(values.len(), 1);
        assert_eq!(
            serde_json::from_slice::<StoredConversation>(&values[0].1).unwrap(),
            StoredConversation::Whole(small)
        );

        let big: Vec<Message> = (0..7).map(|i| Message::user(format!("{i}{}", "y".repeat(400_000)))).collect();
        let values = StoredConversation::split(&key, big.clone(), max).unwrap();
        assert!(values.iter().all(|(_, json)| json.len() <= max - SESSION_VALUE_MARGIN));
        // The parts first, the head last, under the conversation's own key.
        let (head_key, head) = values.last().unwrap();
        assert_eq!(head_key, &key);
        let head: StoredConversation = serde_json::from_slice(head).unwrap();
        let part_keys = head.part_keys(&key);
        assert_eq!(part_keys.len(), values.len() - 1);
        assert_eq!(part_keys, values[..values.len() - 1].iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
        assert!(part_keys[0].starts_with("ctx.chat.ctx_1=") && part_keys[0].ends_with(".0"), "{part_keys:?}");
        let joined: Vec<Message> = values[..values.len() - 1]
            .iter()
            .flat_map(|(_, json)| serde_json::from_slice::<Vec<Message>>(json).unwrap())
            .collect();
        assert_eq!(joined, big);
    }

    #[test]
    fn messages_split_into_runs_that_fit_and_keep_their_order() {
        let msgs: Vec<Message> = (0..10).map(|i| Message::user(format!("{i}{}", "z".repeat(90)))).collect();
        let one = serde_json::to_vec(&msgs[0]).unwrap().len() + 1;
        let runs = split_messages(msgs.clone(), 10, 10 + 2 + 3 * one);
        assert_eq!(runs.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 3, 1]);
        assert_eq!(runs.concat(), msgs);
        // One larger than the room is a run of its own.
        assert_eq!(split_messages(msgs[..2].to_vec(), 0, 10).iter().map(Vec::len).collect::<Vec<_>>(), [1, 1]);
        assert_eq!(split_messages(Vec::new(), 0, 10), [Vec::<Message>::new()]);
    }
}
