//! The raw shape of `fleet.yaml` and its validation: every field optional, unknown keys
//! refused (strict) or stripped with a notice (stored); [`Fleet::parse`], [`Fleet::load_stored`].

use super::*;

const TOP_KEYS: &[&str] =
    &["name", "goal", "members", "router", "loop", "limits", "fanout", "hitl", "procedure", "parallel", "needs"];
const LOOP_KEYS: &[&str] = &[
    "trigger",
    "done_when",
    "deadline",
    "budget_usd",
    "max_iterations",
    "timezone",
    "overlap",
    "catchup",
    "pause_after_failures",
];
const LIMITS_KEYS: &[&str] = &["deadline", "stuck", "cost_usd"];
const HITL_KEYS: &[&str] = &["mode", "auto_approve_tiers"];
const STEP_KEYS: &[&str] = &["id", "member", "task", "depends_on", "on_failure", "max_retries", "tier"];
const PARALLEL_KEYS: &[&str] = &["mode", "tracks", "judge", "pre_filter", "partition"];
const TRACK_KEYS: &[&str] = &["name", "approach", "model"];
const JUDGE_KEYS: &[&str] = &["model", "rubric"];
const PARTITION_KEYS: &[&str] = &["target_file"];

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct Raw {
    name: Option<String>,
    goal: Option<String>,
    members: Option<Vec<String>>,
    router: Option<String>,
    r#loop: Option<RawLoop>,
    limits: Option<RawLimits>,
    fanout: Option<Int>,
    hitl: Option<RawHitl>,
    procedure: Option<Vec<RawStep>>,
    parallel: Option<RawParallel>,
    needs: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawLoop {
    trigger: Option<String>,
    done_when: Option<String>,
    deadline: Option<Text>,
    budget_usd: Option<Real>,
    max_iterations: Option<Int>,
    timezone: Option<String>,
    overlap: Option<String>,
    catchup: Option<Text>,
    pause_after_failures: Option<Int>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
pub(super) struct RawLimits {
    deadline: Option<Text>,
    stuck: Option<Text>,
    cost_usd: Option<Real>,
}

/// A duration as written: text, or an unquoted number (`deadline: 90`, seconds) kept as
/// its digits, so that [`parse_duration`] judges every spelling and its error names the
/// field's rule (`-5`, `1.5` and integers past 64 bits included).
struct Text(String);

impl Text {
    fn into_string(self) -> String {
        self.0
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Text, D::Error> {
        struct Written;
        impl serde::de::Visitor<'_> for Written {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(DURATION_RULE.trim_start_matches("must be "))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
        }
        deserializer.deserialize_any(Written)
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawHitl {
    mode: Option<Value>,
    auto_approve_tiers: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawStep {
    id: Option<String>,
    member: Option<String>,
    task: Option<String>,
    depends_on: Option<Vec<String>>,
    on_failure: Option<Value>,
    max_retries: Option<Int>,
    tier: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawParallel {
    mode: Value,
    tracks: Option<Vec<Track>>,
    judge: Option<Judge>,
    pre_filter: Option<String>,
    partition: Option<Partition>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Strict,
    Stored,
}

/// Collects broken rules; in stored mode the softened ones become notices.
struct Rules {
    mode: Mode,
    errors: Vec<String>,
    notices: Vec<String>,
}

impl Rules {
    fn fail(&mut self, path: &str, rule: impl fmt::Display) {
        self.errors.push(format!("{path}: {rule}"));
    }

    /// One of an enum's values (`hitl.mode`, `parallel.mode`, a step's `on_failure` and
    /// `tier`), read from what the text holds there; anything else is a broken rule in
    /// serde's words (`unknown variant `sometimes`, expected one of …`), reported with the
    /// others rather than stopping the parse.
    fn choice<T: serde::de::DeserializeOwned>(&mut self, path: &str, value: Value) -> Option<T> {
        if value.is_string() {
            return serde_yaml_ng::from_value(value).map_err(|e| self.fail(path, e)).ok();
        }
        // Not text at all: serde's words for it name YAML internals; the values allowed are
        // the ones an unknown one is told.
        let allowed = serde_yaml_ng::from_value::<T>(Value::String(String::new()))
            .err()
            .and_then(|e| e.to_string().split_once("expected ").map(|(_, list)| list.to_string()))
            .unwrap_or_else(|| "text".into());
        let shown = serde_json::to_string(&value).unwrap_or_default();
        self.fail(path, format_args!("must be {allowed}, got {shown}"));
        None
    }

    /// A rule older versions did not apply: refused when strict, a notice (saying what is
    /// used instead) when stored.
    fn soft(&mut self, path: &str, rule: impl fmt::Display, instead: &str) {
        match self.mode {
            Mode::Strict => self.fail(path, rule),
            Mode::Stored => self.notices.push(format!("{path}: {rule} (stored by an older version; {instead})")),
        }
    }
}

impl Fleet {
    /// Parses and validates `fleet.yaml` text strictly, as `mur fleet create` and `apply`
    /// do.
    ///
    /// # Errors
    /// [`Error::Parse`] for text that does not fit the shape (an unknown key, a wrong type),
    /// naming the field path; with unknown keys, one line each, followed by what the rest
    /// breaks (its shape or its rules). [`Error::Invalid`] listing every broken rule, one
    /// `path: rule` line each — a value outside its set (`hitl.mode`, `parallel.mode`, a
    /// step's `on_failure` or `tier`) among them.
    pub fn parse(text: &str) -> Result<Fleet, Error> {
        let text = crate::without_bom(text);
        // Every unknown key at once (serde stops at the first), in serde's words, and then
        // what the rest breaks: one answer names everything there is to mend.
        if let Ok(Value::Mapping(mut map)) = serde_yaml_ng::from_str::<Value>(text) {
            let unknown = remove_unknown(&mut map, |_| true);
            if !unknown.is_empty() {
                let mut lines: Vec<String> = unknown.iter().map(Unknown::refused).collect();
                match serde_yaml_ng::from_value::<Raw>(Value::Mapping(map)) {
                    Err(e) => lines.push(e.to_string()),
                    Ok(raw) => match validate(raw, None, Mode::Strict) {
                        Err(Error::Invalid(rules)) => lines.extend(rules),
                        Err(Error::Parse(line)) => lines.push(line),
                        Ok(_) => {}
                    },
                }
                return Err(Error::Parse(lines.join("\n")));
            }
        }
        let raw: Raw = serde_yaml_ng::from_str(text).map_err(|e| Error::Parse(e.to_string()))?;
        validate(raw, None, Mode::Strict)
    }

    /// Loads a definition already stored, accepting what older versions accepted (see the
    /// module header); every such value is recorded in [`Fleet::notices`].
    ///
    /// # Errors
    /// Text that is not a YAML mapping, a wrong type outside `limits:`, or a rule that
    /// applies when any fleet loads (the name, the `procedure:` rules).
    pub fn load_stored(text: &str) -> Result<Fleet, Error> {
        let mut value: Value =
            serde_yaml_ng::from_str(crate::without_bom(text)).map_err(|e| Error::Parse(e.to_string()))?;
        let Some(map) = value.as_mapping_mut() else {
            return Err(Error::Parse("fleet.yaml must be a mapping of keys".to_string()));
        };
        // `limits:` keeps its unknown keys: a block that does not parse is reported below.
        let mut notices: Vec<String> =
            remove_unknown(map, |path| path != "limits").iter().map(Unknown::ignored).collect();
        // The limits block is read on its own: one that does not parse leaves the fleet
        // loadable but unbounded-by-choice, so it never resolves (§Unattended runs).
        let stored_limits = map.remove("limits").map(|v| match serde_yaml_ng::from_value::<Option<RawLimits>>(v) {
            Ok(None) => LimitsBlock::Absent,
            Err(e) => LimitsBlock::Invalid(vec![format!("limits: {e}")]),
            Ok(Some(raw)) => {
                let mut errors = Vec::new();
                let limits = validate_limits(raw, &mut errors);
                if errors.is_empty() { LimitsBlock::Set(limits) } else { LimitsBlock::Invalid(errors) }
            }
        });
        let raw: Raw = serde_yaml_ng::from_value(value).map_err(|e| Error::Parse(e.to_string()))?;
        let mut fleet = validate(raw, stored_limits, Mode::Stored)?;
        if let LimitsBlock::Invalid(errors) = &fleet.limits {
            for e in errors {
                fleet.notices.push(format!("{e} (stored by an older version; the fleet's bounds do not resolve)"));
            }
        }
        notices.append(&mut fleet.notices);
        fleet.notices = notices;
        Ok(fleet)
    }

    /// How a run plans (§A fixed step graph; issue #10 `router`): the procedure if there is
    /// one, else the router when set and there are several members, else every member.
    pub fn plan_kind(&self) -> PlanKind {
        if !self.procedure.is_empty() {
            PlanKind::Procedure
        } else if self.router.is_some() && self.members.len() > 1 {
            PlanKind::Router
        } else {
            PlanKind::Broadcast
        }
    }

    /// What a run needs that loading does not: at least one member.
    ///
    /// # Errors
    /// A line naming the fleet and the missing piece.
    pub fn check_runnable(&self) -> Result<(), String> {
        if self.members.is_empty() {
            return Err(format!("fleet '{}': members: is empty; add capsule names to run it", self.name));
        }
        Ok(())
    }

    /// The fleet's channel id, `fleet-<name>`.
    pub fn channel_id(&self) -> String {
        channel_id(&self.name)
    }

    /// The limits the fleet contributes to bounds resolution: its `limits:` block, or when
    /// that is absent the legacy `loop.deadline` / `loop.budget_usd` (> 0).
    pub(super) fn fleet_scope(&self) -> Result<(Limits, Source), Vec<String>> {
        match &self.limits {
            LimitsBlock::Set(l) => Ok((l.clone(), Source::FleetLimits)),
            LimitsBlock::Invalid(errors) => Err(errors.clone()),
            LimitsBlock::Absent => Ok((
                Limits {
                    deadline: self.r#loop.deadline.clone(),
                    stuck: None,
                    cost_usd: (self.r#loop.budget_usd > 0.0).then_some(self.r#loop.budget_usd),
                },
                Source::FleetLoop,
            )),
        }
    }
}

/// A key outside the closed set of keys of its mapping.
struct Unknown {
    /// The mapping's path: `""` for the top, `loop`, `procedure[0]`, `parallel.tracks[1]`.
    path: String,
    key: String,
    allowed: &'static [&'static str],
}

impl Unknown {
    /// As strict parsing refuses it, in serde's words (serde reports only the first):
    /// ``loop: unknown field `max_iteration`, expected one of `trigger`, …``.
    fn refused(&self) -> String {
        let prefix = if self.path.is_empty() { String::new() } else { format!("{}: ", self.path) };
        let expected = self.allowed.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", ");
        format!("{prefix}unknown field `{}`, expected one of {expected}", self.key)
    }

    /// As loading a stored definition notes it: `loop.max_iteration: unknown key (…; ignored)`.
    fn ignored(&self) -> String {
        let prefix = if self.path.is_empty() { String::new() } else { format!("{}.", self.path) };
        format!("{prefix}{}: unknown key (stored by an older version; ignored)", self.key)
    }
}

/// Removes every unknown key of a fleet's mapping and of its `loop:`, `limits:`, `hitl:`,
/// `parallel:` (its tracks, judge and partition) and `procedure[i]` mappings, of those
/// whose path `within` accepts, and returns them in document order.
fn remove_unknown(map: &mut Mapping, within: impl Fn(&str) -> bool) -> Vec<Unknown> {
    let mut out = Vec::new();
    let mut check = |map: &mut Mapping, allowed: &'static [&'static str], path: String| {
        if !within(&path) {
            return;
        }
        let unknown: Vec<Value> =
            map.keys().filter(|k| !k.as_str().is_some_and(|k| allowed.contains(&k))).cloned().collect();
        for k in unknown {
            map.remove(&k);
            let key = k.as_str().map_or_else(|| format!("{k:?}"), str::to_string);
            out.push(Unknown { path: path.clone(), key, allowed });
        }
    };
    check(map, TOP_KEYS, String::new());
    for (key, allowed) in
        [("loop", LOOP_KEYS), ("limits", LIMITS_KEYS), ("hitl", HITL_KEYS), ("parallel", PARALLEL_KEYS)]
    {
        if let Some(Value::Mapping(m)) = map.get_mut(key) {
            check(m, allowed, key.to_string());
        }
    }
    if let Some(Value::Sequence(steps)) = map.get_mut("procedure") {
        for (i, step) in steps.iter_mut().enumerate() {
            if let Value::Mapping(m) = step {
                check(m, STEP_KEYS, format!("procedure[{i}]"));
            }
        }
    }
    if let Some(Value::Mapping(parallel)) = map.get_mut("parallel") {
        if let Some(Value::Sequence(tracks)) = parallel.get_mut("tracks") {
            for (i, track) in tracks.iter_mut().enumerate() {
                if let Value::Mapping(m) = track {
                    check(m, TRACK_KEYS, format!("parallel.tracks[{i}]"));
                }
            }
        }
        for (key, allowed) in [("judge", JUDGE_KEYS), ("partition", PARTITION_KEYS)] {
            if let Some(Value::Mapping(m)) = parallel.get_mut(key) {
                check(m, allowed, format!("parallel.{key}"));
            }
        }
    }
    out
}

pub(super) fn validate_limits(raw: RawLimits, errors: &mut Vec<String>) -> Limits {
    let deadline = raw.deadline.map(Text::into_string).and_then(|d| {
        DurationText::parse_bound(&d).map_err(|rule| errors.push(format!("limits.deadline: {rule}"))).ok()
    });
    let stuck = raw
        .stuck
        .map(Text::into_string)
        .and_then(|s| Stuck::parse(&s).map_err(|rule| errors.push(format!("limits.stuck: {rule}"))).ok());
    let cost_usd = raw.cost_usd.and_then(|c| match c.number() {
        Some(v) if v.is_finite() && v >= 0.0 => Some(v),
        _ => {
            errors.push(format!("limits.cost_usd: must be a non-negative number (0 for no ceiling), got {c}"));
            None
        }
    });
    Limits { deadline, stuck, cost_usd }
}

fn validate(raw: Raw, stored_limits: Option<LimitsBlock>, mode: Mode) -> Result<Fleet, Error> {
    let mut r = Rules { mode, errors: Vec::new(), notices: Vec::new() };

    let name = match raw.name {
        None => {
            r.fail("name", "required");
            String::new()
        }
        Some(n) => {
            if !is_valid_fleet_name(&n) {
                r.fail("name", format_args!("{NAME_RULE}, got {n:?}"));
            }
            n
        }
    };

    let members = raw.members.unwrap_or_default();
    let mut seen = BTreeSet::new();
    for (i, m) in members.iter().enumerate() {
        let path = format!("members[{i}]");
        if !crate::manifest::is_valid_name(m) {
            r.fail(&path, format_args!("{CAPSULE_NAME_RULE}, got {m:?}"));
        } else if !seen.insert(m.as_str()) {
            r.fail(&path, format_args!("duplicate member {m:?}"));
        }
    }
    if let Some(router) = &raw.router
        && !crate::manifest::is_valid_name(router)
    {
        r.fail("router", format_args!("{CAPSULE_NAME_RULE}, got {router:?}"));
    }

    let r#loop = validate_loop(raw.r#loop.unwrap_or_default(), &mut r);

    let limits = match stored_limits {
        Some(block) => block,
        None => match raw.limits {
            None => LimitsBlock::Absent,
            Some(l) => {
                let mut errors = Vec::new();
                let limits = validate_limits(l, &mut errors);
                r.errors.append(&mut errors);
                LimitsBlock::Set(limits)
            }
        },
    };

    // A whole number past the cap's range is refused by the range, anything else that is
    // not a positive whole number by the key's rule, never in serde's words.
    let fanout = raw.fanout.and_then(|v| {
        let rule = match &v {
            Int::Whole(n) if *n <= 0 => format!("must be a positive integer, got {n}"),
            Int::Other(shown) => format!("must be a positive integer, got {shown}"),
            _ => match v.within(1, u32::MAX) {
                Ok(n) => return Some(n),
                Err(rule) => rule,
            },
        };
        r.soft("fanout", rule, "the default of 3 applies");
        None
    });

    let hitl = validate_hitl(raw.hitl.unwrap_or_default(), &mut r);
    let procedure = validate_procedure(raw.procedure.unwrap_or_default(), &members, &mut r);

    let parallel = raw.parallel.map(|p| Parallel {
        // A wrong mode is a broken rule: no fleet comes of it, the stand-in is never seen.
        mode: r.choice("parallel.mode", p.mode).unwrap_or(ParallelMode::Speculative),
        tracks: p.tracks.unwrap_or_default(),
        judge: p.judge,
        pre_filter: p.pre_filter,
        partition: p.partition,
    });
    if let Some(p) = &parallel {
        if !procedure.is_empty() {
            r.fail("procedure", "cannot be used together with parallel: (remove one)");
        }
        let mut names = BTreeSet::new();
        for (i, t) in p.tracks.iter().enumerate() {
            if t.name.trim().is_empty() {
                r.fail(&format!("parallel.tracks[{i}].name"), "must not be empty");
            } else if !names.insert(t.name.as_str()) {
                r.fail(&format!("parallel.tracks[{i}].name"), format_args!("duplicate track {:?}", t.name));
            }
        }
        if p.mode == ParallelMode::Partition && p.partition.is_none() {
            r.fail("parallel.partition", "required when parallel.mode is partition");
        }
    }

    let needs = raw.needs.unwrap_or_default();
    for (i, n) in needs.iter().enumerate() {
        if n.trim().is_empty() {
            r.fail(&format!("needs[{i}]"), "must not be empty");
        }
    }

    if !r.errors.is_empty() {
        return Err(Error::Invalid(r.errors));
    }
    Ok(Fleet {
        name,
        goal: raw.goal.unwrap_or_default(),
        members,
        router: raw.router,
        r#loop,
        limits,
        fanout,
        hitl,
        procedure,
        parallel,
        needs,
        notices: r.notices,
    })
}

fn validate_loop(l: RawLoop, r: &mut Rules) -> Loop {
    let mut out = Loop::default();
    if let Some(t) = l.trigger {
        match Trigger::parse(&t) {
            Ok(trigger) => out.trigger = trigger,
            Err(rule) => {
                r.soft("loop.trigger", rule, "it never fires");
                out.trigger = Trigger::Never(t.trim().to_string());
            }
        }
    }
    if let Some(d) = l.done_when {
        match DoneWhen::parse(&d) {
            Ok(p) => out.done_when = p,
            Err(rule) => r.soft("loop.done_when", rule, "the router judges DONE"),
        }
    }
    if let Some(d) = l.deadline.map(Text::into_string)
        && !d.trim().is_empty()
    {
        match DurationText::parse_bound(&d) {
            Ok(d) => out.deadline = Some(d),
            Err(rule) => r.soft("loop.deadline", rule, "ignored; the loop is bounded by its other limits"),
        }
    }
    if let Some(b) = l.budget_usd {
        if let Some(v) = b.number().filter(|v| v.is_finite() && *v >= 0.0) {
            out.budget_usd = v;
        } else {
            r.soft(
                "loop.budget_usd",
                format_args!("must be a non-negative number (0 for no ceiling), got {b}"),
                "ignored",
            );
        }
    }
    if let Some(n) = l.max_iterations {
        match n.within(0, u64::MAX) {
            Ok(n) => {
                out.max_iterations = n;
                if n != 0 {
                    r.notices.push(format!("loop.max_iterations: {MAX_ITERATIONS_NOTICE}"));
                }
            }
            Err(rule) => r.fail("loop.max_iterations", rule),
        }
    }
    if let Some(z) = l.timezone {
        match schedule::parse_timezone(&z) {
            Ok(tz) => out.timezone = tz,
            Err(rule) => {
                // Fail closed: a cron read in the wrong zone would fire at the wrong hour.
                r.soft("loop.timezone", rule, "the trigger never fires");
                if !matches!(out.trigger, Trigger::Manual | Trigger::Never(_)) {
                    out.trigger = Trigger::Never(out.trigger.as_text());
                }
            }
        }
    }
    if let Some(o) = l.overlap {
        match Overlap::parse(&o) {
            Ok(o) => out.overlap = o,
            Err(rule) => r.soft("loop.overlap", rule, "skip"),
        }
    }
    if let Some(c) = l.catchup.map(Text::into_string) {
        match schedule::parse_catchup(&c) {
            Ok(c) => out.catchup = c,
            Err(rule) => r.soft("loop.catchup", rule, "the built-in 90s"),
        }
    }
    if let Some(n) = l.pause_after_failures {
        match n.within(0, 1000) {
            Ok(n) => out.pause_after_failures = n,
            Err(rule) => r.soft("loop.pause_after_failures", rule, "never pauses"),
        }
    }
    out
}

fn validate_hitl(h: RawHitl, r: &mut Rules) -> Hitl {
    let mut tiers = Vec::new();
    for (i, t) in h.auto_approve_tiers.unwrap_or_default().iter().enumerate() {
        let path = format!("hitl.auto_approve_tiers[{i}]");
        let tier: Option<RiskTier> = serde_yaml_ng::from_value(Value::String(t.trim().to_string())).ok();
        match tier {
            None => r.fail(
                &path,
                format_args!("unknown risk tier {t:?} (read, write, network-egress, spend, destructive, privileged)"),
            ),
            Some(tier) if tier > RiskTier::AUTO_APPROVE_CEILING => r.soft(
                &path,
                format_args!(
                    "{:?} is above the auto-approve ceiling write: only read and write may be auto-approved",
                    tier.as_str()
                ),
                "not auto-approved",
            ),
            Some(tier) => {
                if !tiers.contains(&tier) {
                    tiers.push(tier);
                }
            }
        }
    }
    let mode = h.mode.and_then(|v| r.choice("hitl.mode", v));
    Hitl { mode, auto_approve_tiers: tiers }
}

fn validate_procedure(raw: Vec<RawStep>, members: &[String], r: &mut Rules) -> Vec<Step> {
    if raw.len() > MAX_PROCEDURE_STEPS {
        r.fail("procedure", format_args!("at most {MAX_PROCEDURE_STEPS} steps, got {}", raw.len()));
    }
    let steps: Vec<Step> = raw
        .into_iter()
        .enumerate()
        .map(|(i, s)| Step {
            id: s.id.unwrap_or_default().trim().to_string(),
            member: s.member.unwrap_or_default().trim().to_string(),
            task: s.task.unwrap_or_default(),
            depends_on: s.depends_on.unwrap_or_default().into_iter().map(|d| d.trim().to_string()).collect(),
            on_failure: s
                .on_failure
                .and_then(|v| r.choice(&format!("procedure[{i}].on_failure"), v))
                .unwrap_or_default(),
            max_retries: s.max_retries.map_or(DEFAULT_MAX_RETRIES, |n| {
                n.within(0, u32::MAX).unwrap_or_else(|rule| {
                    r.fail(&format!("procedure[{i}].max_retries"), rule);
                    DEFAULT_MAX_RETRIES
                })
            }),
            tier: s.tier.and_then(|v| r.choice(&format!("procedure[{i}].tier"), v)),
        })
        .collect();
    let ids: BTreeSet<&str> = steps.iter().map(|s| s.id.as_str()).collect();
    let mut seen = BTreeSet::new();
    for (i, s) in steps.iter().enumerate() {
        if s.id.is_empty() {
            r.fail(&format!("procedure[{i}].id"), "must not be empty");
        } else if !seen.insert(s.id.as_str()) {
            r.fail(&format!("procedure[{i}].id"), format_args!("duplicate step id {:?}", s.id));
        }
        if s.member.is_empty() {
            r.fail(&format!("procedure[{i}].member"), "required");
        } else if !members.contains(&s.member) {
            r.fail(&format!("procedure[{i}].member"), format_args!("{:?} is not in members:", s.member));
        }
        for (j, d) in s.depends_on.iter().enumerate() {
            if !ids.contains(d.as_str()) || d.is_empty() {
                r.fail(&format!("procedure[{i}].depends_on[{j}]"), format_args!("names no step: {d:?}"));
            }
        }
    }
    steps
}

/// The procedure's steps grouped into ranks (a step's rank is its longest dependency
/// chain), each rank in declaration order. A cycle is refused when the run starts
/// (§A fixed step graph).
///
/// # Errors
/// `procedure: dependency cycle among steps "a", "b"` naming every step that cannot run.
pub fn procedure_ranks(steps: &[Step]) -> Result<Vec<Vec<&Step>>, String> {
    let mut rank: BTreeMap<&str, usize> = BTreeMap::new();
    let mut left: Vec<&Step> = steps.iter().collect();
    while !left.is_empty() {
        let before = left.len();
        left.retain(|s| {
            let deps: Option<Vec<usize>> = s.depends_on.iter().map(|d| rank.get(d.as_str()).copied()).collect();
            match deps {
                Some(deps) => {
                    rank.insert(&s.id, deps.iter().map(|r| r + 1).max().unwrap_or(0));
                    false
                }
                None => true,
            }
        });
        if left.len() == before {
            let names: Vec<String> = left.iter().map(|s| format!("{:?}", s.id)).collect();
            return Err(format!("procedure: dependency cycle among steps {}", names.join(", ")));
        }
    }
    let depth = rank.values().max().map_or(0, |m| m + 1);
    let mut ranks = vec![Vec::new(); depth];
    for s in steps {
        ranks[rank[s.id.as_str()]].push(s);
    }
    Ok(ranks)
}
