//! `cargo bench -p mur-tests --bench trigger`: what a time zone costs a fleet trigger
//! (issue #36). The leader evaluates every triggered fleet once a second
//! (`mur_coordinator::fleet::schedule::step`); this measures that evaluation for the same
//! cron (`*/5 * * * *`) read in UTC (the baseline) and in Europe/Berlin, interleaved round by
//! round in this one process so the figures compare as a ratio, over two workloads:
//!
//! - tick: a step at each second of a day that spans the 2026-10-25 fall-back (86,400
//!   steps; 288 of them fire), runs ending at once — the leader's steady cost;
//! - next: `Cron::next_in` from each of those seconds — the search alone.
//!
//! A release build runs 5 rounds, a debug build (CI's smoke run) 1 round over 2 hours
//! (`MUR_BENCH_ROUNDS=N` chooses). Printed: nanoseconds per evaluation of each zone (the
//! median round) and the zone/UTC ratio.

use mur_coordinator::fleet::schedule::{Action, Outcome, Seen, State, step};
use mur_proto::Fleet;
use mur_proto::fleet::Trigger;
use std::time::{Duration, Instant};

/// 2026-10-24T22:00:00Z, two hours before Berlin's 02:00 CEST of the fall-back day.
const START_MS: u64 = 1_792_879_200_000;

fn loop_of(zone: &str) -> mur_proto::fleet::Loop {
    Fleet::parse(&format!("name: b\nmembers: [m]\nloop:\n  trigger: cron:*/5 * * * *\n  timezone: {zone}\n"))
        .expect("fleet")
        .r#loop
}

/// Steps once a second for `seconds`; returns the time taken and the runs started.
fn ticks(lp: &mur_proto::fleet::Loop, seconds: u64) -> (Duration, u64) {
    let mut state = State::default();
    let mut started = 0;
    let begun = Instant::now();
    for s in 0..seconds {
        let now = START_MS + s * 1_000;
        // The run started by the last step has a record and is over at once.
        let ours = state.claim.is_some();
        let seen = Seen {
            now,
            autorun: true,
            going: None,
            ended: ours.then_some(Outcome::Ok),
            claim_started: ours,
            fresh_run_id: "fleet-b-run",
        };
        let (next, actions) = step(&state, lp, &seen);
        started += actions.iter().filter(|a| matches!(a, Action::Start { .. })).count() as u64;
        state = next;
    }
    (begun.elapsed(), started)
}

fn nexts(lp: &mur_proto::fleet::Loop, seconds: u64) -> Duration {
    let Trigger::Cron(cron) = &lp.trigger else { unreachable!("a cron") };
    let begun = Instant::now();
    let mut sum = 0u64;
    for s in 0..seconds {
        sum = sum.wrapping_add(cron.next_in(lp.timezone, START_MS + s * 1_000).unwrap_or(0));
    }
    std::hint::black_box(sum);
    begun.elapsed()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    mur_nats::tls::install_crypto_provider();
    let release = !cfg!(debug_assertions);
    let rounds: usize =
        std::env::var("MUR_BENCH_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(if release { 5 } else { 1 });
    let seconds: u64 = if release { 86_400 } else { 7_200 };
    let (utc, berlin) = (loop_of("UTC"), loop_of("Europe/Berlin"));
    let (mut tick_utc, mut tick_zone, mut next_utc, mut next_zone) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let (t, fired_utc) = ticks(&utc, seconds);
        tick_utc.push(t);
        let (t, fired_zone) = ticks(&berlin, seconds);
        tick_zone.push(t);
        // Every 5 minutes in both zones, but Berlin's repeated hour (01:00-02:00 UTC,
        // 3 h after the start) fires its 12 wall-clock times once, in the first hour.
        let repeated = if seconds >= 4 * 3_600 { 12 } else { 0 };
        assert_eq!(fired_zone + repeated, fired_utc, "runs started in UTC and in Berlin");
        next_utc.push(nexts(&utc, seconds));
        next_zone.push(nexts(&berlin, seconds));
    }
    let per = |d: Duration| d.as_nanos() as f64 / seconds as f64;
    let (tu, tz, nu, nz) = (
        per(median(&mut tick_utc)),
        per(median(&mut tick_zone)),
        per(median(&mut next_utc)),
        per(median(&mut next_zone)),
    );
    println!("trigger evaluation, {rounds} round(s) of {seconds} one-second ticks (median round):");
    println!("  tick  UTC {tu:>8.0} ns   Europe/Berlin {tz:>8.0} ns   ratio {:.2}x", tz / tu);
    println!("  next  UTC {nu:>8.0} ns   Europe/Berlin {nz:>8.0} ns   ratio {:.2}x", nz / nu);
}
