//! Tool calls of an OpenAI-compatible reply, put together from the pieces servers send:
//! the [`Assembler`] shared by the `openai` driver's streamed and whole-reply paths.
//!
//! OpenAI streams each call as deltas keyed by `index`, the first with `id` and
//! `function.name`, the rest with `function.arguments` fragments to concatenate (what the
//! official SDKs do). Compatible servers differ (issue #28 item 1, seen in vLLM, llama.cpp
//! and LiteLLM versions): several parallel calls streamed on index 0 without ids, each
//! delta carrying a new `name` and complete JSON arguments; no `index` at all; no ids. The
//! rules, for a piece on an index that already has a call being built:
//!
//! 1. a piece whose `id` is the current call's id continues it;
//! 2. a piece with a different non-empty `id` starts a new call;
//! 3. a piece with a `name`, while the current call has one, starts a new call, unless it
//!    is the same name and the current arguments are not yet complete JSON (servers that
//!    repeat the name on every delta);
//! 4. a piece with arguments, while the current call's arguments already parse as complete
//!    JSON and the piece starts a new JSON value, starts a new call (it has no name: a
//!    server that sends the name once per index);
//! 5. anything else continues the current call.
//!
//! A piece without `index` takes the index of the last piece. Calls come out ordered by
//! index, then by arrival. A call without an id gets `call_<position>` (its 0-based place
//! in the reply), suffixed `_<n>` when the server gave that id to another call of the
//! reply. Pure: no IO.

use mur_proto::message::Block;
use serde_json::{Map, Value, json};

/// One tool call as it arrives in pieces.
#[derive(Clone, Debug, Default)]
struct Partial {
    index: u64,
    id: String,
    name: String,
    arguments: String,
}

impl Partial {
    /// Whether the arguments so far are a complete JSON value. Only checked when they can
    /// be (they end with `}` or `]`), so a call split into many fragments is not re-parsed
    /// on each.
    fn complete(&self) -> bool {
        let text = self.arguments.trim_end();
        matches!(text.as_bytes().last(), Some(b'}' | b']'))
            && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
    }
}

/// Builds tool calls from pieces: streamed `delta.tool_calls[]` entries, or the entries of
/// a whole reply's `message.tool_calls` (each [`closed`](Assembler::close) after it).
#[derive(Clone, Debug, Default)]
pub struct Assembler {
    calls: Vec<Partial>,
    /// Position in `calls` of the call being built on each index (few indices: a list).
    current: Vec<(u64, usize)>,
    last_index: Option<u64>,
}

impl Assembler {
    /// An assembler with no calls.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether no call was started.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Takes one piece: `{"index", "id", "type", "function": {"name", "arguments"}}`, every
    /// member optional. `arguments` is normally a string fragment; another JSON value is
    /// taken as its JSON text.
    pub fn feed(&mut self, piece: &Value) {
        let id = piece.get("id").and_then(Value::as_str).filter(|i| !i.is_empty());
        let index = piece.get("index").and_then(Value::as_u64).or(self.last_index).unwrap_or(0);
        self.last_index = Some(index);
        let function = piece.get("function");
        let name = function.and_then(|f| f.get("name")).and_then(Value::as_str).filter(|n| !n.is_empty());
        let fragment = match function.and_then(|f| f.get("arguments")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(std::borrow::Cow::Borrowed(s.as_str())),
            Some(other) => Some(std::borrow::Cow::Owned(other.to_string())),
        };
        let slot = self.current.iter().position(|(i, _)| *i == index);
        let continues = slot.is_some_and(|s| {
            let call = &self.calls[self.current[s].1];
            match id {
                Some(id) if id == call.id => true,
                Some(_) if !call.id.is_empty() => false,
                _ => match name {
                    Some(name) if !call.name.is_empty() => name == call.name && !call.complete(),
                    _ => !fragment.as_deref().is_some_and(|f| starts_value(f) && call.complete()),
                },
            }
        });
        let position = match slot {
            Some(s) if continues => self.current[s].1,
            _ => {
                self.calls.push(Partial { index, ..Partial::default() });
                let position = self.calls.len() - 1;
                match slot {
                    Some(s) => self.current[s].1 = position,
                    None => self.current.push((index, position)),
                }
                position
            }
        };
        let call = &mut self.calls[position];
        if let Some(id) = id {
            id.clone_into(&mut call.id);
        }
        if let Some(name) = name {
            name.clone_into(&mut call.name);
        }
        if let Some(fragment) = fragment {
            call.arguments.push_str(&fragment);
        }
    }

