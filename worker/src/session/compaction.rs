//! Checking a compaction hook's replacement history (the context seed, step 4; checklist
//! C4): a `tool`-role message survives only if the hook returned it unmodified, and a
//! replacement that would leave a tool result without its call, or a call without its
//! result, is rejected (`unresolved_tool_call`). When the turn being compacted still has
//! tool calls to run, the replacement must end with that turn's assistant message, so the
//! results about to be appended have their call. Pure.

use mur_proto::message::{Message, Role};
use std::collections::HashSet;

/// Why a compaction did not replace the context (`compaction_declined.reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decline {
    /// No hook is bound, or none returned a replacement.
    NoHookReplacement,
    /// The replacement breaks tool call / result pairing.
    UnresolvedToolCall,
    /// The last compaction left the count over the threshold and the history has not
    /// outgrown that count since (issue #28 item 4): no hook is called.
    ThresholdUnreachable,
}

impl Decline {
    /// The trace spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Decline::NoHookReplacement => "no_hook_replacement",
            Decline::UnresolvedToolCall => "unresolved_tool_call",
            Decline::ThresholdUnreachable => "threshold_unreachable",
        }
    }
}

/// Checks `replacement` against the `original` history. `pending` is the assistant message
/// whose tool calls have not run yet, if any.
///
/// # Errors
/// [`Decline::UnresolvedToolCall`] when pairing is broken.
pub fn accept(
    original: &[Message],
    replacement: Vec<Message>,
    pending: Option<&Message>,
) -> Result<Vec<Message>, Decline> {
    // A tool message survives only if it comes back exactly as it was.
    let kept: Vec<Message> =
        replacement.into_iter().filter(|m| m.role != Role::Tool || original.iter().any(|o| o == m)).collect();
    if let Some(p) = pending
        && kept.last() != Some(p)
    {
        return Err(Decline::UnresolvedToolCall);
    }
    let mut calls: HashSet<&str> = HashSet::new();
    let mut answered: HashSet<&str> = HashSet::new();
    for m in &kept {
        match m.role {
            Role::Assistant => {
                for (id, _, _) in m.tool_calls() {
                    calls.insert(id);
                }
            }
            Role::Tool => {
                let id = m.tool_call_id.as_deref().unwrap_or("");
                if !calls.contains(id) || !answered.insert(id) {
                    return Err(Decline::UnresolvedToolCall);
                }
            }
            Role::User => {}
        }
    }
    // Every call must be answered, except the pending turn's calls.
    let pending_ids: HashSet<&str> = pending.map(|p| p.tool_calls().map(|(id, _, _)| id).collect()).unwrap_or_default();
    if calls.iter().any(|id| !answered.contains(id) && !pending_ids.contains(id)) {
        return Err(Decline::UnresolvedToolCall);
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::message::Block;
    use serde_json::json;

    fn call(id: &str) -> Message {
        Message::assistant(vec![Block::ToolCall { id: id.into(), name: "sh".into(), input: json!({}) }])
    }

    #[test]
    fn a_summary_keeping_call_and_result_together_is_accepted() {
        let original =
            vec![Message::user("t"), call("a"), Message::tool_result("a", "out", false), Message::user("more")];
        let replacement = vec![Message::user("summary"), call("a"), Message::tool_result("a", "out", false)];
        assert_eq!(accept(&original, replacement.clone(), None), Ok(replacement));
    }

    #[test]
    fn a_modified_tool_message_is_dropped_and_its_call_left_unresolved() {
        let original = vec![call("a"), Message::tool_result("a", "out", false)];
        let replacement = vec![call("a"), Message::tool_result("a", "shortened", false)];
        assert_eq!(accept(&original, replacement, None), Err(Decline::UnresolvedToolCall));
    }

    #[test]
    fn a_result_without_its_call_is_rejected() {
        let original = vec![call("a"), Message::tool_result("a", "out", false)];
        let replacement = vec![Message::user("summary"), Message::tool_result("a", "out", false)];
        assert_eq!(accept(&original, replacement, None), Err(Decline::UnresolvedToolCall));
    }

    #[test]
    fn the_pending_turn_must_stay_last() {
        let original = vec![Message::user("t"), call("p")];
        assert_eq!(
            accept(&original, vec![Message::user("s"), call("p")], Some(&call("p"))),
            Ok(vec![Message::user("s"), call("p")])
        );
        assert_eq!(accept(&original, vec![Message::user("s")], Some(&call("p"))), Err(Decline::UnresolvedToolCall));
    }
}
