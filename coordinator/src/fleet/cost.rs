//! Cost on the leader (issue #11 §Cost): the cluster config's fleet settings (`prices:`,
//! `fleet.autorun`), whether a fleet runs on metered models (a capsule whose
//! `inference.model` has a price; the capsule index records each capsule's model), the
//! notice a local fleet gets at its start, and the accounting of an iteration's spend
//! into the run's record from its tasks' terminal records (run, job, member).
//!
//! The budget check itself is pure ([`crate::fleet::machine::Run`], before each iteration).

use async_nats::jetstream::kv;
use mur_proto::cluster::CapsuleIndexEntry;
use mur_proto::cost::{Prices, Spend, Usage};
use mur_proto::fleet::{Bounds, Fleet};
use mur_proto::fleet_store::RunRecord;
use std::sync::Mutex;

/// The fleet part of the cluster config (`--config`): `prices:` and `fleet: {autorun}`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetSettings {
    /// USD per 1,000 tokens per model; a model without a price is local (not metered).
    pub prices: Prices,
    /// `fleet.autorun`: triggers fire unattended (`MUR_FLEET_AUTORUN` also enables it).
    pub autorun: bool,
    /// The cluster config's `limits:` (§The bounds: the scope after a fleet's own).
    pub limits: mur_proto::fleet::LimitsBlock,
}

/// The models of `capsules` as their latest push recorded them (`None`: no model, not
/// pushed, or the index could not be read).
pub async fn models_of(index: &kv::Store, capsules: &[String]) -> Vec<Option<String>> {
    let mut out = Vec::with_capacity(capsules.len());
    for c in capsules {
        let model = match index.get(c).await {
            Ok(Some(v)) => serde_json::from_slice::<CapsuleIndexEntry>(&v).ok().and_then(|e| e.model),
            _ => None,
        };
        out.push(model);
    }
    out
}

/// The capsules a fleet's run calls: its members and its router.
pub fn capsules_of(fleet: &Fleet) -> Vec<String> {
    fleet.members.iter().cloned().chain(fleet.router.clone()).collect()
}

/// The coordinator's environment variable that sets the projection's rate (USD per 1,000
/// tokens) for every metered fleet, when it is a number above 0 (ref §3 step 4).
pub const COST_PER_1K_ENV: &str = "MUR_FLEET_COST_PER_1K";

/// [`COST_PER_1K_ENV`] as `env` gives it: a finite number above 0, else `None`.
pub fn rate_override(env: &dyn Fn(&str) -> Option<String>) -> Option<f64> {
    env(COST_PER_1K_ENV).and_then(|v| v.trim().parse::<f64>().ok()).filter(|r| r.is_finite() && *r > 0.0)
}

/// How a run is bounded in money: `(budget, guard rate, notice)`. A fleet on metered
/// models (some capsule's model has a price) gets the resolved cost bound (if any) and the
/// projection's rate: `rate_override` ([`rate_override`]) when given, else the dearest
/// output price of its models; a local fleet gets no budget and the notice that its
/// deadline bounds it (ref §2 "Cost applicability").
pub fn metering(
    fleet: &Fleet,
    bounds: &Bounds,
    prices: &Prices,
    models: &[Option<String>],
    rate_override: Option<f64>,
) -> Metering {
    match prices.guard_rate(models.iter().map(Option::as_deref)) {
        Some(rate) => {
            Metering { budget_usd: bounds.cost_usd.value, guard_rate: rate_override.unwrap_or(rate), notice: None }
        }
        None => {
            let ignored = match bounds.cost_usd.value {
                Some(_) => format!("; the budget {} ← {} is ignored", bounds.cost_usd.text, bounds.cost_usd.source),
                None => String::new(),
            };
            Metering {
                budget_usd: None,
                guard_rate: 0.0,
                notice: Some(format!(
                    "fleet '{}' runs on models with no price (local): it is bounded by its deadline {}{ignored}",
                    fleet.name, bounds.deadline.text
                )),
            }
        }
    }
}

/// What [`metering`] decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Metering {
    /// The spend ceiling in force.
    pub budget_usd: Option<f64>,
    /// USD per 1,000 tokens for the projection; 0 when not metered.
    pub guard_rate: f64,
    /// The notice of a local fleet.
    pub notice: Option<String>,
}

/// Usage of the tasks an iteration waited for, as their terminal records carried it.
#[derive(Debug, Default)]
pub struct Tally(Mutex<Vec<(String, Usage)>>);

impl Tally {
    /// Notes a finished task of `capsule`.
    pub fn note(&self, capsule: &str, usage: Option<&Usage>) {
        if let Some(u) = usage {
            self.0.lock().expect("tally poisoned").push((capsule.to_string(), u.clone()));
        }
    }

    /// Everything noted since the last call.
    pub fn take(&self) -> Vec<(String, Usage)> {
        std::mem::take(&mut *self.0.lock().expect("tally poisoned"))
    }
}

/// Adds an iteration's task usages to `record` (run, members, and `job` when there is
/// one). Returns the iteration's spend.
pub fn account(record: &mut RunRecord, prices: &Prices, job: Option<&str>, usages: &[(String, Usage)]) -> Spend {
    let mut iteration = Spend::default();
    for (capsule, usage) in usages {
        let usd = prices.cost(usage);
        mur_nats::metrics::fleet_spend(&record.fleet, usd.unwrap_or(0.0));
        iteration.add(usage, usd);
        record.members.entry(capsule.clone()).or_default().add(usage, usd);
        if let Some(j) = job {
            record.jobs.entry(j.to_string()).or_default().add(usage, usd);
        }
    }
    record.spend.add_spend(&iteration);
    iteration
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::fleet::{self, LimitsBlock, RunFlags};

    #[test]
    fn a_fleet_without_a_priced_model_is_bounded_by_its_deadline_and_told_so() {
        let f = Fleet::parse("name: local\nmembers: [a]\n").unwrap();
        let flags = RunFlags { budget_usd: Some(5.0), deadline: Some("2m".into()), ..RunFlags::default() };
        let bounds = fleet::resolve_bounds(&f, &flags, &LimitsBlock::Absent).unwrap();
        let prices: Prices = serde_yaml_ng::from_str("gpt-x: {input: 1, output: 2}\n").unwrap();
        let local = metering(&f, &bounds, &prices, &[Some("llama".into())], Some(9.0));
        assert_eq!(
            local,
            Metering {
                budget_usd: None,
                guard_rate: 0.0,
                notice: Some(
                    "fleet 'local' runs on models with no price (local): it is bounded by its deadline 2m; \
                     the budget 5 ← --budget-usd is ignored"
                        .into()
                ),
            }
        );
        let metered = metering(&f, &bounds, &prices, &[Some("gpt-x".into())], None);
        assert_eq!(metered, Metering { budget_usd: Some(5.0), guard_rate: 2.0, notice: None });
        let overridden = metering(&f, &bounds, &prices, &[Some("gpt-x".into())], Some(0.25));
        assert_eq!(overridden.guard_rate, 0.25);
    }

    #[test]
    fn the_rate_override_must_be_a_number_above_zero() {
        let env = |v: &'static str| move |k: &str| (k == COST_PER_1K_ENV).then(|| v.to_string());
        assert_eq!(rate_override(&env(" 0.5 ")), Some(0.5));
        for bad in ["0", "-1", "NaN", "inf", "cheap", ""] {
            assert_eq!(rate_override(&env(bad)), None, "{bad:?}");
        }
    }
}
