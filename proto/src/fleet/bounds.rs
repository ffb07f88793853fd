//! A run's bounds and fan-out cap, resolved from flags, the fleet and the config (§The bounds).

use super::*;

/// Where a bound's value came from, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A `mur fleet run` flag; the flag's spelling.
    Flag(&'static str),
    /// The fleet's `limits:` block.
    FleetLimits,
    /// The fleet's legacy `loop.deadline` / `loop.budget_usd` (only without `limits:`).
    FleetLoop,
    /// The cluster's `config.yaml` `limits:` block.
    Config,
    /// The built-in default.
    BuiltIn,
}

impl Source {
    /// The label printed after `←`.
    pub const fn label(self) -> &'static str {
        match self {
            Source::Flag(f) => f,
            Source::FleetLimits => "fleet.yaml",
            Source::FleetLoop => "fleet.yaml loop",
            Source::Config => "config.yaml",
            Source::BuiltIn => "built-in",
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One resolved bound: its value, its text as given, and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound<T> {
    /// The value.
    pub value: T,
    /// The text as given (`2m`, `off`, `5`), for display.
    pub text: String,
    /// Where it came from.
    pub source: Source,
}

/// The flags of `mur fleet run NAME [JOB] [--loop] [--deadline D] [--budget-usd N]
/// [--run-id ID]`, plus the ignored `--max-iterations`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunFlags {
    /// `--loop`.
    pub r#loop: bool,
    /// `--deadline D`.
    pub deadline: Option<String>,
    /// `--budget-usd N` (0: no ceiling).
    pub budget_usd: Option<f64>,
    /// `--run-id ID`.
    pub run_id: Option<String>,
    /// `--max-iterations N`: ignored with a notice.
    pub max_iterations: Option<u64>,
}

/// A run's resolved bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct Bounds {
    /// Wall clock for the loop, from its start.
    pub deadline: Bound<Duration>,
    /// No-progress window; `None` when off.
    pub stuck: Bound<Option<Duration>>,
    /// Spend ceiling in USD; `None` when there is none (absent or 0).
    pub cost_usd: Bound<Option<f64>>,
    /// Notices to print before the run (ignored iteration caps).
    pub notices: Vec<String>,
}

impl Bounds {
    /// The line printed at start: `bounds: deadline 2m ← --deadline; stuck 10m ← built-in`.
    pub fn line(&self) -> String {
        format!(
            "bounds: deadline {} ← {}; stuck {} ← {}",
            self.deadline.text, self.deadline.source, self.stuck.text, self.stuck.source
        )
    }
}

