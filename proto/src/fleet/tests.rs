//! Fleet rules, each test checking exact values: messages, defaults, the bounds line,
//! precedence.
use super::*;

const MINIMAL: &str = "name: builder\nmembers: [writer, critic]\n";

fn rules(yaml: &str) -> Vec<String> {
    match Fleet::parse(yaml) {
        Err(Error::Invalid(lines)) => lines,
        other => panic!("expected rule violations, got {other:?}"),
    }
}

fn parse_err(yaml: &str) -> String {
    match Fleet::parse(yaml) {
        Err(Error::Parse(m)) => m,
        other => panic!("expected a parse error, got {other:?}"),
    }
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn bounds(yaml: &str, flags: &RunFlags, config: &LimitsBlock) -> Bounds {
    resolve_bounds(&Fleet::parse(yaml).unwrap(), flags, config).unwrap()
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

// ---- schema -------------------------------------------------------------------------

#[test]
fn minimal_fleet_has_the_documented_defaults() {
    let f = Fleet::parse("name: dev\n").unwrap();
    assert_eq!(f.name, "dev");
    assert_eq!(f.goal, "");
    assert!(f.members.is_empty());
    assert_eq!(f.router, None);
    assert_eq!(f.r#loop, Loop::default());
    assert_eq!(f.r#loop.trigger, Trigger::Manual);
    assert_eq!(f.r#loop.done_when, DoneWhen::Router);
    assert_eq!(f.r#loop.deadline, None);
    assert_eq!(f.r#loop.budget_usd, 0.0);
    assert_eq!(f.r#loop.max_iterations, 0);
    assert_eq!(f.limits, LimitsBlock::Absent);
    assert_eq!(f.fanout, None);
    assert_eq!(f.hitl, Hitl::default());
    assert!(f.procedure.is_empty() && f.parallel.is_none() && f.needs.is_empty() && f.notices.is_empty());
    assert_eq!(f.channel_id(), "fleet-dev");
    assert_eq!(f.check_runnable(), Err("fleet 'dev': members: is empty; add capsule names to run it".to_string()));
}

#[test]
fn full_fleet_parses_every_key() {
    let y = "\
name: dev-team
goal: Keep the build green.
members: [writer, critic]
router: planner
loop:
  trigger: cron:*/15 * * * *
  done_when: marker:ALL GREEN
  deadline: 2h
  budget_usd: 4.5
limits:
  deadline: 1h30m
  stuck: 5m
  cost_usd: 10
fanout: 6
hitl:
  mode: defer
  auto_approve_tiers: [read, write]
needs: [cargo, git]
";
    let f = Fleet::parse(y).unwrap();
    assert_eq!(f.goal, "Keep the build green.");
    assert_eq!(f.members, ["writer", "critic"]);
    assert_eq!(f.router.as_deref(), Some("planner"));
    assert!(matches!(&f.r#loop.trigger, Trigger::Cron(c) if c.text == "*/15 * * * *"));
    assert_eq!(f.r#loop.done_when, DoneWhen::Marker("ALL GREEN".to_string()));
    assert_eq!(f.r#loop.deadline.as_ref().unwrap().duration, secs(7200));
    assert_eq!(f.r#loop.budget_usd, 4.5);
    let LimitsBlock::Set(l) = &f.limits else { panic!("limits set") };
    assert_eq!(l.deadline.as_ref().map(|d| (d.text.as_str(), d.duration)), Some(("1h30m", secs(5400))));
    assert_eq!(l.stuck.as_ref().map(Stuck::as_text), Some("5m"));
    assert_eq!(l.cost_usd, Some(10.0));
    assert_eq!(f.fanout, Some(6));
    assert_eq!(f.hitl.mode, Some(HitlMode::Defer));
    assert_eq!(f.hitl.auto_approve_tiers, [RiskTier::Read, RiskTier::Write]);
    assert_eq!(f.needs, ["cargo", "git"]);
    assert_eq!(f.plan_kind(), PlanKind::Router);
}

#[test]
fn fleet_names_follow_the_reference_rule() {
    for ok in ["dev", "dev-team", "dev_1", "-x", &"a".repeat(64)] {
        assert!(is_valid_fleet_name(ok), "{ok}");
    }
    for bad in ["", "Dev", "a b", ".x", "a/b", "../x", &"a".repeat(65)] {
        assert!(!is_valid_fleet_name(bad), "{bad}");
    }
    assert_eq!(rules("name: Dev\n"), ["name: must be 1-64 characters of a-z, 0-9, '-' or '_', got \"Dev\""]);
    assert_eq!(rules("goal: x\n"), ["name: required"]);
}

#[test]
fn channel_ids_map_back_only_to_valid_names() {
    assert_eq!(channel_id("dev"), "fleet-dev");
    assert_eq!(fleet_of_channel("fleet-dev"), Some("dev"));
    for bad in ["fleet-", "fleet-Dev", "fleet-../x", "dev"] {
        assert_eq!(fleet_of_channel(bad), None, "{bad}");
    }
}

#[test]
fn unknown_keys_are_refused_with_their_path() {
    let err = parse_err(&format!("{MINIMAL}colour: blue\n"));
    assert!(err.starts_with("unknown field `colour`, expected one of"), "{err}");
    let err = parse_err(&format!("{MINIMAL}loop:\n  max_iteration: 3\n"));
    assert!(err.starts_with("loop: unknown field `max_iteration`"), "{err}");
    let err = parse_err(&format!("{MINIMAL}limits:\n  max_iterations: 3\n"));
    assert!(
        err.starts_with("limits: unknown field `max_iterations`, expected one of `deadline`, `stuck`, `cost_usd`"),
        "{err}"
    );
    let err = parse_err(&format!("{MINIMAL}procedure:\n  - id: a\n    member: writer\n    after: [b]\n"));
    assert!(err.starts_with("procedure[0]: unknown field `after`"), "{err}");
}

#[test]
fn a_block_of_the_wrong_type_is_named_as_a_mapping_not_an_internal_type() {
    assert_eq!(
        parse_err(&format!(
            "{MINIMAL}loop: 5
"
        )),
        "loop: invalid type: integer `5`, expected a mapping at line 3 column 7"
    );
    assert_eq!(
        parse_err(&format!("{MINIMAL}procedure:\n  - writer\n")),
        "procedure[0]: invalid type: string \"writer\", expected a mapping at line 4 column 5"
    );
}

#[test]
fn hitl_mode_is_one_of_defer_wait_deny() {
    for m in ["defer", "wait", "deny"] {
        let f = Fleet::parse(&format!("{MINIMAL}hitl:\n  mode: {m}\n")).unwrap();
        assert_eq!(serde_yaml_ng::to_string(&f.hitl.mode.unwrap()).unwrap().trim(), m);
    }
    assert_eq!(
        rules(&format!("{MINIMAL}hitl:\n  mode: ask\n")),
        ["hitl.mode: unknown variant `ask`, expected one of `defer`, `wait`, `deny`"]
    );
}

/// A value outside its set (`hitl.mode`, `parallel.mode`, a step's `on_failure` and `tier`)
/// is one broken rule among the others, not a parse error that hides them.
#[test]
fn a_value_outside_its_set_is_reported_with_the_other_broken_rules() {
    let y = "name: Dev\nmembers: [w]\nhitl:\n  mode: sometimes\nparallel:\n  mode: [a]\n  tracks:\n    - name: a\n    \
             - name: a\nfanout: 0\n";
    assert_eq!(
        rules(y),
        [
            "name: must be 1-64 characters of a-z, 0-9, '-' or '_', got \"Dev\"",
            "fanout: must be a positive integer, got 0",
            "hitl.mode: unknown variant `sometimes`, expected one of `defer`, `wait`, `deny`",
            "parallel.mode: must be `speculative` or `partition`, got [\"a\"]",
            "parallel.tracks[1].name: duplicate track \"a\"",
        ]
    );
}

#[test]
fn auto_approve_tiers_above_write_are_refused_naming_the_ceiling() {
    assert_eq!(
        rules(&format!("{MINIMAL}hitl:\n  auto_approve_tiers: [write, destructive, sometimes]\n")),
        [
            "hitl.auto_approve_tiers[1]: \"destructive\" is above the auto-approve ceiling write: only read and write \
             may be auto-approved",
            "hitl.auto_approve_tiers[2]: unknown risk tier \"sometimes\" (read, write, network-egress, spend, \
             destructive, privileged)",
        ]
    );
}

#[test]
fn members_and_router_must_be_capsule_names_without_duplicates() {
    assert_eq!(
        rules("name: dev\nmembers: [writer, Writer, writer]\nrouter: a b\n"),
        [
            "members[1]: must be a capsule name (1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or \
             digit), got \"Writer\"",
            "members[2]: duplicate member \"writer\"",
            "router: must be a capsule name (1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or \
             digit), got \"a b\"",
        ]
    );
}

#[test]
fn every_broken_rule_is_reported_at_once() {
    let y = "\
name: Dev
loop:
  deadline: 2026-12-31
  trigger: whenever
  done_when: DONE
  budget_usd: -1
limits:
  stuck: sometimes
  cost_usd: -2
fanout: 0
";
    assert_eq!(
        rules(y),
        [
            "name: must be 1-64 characters of a-z, 0-9, '-' or '_', got \"Dev\"",
            "loop.trigger: must be manual, interval:<duration> or cron:<minute hour day-of-month month day-of-week>, \
             got \"whenever\"",
            "loop.done_when: must be empty (the router judges), queue-empty or marker:<TEXT>; the marker: prefix is \
             required (marker:DONE), got \"DONE\"",
            "loop.deadline: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, \
             got \"2026-12-31\"",
            "loop.budget_usd: must be a non-negative number (0 for no ceiling), got -1",
            "limits.stuck: must be a duration such as 30s, 5m, 2h, 1d or 1h30m, or off, got \"sometimes\"",
            "limits.cost_usd: must be a non-negative number (0 for no ceiling), got -2",
            "fanout: must be a positive integer, got 0",
        ]
    );
}

#[test]
fn loop_with_only_a_trigger_defaults_the_rest() {
    let f = Fleet::parse(&format!("{MINIMAL}loop:\n  trigger: interval:30m\n")).unwrap();
    assert_eq!(f.r#loop.trigger, Trigger::Interval(DurationText { text: "30m".into(), duration: secs(1800) }));
    assert_eq!(f.r#loop.done_when, DoneWhen::Router);
    assert_eq!(f.r#loop.deadline, None);
    assert_eq!(f.r#loop.budget_usd, 0.0);
    assert_eq!(f.r#loop.trigger.as_text(), "interval:30m");
}

#[test]
fn counts_past_their_range_are_refused_naming_the_field_and_the_bound() {
    // Past 64 bits serde said `invalid type: integer `…` as u128, expected u64`.
    let past = "99999999999999999999999";
    assert_eq!(
        rules(&format!("{MINIMAL}loop:\n  max_iterations: {past}\n")),
        [format!("loop.max_iterations: must be at most 18446744073709551615, got {past}")]
    );
    assert_eq!(
        rules(&format!("{MINIMAL}loop:\n  max_iterations: -1\n")),
        ["loop.max_iterations: must be at least 0, got -1"]
    );
    let step = "name: pair\nmembers: [writer]\nprocedure:\n  - id: a\n    member: writer\n    task: t\n    on_failure: retry\n";
    assert_eq!(
        rules(&format!("{step}    max_retries: 4294967296\n")),
        ["procedure[0].max_retries: must be at most 4294967295, got 4294967296"]
    );
    assert_eq!(
        rules(&format!("{step}    max_retries: -2\n")),
        ["procedure[0].max_retries: must be at least 0, got -2"]
    );
    assert_eq!(
        rules(&format!("{step}    max_retries: 1.5\n")),
        ["procedure[0].max_retries: must be a whole number, got 1.5"]
    );
    assert_eq!(
        rules(&format!("{MINIMAL}loop:\n  max_iterations: 1e27\n")),
        ["loop.max_iterations: must be a whole number, got 1e27"]
    );
    let f = Fleet::parse(&format!("{step}    max_retries: 4294967295\n")).unwrap();
    assert_eq!(f.procedure[0].max_retries, u32::MAX);
}

#[test]
fn nonzero_max_iterations_is_accepted_with_a_notice() {
    let f = Fleet::parse(&format!("{MINIMAL}loop:\n  max_iterations: 8\n")).unwrap();
    assert_eq!(f.r#loop.max_iterations, 8);
    assert_eq!(
        f.notices,
        ["loop.max_iterations: is ignored: loops are bounded by deadline, stuck and cost (a 10000-iteration \
          diagnostic ceiling remains)"]
    );
    assert!(Fleet::parse(&format!("{MINIMAL}loop:\n  max_iterations: 0\n")).unwrap().notices.is_empty());
}

#[test]
fn fanout_key_must_be_a_positive_integer() {
    assert_eq!(Fleet::parse(&format!("{MINIMAL}fanout: 8\n")).unwrap().fanout, Some(8));
    assert_eq!(rules(&format!("{MINIMAL}fanout: lots\n")), ["fanout: must be a positive integer, got \"lots\""]);
    assert_eq!(rules(&format!("{MINIMAL}fanout: -2\n")), ["fanout: must be a positive integer, got -2"]);
    assert_eq!(rules(&format!("{MINIMAL}fanout: 1.5\n")), ["fanout: must be a positive integer, got 1.5"]);
    // Issue #29: a number past 64 bits was refused in serde's words (`invalid type: integer
    // `…` as u128, expected any YAML value`); one written with an exponent is a fraction.
    assert_eq!(
        rules(&format!("{MINIMAL}fanout: 1000000000000000000000000000\n")),
        ["fanout: must be at most 4294967295, got 1000000000000000000000000000"]
    );
    assert_eq!(
        rules(&format!("{MINIMAL}fanout: 4294967296\n")),
        ["fanout: must be at most 4294967295, got 4294967296"]
    );
    assert_eq!(rules(&format!("{MINIMAL}fanout: 1e27\n")), ["fanout: must be a positive integer, got 1e27"]);
    assert_eq!(rules(&format!("{MINIMAL}fanout: [3]\n")), ["fanout: must be a positive integer, got a list"]);
    assert_eq!(Fleet::parse(&format!("{MINIMAL}fanout: 4294967295\n")).unwrap().fanout, Some(u32::MAX));
}

#[test]
fn a_spend_ceiling_that_is_no_number_is_refused_by_its_rule() {
    // YAML reads a number past f64 as a string: serde said `invalid type: string "1e400",
    // expected f64`.
    for (value, shown) in [("1e400", "\"1e400\""), ("lots", "\"lots\""), ("-1", "-1"), (".nan", "NaN")] {
        assert_eq!(
            rules(&format!("{MINIMAL}limits:\n  cost_usd: {value}\n")),
            [format!("limits.cost_usd: must be a non-negative number (0 for no ceiling), got {shown}")]
        );
    }
    let f = Fleet::parse(&format!("{MINIMAL}limits:\n  cost_usd: 2\n")).unwrap();
    assert!(matches!(f.limits, LimitsBlock::Set(Limits { cost_usd: Some(2.0), .. })), "{:?}", f.limits);
}

// ---- durations, triggers, done_when ---------------------------------------------------

#[test]
fn durations_accept_the_reference_grammar() {
    for (t, s) in [("30s", 30), ("5m", 300), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("90", 90), (" 2m ", 120)] {
        assert_eq!(parse_duration(t), Ok(secs(s)), "{t}");
    }
    assert_eq!(DurationText::parse(" 1h30m ").unwrap().to_string(), "1h30m");
}

#[test]
fn durations_refuse_everything_else() {
    for bad in ["", "off", "2 hours", "1h3", "h", "-5m", "1.5h", "2y", "5ms", "1hh"] {
        assert_eq!(
            parse_duration(bad),
            Err(format!("must be a duration such as 30s, 5m, 2h, 1d or 1h30m, got {:?}", bad.trim())),
            "{bad}"
        );
    }
    assert_eq!(
        parse_duration("2026-12-31"),
        Err("must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, got \
             \"2026-12-31\""
            .to_string())
    );
}

#[test]
fn durations_are_at_most_365_days() {
    assert_eq!(parse_duration("365d"), Ok(MAX_DURATION));
    assert_eq!(parse_duration("31536000"), Ok(MAX_DURATION));
    for bad in ["366d", "365d1s", "31536001", "18446744073709551615", "99999999999999d"] {
        assert_eq!(parse_duration(bad), Err(format!("must be at most 365d, got {bad:?}")), "{bad}");
    }
    let flags = RunFlags { deadline: Some("18446744073709551615".into()), ..RunFlags::default() };
    assert_eq!(
        resolve_bounds(&Fleet::parse(MINIMAL).unwrap(), &flags, &LimitsBlock::Absent),
        Err(Error::Invalid(vec![
            "fleet 'builder': --deadline: must be at most 365d, got \"18446744073709551615\"".into()
        ]))
    );
}

#[test]
fn unquoted_integer_durations_are_seconds() {
    let f = Fleet::parse(&format!("{MINIMAL}limits:\n  deadline: 90\n")).unwrap();
    let LimitsBlock::Set(l) = f.limits else { panic!() };
    assert_eq!(l.deadline, Some(DurationText { text: "90".into(), duration: secs(90) }));
}

#[test]
fn stuck_accepts_off_in_any_case() {
    assert_eq!(Stuck::parse("OFF"), Ok(Stuck::Off));
    assert_eq!(Stuck::parse("10m").unwrap().window(), Some(secs(600)));
    assert_eq!(Stuck::Off.window(), None);
}

#[test]
fn triggers_parse_manual_interval_and_cron() {
    assert_eq!(Trigger::parse("manual"), Ok(Trigger::Manual));
    assert_eq!(Trigger::parse(""), Ok(Trigger::Manual));
    assert!(matches!(Trigger::parse(" interval:30m "), Ok(Trigger::Interval(d)) if d.duration == secs(1800)));
    assert!(matches!(Trigger::parse("cron:*/15 * * * *"), Ok(Trigger::Cron(_))));
    assert!(matches!(Trigger::parse("cron:0 0 29 2 *"), Ok(Trigger::Cron(_))), "leap day fires");
    assert!(matches!(Trigger::parse("cron:0 9 31 2 mon"), Ok(Trigger::Cron(_))), "either day field fires");
    assert_eq!(
        Trigger::parse("interval:tuesday"),
        Err("interval: must be a duration such as 30s, 5m, 2h, 1d or 1h30m, got \"tuesday\"".to_string())
    );
    assert_eq!(Trigger::parse("interval:0s"), Err("interval: must be longer than zero, got \"0s\"".to_string()));
}

#[test]
fn unfirable_cron_is_refused() {
    assert_eq!(
        Trigger::parse("cron:0 9 31 2 *"),
        Err("cron: never fires: February has no 31st, got \"0 9 31 2 *\"".to_string())
    );
    assert_eq!(
        Cron::parse("0 9 30,31 feb *"),
        Err("never fires: February has no 30th, got \"0 9 30,31 feb *\"".to_string())
    );
    assert_eq!(Cron::parse("0 9 31 4,6 *"), Err("never fires: April has no 31st, got \"0 9 31 4,6 *\"".to_string()));
    assert_eq!(
        Cron::parse("0 9 * *"),
        Err("needs 5 fields (minute hour day-of-month month day-of-week), got 4 in \"0 9 * *\"".to_string())
    );
    assert_eq!(
        Cron::parse("60 * * * *"),
        Err("minute: \"60\" is not valid (Component error: Number out of bounds.)".to_string())
    );
    assert!(Cron::parse("* * * * 1-x").unwrap_err().starts_with("day-of-week: \"1-x\" is not valid ("));
    assert_eq!(
        Cron::parse("*/0 * * * *"),
        Err("minute: \"*/0\" is not valid (Component error: Step cannot be zero.)".to_string())
    );
}

#[test]
fn cron_fires_at_the_next_matching_minute_with_posix_semantics() {
    // 2026-01-01T00:00:00Z (a Thursday).
    let t0 = 1_767_225_600_000u64;
    let c = Cron::parse("0,30 9-17/4 1 jan-mar 7").unwrap();
    // Day 1 of January–March, or any Sunday (either day field), at 9, 13 or 17 h, :00 or :30.
    assert_eq!(c.next_after(t0), Some(t0 + 9 * 3_600_000));
    let every_quarter = Cron::parse("*/15 * * * *").unwrap();
    assert_eq!(every_quarter.next_after(t0), Some(t0 + 15 * 60_000));
    assert!(every_quarter.can_fire());
    assert_eq!(Cron::parse("0 0 29 2 *").unwrap().next_after(t0), Some(1_835_395_200_000), "2028-02-29");
}

#[test]
fn done_when_forms() {
    assert_eq!(DoneWhen::parse(""), Ok(DoneWhen::Router));
    assert_eq!(DoneWhen::parse("queue-empty"), Ok(DoneWhen::QueueEmpty));
    assert_eq!(DoneWhen::parse(" marker: DONE "), Ok(DoneWhen::Marker("DONE".to_string())));
    assert_eq!(
        DoneWhen::parse("marker:"),
        Err("marker: needs the text a member emits alone on a line, got \"marker:\"".to_string())
    );
    assert!(DoneWhen::parse("DONE").unwrap_err().contains("the marker: prefix is required (marker:DONE)"));
    assert_eq!(DoneWhen::Marker("X".into()).as_text(), "marker:X");
}

#[test]
fn marker_matching_is_whole_line_not_substring() {
    assert!(marker_matches("work finished\n  DONE  \n", "DONE"));
    assert!(marker_matches("DONE", " DONE "));
    assert!(!marker_matches("I'll print DONE when finished", "DONE"));
    assert!(!marker_matches("not DONE", "DONE"));
    assert!(!marker_matches("UNDONE\nDONE.", "DONE"));
    assert!(!marker_matches("DONE", ""));
}

#[test]
fn router_verdict_needs_a_standalone_done_and_no_negation() {
    for yes in ["DONE", "done.", "Verdict: Done"] {
        assert!(router_says_done(yes), "{yes}");
    }
    for no in ["not done", "done but CONTINUE", "undone", "", "incomplete, done soon", "CONTINUE"] {
        assert!(!router_says_done(no), "{no}");
    }
}

// ---- procedure ------------------------------------------------------------------------

const PROCEDURE: &str = "\
name: pair
members: [writer, critic]
procedure:
  - id: draft
    member: writer
    task: Draft the answer.
  - id: review-a
    member: critic
    task: Find the weakest claim in the draft.
    depends_on: [draft]
  - id: final
    member: writer
    task: Revise using the review.
    depends_on: [review-a]
";

#[test]
fn the_seed_procedure_loads_and_ranks_in_order() {
    let f = Fleet::parse(PROCEDURE).unwrap();
    assert_eq!(f.plan_kind(), PlanKind::Procedure);
    assert_eq!(f.procedure[1].depends_on, ["draft"]);
    let ranks = procedure_ranks(&f.procedure).unwrap();
    let ids: Vec<Vec<&str>> = ranks.iter().map(|r| r.iter().map(|s| s.id.as_str()).collect()).collect();
    assert_eq!(ids, [["draft"], ["review-a"], ["final"]]);
}

#[test]
fn bad_procedures_are_refused_when_the_fleet_loads() {
    let y = "\
name: pair
members: [writer]
procedure:
  - id: a
    member: ghost
  - id: ''
    member: writer
  - id: a
    member: writer
    depends_on: [nowhere]
";
    let expect = [
        "procedure[0].member: \"ghost\" is not in members:",
        "procedure[1].id: must not be empty",
        "procedure[2].id: duplicate step id \"a\"",
        "procedure[2].depends_on[0]: names no step: \"nowhere\"",
    ];
    assert_eq!(rules(y), expect);
    assert_eq!(Fleet::load_stored(y), Err(Error::Invalid(expect.map(String::from).to_vec())));
}

#[test]
fn more_than_32_steps_are_refused() {
    let mut y = String::from("name: big\nmembers: [w]\nprocedure:\n");
    for i in 0..33 {
        y.push_str(&format!("  - id: s{i}\n    member: w\n"));
    }
    assert_eq!(rules(&y), ["procedure: at most 32 steps, got 33"]);
}

#[test]
fn procedure_and_parallel_together_are_refused() {
    let y = format!("{PROCEDURE}parallel:\n  mode: speculative\n  tracks:\n    - name: a\n");
    assert_eq!(rules(&y), ["procedure: cannot be used together with parallel: (remove one)"]);
}

#[test]
fn a_dependency_cycle_is_refused_when_the_run_starts() {
    let y = "\
name: loopy
members: [w]
procedure:
  - id: start
    member: w
  - id: a
    member: w
    depends_on: [b]
  - id: b
    member: w
    depends_on: [a, start]
";
    let f = Fleet::parse(y).unwrap();
    assert_eq!(procedure_ranks(&f.procedure).unwrap_err(), "procedure: dependency cycle among steps \"a\", \"b\"");
}

#[test]
fn step_failure_policy_and_tier_default_to_abort_one_retry_and_none() {
    let f = Fleet::parse(PROCEDURE).unwrap();
    assert_eq!(
        (f.procedure[0].on_failure, f.procedure[0].max_retries, f.procedure[0].tier),
        (OnFailure::Abort, 1, None)
    );
    let y = format!(
        "{PROCEDURE}  - id: last\n    member: critic\n    on_failure: retry\n    max_retries: 3\n    tier: destructive\n"
    );
    let f = Fleet::parse(&y).unwrap();
    assert_eq!((f.procedure[3].on_failure, f.procedure[3].max_retries), (OnFailure::Retry, 3));
    assert_eq!(f.procedure[3].tier, Some(RiskTier::Destructive));
    assert_eq!(
        rules(&format!("{PROCEDURE}  - id: x\n    member: critic\n    on_failure: ignore\n    tier: scary\n")),
        [
            "procedure[3].on_failure: unknown variant `ignore`, expected one of `abort`, `skip`, `retry`",
            "procedure[3].tier: unknown variant `scary`, expected one of `read`, `write`, `network-egress`, `spend`, \
             `destructive`, `privileged`",
        ]
    );
}

#[test]
fn the_next_job_is_an_answered_blocked_one_before_the_oldest_queued() {
    let mut parked = job(2, JobStatus::Blocked, Some("r-0"));
    let queued = job(1, JobStatus::Queued, None);
    assert_eq!(next_job(&[queued.clone(), parked.clone()]).map(|j| &j.id), Some(&queued.id));
    parked.approval = Some(Approval { steps: vec!["a".into()], decision: None, by: None, at: None });
    assert!(!is_answered(&parked));
    parked.approval.as_mut().unwrap().decision = Some(Decision::Denied);
    assert!(is_answered(&parked));
    assert_eq!(next_job(&[queued, parked.clone()]).map(|j| &j.id), Some(&parked.id));
}

#[test]
fn parallel_block_parses_and_checks_tracks() {
    let y = format!(
        "{MINIMAL}parallel:\n  mode: partition\n  tracks:\n    - name: a\n      approach: top-down\n    - name: a\n  \
         judge:\n    model: big\n    rubric: fewest bugs\n"
    );
    assert_eq!(
        rules(&y),
        [
            "parallel.tracks[1].name: duplicate track \"a\"",
            "parallel.partition: required when parallel.mode is partition"
        ]
    );
    let y = format!("{MINIMAL}parallel:\n  mode: partition\n  partition:\n    target_file: src/lib.rs\n");
    let p = Fleet::parse(&y).unwrap().parallel.unwrap();
    assert_eq!(p.partition.unwrap().target_file, "src/lib.rs");
}

#[test]
fn plan_kind_without_router_broadcasts() {
    assert_eq!(Fleet::parse(MINIMAL).unwrap().plan_kind(), PlanKind::Broadcast);
    let one = Fleet::parse("name: solo\nmembers: [writer]\nrouter: planner\n").unwrap();
    assert_eq!(one.plan_kind(), PlanKind::Broadcast, "a single member gets every job");
}

// ---- stored fleets --------------------------------------------------------------------

const LEGACY: &str = "\
name: old
members: [writer]
colour: blue
loop:
  trigger: cron:0 9 31 2 *
  done_when: DONE
  deadline: 2026-12-31
  budget_usd: -1
fanout: lots
hitl:
  auto_approve_tiers: [read, destructive]
";

#[test]
fn stored_fleet_with_values_older_versions_accepted_still_loads() {
    assert!(matches!(Fleet::parse(LEGACY), Err(Error::Parse(_))), "strict refuses the unknown key");
    let f = Fleet::load_stored(LEGACY).unwrap();
    assert_eq!(f.r#loop.trigger, Trigger::Never("cron:0 9 31 2 *".to_string()));
    assert_eq!(f.r#loop.done_when, DoneWhen::Router);
    assert_eq!(f.r#loop.deadline, None);
    assert_eq!(f.r#loop.budget_usd, 0.0);
    assert_eq!(f.fanout, None);
    assert_eq!(f.hitl.auto_approve_tiers, [RiskTier::Read]);
    assert_eq!(
        f.notices,
        [
            "colour: unknown key (stored by an older version; ignored)",
            "loop.trigger: cron: never fires: February has no 31st, got \"0 9 31 2 *\" (stored by an older version; \
             it never fires)",
            "loop.done_when: must be empty (the router judges), queue-empty or marker:<TEXT>; the marker: prefix is \
             required (marker:DONE), got \"DONE\" (stored by an older version; the router judges DONE)",
            "loop.deadline: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, \
             got \"2026-12-31\" (stored by an older version; ignored; the loop is bounded by its other limits)",
            "loop.budget_usd: must be a non-negative number (0 for no ceiling), got -1 (stored by an older version; \
             ignored)",
            "fanout: must be a positive integer, got \"lots\" (stored by an older version; the default of 3 applies)",
            "hitl.auto_approve_tiers[1]: \"destructive\" is above the auto-approve ceiling write: only read and \
             write may be auto-approved (stored by an older version; not auto-approved)",
        ]
    );
    // Its bounds still resolve to the built-ins.
    let b = resolve_bounds(&f, &RunFlags::default(), &LimitsBlock::Absent).unwrap();
    assert_eq!(b.line(), "bounds: deadline 1h ← built-in; stuck 10m ← built-in");
}

#[test]
fn stored_fleet_accepts_an_unrelated_edit_and_keeps_the_stale_value() {
    let edit = LoopEdit { done_when: Some(" queue-empty ".into()), ..LoopEdit::default() };
    let text = apply_loop_edit(LEGACY, &edit).unwrap();
    let f = Fleet::load_stored(&text).unwrap();
    assert_eq!(f.r#loop.done_when, DoneWhen::QueueEmpty);
    assert_eq!(f.r#loop.trigger, Trigger::Never("cron:0 9 31 2 *".to_string()), "untouched");
    let v: Value = serde_yaml_ng::from_str(&text).unwrap();
    assert_eq!(v["loop"]["deadline"], Value::String("2026-12-31".into()), "stale value kept as stored");
    assert_eq!(v["loop"]["done_when"], Value::String("queue-empty".into()), "stored trimmed");
}

#[test]
fn loop_edit_refuses_values_that_would_be_reinterpreted() {
    let edit = LoopEdit {
        trigger: Some("cron:0 9 31 2 *".into()),
        done_when: Some("DONE".into()),
        deadline: Some("2026-12-31".into()),
        budget_usd: Some(-1.0),
        timezone: Some("CEST".into()),
        overlap: Some("queue".into()),
        catchup: Some("0".into()),
        pause_after_failures: Some("many".into()),
    };
    let Err(Error::Invalid(lines)) = apply_loop_edit(MINIMAL, &edit) else { panic!("refused") };
    assert_eq!(
        lines,
        [
            "--trigger: cron: never fires: February has no 31st, got \"0 9 31 2 *\"",
            "--done-when: must be empty (the router judges), queue-empty or marker:<TEXT>; the marker: prefix is \
             required (marker:DONE), got \"DONE\"",
            "--deadline: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, got \
             \"2026-12-31\"",
            "--budget-usd: must be a non-negative number (0 for no ceiling), got -1",
            "--timezone: must be an IANA time zone name (UTC, Europe/Berlin, America/New_York), got \"CEST\"",
            "--overlap: must be skip, queue_one or cancel_previous, got \"queue\"",
            "--catchup: must be longer than zero (leave it out for the built-in 90s), got \"0\"",
            "--pause-after-failures: must be a whole number of failed runs in a row from 0 (never pause) to 1000, \
             got \"many\"",
        ]
    );
    let ok = LoopEdit {
        trigger: Some("interval:30m".into()),
        done_when: Some(String::new()),
        deadline: Some(String::new()),
        budget_usd: Some(0.0),
        timezone: Some(" Europe/Berlin ".into()),
        overlap: Some("queue_one".into()),
        catchup: Some("1h".into()),
        pause_after_failures: Some("3".into()),
    };
    let edited = apply_loop_edit(MINIMAL, &ok).unwrap();
    let f = Fleet::parse(&edited).unwrap();
    assert!(matches!(f.r#loop.trigger, Trigger::Interval(_)));
    assert_eq!((&f.r#loop.done_when, &f.r#loop.deadline, f.r#loop.budget_usd), (&DoneWhen::Router, &None, 0.0));
    assert_eq!(f.r#loop.timezone, chrono_tz::Europe::Berlin);
    assert_eq!(f.r#loop.overlap, Overlap::QueueOne);
    assert_eq!(f.r#loop.catchup_window(), Duration::from_secs(3600));
    assert_eq!(f.r#loop.pause_after_failures, 3);
    // Empty --catchup and --timezone go back to the built-ins; 0 never pauses.
    let back = LoopEdit {
        timezone: Some(String::new()),
        catchup: Some(String::new()),
        pause_after_failures: Some("0".into()),
        ..LoopEdit::default()
    };
    let f = Fleet::parse(&apply_loop_edit(&edited, &back).unwrap()).unwrap();
    assert_eq!(f.r#loop.timezone, chrono_tz::Tz::UTC);
    assert_eq!((f.r#loop.catchup_window(), f.r#loop.pause_after_failures), (Duration::from_secs(90), 0));
}

#[test]
fn the_schedule_keys_load_and_each_bad_value_is_refused_naming_its_field() {
    let good = format!(
        "{MINIMAL}loop:\n  trigger: cron:30 2 * * *\n  timezone: America/New_York\n  overlap: cancel_previous\n  \
         catchup: 1h\n  pause_after_failures: 2\n"
    );
    let f = Fleet::parse(&good).unwrap();
    assert_eq!(f.r#loop.timezone, chrono_tz::America::New_York);
    assert_eq!(f.r#loop.overlap, Overlap::CancelPrevious);
    assert_eq!(f.r#loop.catchup.as_ref().map(|c| c.text.as_str()), Some("1h"));
    assert_eq!(f.r#loop.pause_after_failures, 2);
    let defaults = Fleet::parse(&format!("{MINIMAL}loop:\n  trigger: cron:0 9 * * *\n")).unwrap();
    assert_eq!(
        (
            defaults.r#loop.timezone,
            defaults.r#loop.overlap,
            defaults.r#loop.catchup_window(),
            defaults.r#loop.pause_after_failures
        ),
        (chrono_tz::Tz::UTC, Overlap::Skip, Duration::from_secs(90), 0)
    );
    let bad = format!(
        "{MINIMAL}loop:\n  trigger: cron:30 2 * * *\n  timezone: Mars/Olympus\n  overlap: both\n  \
         catchup: 2026-12-31\n  pause_after_failures: -2\n"
    );
    let Err(Error::Invalid(lines)) = Fleet::parse(&bad) else { panic!("refused") };
    assert_eq!(
        lines,
        [
            "loop.timezone: must be an IANA time zone name (UTC, Europe/Berlin, America/New_York), got \"Mars/Olympus\"",
            "loop.overlap: must be skip, queue_one or cancel_previous, got \"both\"",
            "loop.catchup: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a calendar date, got \
             \"2026-12-31\"",
            "loop.pause_after_failures: must be at least 0, got -2",
        ]
    );
    // Stored: it loads, and a cron whose zone is unknown never fires (fail closed).
    let f = Fleet::load_stored(&bad).unwrap();
    assert_eq!(f.r#loop.trigger, Trigger::Never("cron:30 2 * * *".into()));
    assert_eq!(f.r#loop.overlap, Overlap::Skip);
}

#[test]
fn set_loop_bounds_go_to_limits_when_the_fleet_has_a_limits_block() {
    // Legacy loop.* bounds are ignored beside `limits:`; set-loop writes where they apply.
    let with_limits = format!("{MINIMAL}limits:\n  deadline: 2h\n  stuck: off\n");
    let edit = LoopEdit { deadline: Some("30m".into()), budget_usd: Some(2.5), ..LoopEdit::default() };
    let f = Fleet::parse(&apply_loop_edit(&with_limits, &edit).unwrap()).unwrap();
    let b = resolve_bounds(&f, &RunFlags::default(), &LimitsBlock::Absent).unwrap();
    assert_eq!(b.line(), "bounds: deadline 30m ← fleet.yaml; stuck off ← fleet.yaml");
    assert_eq!((b.cost_usd.value, b.cost_usd.source), (Some(2.5), Source::FleetLimits));
    assert_eq!((f.r#loop.deadline, f.r#loop.budget_usd), (None, 0.0), "no legacy keys written");
    // An empty --deadline clears limits.deadline: the built-in applies again.
    let cleared = apply_loop_edit(
        &apply_loop_edit(&with_limits, &edit).unwrap(),
        &LoopEdit { deadline: Some(String::new()), ..LoopEdit::default() },
    )
    .unwrap();
    let f = Fleet::parse(&cleared).unwrap();
    let b = resolve_bounds(&f, &RunFlags::default(), &LimitsBlock::Absent).unwrap();
    assert_eq!(b.line(), "bounds: deadline 1h ← built-in; stuck off ← fleet.yaml");
    // Without `limits:` the loop keys are the ones that apply, and stay where they were.
    let f = Fleet::parse(&apply_loop_edit(MINIMAL, &edit).unwrap()).unwrap();
    let b = resolve_bounds(&f, &RunFlags::default(), &LimitsBlock::Absent).unwrap();
    assert_eq!(b.line(), "bounds: deadline 30m ← fleet.yaml loop; stuck 10m ← built-in");
}

#[test]
fn stored_limits_that_do_not_parse_load_but_never_resolve() {
    let y = format!("{MINIMAL}limits:\n  deadline: 2h\n  max_iterations: 5\n");
    assert!(Fleet::parse(&y).is_err());
    let f = Fleet::load_stored(&y).unwrap();
    let LimitsBlock::Invalid(errors) = &f.limits else { panic!("invalid block") };
    assert_eq!(errors.len(), 1);
    assert!(errors[0].starts_with("limits: unknown field `max_iterations`"), "{errors:?}");
    let Err(Error::Invalid(lines)) = resolve_bounds(&f, &RunFlags::default(), &LimitsBlock::Absent) else {
        panic!("bounds must not resolve")
    };
    assert!(lines[0].starts_with("fleet 'builder': fleet.yaml: limits: unknown field `max_iterations`"), "{lines:?}");

    let f = Fleet::load_stored(&format!("{MINIMAL}limits:\n  stuck: sometimes\n")).unwrap();
    assert_eq!(
        f.limits,
        LimitsBlock::Invalid(vec![
            "limits.stuck: must be a duration such as 30s, 5m, 2h, 1d or 1h30m, or off, got \"sometimes\"".into()
        ])
    );
    assert_eq!(
        f.notices,
        ["limits.stuck: must be a duration such as 30s, 5m, 2h, 1d or 1h30m, or off, got \"sometimes\" (stored by an \
          older version; the fleet's bounds do not resolve)"]
    );
}

#[test]
fn empty_limits_key_reads_the_same_strict_and_stored() {
    let y = format!("{MINIMAL}limits:\n");
    assert_eq!(Fleet::parse(&y).unwrap().limits, LimitsBlock::Absent);
    assert_eq!(Fleet::load_stored(&y).unwrap().limits, LimitsBlock::Absent);
    let y = format!("{MINIMAL}limits: {{}}\n");
    assert_eq!(Fleet::parse(&y).unwrap().limits, LimitsBlock::Set(Limits::default()));
    assert_eq!(Fleet::load_stored(&y).unwrap().limits, LimitsBlock::Set(Limits::default()));
}

#[test]
fn stored_loading_still_refuses_a_bad_name() {
    assert_eq!(
        Fleet::load_stored("name: ../x\n"),
        Err(Error::Invalid(vec!["name: must be 1-64 characters of a-z, 0-9, '-' or '_', got \"../x\"".into()]))
    );
}

// ---- bounds ---------------------------------------------------------------------------

#[test]
fn no_limits_anywhere_gives_the_built_ins() {
    let b = bounds(MINIMAL, &RunFlags::default(), &LimitsBlock::Absent);
    assert_eq!(b.deadline, Bound { value: secs(3600), text: "1h".into(), source: Source::BuiltIn });
    assert_eq!(b.stuck, Bound { value: Some(secs(600)), text: "10m".into(), source: Source::BuiltIn });
    assert_eq!(b.cost_usd, Bound { value: None, text: "none".into(), source: Source::BuiltIn });
    assert_eq!(b.line(), "bounds: deadline 1h ← built-in; stuck 10m ← built-in");
}

#[test]
fn deadline_flag_prints_as_given() {
    let flags = RunFlags { deadline: Some("2m".into()), ..RunFlags::default() };
    let b = bounds(MINIMAL, &flags, &LimitsBlock::Absent);
    assert_eq!(b.line(), "bounds: deadline 2m ← --deadline; stuck 10m ← built-in");
    assert_eq!(b.deadline.value, secs(120));
}

#[test]
fn flag_beats_fleet_beats_config_per_key() {
    let fleet = format!("{MINIMAL}limits:\n  deadline: 2h\n");
    let config = LimitsBlock::Set(Limits::from_yaml("deadline: 3h\nstuck: 20m\ncost_usd: 7\n").unwrap());
    let b = bounds(&fleet, &RunFlags::default(), &config);
    assert_eq!(b.line(), "bounds: deadline 2h ← fleet.yaml; stuck 20m ← config.yaml");
    assert_eq!((b.cost_usd.value, b.cost_usd.source), (Some(7.0), Source::Config));

    let flags = RunFlags { deadline: Some("45m".into()), budget_usd: Some(2.5), ..RunFlags::default() };
    let b = bounds(&fleet, &flags, &config);
    assert_eq!(b.line(), "bounds: deadline 45m ← --deadline; stuck 20m ← config.yaml");
    assert_eq!(b.cost_usd, Bound { value: Some(2.5), text: "2.5".into(), source: Source::Flag("--budget-usd") });
}

#[test]
fn stuck_off_prints_off() {
    let b = bounds(&format!("{MINIMAL}limits:\n  stuck: Off\n"), &RunFlags::default(), &LimitsBlock::Absent);
    assert_eq!(b.stuck.value, None);
    assert_eq!(b.line(), "bounds: deadline 1h ← built-in; stuck off ← fleet.yaml");
}

#[test]
fn legacy_loop_values_apply_only_without_a_limits_block() {
    let legacy = format!("{MINIMAL}loop:\n  deadline: 30m\n  budget_usd: 3\n");
    let b = bounds(&legacy, &RunFlags::default(), &LimitsBlock::Absent);
    assert_eq!(b.line(), "bounds: deadline 30m ← fleet.yaml loop; stuck 10m ← built-in");
    assert_eq!((b.cost_usd.value, b.cost_usd.source), (Some(3.0), Source::FleetLoop));

    let suppressed = format!("{legacy}limits: {{}}\n");
    let b = bounds(&suppressed, &RunFlags::default(), &LimitsBlock::Absent);
    assert_eq!(b.line(), "bounds: deadline 1h ← built-in; stuck 10m ← built-in");
    assert_eq!(b.cost_usd.value, None);
}

#[test]
fn zero_budget_flag_replaces_a_fleet_ceiling_with_none() {
    let flags = RunFlags { budget_usd: Some(0.0), ..RunFlags::default() };
    let b = bounds(&format!("{MINIMAL}limits:\n  cost_usd: 5\n"), &flags, &LimitsBlock::Absent);
    assert_eq!(b.cost_usd, Bound { value: None, text: "0".into(), source: Source::Flag("--budget-usd") });
}

#[test]
fn bad_flags_and_config_are_reported_with_scope_and_fleet() {
    let flags = RunFlags { deadline: Some("2026-12-31".into()), budget_usd: Some(-1.0), ..RunFlags::default() };
    let config = LimitsBlock::Invalid(vec![
        "limits.deadline: must be a duration such as 30s, 5m, 2h, 1d or 1h30m, got \"soon\"".into(),
    ]);
    let f = Fleet::parse(MINIMAL).unwrap();
    assert_eq!(
        resolve_bounds(&f, &flags, &config),
        Err(Error::Invalid(vec![
            "fleet 'builder': --deadline: must be a duration relative to the loop's start (30m, 2h, 1h30m), not a \
             calendar date, got \"2026-12-31\""
                .into(),
            "fleet 'builder': --budget-usd: must be a non-negative number (0 for no ceiling), got -1".into(),
            "fleet 'builder': config.yaml: limits.deadline: must be a duration such as 30s, 5m, 2h, 1d or 1h30m, got \
             \"soon\""
                .into(),
        ]))
    );
}

#[test]
fn config_limits_are_parsed_strictly() {
    let Err(Error::Parse(m)) = Limits::from_yaml("deadline: 1h\nmax_iterations: 3\n") else { panic!() };
    assert!(m.starts_with("limits: unknown field `max_iterations`"), "{m}");
    assert_eq!(
        Limits::from_yaml("cost_usd: -1\n"),
        Err(Error::Invalid(vec!["limits.cost_usd: must be a non-negative number (0 for no ceiling), got -1".into()]))
    );
    assert_eq!(
        Limits::from_yaml("cost_usd: .nan\n").unwrap_err().to_string(),
        "limits.cost_usd: must be a non-negative number (0 for no ceiling), got NaN"
    );
}

#[test]
fn iteration_caps_are_ignored_with_a_notice() {
    let flags = RunFlags { max_iterations: Some(5), ..RunFlags::default() };
    let b = bounds(&format!("{MINIMAL}loop:\n  max_iterations: 8\n"), &flags, &LimitsBlock::Absent);
    assert_eq!(
        b.notices,
        [
            "--max-iterations is ignored: loops are bounded by deadline, stuck and cost (a 10000-iteration diagnostic \
             ceiling remains)",
            "loop.max_iterations is ignored: loops are bounded by deadline, stuck and cost (a 10000-iteration \
             diagnostic ceiling remains)",
        ]
    );
    assert_eq!(b.line(), "bounds: deadline 1h ← built-in; stuck 10m ← built-in");
}

// ---- fan-out, autorun -----------------------------------------------------------------

#[test]
fn fanout_defaults_to_three() {
    assert_eq!(resolve_fanout(None, &no_env), Fanout { cap: 3, source: FanoutSource::BuiltIn, notice: None });
}

#[test]
fn fanout_env_raises_the_cap_and_nonsense_falls_back_to_three() {
    let f = resolve_fanout(None, &|k| (k == "MUR_FLEET_FANOUT").then(|| "8".to_string()));
    assert_eq!((f.cap, f.source), (8, FanoutSource::Env));
    for bad in ["0", "lots", "-1", "", "2.5"] {
        let f = resolve_fanout(None, &|_| Some(bad.to_string()));
        assert_eq!((f.cap, f.source), (3, FanoutSource::BuiltIn), "{bad}");
        assert_eq!(
            f.notice,
            Some(format!("MUR_FLEET_FANOUT={bad:?} is not a positive integer; at most 3 delegated steps run at once"))
        );
    }
}

#[test]
fn fleet_fanout_key_wins_over_the_env() {
    let f = resolve_fanout(Some(5), &|_| Some("8".to_string()));
    assert_eq!(f, Fanout { cap: 5, source: FanoutSource::Fleet, notice: None });
    assert_eq!(resolve_fanout(Some(0), &no_env).cap, 3);
}

#[test]
fn fanout_never_exceeds_the_step_count_or_drops_below_one() {
    let f = resolve_fanout(Some(8), &no_env);
    assert_eq!(f.for_steps(6), 6);
    assert_eq!(f.for_steps(20), 8);
    assert_eq!(f.for_steps(0), 1);
    assert_eq!(resolve_fanout(None, &no_env).for_steps(6), 3);
}

#[test]
fn autorun_is_off_unless_asked() {
    assert!(!autorun_enabled(&no_env, false));
    assert!(autorun_enabled(&no_env, true));
    for yes in ["1", "true", "YES"] {
        assert!(autorun_enabled(&|k| (k == "MUR_FLEET_AUTORUN").then(|| yes.to_string()), false), "{yes}");
    }
    for no in ["0", "no", "on"] {
        assert!(!autorun_enabled(&|_| Some(no.to_string()), false), "{no}");
    }
}

// ---- run ids and jobs -----------------------------------------------------------------

#[test]
fn run_ids_follow_the_conventions() {
    assert_eq!(check_run_id("nightly_2026-01"), Ok(()));
    assert_eq!(check_run_id(&"a".repeat(96)), Ok(()));
    for bad in ["", "a b", "x/y", &"a".repeat(97)] {
        assert_eq!(check_run_id(bad), Err(format!("--run-id: must be 1-96 letters, digits, '-' or '_', got {bad:?}")));
    }
    let u = uuid::Uuid::parse_str("01890a5d-ac96-774b-bcce-b302099a8057").unwrap();
    assert_eq!(loop_run_id("dev", u), "fleet-dev-01890a5d-ac96-774b-bcce-b302099a8057");
    assert_eq!(one_shot_run_id(u), "run-01890a5d-ac96-774b-bcce-b302099a8057");
    assert_eq!(iteration_run_id("nightly", 0), "nightly-0");
    assert_eq!(iteration_run_id("nightly", 12), "nightly-12");
    assert!(check_run_id(&loop_run_id("dev", u)).is_ok());
    // A run is named by its id or, for a loop's iteration, `<id>-<n>` (which may pass 96).
    let long = "a".repeat(96);
    assert!(is_run_ref(&iteration_run_id(&long, 3)) && is_run_ref("nightly"));
    for bad in ["", "*", ">", "a.b", &format!("{long}a-x")] {
        assert!(!is_run_ref(bad), "{bad:?}");
    }
}

#[test]
fn since_matches_run_ids_by_prefix_including_loop_iterations() {
    assert!(run_id_matches(Some("nightly"), "nightly"));
    assert!(run_id_matches(Some("nightly-0"), "nightly"));
    assert!(run_id_matches(Some("nightly-1"), "nightly"));
    assert!(!run_id_matches(Some("daily-0"), "nightly"));
    assert!(!run_id_matches(None, "nightly"));
}

fn job(n: u128, status: JobStatus, run: Option<&str>) -> Job {
    let mut j = Job::with_id(uuid::Uuid::from_u128(n), format!("job {n}"), SOURCE_CLI, 1000);
    j.status = status;
    j.run_id = run.map(String::from);
    j
}

#[test]
fn new_jobs_are_queued_uuid_v7_with_source_and_time() {
    let j = Job::new("cargo nextest run -p mur-core", SOURCE_CLI, 1_700_000_000_000);
    let id = uuid::Uuid::parse_str(&j.id).unwrap();
    assert_eq!(id.get_version_num(), 7);
    assert_eq!(j.id, id.hyphenated().to_string());
    assert_eq!(j.status, JobStatus::Queued);
    assert_eq!((j.source.as_str(), j.created_at, j.started_at, j.finished_at), ("cli", 1_700_000_000_000, None, None));
    let later = Job::new("b", SOURCE_CLI, 0);
    assert!(j.id < later.id, "lexical order is creation order");
}

#[test]
fn job_json_has_every_field() {
    let j = job(1, JobStatus::Queued, None);
    let v = serde_json::to_value(&j).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "id": "00000000-0000-0000-0000-000000000001", "status": "queued", "text": "job 1",
            "result": null, "error": null, "run_id": null, "source": "cli",
            "created_at": 1000, "started_at": null, "finished_at": null, "approval": null, "steps_done": {}
        })
    );
    let back: Job = serde_json::from_value(serde_json::json!({
        "id": "x", "status": "blocked", "text": "t", "source": "a2a:planner", "created_at": 5
    }))
    .unwrap();
    assert_eq!((back.status, back.result, back.run_id), (JobStatus::Blocked, None, None));
}

#[test]
fn job_transitions_follow_the_lifecycle() {
    use JobStatus::*;
    let all = [Queued, Running, Blocked, Done, Failed, Canceled];
    let legal: Vec<(JobStatus, JobStatus)> =
        all.iter().flat_map(|&a| all.iter().map(move |&b| (a, b))).filter(|&(a, b)| a.can_become(b)).collect();
    assert_eq!(
        legal,
        [
            (Queued, Running),
            (Queued, Canceled),
            (Running, Blocked),
            (Running, Done),
            (Running, Failed),
            (Running, Canceled),
            (Blocked, Running),
            (Blocked, Canceled),
        ]
    );
    assert!(all.iter().filter(|s| s.is_terminal()).eq([Done, Failed, Canceled].iter()));
    assert_eq!(
        all.map(JobStatus::a2a_state),
        ["submitted", "working", "input-required", "completed", "failed", "canceled"]
    );
}

#[test]
fn job_transition_stamps_times_and_refuses_illegal_moves() {
    let mut j = job(1, JobStatus::Queued, None);
    j.claim("nightly-0", 2000).unwrap();
    assert_eq!((j.status, j.started_at, j.run_id.as_deref()), (JobStatus::Running, Some(2000), Some("nightly-0")));
    j.transition(JobStatus::Blocked, 3000).unwrap();
    j.transition(JobStatus::Running, 4000).unwrap();
    assert_eq!(j.started_at, Some(2000), "first claim kept");
    j.transition(JobStatus::Done, 5000).unwrap();
    assert_eq!(j.finished_at, Some(5000));
    let err = j.transition(JobStatus::Running, 6000).unwrap_err();
    assert_eq!(err.to_string(), "job 00000000-0000-0000-0000-000000000001: cannot go from done to running");
    assert_eq!(j.status, JobStatus::Done);
    let mut q = job(2, JobStatus::Queued, None);
    assert_eq!(
        q.transition(JobStatus::Done, 1).unwrap_err().to_string(),
        "job 00000000-0000-0000-0000-000000000002: cannot go from queued to done"
    );
}

#[test]
fn job_listing_hides_terminal_jobs_unless_all_or_since() {
    let jobs = [
        job(1, JobStatus::Done, Some("nightly-0")),
        job(2, JobStatus::Running, Some("nightly-1")),
        job(3, JobStatus::Queued, None),
        job(4, JobStatus::Failed, Some("other")),
        job(5, JobStatus::Blocked, Some("other-0")),
    ];
    let ids = |f: &JobFilter| jobs.iter().filter(|j| f.matches(j)).map(|j| j.text.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&JobFilter::default()), ["job 2", "job 3", "job 5"]);
    assert_eq!(ids(&JobFilter { all: true, ..JobFilter::default() }), ["job 1", "job 2", "job 3", "job 4", "job 5"]);
    assert_eq!(ids(&JobFilter { since: Some("nightly".into()), ..JobFilter::default() }), ["job 1", "job 2"]);
    let blocked = JobFilter { since: Some("other".into()), status: Some(JobStatus::Blocked), ..JobFilter::default() };
    assert_eq!(ids(&blocked), ["job 5"]);
    assert_eq!(ids(&JobFilter { status: Some(JobStatus::Done), ..JobFilter::default() }), ["job 1"]);
}

#[test]
fn next_queued_is_the_oldest_queued_job() {
    let jobs = [job(3, JobStatus::Queued, None), job(1, JobStatus::Running, None), job(2, JobStatus::Queued, None)];
    assert_eq!(next_queued(&jobs).map(|j| j.text.as_str()), Some("job 2"));
    assert_eq!(next_queued(&jobs[1..2]), None);
}

// ---- stops and guards -----------------------------------------------------------------

#[test]
fn stop_reasons_map_to_labels_states_and_remedies() {
    let table: Vec<(&str, &str, &str, bool)> = [
        Stop::Converged,
        Stop::QueueDrained,
        Stop::AwaitingApproval,
        Stop::Stopped,
        Stop::Deadline,
        Stop::Stuck,
        Stop::Budget,
        Stop::MaxIterations,
        Stop::IterationFailed,
    ]
    .into_iter()
    .map(|s| (s.label(), s.channel_state(), s.run_state(), s.remedy("dev", None).is_some_and(|r| r.contains("dev"))))
    .collect();
    assert_eq!(
        table,
        [
            ("converged", "completed", "done", false),
            ("queue-drained", "completed", "done", false),
            ("awaiting-approval", "input-required", "blocked", true),
            ("stopped", "canceled", "stopped", true),
            ("deadline", "failed", "failed", true),
            ("stuck", "failed", "failed", true),
            ("budget", "failed", "failed", true),
            ("max-iterations", "failed", "failed", true),
            ("iteration-failed", "failed", "failed", true),
        ]
    );
    assert_eq!(Stop::Converged.remedy("dev", None), None);
    assert_eq!(Stop::Stopped.remedy("dev", None).unwrap(), "mur fleet start dev clears the kill-switch");
    assert_eq!(
        Stop::AwaitingApproval.remedy("dev", Some("job_7")).unwrap(),
        "approve the parked steps: mur fleet approve dev job_7, then run it again"
    );
}

#[test]
fn guards_check_deadline_then_stuck_then_the_ceiling() {
    let g = GuardInput {
        elapsed: secs(10),
        deadline: secs(3600),
        stuck: Some(secs(600)),
        since_progress: secs(0),
        iteration: 1,
    };
    assert_eq!(check_guards(g), None);
    assert_eq!(check_guards(GuardInput { elapsed: secs(3600), since_progress: secs(700), ..g }), Some(Stop::Deadline));
    assert_eq!(check_guards(GuardInput { since_progress: secs(600), ..g }), Some(Stop::Stuck));
    assert_eq!(
        check_guards(GuardInput { since_progress: secs(600), iteration: 0, ..g }),
        None,
        "never before the first iteration"
    );
    assert_eq!(check_guards(GuardInput { since_progress: secs(9999), stuck: None, ..g }), None, "stuck off");
    assert_eq!(check_guards(GuardInput { iteration: 10_000, ..g }), Some(Stop::MaxIterations));
}

#[test]
fn delegates_inherit_the_remaining_time_at_least_one_second() {
    assert_eq!(inherited_deadline(secs(3600), secs(600)), secs(3000));
    assert_eq!(inherited_deadline(secs(60), secs(600)), secs(1));
}

#[test]
fn the_cluster_configs_limits_block_is_read_strictly() {
    let v = |y: &str| Some(serde_yaml_ng::from_str::<serde_yaml_ng::Value>(y).unwrap());
    assert_eq!(LimitsBlock::from_config(None), Ok(LimitsBlock::Absent));
    let Ok(LimitsBlock::Set(l)) = LimitsBlock::from_config(v("deadline: 2h\nstuck: off\ncost_usd: 5")) else {
        panic!("a good block is set")
    };
    assert_eq!(l.cost_usd, Some(5.0));
    let f = Fleet::parse(MINIMAL).unwrap();
    let b = resolve_bounds(&f, &RunFlags::default(), &LimitsBlock::Set(l)).unwrap();
    assert_eq!(b.line(), "bounds: deadline 2h ← config.yaml; stuck off ← config.yaml");
    let errors = LimitsBlock::from_config(v("deadline: 2026-12-31\ncost_usd: -1")).unwrap_err();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].starts_with("limits.deadline: "), "{errors:?}");
    assert!(errors[1].starts_with("limits.cost_usd: "), "{errors:?}");
    let errors = LimitsBlock::from_config(v("max_iterations: 3")).unwrap_err();
    assert!(errors[0].starts_with("limits: unknown field `max_iterations`"), "{errors:?}");
}

#[test]
fn a_zero_deadline_or_stuck_window_is_refused_where_it_is_written() {
    // Zero is not "no bound": a zero deadline would stop every run before its first
    // iteration, a zero stuck window right after it.
    assert_eq!(
        rules(&format!("{MINIMAL}limits:\n  deadline: 0\n  stuck: 0s\n")),
        [
            "limits.deadline: must be longer than zero (leave it out for the built-in), got \"0\"",
            "limits.stuck: must be longer than zero, or off, got \"0s\"",
        ]
    );
    assert_eq!(
        rules(&format!("{MINIMAL}loop:\n  deadline: 0m\n")),
        ["loop.deadline: must be longer than zero (leave it out for the built-in), got \"0m\""]
    );
    let flags = RunFlags { deadline: Some("0".into()), ..RunFlags::default() };
    assert_eq!(
        resolve_bounds(&Fleet::parse(MINIMAL).unwrap(), &flags, &LimitsBlock::Absent),
        Err(Error::Invalid(vec![
            "fleet 'builder': --deadline: must be longer than zero (leave it out for the built-in), got \"0\"".into()
        ]))
    );
    let edit = LoopEdit { deadline: Some("0h".into()), ..LoopEdit::default() };
    assert_eq!(
        apply_loop_edit(MINIMAL, &edit),
        Err(Error::Invalid(vec![
            "--deadline: must be longer than zero (leave it out for the built-in), got \"0h\"".into()
        ]))
    );
    // A stored fleet an older version accepted with a zero deadline still loads; its bounds
    // do not resolve, so no run starts that would stop at once.
    let stored = Fleet::load_stored(&format!("{MINIMAL}limits:\n  deadline: 0\n")).unwrap();
    assert!(resolve_bounds(&stored, &RunFlags::default(), &LimitsBlock::Absent).is_err());
    assert!(DurationText::parse_bound("1s").is_ok());
}

#[test]
fn every_unknown_key_is_reported_at_once() {
    let err = parse_err(&format!(
        "{MINIMAL}colour: blue\nloop:\n  max_iteration: 3\n  trigger: manual\nlimits:\n  max_iterations: 3\n  \
         timeout: 1h\nprocedure:\n  - id: a\n    member: writer\n    after: [b]\n"
    ));
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines,
        [
            "unknown field `colour`, expected one of `name`, `goal`, `members`, `router`, `loop`, `limits`, \
             `fanout`, `hitl`, `procedure`, `parallel`, `needs`",
            "loop: unknown field `max_iteration`, expected one of `trigger`, `done_when`, `deadline`, `budget_usd`, \
             `max_iterations`, `timezone`, `overlap`, `catchup`, `pause_after_failures`",
            "limits: unknown field `max_iterations`, expected one of `deadline`, `stuck`, `cost_usd`",
            "limits: unknown field `timeout`, expected one of `deadline`, `stuck`, `cost_usd`",
            "procedure[0]: unknown field `after`, expected one of `id`, `member`, `task`, `depends_on`, \
             `on_failure`, `max_retries`, `tier`",
        ]
    );
    let err = parse_err(&format!(
        "{MINIMAL}parallel:\n  mode: speculative\n  tracks:\n    - name: a\n      zzz: 1\n  judge:\n    yyy: 2\n"
    ));
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        [
            "parallel.tracks[0]: unknown field `zzz`, expected one of `name`, `approach`, `model`",
            "parallel.judge: unknown field `yyy`, expected one of `model`, `rubric`",
        ]
    );
}

#[test]
fn unknown_keys_and_the_rules_the_rest_breaks_are_reported_together() {
    // The unknown key first, then what the rest breaks: one answer names all there is to mend.
    let err = parse_err(&format!("{MINIMAL}colour: blue\nloop:\n  deadline: 0m\n  budget_usd: -1\n"));
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(lines[0].starts_with("unknown field `colour`, expected one of"), "{err}");
    assert_eq!(lines[1], "loop.deadline: must be longer than zero (leave it out for the built-in), got \"0m\"");
    assert!(lines[2].starts_with("loop.budget_usd: must be a non-negative number"), "{err}");
    // A wrong type left after the unknown keys is named too.
    let err = parse_err(&format!("{MINIMAL}colour: blue\nfanout: lots\n"));
    assert_eq!(err.lines().nth(1), Some("fanout: must be a positive integer, got \"lots\""), "{err}");
    assert_eq!(err.lines().count(), 2, "{err}");
}

#[test]
fn a_stored_fleet_with_unknown_keys_in_its_tracks_judge_or_partition_still_loads() {
    let f = Fleet::load_stored(&format!(
        "{MINIMAL}parallel:\n  mode: speculative\n  tracks:\n    - name: a\n      zzz: 1\n    - name: b\n  \
         judge:\n    yyy: 2\n"
    ))
    .unwrap();
    assert_eq!(
        f.notices,
        [
            "parallel.tracks[0].zzz: unknown key (stored by an older version; ignored)",
            "parallel.judge.yyy: unknown key (stored by an older version; ignored)",
        ]
    );
}

#[test]
fn a_leading_byte_order_mark_is_read_past() {
    assert_eq!(Fleet::parse(&format!("\u{feff}{MINIMAL}")).unwrap().name, "builder");
    assert_eq!(Fleet::load_stored(&format!("\u{feff}{MINIMAL}")).unwrap().name, "builder");
}

#[test]
fn a_duration_written_as_a_negative_a_fraction_or_past_64_bits_is_refused_with_the_fields_rule() {
    let rule = "must be a duration such as 30s, 5m, 2h, 1d or 1h30m";
    for (written, refusal) in [
        ("-5", format!("limits.deadline: {rule}, got \"-5\"")),
        ("1.5", format!("limits.deadline: {rule}, got \"1.5\"")),
        ("99999999999999999999999", "limits.deadline: must be at most 365d, got \"99999999999999999999999\"".into()),
    ] {
        assert_eq!(rules(&format!("{MINIMAL}limits:\n  deadline: {written}\n")), vec![refusal], "{written}");
    }
    assert_eq!(
        rules(&format!("{MINIMAL}limits:\n  stuck: 99999999999999999999999\n")),
        vec!["limits.stuck: must be at most 365d, got \"99999999999999999999999\"".to_string()]
    );
    assert_eq!(
        rules(&format!("{MINIMAL}limits:\n  stuck: -1\n")),
        vec![format!("limits.stuck: {rule}, or off, got \"-1\"")]
    );
}
