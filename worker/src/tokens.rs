//! The runtime's own token estimate, recorded beside whatever the provider reports.
//!
//! Stated approximation: one token per four bytes of UTF-8, rounded up
//! (`reference/murmur-runtime.md` §4 gives `len/4` as the fallback of the cl100k
//! tokenizer). Counts are taken once per message as it is appended, never re-walked.

/// Estimates tokens of text.
pub trait Estimator: Send + Sync {
    /// Estimated tokens of `text`.
    fn count(&self, text: &str) -> u64;
}

/// Four bytes per token, rounded up.
#[derive(Clone, Copy, Debug, Default)]
pub struct BytesOver4;

impl Estimator for BytesOver4 {
    fn count(&self, text: &str) -> u64 {
        (text.len() as u64).div_ceil(4)
    }
}