/// Resolves a run's bounds per key, narrowest first: flag → the fleet's `limits:` (or its
/// legacy `loop.*` keys when `limits:` is absent) → the cluster's `config.yaml` `limits:` →
/// built-in (deadline 1h, stuck 10m, no cost ceiling). Scopes replace a key, they never
/// combine. Every scope is validated first and every error reported.
///
/// # Errors
/// [`Error::Invalid`], one line per broken value, each starting `fleet '<name>': ` and the
/// scope (`--deadline: `, `fleet.yaml: limits.stuck: `, `config.yaml: limits.deadline: `).
pub fn resolve_bounds(fleet: &Fleet, flags: &RunFlags, config: &LimitsBlock) -> Result<Bounds, Error> {
    let prefix = format!("fleet '{}': ", fleet.name);
    let mut errors = Vec::new();
    let mut notices = Vec::new();

    let flag_deadline = flags.deadline.as_deref().and_then(|d| {
        DurationText::parse_bound(d).map_err(|rule| errors.push(format!("{prefix}--deadline: {rule}"))).ok()
    });
    let flag_cost = flags.budget_usd.and_then(|b| {
        if b.is_finite() && b >= 0.0 {
            Some(b)
        } else {
            errors.push(format!("{prefix}--budget-usd: must be a non-negative number (0 for no ceiling), got {b}"));
            None
        }
    });
    let fleet_scope = fleet.fleet_scope().map_err(|e| {
        errors.extend(e.into_iter().map(|e| format!("{prefix}fleet.yaml: {e}")));
    });
    let config_scope = match config {
        LimitsBlock::Absent => Some(Limits::default()),
        LimitsBlock::Set(l) => Some(l.clone()),
        LimitsBlock::Invalid(e) => {
            errors.extend(e.iter().map(|e| format!("{prefix}config.yaml: {e}")));
            None
        }
    };
    if flags.max_iterations.is_some() {
        notices.push(format!("--max-iterations {MAX_ITERATIONS_NOTICE}"));
    }
    if fleet.r#loop.max_iterations != 0 {
        notices.push(format!("loop.max_iterations {MAX_ITERATIONS_NOTICE}"));
    }
    let (Ok((fleet_limits, fleet_source)), Some(config_limits)) = (fleet_scope, config_scope) else {
        return Err(Error::Invalid(errors));
    };
    if !errors.is_empty() {
        return Err(Error::Invalid(errors));
    }

    let builtin_deadline = DurationText::parse(BUILTIN_DEADLINE).expect("built-in deadline parses");
    let (d, source) = [
        (flag_deadline, Source::Flag("--deadline")),
        (fleet_limits.deadline, fleet_source),
        (config_limits.deadline, Source::Config),
    ]
    .into_iter()
    .find_map(|(d, s)| d.map(|d| (d, s)))
    .unwrap_or((builtin_deadline, Source::BuiltIn));
    let deadline = Bound { value: d.duration, text: d.text, source };

    let builtin_stuck = Stuck::After(DurationText::parse(BUILTIN_STUCK).expect("built-in stuck parses"));
    let (s, source) = [(fleet_limits.stuck, fleet_source), (config_limits.stuck, Source::Config)]
        .into_iter()
        .find_map(|(s, src)| s.map(|s| (s, src)))
        .unwrap_or((builtin_stuck, Source::BuiltIn));
    let stuck = Bound { value: s.window(), text: s.as_text().to_string(), source };

    let (c, source) = [
        (flag_cost, Source::Flag("--budget-usd")),
        (fleet_limits.cost_usd, fleet_source),
        (config_limits.cost_usd, Source::Config),
    ]
    .into_iter()
    .find_map(|(c, s)| c.map(|c| (c, s)))
    .map_or((None, Source::BuiltIn), |(c, s)| (Some(c), s));
    let cost_usd =
        Bound { value: c.filter(|&c| c > 0.0), text: c.map_or_else(|| "none".to_string(), |c| c.to_string()), source };

    Ok(Bounds { deadline, stuck, cost_usd, notices })
}

/// The fan-out cap: how many delegated steps may run at once, cluster-wide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fanout {
    /// At least 1.
    pub cap: u32,
    /// Where it came from.
    pub source: FanoutSource,
    /// Set when `MUR_FLEET_FANOUT` was given but not used because it is not a positive
    /// integer.
    pub notice: Option<String>,
}

/// Where the fan-out cap came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FanoutSource {
    /// The fleet's `fanout:` key.
    Fleet,
    /// `MUR_FLEET_FANOUT`.
    Env,
    /// The default, 3.
    BuiltIn,
}

impl Fanout {
    /// Steps to run at once for a rank of `steps` steps: the cap, but never more than
    /// there are steps and never below 1.
    pub fn for_steps(&self, steps: usize) -> usize {
        (self.cap as usize).min(steps).max(1)
    }
}

/// Resolves the fan-out cap (§The bounds, fan-out bound; issue #10): the fleet's
/// `fanout:` key, else `MUR_FLEET_FANOUT` (read through `env`), else 3. A value that is 0
/// or not a positive integer falls back to the default, never to unbounded.
pub fn resolve_fanout(fleet_fanout: Option<u32>, env: &dyn Fn(&str) -> Option<String>) -> Fanout {
    if let Some(cap) = fleet_fanout.filter(|&c| c > 0) {
        return Fanout { cap, source: FanoutSource::Fleet, notice: None };
    }
    match env(FANOUT_ENV) {
        None => Fanout { cap: DEFAULT_FANOUT, source: FanoutSource::BuiltIn, notice: None },
        Some(v) => match v.trim().parse::<u32>() {
            Ok(cap) if cap > 0 => Fanout { cap, source: FanoutSource::Env, notice: None },
            _ => Fanout {
                cap: DEFAULT_FANOUT,
                source: FanoutSource::BuiltIn,
                notice: Some(format!(
                    "{FANOUT_ENV}={v:?} is not a positive integer; at most {DEFAULT_FANOUT} delegated steps run at once"
                )),
            },
        },
    }
}

/// Whether unattended runs may start (§Unattended runs): `MUR_FLEET_AUTORUN` is `1`,
/// `true` or `yes` (any case), or the cluster config's `fleet.autorun` is true.
pub fn autorun_enabled(env: &dyn Fn(&str) -> Option<String>, config_autorun: bool) -> bool {
    config_autorun
        || env(AUTORUN_ENV).is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}