    /// Ends the calls being built: the next piece starts a new call whatever it holds (one
    /// entry of a whole reply's `tool_calls` is one call).
    pub fn close(&mut self) {
        self.current.clear();
        self.last_index = None;
    }

    /// The calls as tool-call blocks, ordered by index then arrival, ids minted where
    /// missing. Arguments: empty means `{}`, text that is not JSON is passed as
    /// `{"_raw": "<text>"}` so the tool refuses it and the model sees why.
    pub fn finish(mut self) -> Vec<Block> {
        self.calls.sort_by_key(|c| c.index);
        let given: Vec<String> = self.calls.iter().map(|c| c.id.clone()).filter(|i| !i.is_empty()).collect();
        let mut minted: Vec<String> = Vec::new();
        self.calls
            .into_iter()
            .enumerate()
            .map(|(position, call)| {
                let id = if call.id.is_empty() {
                    let base = format!("call_{position}");
                    let mut id = base.clone();
                    let mut n = 1;
                    while given.contains(&id) || minted.contains(&id) {
                        id = format!("{base}_{n}");
                        n += 1;
                    }
                    minted.push(id.clone());
                    id
                } else {
                    call.id
                };
                Block::ToolCall { id, name: call.name, input: arguments(&call.arguments) }
            })
            .collect()
    }
}

/// Whether an arguments fragment opens a new JSON object or array (after blanks).
fn starts_value(fragment: &str) -> bool {
    matches!(fragment.trim_start().as_bytes().first(), Some(b'{' | b'['))
}

/// A call's input from its arguments text.
fn arguments(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Object(Map::new());
    }
    serde_json::from_str(text).unwrap_or_else(|_| json!({"_raw": text}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, name: &str, input: Value) -> Block {
        Block::ToolCall { id: id.into(), name: name.into(), input }
    }

    fn assemble(pieces: &[Value]) -> Vec<Block> {
        let mut a = Assembler::new();
        pieces.iter().for_each(|p| a.feed(p));
        a.finish()
    }

    #[test]
    fn parallel_calls_on_one_index_without_ids_are_split_and_given_ids() {
        let pieces = [
            json!({"index": 0, "function": {"name": "sh", "arguments": "{\"command\": \"echo a\"}"}}),
            json!({"index": 0, "function": {"name": "sh", "arguments": "{\"command\": \"echo b\"}"}}),
            json!({"index": 0, "function": {"name": "read", "arguments": "{\"path\": \"x\"}"}}),
        ];
        assert_eq!(
            assemble(&pieces),
            [
                call("call_0", "sh", json!({"command": "echo a"})),
                call("call_1", "sh", json!({"command": "echo b"})),
                call("call_2", "read", json!({"path": "x"})),
            ]
        );
    }

    #[test]
    fn a_repeated_name_mid_arguments_continues_the_call() {
        let pieces = [
            json!({"index": 0, "function": {"name": "sh", "arguments": ""}}),
            json!({"index": 0, "function": {"name": "sh", "arguments": "{\"comm"}}),
            json!({"index": 0, "function": {"name": "sh", "arguments": "and\":\"ls\"}"}}),
            // Complete JSON, then a nameless new value: a second call.
            json!({"index": 0, "function": {"arguments": "{\"command\":\"pwd\"}"}}),
        ];
        assert_eq!(
            assemble(&pieces),
            [call("call_0", "sh", json!({"command": "ls"})), call("call_1", "", json!({"command": "pwd"}))]
        );
    }

    #[test]
    fn minted_ids_do_not_take_a_given_one() {
        let pieces = [
            json!({"index": 0, "function": {"name": "a", "arguments": "{}"}}),
            json!({"index": 1, "id": "call_0", "function": {"name": "b", "arguments": "{}"}}),
        ];
        assert_eq!(assemble(&pieces), [call("call_0_1", "a", json!({})), call("call_0", "b", json!({}))]);
    }
}
