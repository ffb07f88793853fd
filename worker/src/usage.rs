//! A task's token usage, tallied from its session's trace (issue #11 §Cost): a trace
//! [`Sink`] that adds up every `inference` line — the provider's counts where it reported
//! them, the runtime's estimates where it did not ([`Usage::estimated`]) — so the worker
//! can put the total on the task's terminal record. Hooks' own model calls count too, and
//! responses a takeover reused from the tool-call journal (`journal_replay` lines).

use crate::trace::{Error, Sink};
use mur_proto::cost::Usage;
use mur_proto::trace::{Event, Line};
use std::sync::{Arc, Mutex};

/// Adds up usage as trace lines go by; clones share the tally.
#[derive(Clone, Debug, Default)]
pub struct UsageTally {
    inner: Arc<Mutex<Tally>>,
}

#[derive(Debug, Default)]
struct Tally {
    usage: Usage,
    /// The session's driver counts cache reads apart from its input tokens (Anthropic).
    input_excludes_cached: bool,
    calls: u64,
}

impl UsageTally {
    /// The usage so far; `None` when no model call was made.
    pub fn usage(&self) -> Option<Usage> {
        let t = self.inner.lock().expect("usage tally poisoned");
        (t.calls > 0).then(|| t.usage.clone())
    }
}

impl Sink for UsageTally {
    fn write(&mut self, line: &Line) -> Result<(), Error> {
        let mut t = self.inner.lock().expect("usage tally poisoned");
        match &line.event {
            Event::SessionStart { model, driver, .. } => {
                t.usage.model = Some(model.clone());
                t.input_excludes_cached = driver == "anthropic";
            }
            Event::Inference { input_tokens, output_tokens, usage, .. }
            // A response reused from the journal (issue #34): billed once, by a worker
            // that died before reporting it; counted here, once.
            | Event::JournalReplay {
                tokens: Some(mur_proto::trace::ReplayedTokens { input_tokens, output_tokens, usage }), ..
            } => {
                let excludes = t.input_excludes_cached;
                t.usage.add_call(*input_tokens, *output_tokens, usage, excludes);
                t.calls += 1;
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::trace::{Decision, ProviderUsage};

    fn line(event: Event) -> Line {
        Line { event, session_id: "ses_1".into(), timestamp: 0, event_id: "evt_1".into(), parent_id: None }
    }

    fn inference(input: u64, output: u64, usage: ProviderUsage) -> Event {
        Event::Inference {
            turn: 0,
            task_id: "tsk_1".into(),
            input_tokens: input,
            output_tokens: output,
            decision: Decision::EndTurn,
            tool_name: None,
            duration_ms: 1,
            usage,
            origin: None,
        }
    }

    #[test]
    fn every_call_is_added_and_an_unreported_one_marks_the_total_estimated() {
        let tally = UsageTally::default();
        let mut sink = tally.clone();
        assert_eq!(tally.usage(), None);
        let reported = ProviderUsage {
            input_tokens_actual: Some(1000),
            output_tokens_actual: Some(50),
            cached_tokens: Some(400),
            cache_write_tokens: None,
        };
        sink.write(&line(inference(900, 40, reported))).unwrap();
        assert_eq!(
            tally.usage(),
            Some(Usage {
                model: None,
                input_tokens: 1000,
                output_tokens: 50,
                cached_tokens: 400,
                cache_write_tokens: 0,
                estimated: false
            })
        );
        sink.write(&line(inference(30, 7, ProviderUsage::default()))).unwrap();
        let u = tally.usage().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens, u.cached_tokens, u.estimated), (1030, 57, 400, true));
    }

    #[test]
    fn a_response_reused_from_the_journal_counts_once_and_a_reused_result_not_at_all() {
        let tally = UsageTally::default();
        let mut sink = tally.clone();
        let replay = |what: &str, tokens| Event::JournalReplay {
            task_id: "tsk_1".into(),
            turn: 0,
            what: what.into(),
            tool_name: None,
            idempotency_key: None,
            previous_worker: "wkr-a".into(),
            tokens,
        };
        let reported =
            ProviderUsage { input_tokens_actual: Some(700), output_tokens_actual: Some(20), ..Default::default() };
        sink.write(&line(replay(
            "model_response",
            Some(mur_proto::trace::ReplayedTokens { input_tokens: 650, output_tokens: 18, usage: reported }),
        )))
        .unwrap();
        sink.write(&line(replay("tool_result", None))).unwrap();
        let u = tally.usage().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens, u.estimated), (700, 20, false));
        // The next call, made by this worker, adds to it.
        sink.write(&line(inference(30, 7, ProviderUsage::default()))).unwrap();
        let u = tally.usage().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens, u.estimated), (730, 27, true));
    }
}
