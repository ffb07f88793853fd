//! What model calls cost (issue #11 §Cost): the cluster config's `prices:` (USD per 1,000
//! tokens, per model, cache reads and cache writes priced separately, issue #28 item 3), a task's token [`Usage`] (provider-
//! reported where available, the runtime's estimate otherwise, and [`Usage::estimated`]
//! says which), the [`Spend`] of a run, a job or a member, and the budget projection of
//! the fleet reference, §3 step 4.
//!
//! Pure: no IO, no clock.

use crate::trace::ProviderUsage;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Tokens a member is projected to spend in an iteration before any iteration has run:
/// the reference's 3.5 M (ref §3 step 4; a $10 cap once overspent by 300× on a smaller
/// guess, ref §8).
pub const PROJECTION_TOKENS_PER_MEMBER: u64 = 3_500_000;

/// One model's price, USD per 1,000 tokens (`prices: {claude-x: {input: 3, output: 15,
/// cached_input: 0.3, cache_write: 3.75}}`). `cached_input` and `cache_write` default to
/// `input` (a cache read is never priced below what the provider was told to charge; a
/// cache write was billed as input before the key existed).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Input (prompt) tokens not served from the prompt cache.
    pub input: f64,
    /// Output (completion) tokens.
    pub output: f64,
    /// Input tokens served from the provider's prompt cache; absent: `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
    /// Input tokens written to the provider's prompt cache (Anthropic's
    /// `cache_creation_input_tokens`, billed at 1.25× input for the 5-minute cache);
    /// absent: `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<f64>,
}

impl Price {
    /// What `usage` costs, USD: plain input × `input` + cache reads × `cached_input` +
    /// cache writes × `cache_write` + output × `output`, each per 1,000 tokens, where plain
    /// input is the input tokens less the cache reads and writes.
    pub fn cost(&self, usage: &Usage) -> f64 {
        let plain = usage.input_tokens.saturating_sub(usage.cached_tokens).saturating_sub(usage.cache_write_tokens);
        (plain as f64 * self.input
            + usage.cached_tokens as f64 * self.cached_input.unwrap_or(self.input)
            + usage.cache_write_tokens as f64 * self.cache_write.unwrap_or(self.input)
            + usage.output_tokens as f64 * self.output)
            / 1000.0
    }
}

/// The cluster config's `prices:`: model name → [`Price`]. A model without an entry is
/// not metered (a local model): no spend is counted for it and a budget does not bound it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Prices(pub BTreeMap<String, Price>);

impl Prices {
    /// Checks every price: each rate a non-negative finite number.
    ///
    /// # Errors
    /// Every broken rule, one `prices.<model>.<key>: rule, got value` line each.
    pub fn validate(&self) -> Result<(), String> {
        let mut errors = Vec::new();
        for (model, p) in &self.0 {
            for (key, v) in [
                ("input", Some(p.input)),
                ("output", Some(p.output)),
                ("cached_input", p.cached_input),
                ("cache_write", p.cache_write),
            ] {
                if let Some(v) = v
                    && !(v.is_finite() && v >= 0.0)
                {
                    errors.push(format!(
                        "prices.{model}.{key}: must be a non-negative number of USD per 1,000 tokens, got {v}"
                    ));
                }
            }
        }
        if errors.is_empty() { Ok(()) } else { Err(errors.join("\n")) }
    }

    /// The price of `model`, if it has one.
    pub fn of(&self, model: Option<&str>) -> Option<&Price> {
        self.0.get(model?.trim())
    }

    /// What `usage` costs at its model's price; `None` for a model without one.
    pub fn cost(&self, usage: &Usage) -> Option<f64> {
        self.of(usage.model.as_deref()).map(|p| p.cost(usage))
    }

    /// The guard rate of a fleet whose capsules run `models` (ref §3 step 4): the dearest
    /// output price among them, USD per 1,000 tokens; `None` when none has a price (the
    /// fleet is not metered).
    pub fn guard_rate<'a>(&self, models: impl IntoIterator<Item = Option<&'a str>>) -> Option<f64> {
        models.into_iter().filter_map(|m| self.of(m)).map(|p| p.output).reduce(f64::max)
    }
}

/// A task's token usage, kept on its terminal record. `input_tokens` counts every input
/// token, cache reads and writes included; `cached_tokens` is the part served from the
/// prompt cache, `cache_write_tokens` the part written to it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// The model the task's session called (the manifest's `inference.model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Input tokens, cached ones included.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens the provider served from its prompt cache.
    pub cached_tokens: u64,
    /// Input tokens the provider wrote to its prompt cache (0 on records from before it
    /// was counted).
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// Whether any count is the runtime's estimate because the provider did not report it.
    pub estimated: bool,
}

