//! The runtime's own token estimate, recorded beside whatever the provider reports.
//!
//! Two estimators, chosen per model by [`for_model`]:
//! - [`Tiktoken`]: OpenAI's own BPE (through the `tiktoken-rs` crate) for the `openai`
//!   driver with an OpenAI model name: `cl100k_base` for the gpt-3.5 / gpt-4 family (the
//!   reference runtime's tokenizer, the runtime reference, §4), `o200k_base` for
//!   gpt-4o, gpt-4.1, gpt-5 and the o-series. The BPE is loaded on first use, once per
//!   process, and shared; loading takes tens of milliseconds and some megabytes, so
//!   capsules that do not need it never load it. A cluster worker loads it on a blocking
//!   thread when it loads a capsule that needs it ([`preload`]), not at a session's first
//!   count on an async runtime thread.
//! - [`BytesOver4`], the stated approximation, for everything else: Claude, local models
//!   behind an OpenAI-compatible server, the scripted driver. Their tokenizers are not
//!   public or not known here, so the estimate there is an approximation: one token per
//!   four bytes of UTF-8, rounded up (the reference runtime's fallback).
//!
//! Counts are taken once per message as it is appended, never re-walked.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use tiktoken_rs::CoreBPE;

/// Estimates tokens of text.
pub trait Estimator: Send + Sync {
    /// Estimated tokens of `text`.
    fn count(&self, text: &str) -> u64;

    /// [`Estimator::count`] of a text that comes again session after session: a capsule's
    /// system prompt and tool specs. The same number; an estimator whose count is costly
    /// may remember it.
    fn count_repeated(&self, text: &str) -> u64 {
        self.count(text)
    }
}

/// Four bytes per token, rounded up.
#[derive(Clone, Copy, Debug, Default)]
pub struct BytesOver4;

impl Estimator for BytesOver4 {
    fn count(&self, text: &str) -> u64 {
        (text.len() as u64).div_ceil(4)
    }
}

/// A tiktoken encoding the runtime can count with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// `cl100k_base`: gpt-3.5-turbo, gpt-4, gpt-4-turbo, the text-embedding-3 models.
    Cl100kBase,
    /// `o200k_base`: gpt-4o, gpt-4.1, gpt-4.5, gpt-5, o1, o3, o4-mini (and gpt-oss, whose
    /// `o200k_harmony` differs only in special tokens, which ordinary text never yields).
    O200kBase,
}

impl Encoding {
    /// The encoding OpenAI uses for `model`, by exact name or family prefix (tiktoken's
    /// own table, so dated snapshots such as `gpt-4o-2024-08-06` and fine-tunes
    /// `ft:gpt-4o-mini:org::id` resolve too); `None` for any other name, and for the
    /// legacy GPT-3 encodings, which the runtime does not ship.
    pub fn for_model(model: &str) -> Option<Encoding> {
        use tiktoken_rs::tokenizer::{Tokenizer, get_tokenizer};
        match get_tokenizer(model.trim())? {
            Tokenizer::Cl100kBase => Some(Encoding::Cl100kBase),
            Tokenizer::O200kBase | Tokenizer::O200kHarmony => Some(Encoding::O200kBase),
            Tokenizer::P50kBase | Tokenizer::R50kBase | Tokenizer::P50kEdit | Tokenizer::Gpt2 => None,
        }
    }

    /// `cl100k_base` or `o200k_base`.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Cl100kBase => "cl100k_base",
            Encoding::O200kBase => "o200k_base",
        }
    }

    /// The BPE, loaded on first use and kept for the life of the process; `None` if the
    /// embedded table could not be loaded (never expected: it is compiled in).
    fn bpe(self) -> Option<&'static CoreBPE> {
        self.cell().get_or_init(|| self.load()).as_ref()
    }

    /// Loads the BPE from the table compiled in (tens of milliseconds of CPU).
    fn load(self) -> Option<CoreBPE> {
        let loaded = match self {
            Encoding::Cl100kBase => tiktoken_rs::cl100k_base(),
            Encoding::O200kBase => tiktoken_rs::o200k_base(),
        };
        loaded
            .inspect_err(
                |e| tracing::warn!(error = %e, encoding = self.name(), "tokenizer failed to load; estimating len/4"),
            )
            .ok()
    }

    /// Where the BPE is kept once loaded: one cell per encoding, for the process.
    fn cell(self) -> &'static OnceLock<Option<CoreBPE>> {
        static CL100K: OnceLock<Option<CoreBPE>> = OnceLock::new();
        static O200K: OnceLock<Option<CoreBPE>> = OnceLock::new();
        match self {
            Encoding::Cl100kBase => &CL100K,
            Encoding::O200kBase => &O200K,
        }
    }

    /// Whether the BPE has been loaded in this process (any test of the process may have
    /// loaded it).
    #[cfg(test)]
    fn loaded(self) -> bool {
        self.cell().get().is_some()
    }
}

