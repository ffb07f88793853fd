//! The trigger's state machine on a controllable clock: exact instants asserted.

use super::*;
use mur_proto::Fleet;
use std::collections::BTreeMap;

/// Unix ms of an RFC 3339 instant.
fn at(text: &str) -> u64 {
    humantime::parse_rfc3339(text).unwrap().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

const MINUTE: u64 = 60_000;

fn lp(extra: &str) -> Loop {
    Fleet::parse(&format!("name: f\nmembers: [m]\nloop:\n{extra}")).unwrap().r#loop
}

/// The adapter, simulated: starts what it is told, tracks the run going and how runs end.
struct Sim {
    lp: Loop,
    state: State,
    now: u64,
    autorun: bool,
    /// The run going (started by the trigger or by hand).
    going: Option<String>,
    /// How ended runs ended.
    ended: BTreeMap<String, Outcome>,
    /// Started runs' ids (their records exist).
    started: Vec<String>,
    /// (occurrence, run id) of each start.
    starts: Vec<(u64, String)>,
    cancels: Vec<String>,
    notes: Vec<String>,
    next_id: u32,
}

impl Sim {
    fn new(extra: &str, now: &str) -> Sim {
        Sim {
            lp: lp(extra),
            state: State::default(),
            now: at(now),
            autorun: true,
            going: None,
            ended: BTreeMap::new(),
            started: Vec::new(),
            starts: Vec::new(),
            cancels: Vec::new(),
            notes: Vec::new(),
            next_id: 1,
        }
    }

    /// One tick at the current clock; a run started is going from then on.
    fn tick(&mut self) {
        let fresh = format!("run-{}", self.next_id);
        // The trigger's run: the claimed one, else the one going.
        let ours = self.state.claim.as_ref().map(|c| &c.run_id).or(self.state.running.as_ref());
        let ended = ours.and_then(|r| self.ended.get(r).copied());
        let claim_started = self.state.claim.as_ref().is_some_and(|c| self.started.contains(&c.run_id));
        let seen = Seen {
            now: self.now,
            autorun: self.autorun,
            going: self.going.as_deref(),
            ended,
            claim_started,
            fresh_run_id: &fresh,
        };
        let (state, actions) = step(&self.state, &self.lp, &seen);
        self.state = state;
        for a in actions {
            match a {
                Action::Start { occurrence, run_id } => {
                    if run_id == fresh {
                        self.next_id += 1;
                    }
                    self.started.push(run_id.clone());
                    self.starts.push((occurrence, run_id.clone()));
                    self.going = Some(run_id);
                }
                Action::Cancel { run_id } => self.cancels.push(run_id),
                Action::Note(n) => self.notes.push(n),
            }
        }
    }

    /// Ticks every `every` ms until `until` (inclusive).
    fn run_until(&mut self, until: &str, every: u64) {
        let until = at(until);
        while self.now <= until {
            self.tick();
            self.now += every;
        }
        self.now = until;
    }

    /// The run going ends.
    fn end(&mut self, outcome: Outcome) {
        let run = self.going.take().expect("a run going");
        self.ended.insert(run, outcome);
    }

    /// Runs end as soon as they start (ticking each `every` ms to `until`).
    fn run_until_each_ending(&mut self, until: &str, every: u64) {
        let until = at(until);
        while self.now <= until {
            self.tick();
            if self.going.is_some() {
                self.end(Outcome::Ok);
            }
            self.now += every;
        }
    }

    fn occurrences(&self) -> Vec<u64> {
        self.starts.iter().map(|(o, _)| *o).collect()
    }
}

fn instants(texts: &[&str]) -> Vec<u64> {
    texts.iter().map(|t| at(t)).collect()
}

/// Ticks a day across a daylight-saving change once a second around each expected
/// instant and once a minute elsewhere would miss nothing either way: ticking every
/// 10 s over the whole day, runs ending at once.
fn fired(extra: &str, from: &str, to: &str) -> Vec<u64> {
    let mut sim = Sim::new(extra, from);
    sim.run_until_each_ending(to, 10_000);
    assert_eq!(sim.state.skipped, 0, "{:?}", sim.notes);
    sim.occurrences()
}

#[test]
fn berlin_fall_back_fires_a_repeated_local_time_once_the_first() {
    assert_eq!(
        fired(
            "  trigger: cron:30 2 * * *\n  timezone: Europe/Berlin\n",
            "2026-10-24T22:00:00Z",
            "2026-10-26T03:00:00Z"
        ),
        instants(&["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"])
    );
    assert_eq!(
        fired("  trigger: cron:0 * * * *\n  timezone: Europe/Berlin\n", "2026-10-24T22:30:00Z", "2026-10-25T03:30:00Z"),
        instants(&["2026-10-24T23:00:00Z", "2026-10-25T00:00:00Z", "2026-10-25T02:00:00Z", "2026-10-25T03:00:00Z"])
    );
}

#[test]
fn berlin_spring_forward_fires_a_missing_local_time_once_after_the_gap() {
    assert_eq!(
        fired(
            "  trigger: cron:30 2 * * *\n  timezone: Europe/Berlin\n",
            "2026-03-28T02:00:00Z",
            "2026-03-30T02:00:00Z"
        ),
        instants(&["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"])
    );
    assert_eq!(
        fired("  trigger: cron:0 * * * *\n  timezone: Europe/Berlin\n", "2026-03-28T23:30:00Z", "2026-03-29T02:30:00Z"),
        instants(&["2026-03-29T00:00:00Z", "2026-03-29T01:00:00Z", "2026-03-29T02:00:00Z"])
    );
}

#[test]
fn new_york_both_changes_fire_each_local_time_once() {
    let ny = |cron: &str| format!("  trigger: cron:{cron}\n  timezone: America/New_York\n");
    assert_eq!(
        fired(&ny("30 2 * * *"), "2026-03-07T08:00:00Z", "2026-03-09T08:00:00Z"),
        instants(&["2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z"])
    );
    assert_eq!(
        fired(&ny("0 * * * *"), "2026-03-08T05:30:00Z", "2026-03-08T08:30:00Z"),
        instants(&["2026-03-08T06:00:00Z", "2026-03-08T07:00:00Z", "2026-03-08T08:00:00Z"])
    );
    assert_eq!(
        fired(&ny("30 2 * * *"), "2026-10-31T08:00:00Z", "2026-11-02T08:00:00Z"),
        instants(&["2026-11-01T07:30:00Z", "2026-11-02T07:30:00Z"])
    );
    assert_eq!(
        fired(&ny("0 * * * *"), "2026-11-01T04:30:00Z", "2026-11-01T08:30:00Z"),
        instants(&["2026-11-01T05:00:00Z", "2026-11-01T07:00:00Z", "2026-11-01T08:00:00Z"])
    );
}

#[test]
fn a_cron_first_stamps_a_baseline_and_never_fires_on_enable() {
    let mut sim = Sim::new("  trigger: cron:0 * * * *\n", "2026-06-01T10:00:00Z");
    sim.tick();
    assert_eq!(sim.state.last, Some(at("2026-06-01T10:00:00Z")));
    assert!(sim.starts.is_empty());
    sim.run_until_each_ending("2026-06-01T11:00:30Z", 1_000);
    assert_eq!(sim.occurrences(), instants(&["2026-06-01T11:00:00Z"]));
}

#[test]
fn skip_skips_an_occurrence_finding_a_run_going_with_a_note_and_a_count() {
    let mut sim = Sim::new("  trigger: cron:0 * * * *\n", "2026-06-01T09:30:00Z");
    sim.run_until("2026-06-01T10:00:00Z", MINUTE);
    assert_eq!(sim.starts, [(at("2026-06-01T10:00:00Z"), "run-1".to_string())]);
    // run-1 is still going at 11:00 and 12:00.
    sim.run_until("2026-06-01T12:00:00Z", MINUTE);
    assert_eq!(sim.starts.len(), 1);
    assert_eq!(sim.state.skipped, 2);
    assert_eq!(
        sim.notes,
        [
            "occurrence 2026-06-01 11:00 UTC skipped: run run-1 is still going (loop.overlap: skip)",
            "occurrence 2026-06-01 12:00 UTC skipped: run run-1 is still going (loop.overlap: skip)",
        ]
    );
    // It ends: nothing starts until the next occurrence.
    sim.end(Outcome::Ok);
    sim.run_until("2026-06-01T12:59:00Z", MINUTE);
    assert_eq!(sim.starts.len(), 1);
    sim.run_until("2026-06-01T13:00:00Z", MINUTE);
    assert_eq!(sim.occurrences(), instants(&["2026-06-01T10:00:00Z", "2026-06-01T13:00:00Z"]));
}

#[test]
fn a_run_started_by_hand_counts_as_going() {
    let mut sim = Sim::new("  trigger: cron:0 * * * *\n", "2026-06-01T09:30:00Z");
    sim.tick();
    sim.going = Some("fleet-f-by-hand".into());
    sim.run_until("2026-06-01T10:00:00Z", MINUTE);
    assert!(sim.starts.is_empty());
    assert_eq!(
        sim.notes,
        ["occurrence 2026-06-01 10:00 UTC skipped: run fleet-f-by-hand is still going (loop.overlap: skip)"]
    );
}

#[test]
fn queue_one_starts_one_waiting_occurrence_when_the_run_ends_and_skips_the_rest() {
    let mut sim = Sim::new("  trigger: cron:*/10 * * * *\n  overlap: queue_one\n", "2026-06-01T09:55:00Z");
    sim.run_until("2026-06-01T10:00:00Z", MINUTE);
    assert_eq!(sim.occurrences(), instants(&["2026-06-01T10:00:00Z"]));
    sim.run_until("2026-06-01T10:25:00Z", MINUTE); // 10:10 waits, 10:20 is skipped
    assert_eq!(sim.state.queued, Some(at("2026-06-01T10:10:00Z")));
    assert_eq!(sim.state.skipped, 1);
    assert_eq!(
        sim.notes,
        [
            "occurrence 2026-06-01 10:10 UTC waits for run run-1 to end (loop.overlap: queue_one)",
            "occurrence 2026-06-01 10:20 UTC skipped: run run-1 is still going and occurrence 2026-06-01 10:10 UTC \
             already waits (loop.overlap: queue_one)",
        ]
    );
    sim.end(Outcome::Ok);
    sim.tick(); // at 10:25: the run's end is seen and the waiting occurrence starts at once
    assert_eq!(
        sim.starts,
        [(at("2026-06-01T10:00:00Z"), "run-1".to_string()), (at("2026-06-01T10:10:00Z"), "run-2".to_string())]
    );
    assert_eq!(sim.state.queued, None);
    assert!(sim.cancels.is_empty());
}

#[test]
fn cancel_previous_asks_the_run_going_to_stop_and_starts_the_occurrence_once_it_ended() {
    let mut sim = Sim::new("  trigger: cron:*/10 * * * *\n  overlap: cancel_previous\n", "2026-06-01T09:55:00Z");
    sim.run_until("2026-06-01T10:10:00Z", MINUTE);
    assert_eq!(sim.cancels, ["run-1"]);
    assert_eq!(
        sim.notes,
        ["occurrence 2026-06-01 10:10 UTC waits: run run-1 is asked to stop at its next iteration (loop.overlap: \
          cancel_previous)"]
    );
    assert_eq!(sim.starts.len(), 1, "nothing starts beside the run going");
    sim.now = at("2026-06-01T10:11:00Z");
    sim.end(Outcome::Ok); // it stopped
    sim.tick();
    assert_eq!(sim.starts[1], (at("2026-06-01T10:10:00Z"), "run-2".to_string()));
    assert_eq!(sim.state.skipped, 0);
}

#[test]
fn after_a_three_hour_outage_catchup_1h_runs_once_and_the_default_runs_none() {
    for (extra, runs, skipped, note) in [
        (
            "  trigger: cron:0 * * * *\n  catchup: 1h\n",
            vec![at("2026-06-01T09:00:00Z"), at("2026-06-01T12:00:00Z")],
            2,
            "2 missed occurrence(s) skipped (2026-06-01 10:00 UTC to 2026-06-01 11:00 UTC): the run for \
             2026-06-01 12:00 UTC stands for them (at most one run after downtime)",
        ),
        (
            "  trigger: cron:0 * * * *\n",
            vec![at("2026-06-01T09:00:00Z")],
            3,
            "3 missed occurrence(s) skipped (2026-06-01 10:00 UTC to 2026-06-01 12:00 UTC): older than \
             loop.catchup 90s (the built-in)",
        ),
    ] {
        let mut sim = Sim::new(extra, "2026-06-01T08:30:00Z");
        sim.run_until_each_ending("2026-06-01T09:30:00Z", MINUTE);
        // Down from 09:30 to 12:30: no ticks.
        sim.now = at("2026-06-01T12:30:00Z");
        sim.tick();
        assert_eq!(sim.occurrences(), runs, "{extra}");
        assert_eq!(sim.state.skipped, skipped, "{extra}");
        assert_eq!(sim.notes, [note], "{extra}");
        assert_eq!(sim.state.last, Some(at("2026-06-01T12:00:00Z")));
    }
}

#[test]
fn the_trigger_pauses_after_failures_in_a_row_fires_only_by_hand_then_resumes() {
    let mut sim = Sim::new("  trigger: cron:0 * * * *\n  pause_after_failures: 2\n", "2026-06-01T08:30:00Z");
    sim.run_until("2026-06-01T09:00:00Z", MINUTE);
    sim.end(Outcome::Failed);
    sim.run_until("2026-06-01T10:00:00Z", MINUTE);
    sim.end(Outcome::Ok); // a success clears the count
    sim.run_until("2026-06-01T11:00:00Z", MINUTE);
    sim.end(Outcome::Failed);
    sim.run_until("2026-06-01T12:00:00Z", MINUTE);
    sim.end(Outcome::Failed);
    sim.run_until("2026-06-01T14:30:00Z", MINUTE);
    assert_eq!(
        sim.occurrences(),
        instants(&["2026-06-01T09:00:00Z", "2026-06-01T10:00:00Z", "2026-06-01T11:00:00Z", "2026-06-01T12:00:00Z"])
    );
    assert_eq!(sim.state.paused_at, Some(at("2026-06-01T12:00:00Z")));
    assert_eq!(
        sim.notes,
        ["trigger paused after 2 failed runs in a row (loop.pause_after_failures); `mur fleet start` resumes it"]
    );
    // `mur fleet trigger` fires one occurrence even while paused.
    sim.state.manual = Some(sim.now);
    sim.tick();
    assert_eq!(sim.starts.last().unwrap().0, at("2026-06-01T14:30:00Z"));
    sim.end(Outcome::Ok);
    // `mur fleet start`: the occurrences passed while paused are caught up as after
    // downtime (none inside 90 s), then the next one fires.
    assert!(sim.state.resume());
    sim.run_until("2026-06-01T15:00:00Z", MINUTE);
    assert_eq!(sim.starts.last().unwrap().0, at("2026-06-01T15:00:00Z"));
    assert_eq!(sim.state.failures, 0);
}

#[test]
fn a_claim_not_seen_started_is_started_again_under_its_id_never_twice() {
    let sim = Sim::new("  trigger: interval:1h\n", "2026-06-01T09:00:00Z");
    let seen =
        Seen { now: sim.now, autorun: true, going: None, ended: None, claim_started: false, fresh_run_id: "run-1" };
    let (claimed, actions) = step(&sim.state, &sim.lp, &seen);
    assert_eq!(actions, [Action::Start { occurrence: sim.now, run_id: "run-1".into() }]);
    assert_eq!(claimed.claim, Some(Claim { occurrence: sim.now, run_id: "run-1".into() }));
    // The coordinator died after the claim, before the start: the next leader starts the
    // same occurrence under the same id, storing nothing new.
    let later = Seen { now: sim.now + 5_000, fresh_run_id: "run-2", ..seen.clone() };
    let (again, actions) = step(&claimed, &sim.lp, &later);
    assert_eq!(
        (again.clone(), actions),
        (claimed.clone(), vec![Action::Start { occurrence: sim.now, run_id: "run-1".into() }])
    );
    // Once its record exists it is the trigger's run going; nothing more starts.
    let started = Seen { claim_started: true, going: Some("run-1"), ..later };
    let (running, actions) = step(&claimed, &sim.lp, &started);
    assert_eq!((running.claim, running.running.as_deref(), actions), (None, Some("run-1"), vec![]));
}

#[test]
fn a_refused_start_counts_as_a_failure_and_drops_the_claim() {
    let l = lp("  trigger: interval:1h\n  pause_after_failures: 1\n");
    let claimed =
        State { claim: Some(Claim { occurrence: 5, run_id: "run-1".into() }), last: Some(5), ..State::default() };
    let (s, notes) = start_refused(&claimed, &l, 7, "fleet 'f': limits.deadline: must be …");
    assert_eq!((s.claim, s.failures, s.paused_at), (None, 1, Some(7)));
    assert_eq!(
        notes,
        [
            Action::Note(
                "occurrence 1970-01-01 00:00 UTC: the run was refused: fleet 'f': limits.deadline: must be …".into()
            ),
            Action::Note(
                "trigger paused after 1 failed runs in a row (loop.pause_after_failures); `mur fleet start` resumes it"
                    .into()
            ),
        ]
    );
}

#[test]
fn an_interval_fires_when_never_run_or_once_its_duration_has_passed_and_autorun_off_fires_only_by_hand() {
    let mut sim = Sim::new("  trigger: interval:10s\n", "2026-06-01T09:00:00Z");
    sim.run_until_each_ending("2026-06-01T09:00:25Z", 1_000);
    assert_eq!(sim.occurrences(), instants(&["2026-06-01T09:00:00Z", "2026-06-01T09:00:10Z", "2026-06-01T09:00:20Z"]));
    let mut off = Sim::new("  trigger: interval:10s\n", "2026-06-01T09:00:00Z");
    off.autorun = false;
    off.run_until_each_ending("2026-06-01T09:00:25Z", 1_000);
    assert!(off.starts.is_empty());
    off.state.manual = Some(off.now);
    off.tick();
    assert_eq!(off.occurrences(), [off.now]);
}

#[test]
fn a_bare_number_stored_by_an_older_version_reads_as_the_last_occurrence() {
    assert_eq!(State::decode(b"1700000000000").unwrap(), State { last: Some(1_700_000_000_000), ..State::default() });
    let s = State { last: Some(3), skipped: 2, paused_at: Some(9), ..State::default() };
    assert_eq!(State::decode(&s.encode()).unwrap(), s);
    assert!(State::decode(b"garbage").is_err());
}