impl Usage {
    /// Adds one model call: the provider's counts where it reported them, else the
    /// runtime's estimates `estimated_input` / `estimated_output` (and then
    /// [`Usage::estimated`] is set). `input_excludes_cached`: the provider counts cache
    /// reads and writes apart from its input tokens (Anthropic), so they are added to
    /// the input here; OpenAI's `prompt_tokens` already includes `cached_tokens` (and it
    /// reports no cache writes). Cache writes are also counted in
    /// [`Usage::cache_write_tokens`].
    pub fn add_call(
        &mut self,
        estimated_input: u64,
        estimated_output: u64,
        provider: &ProviderUsage,
        input_excludes_cached: bool,
    ) {
        let cached = provider.cached_tokens.unwrap_or(0);
        match provider.input_tokens_actual {
            Some(input) if input_excludes_cached => {
                self.input_tokens += input + cached + provider.cache_write_tokens.unwrap_or(0);
            }
            Some(input) => self.input_tokens += input.max(cached),
            None => {
                self.input_tokens += estimated_input.max(cached);
                self.estimated = true;
            }
        }
        self.cached_tokens += cached;
        self.cache_write_tokens += provider.cache_write_tokens.unwrap_or(0);
        match provider.output_tokens_actual {
            Some(output) => self.output_tokens += output,
            None => {
                self.output_tokens += estimated_output;
                self.estimated = true;
            }
        }
    }

    /// Whether no model call was counted.
    pub fn is_empty(&self) -> bool {
        self.input_tokens == 0 && self.output_tokens == 0
    }
}

/// Spend of a run, a job or a member: USD at the cluster's prices and the tokens behind it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spend {
    /// USD.
    pub usd: f64,
    /// Input tokens, cached ones included.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Cached input tokens.
    pub cached_tokens: u64,
    /// Input tokens written to the prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// Whether any of it rests on the runtime's estimate.
    pub estimated: bool,
}

impl Spend {
    /// Adds a task's usage and its cost (`None`: the model has no price, so no USD).
    pub fn add(&mut self, usage: &Usage, usd: Option<f64>) {
        self.usd += usd.unwrap_or(0.0);
        self.input_tokens += usage.input_tokens;
        self.output_tokens += usage.output_tokens;
        self.cached_tokens += usage.cached_tokens;
        self.cache_write_tokens += usage.cache_write_tokens;
        self.estimated |= usage.estimated;
    }

    /// Adds another spend (an iteration's to its run's).
    pub fn add_spend(&mut self, other: &Spend) {
        self.usd += other.usd;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cached_tokens += other.cached_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
        self.estimated |= other.estimated;
    }

    /// `$1.2345 (1200 in, 300 cached, 80 out)`, with `, 50 cache-write` after the cached
    /// count when there are any, and `, estimated` when it is.
    pub fn summary(&self) -> String {
        let writes = if self.cache_write_tokens > 0 {
            format!(", {} cache-write", self.cache_write_tokens)
        } else {
            String::new()
        };
        format!(
            "${:.4} ({} in, {} cached{writes}, {} out{})",
            self.usd,
            self.input_tokens,
            self.cached_tokens,
            self.output_tokens,
            if self.estimated { ", estimated" } else { "" }
        )
    }
}

/// The projected cost of the next iteration (ref §3 step 4): before any iteration,
/// `members` × [`PROJECTION_TOKENS_PER_MEMBER`] × `guard_rate` / 1,000; after, the
/// average real spend per iteration so far.
pub fn projected_next(iterations: u64, spent_usd: f64, members: usize, guard_rate: f64) -> f64 {
    if iterations == 0 {
        members as f64 * PROJECTION_TOKENS_PER_MEMBER as f64 * guard_rate / 1000.0
    } else {
        spent_usd / iterations as f64
    }
}

