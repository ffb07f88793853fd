//! Context seeding decisions (the session-loop seed, §Context seeding): what the runtime
//! does with a `seed-context` proposal, checked in the seed's order. Pure: token counts are
//! passed in.
//!
//! | Condition | Result |
//! |---|---|
//! | `inference.transport: process` | nothing seeded (`unsupported_transport`) |
//! | no `context.max_tokens` | nothing seeded (`no_budget`) |
//! | one message alone wider than the ceiling | nothing seeded (`message_over_budget`) |
//! | more than three times the ceiling over it | nothing seeded (`overflow_over_limit`) |
//! | fits the ceiling | all seeded (`seeded`) |
//! | over by no more than `seed_overflow_margin` of the ceiling | oldest dropped until it fits (`trimmed`) |
//! | over by more, an `on-compaction` hook bound | overflowing front summarised, summary first (`compacted`) |
//! | over by more, no `on-compaction` hook answers | oldest dropped until it fits (`trimmed`) |
//!
//! "More than three times the ceiling over it" is read as: the overflow (proposal − ceiling)
//! exceeds 3 × ceiling, as in the reference runtime (the runtime reference, §5).

/// Why nothing was seeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// The process transport owns its own conversation.
    UnsupportedTransport,
    /// The capsule declares no `context.max_tokens`.
    NoBudget,
    /// One message alone is wider than the ceiling.
    MessageOverBudget,
    /// The proposal is more than three times the ceiling over it.
    OverflowOverLimit,
}

impl Rejection {
    /// The `reason` on the `context_seed` event.
    pub const fn as_str(self) -> &'static str {
        match self {
            Rejection::UnsupportedTransport => "unsupported_transport",
            Rejection::NoBudget => "no_budget",
            Rejection::MessageOverBudget => "message_over_budget",
            Rejection::OverflowOverLimit => "overflow_over_limit",
        }
    }
}

/// What to do with a proposal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Seed nothing.
    Reject(Rejection),
    /// Seed every message.
    SeedAll,
    /// Seed the messages from index `keep_from` on (the oldest are dropped).
    Trim {
        /// First kept message.
        keep_from: usize,
    },
    /// Ask the `on-compaction` hook to summarise messages `..keep_from` into a summary that
    /// goes first; if no summary comes back, trim instead (`keep_from` already fits).
    Summarise {
        /// First message kept verbatim.
        keep_from: usize,
    },
}

/// The inputs of the decision.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// The capsule runs `inference.transport: process`.
    pub process_transport: bool,
    /// floor(`context.max_tokens` × `context.seed_budget`); 0 without `context.max_tokens`.
    pub budget: u64,
    /// `context.seed_overflow_margin`.
    pub margin: f64,
    /// A hook is bound to `on-compaction`.
    pub compaction_hook: bool,
    /// Token estimate of each proposed message, oldest first.
    pub tokens: &'a [u64],
}

/// Decides what to seed, in the seed table's order.
pub fn plan(i: Inputs<'_>) -> Plan {
    if i.process_transport {
        return Plan::Reject(Rejection::UnsupportedTransport);
    }
    if i.budget == 0 {
        return Plan::Reject(Rejection::NoBudget);
    }
    if i.tokens.iter().any(|&t| t > i.budget) {
        return Plan::Reject(Rejection::MessageOverBudget);
    }
    let total: u64 = i.tokens.iter().sum();
    if total <= i.budget {
        return Plan::SeedAll;
    }
    let over = total - i.budget;
    if over > 3 * i.budget {
        return Plan::Reject(Rejection::OverflowOverLimit);
    }
    let keep_from = trim_point(i.tokens, i.budget);
    if (over as f64) <= i.margin * i.budget as f64 || !i.compaction_hook {
        Plan::Trim { keep_from }
    } else {
        Plan::Summarise { keep_from }
    }
}

/// The first index such that `tokens[index..]` fits `budget` (dropping from the front).
pub fn trim_point(tokens: &[u64], budget: u64) -> usize {
    let mut total: u64 = tokens.iter().sum();
    let mut i = 0;
    while total > budget && i < tokens.len() {
        total -= tokens[i];
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(process: bool, budget: u64, hook: bool, tokens: &[u64]) -> Plan {
        plan(Inputs { process_transport: process, budget, margin: 0.10, compaction_hook: hook, tokens })
    }

    #[test]
    fn each_row_of_the_seed_table_in_order() {
        // process transport wins over everything else
        assert_eq!(p(true, 100, true, &[10]), Plan::Reject(Rejection::UnsupportedTransport));
        // no context.max_tokens
        assert_eq!(p(false, 0, true, &[10]), Plan::Reject(Rejection::NoBudget));
        // one message wider than the ceiling (even if the total would be small)
        assert_eq!(p(false, 100, true, &[101]), Plan::Reject(Rejection::MessageOverBudget));
        // more than three times the ceiling over it: 100 + 301 = 401
        assert_eq!(p(false, 100, true, &[100, 100, 100, 100, 1]), Plan::Reject(Rejection::OverflowOverLimit));
        // exactly three times over is still handled: 400 total
        assert_eq!(p(false, 100, false, &[100, 100, 100, 100]), Plan::Trim { keep_from: 3 });
        // fits
        assert_eq!(p(false, 100, true, &[50, 50]), Plan::SeedAll);
        // over by no more than the margin (10% of 100 = 10): trimmed even with a hook
        assert_eq!(p(false, 100, true, &[10, 50, 50]), Plan::Trim { keep_from: 1 });
        // over by more, hook bound: summarised
        assert_eq!(p(false, 100, true, &[30, 50, 50]), Plan::Summarise { keep_from: 1 });
        // over by more, no hook: trimmed
        assert_eq!(p(false, 100, false, &[30, 50, 50]), Plan::Trim { keep_from: 1 });
    }

    #[test]
    fn trim_drops_oldest_until_the_rest_fits() {
        assert_eq!(trim_point(&[40, 40, 40], 100), 1);
        assert_eq!(trim_point(&[90, 5, 5], 10), 1);
        assert_eq!(trim_point(&[5, 5], 10), 0);
    }
}