/// Counts with one of OpenAI's tiktoken encodings ([`Encoding`]), as ordinary text
/// (special-token markers such as `<|endoftext|>` in a message count as the text they
/// are). The BPE is loaded on the first count and shared by every estimator of that
/// encoding in the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiktoken {
    encoding: Encoding,
}

impl Tiktoken {
    /// An estimator for `encoding`; nothing is loaded until the first count.
    pub fn new(encoding: Encoding) -> Self {
        Tiktoken { encoding }
    }

    /// Its encoding.
    pub fn encoding(&self) -> Encoding {
        self.encoding
    }
}

impl Estimator for Tiktoken {
    fn count(&self, text: &str) -> u64 {
        match self.encoding.bpe() {
            Some(bpe) => bpe.count_ordinary(text) as u64,
            None => BytesOver4.count(text),
        }
    }

    /// Remembered for the process, by encoding and exact text, up to [`REPEATED_BYTES`] of
    /// text in all (past that it starts over): a capsule's system prompt and tool specs are
    /// counted once, not at every session's start, where a BPE pass over kilobytes of tool
    /// specs took ~3 % of a loaded worker's CPU (issue #9).
    fn count_repeated(&self, text: &str) -> u64 {
        static SEEN: OnceLock<Mutex<Repeated>> = OnceLock::new();
        let seen = SEEN.get_or_init(Mutex::default);
        if let Some(tokens) = seen.lock().expect("repeated counts lock").get(self.encoding, text) {
            return tokens;
        }
        let tokens = self.count(text);
        seen.lock().expect("repeated counts lock").keep(self.encoding, text, tokens);
        tokens
    }
}

/// How many bytes of text [`Tiktoken::count_repeated`] remembers counts of at most.
pub const REPEATED_BYTES: usize = 1 << 20;

/// The counts [`Tiktoken::count_repeated`] remembers, by encoding then text (looked up by
/// `&str`: a text is copied only when kept), and the bytes of text they hold.
#[derive(Default)]
struct Repeated {
    counts: HashMap<Encoding, HashMap<String, u64>>,
    bytes: usize,
}

impl Repeated {
    fn get(&self, encoding: Encoding, text: &str) -> Option<u64> {
        self.counts.get(&encoding)?.get(text).copied()
    }

    /// How many texts are kept, over every encoding.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.counts.values().map(HashMap::len).sum()
    }

    fn keep(&mut self, encoding: Encoding, text: &str, tokens: u64) {
        if text.len() > REPEATED_BYTES || self.get(encoding, text).is_some() {
            return;
        }
        if self.bytes + text.len() > REPEATED_BYTES {
            self.counts.clear();
            self.bytes = 0;
        }
        self.bytes += text.len();
        self.counts.entry(encoding).or_default().insert(text.to_string(), tokens);
    }
}

/// The estimator for a session: [`Tiktoken`] with the model's encoding when `driver` is
/// `openai` and `model` is an OpenAI model name ([`Encoding::for_model`]), else
/// [`BytesOver4`] (Anthropic, local models, the scripted driver, no model).
pub fn for_model(driver: &str, model: Option<&str>) -> Arc<dyn Estimator> {
    match tiktoken_encoding(driver, model) {
        Some(encoding) => Arc::new(Tiktoken::new(encoding)),
        None => Arc::new(BytesOver4),
    }
}

/// The tiktoken encoding [`for_model`] counts with for `driver` and `model`, if any.
fn tiktoken_encoding(driver: &str, model: Option<&str>) -> Option<Encoding> {
    model.filter(|_| driver == "openai").and_then(Encoding::for_model)
}