/// Whether the next iteration cannot be afforded: `spent + projected > budget`.
pub fn unaffordable(spent_usd: f64, projected_usd: f64, budget_usd: f64) -> bool {
    spent_usd + projected_usd > budget_usd
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prices() -> Prices {
        serde_yaml_ng::from_str("gpt-x: {input: 1.0, output: 2.0, cached_input: 0.5}\nplain: {input: 3, output: 4}\n")
            .unwrap()
    }

    #[test]
    fn cached_input_is_priced_apart_and_defaults_to_the_input_price() {
        let u = Usage {
            model: Some("gpt-x".into()),
            input_tokens: 2_000_000,
            output_tokens: 1_000_000,
            cached_tokens: 1_000_000,
            cache_write_tokens: 0,
            estimated: false,
        };
        assert_eq!(prices().cost(&u), Some(3500.0));
        let plain = Usage { model: Some("plain".into()), ..u.clone() };
        assert_eq!(prices().cost(&plain), Some(6000.0 + 4000.0));
        assert_eq!(prices().cost(&Usage { model: Some("local".into()), ..u }), None);
    }

    #[test]
    fn provider_counts_win_and_missing_ones_are_estimated_and_marked() {
        let mut u = Usage::default();
        let reported = ProviderUsage {
            input_tokens_actual: Some(100),
            output_tokens_actual: Some(20),
            cached_tokens: Some(60),
            cache_write_tokens: None,
        };
        u.add_call(90, 25, &reported, false);
        assert_eq!((u.input_tokens, u.output_tokens, u.cached_tokens, u.estimated), (100, 20, 60, false));
        u.add_call(7, 3, &ProviderUsage::default(), false);
        assert_eq!((u.input_tokens, u.output_tokens, u.cached_tokens, u.estimated), (107, 23, 60, true));
        let mut anthropic = Usage::default();
        let a = ProviderUsage {
            input_tokens_actual: Some(10),
            output_tokens_actual: Some(5),
            cached_tokens: Some(30),
            cache_write_tokens: Some(2),
        };
        anthropic.add_call(0, 0, &a, true);
        assert_eq!((anthropic.input_tokens, anthropic.cached_tokens, anthropic.cache_write_tokens), (42, 30, 2));
    }

    #[test]
    fn cache_writes_are_priced_apart_and_default_to_the_input_price() {
        let prices: Prices = serde_yaml_ng::from_str(
            "claude-x: {input: 3, output: 15, cached_input: 0.25, cache_write: 3.75}
old: {input: 3, output: 15, cached_input: 0.25}
",
        )
        .unwrap();
        // 1,000 plain + 4,000 read + 2,000 written = 7,000 input tokens, 500 out.
        let u = Usage {
            model: Some("claude-x".into()),
            input_tokens: 7000,
            output_tokens: 500,
            cached_tokens: 4000,
            cache_write_tokens: 2000,
            estimated: false,
        };
        // (1,000 × 3 + 4,000 × 0.25 + 2,000 × 3.75 + 500 × 15) / 1,000.
        assert_eq!(prices.cost(&u), Some(19.0));
        assert_eq!(prices.cost(&Usage { model: Some("old".into()), ..u.clone() }), Some(17.5));
        let mut spend = Spend::default();
        spend.add(&u, prices.cost(&u));
        assert_eq!(spend.summary(), "$19.0000 (7000 in, 4000 cached, 2000 cache-write, 500 out)");
        let bad: Prices = serde_yaml_ng::from_str(
            "m: {input: 1, output: 1, cache_write: -1}
",
        )
        .unwrap();
        assert_eq!(
            bad.validate().unwrap_err(),
            "prices.m.cache_write: must be a non-negative number of USD per 1,000 tokens, got -1"
        );
    }

    #[test]
    fn the_first_iteration_is_projected_per_member_and_later_ones_by_the_average() {
        assert_eq!(projected_next(0, 0.0, 2, 2.0), 14_000.0);
        assert_eq!(projected_next(2, 7000.0, 2, 2.0), 3500.0);
        assert!(!unaffordable(3500.0, 3500.0, 7000.0));
        assert!(unaffordable(7000.0, 3500.0, 10_000.0));
        assert_eq!(prices().guard_rate([Some("plain"), Some("gpt-x"), None]), Some(4.0));
        assert_eq!(prices().guard_rate([Some("local"), None]), None);
    }

    #[test]
    fn a_negative_or_non_finite_price_is_refused_naming_the_field() {
        let bad: Prices = serde_yaml_ng::from_str("m: {input: -1, output: .nan}\n").unwrap();
        assert_eq!(
            bad.validate().unwrap_err(),
            "prices.m.input: must be a non-negative number of USD per 1,000 tokens, got -1\n\
             prices.m.output: must be a non-negative number of USD per 1,000 tokens, got NaN"
        );
        assert!(serde_yaml_ng::from_str::<Prices>("m: {input: 1, output: 1, cache: 1}\n").is_err());
        assert_eq!(prices().validate(), Ok(()));
    }
}