/// Loads, now, the BPE that [`for_model`]'s estimator for `driver` and `model` will count
/// with (nothing for an estimator that needs none, or one already loaded); returns the
/// encoding. Loading takes tens of milliseconds of CPU and blocks: a worker calls this on
/// a blocking thread when it loads a capsule, so that its first session does not load it
/// on an async runtime thread, stalling every task that shares the thread (issue #9).
pub fn preload(driver: &str, model: Option<&str>) -> Option<Encoding> {
    let encoding = tiktoken_encoding(driver, model)?;
    encoding.bpe();
    Some(encoding)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_count_is_the_count_and_its_memory_starts_over_past_a_mebibyte() {
        let tiktoken = Tiktoken::new(Encoding::Cl100kBase);
        let tools = r#"[{"name":"read_file","description":"Reads a file.","parameters":{"type":"object"}}]"#;
        for text in [tools, "You are a careful agent.", ""] {
            assert_eq!(tiktoken.count_repeated(text), tiktoken.count(text), "{text:?}");
            assert_eq!(tiktoken.count_repeated(text), tiktoken.count(text), "{text:?}, remembered");
        }
        assert_eq!(BytesOver4.count_repeated("abcde"), 2);

        let mut repeated = Repeated::default();
        let half = "x".repeat(REPEATED_BYTES / 2);
        repeated.keep(Encoding::Cl100kBase, &half, 1);
        repeated.keep(Encoding::O200kBase, &half, 2);
        assert_eq!((repeated.len(), repeated.bytes), (2, REPEATED_BYTES));
        assert_eq!(
            (repeated.get(Encoding::Cl100kBase, &half), repeated.get(Encoding::O200kBase, &half)),
            (Some(1), Some(2)),
            "the same text is kept per encoding"
        );
        repeated.keep(Encoding::O200kBase, &half, 2);
        assert_eq!(repeated.len(), 2, "a text kept already is not kept twice");
        repeated.keep(Encoding::Cl100kBase, "y", 3);
        assert_eq!((repeated.len(), repeated.bytes), (1, 1), "one byte more starts over");
        assert_eq!(repeated.get(Encoding::Cl100kBase, &half), None, "forgotten when it started over");
        repeated.keep(Encoding::Cl100kBase, &"z".repeat(REPEATED_BYTES + 1), 4);
        assert_eq!(repeated.len(), 1, "a text over the bound is never kept");
    }

    #[test]
    fn preload_loads_the_bpe_an_openai_models_estimator_counts_with_and_nothing_for_others() {
        assert_eq!(preload("openai", Some("gpt-4o-mini")), Some(Encoding::O200kBase));
        assert!(Encoding::O200kBase.loaded(), "o200k_base is loaded once preload returns");
        assert_eq!(preload("openai", Some("llama-3.1-8b")), None);
        assert_eq!(preload("anthropic", Some("gpt-4o")), None);
        assert_eq!(preload("openai", None), None);
    }

    #[test]
    fn cl100k_counts_match_openai() {
        let cl100k = Tiktoken::new(Encoding::Cl100kBase);
        assert_eq!(cl100k.count("hello world"), 2);
        assert_eq!(cl100k.count("tiktoken is great!"), 6);
        assert_eq!(cl100k.count("antidisestablishmentarianism"), 6);
        assert_eq!(cl100k.count("お誕生日おめでとう"), 9);
        assert_eq!(cl100k.count(""), 0);
        // A special-token marker in a message is ordinary text, not one special token.
        assert!(cl100k.count("<|endoftext|>") > 1);
    }

    #[test]
    fn o200k_counts_differ_from_cl100k_where_openai_says_so() {
        let o200k = Tiktoken::new(Encoding::O200kBase);
        assert_eq!(o200k.count("hello world"), 2);
        assert_eq!(o200k.count("お誕生日おめでとう"), 8);
    }

    #[test]
    fn openai_model_names_route_to_their_encoding() {
        let table = [
            ("gpt-4", Some(Encoding::Cl100kBase)),
            ("gpt-4-turbo", Some(Encoding::Cl100kBase)),
            ("gpt-3.5-turbo", Some(Encoding::Cl100kBase)),
            ("gpt-3.5-turbo-0125", Some(Encoding::Cl100kBase)),
            ("gpt-4o", Some(Encoding::O200kBase)),
            ("gpt-4o-mini", Some(Encoding::O200kBase)),
            ("gpt-4o-2024-08-06", Some(Encoding::O200kBase)),
            ("gpt-4.1", Some(Encoding::O200kBase)),
            ("gpt-4.1-nano", Some(Encoding::O200kBase)),
            ("gpt-5", Some(Encoding::O200kBase)),
            ("gpt-5-mini", Some(Encoding::O200kBase)),
            ("o1", Some(Encoding::O200kBase)),
            ("o3-mini", Some(Encoding::O200kBase)),
            ("ft:gpt-4o-mini:acme::abc123", Some(Encoding::O200kBase)),
            ("llama-3.1-8b-instruct", None),
            ("qwen2.5-coder", None),
            ("claude-sonnet-4-5", None),
            ("davinci", None),
            ("", None),
        ];
        for (model, want) in table {
            assert_eq!(Encoding::for_model(model), want, "{model}");
        }
    }

    #[test]
    fn only_the_openai_driver_with_an_openai_model_gets_a_real_tokenizer() {
        // "hello world": 11 bytes, so 3 by len/4 and 2 by either BPE; the Japanese line
        // (27 bytes, 7 by len/4) is 9 tokens in cl100k_base and 8 in o200k_base.
        let japanese = "お誕生日おめでとう";
        assert_eq!(for_model("openai", Some("gpt-4o")).count("hello world"), 2);
        assert_eq!(for_model("openai", Some("gpt-4o")).count(japanese), 8);
        assert_eq!(for_model("openai", Some("gpt-4")).count(japanese), 9);
        let approximated = [
            ("openai", Some("llama-3.1-8b-instruct")),
            ("openai", None),
            ("anthropic", Some("claude-sonnet-4-5")),
            ("anthropic", Some("gpt-4o")),
            ("scripted", None),
        ];
        for (driver, model) in approximated {
            let estimator = for_model(driver, model);
            assert_eq!(estimator.count("hello world"), 3, "{driver} {model:?}");
            assert_eq!(estimator.count(japanese), 7, "{driver} {model:?}");
        }
    }
}
