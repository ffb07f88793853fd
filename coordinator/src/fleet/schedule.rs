//! A fleet trigger's decisions as a pure state machine (issue #36): given its stored
//! [`State`], the fleet's `loop:` block and what the adapter saw this tick ([`Seen`]: the
//! clock, a run going, how the trigger's last run ended), [`step`] says what to store and
//! what to do ([`Action`]). No IO and no clock reads; `crate::fleet::trigger` is the thin
//! adapter that reads KV, writes the new state with a compare-and-set (the claim), and only
//! then carries the actions out.
//!
//! The rules (`docs/fleet.md` §Unattended runs states them for users):
//!
//! - Occurrences: a cron's boundaries in `loop.timezone` ([`mur_proto::fleet::schedule`]);
//!   an interval's when never run or its duration has passed since the last occurrence; a
//!   manual one (`mur fleet trigger`) whenever asked, paused or not. A cron seen for the
//!   first time only stamps a baseline (never fires on enable).
//! - Catch-up: of the occurrences passed since the last one handled, at most one runs —
//!   the newest, when it is at most `loop.catchup` old (default 90 s); every other one is
//!   skipped (after downtime, never one run per occurrence).
//! - Overlap, when a run of the fleet is going: `skip` skips the occurrence; `queue_one`
//!   keeps one waiting and starts it when nothing is going, skipping further ones;
//!   `cancel_previous` does the same and asks the run going to stop.
//! - Every skipped occurrence is a channel event ([`Action::Note`]) and counts in
//!   [`State::skipped`].
//! - Pause: after `loop.pause_after_failures` failed runs in a row (a run that ended
//!   `failed`, or a start that was refused) the trigger pauses itself, says so, and starts
//!   nothing scheduled until [`State::resume`] (`mur fleet start`).
//! - Exactly once: a start is first a claim ([`State::claim`], with the run id chosen);
//!   a claim whose run has no record yet is started again under the same id (a failover
//!   between claim and start neither loses nor doubles it).

use mur_proto::fleet::schedule::{self, show_instant};
use mur_proto::fleet::{Loop, Overlap, Trigger};
use mur_proto::fleet_store::{NextFire, ScheduleInfo};
use serde::{Deserialize, Serialize};

/// How many next occurrences `mur fleet show`, `set-loop` and `status` print.
pub const NEXT_SHOWN: usize = 3;

/// At most this many passed occurrences are looked at in one step (a `* * * * *` cron
/// after a week down): the count of skipped ones is then a lower bound.
pub const MAX_COUNTED: u64 = 10_000;

/// A trigger's stored state: `mur_fleets` key `lastrun.<fleet>`, JSON. A bare number (what
/// versions before issue #36 stored: when the trigger last fired, unix ms) reads as
/// `{"last": n}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// The newest occurrence handled (started, queued or skipped) or the baseline, unix ms.
    #[serde(default)]
    pub last: Option<u64>,
    /// An occurrence claimed for a run not yet seen started.
    #[serde(default)]
    pub claim: Option<Claim>,
    /// The run the trigger started, until it is seen over.
    #[serde(default)]
    pub running: Option<String>,
    /// An occurrence waiting for the run going to end (`queue_one`, `cancel_previous`).
    #[serde(default)]
    pub queued: Option<u64>,
    /// Failed runs in a row.
    #[serde(default)]
    pub failures: u32,
    /// When the trigger paused itself after failures, unix ms.
    #[serde(default)]
    pub paused_at: Option<u64>,
    /// Occurrences skipped so far (a counter; `mur fleet status` shows it).
    #[serde(default)]
    pub skipped: u64,
    /// An occurrence asked for by `mur fleet trigger`, at this instant (unix ms).
    #[serde(default)]
    pub manual: Option<u64>,
}

/// An occurrence claimed for a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The occurrence, unix ms.
    pub occurrence: u64,
    /// The run id it starts under.
    pub run_id: String,
}

impl State {
    /// Reads a stored value: JSON, or a bare number of unix ms (before issue #36).
    ///
    /// # Errors
    /// The value is neither.
    pub fn decode(bytes: &[u8]) -> Result<State, serde_json::Error> {
        if let Some(last) = std::str::from_utf8(bytes).ok().and_then(|t| t.trim().parse::<u64>().ok()) {
            return Ok(State { last: Some(last), ..State::default() });
        }
        serde_json::from_slice(bytes)
    }

    /// The stored form.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a trigger state serializes")
    }

    /// `mur fleet start`: a paused trigger goes on, its count of failures cleared. Whether
    /// anything changed.
    pub fn resume(&mut self) -> bool {
        let changed = self.paused_at.is_some() || self.failures != 0;
        self.paused_at = None;
        self.failures = 0;
        changed
    }
}

/// The schedule as the API shows it: the loop's keys, the next [`NEXT_SHOWN`]
/// occurrences after `now` (in the zone and in UTC) and the stored state.
pub fn info(lp: &Loop, state: &State, now: u64) -> ScheduleInfo {
    let next = schedule::next_occurrences(&lp.trigger, lp.timezone, now, NEXT_SHOWN)
        .into_iter()
        .map(|at| NextFire { at, local: show_instant(lp.timezone, at), utc: show_instant(schedule::Tz::UTC, at) })
        .collect();
    ScheduleInfo {
        timezone: lp.timezone.name().to_string(),
        overlap: lp.overlap.as_text().to_string(),
        catchup: lp.catchup.as_ref().map_or_else(|| "90s".to_string(), |c| c.text.clone()),
        pause_after_failures: lp.pause_after_failures,
        next,
        failures: state.failures,
        paused_at: state.paused_at,
        skipped: state.skipped,
        queued: state.queued,
        last: state.last,
        run: state.claim.as_ref().map(|c| c.run_id.clone()).or_else(|| state.running.clone()),
        manual: state.manual,
    }
}

/// How a run ended, as far as pausing goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Any end but `failed`.
    Ok,
    /// The run ended `failed`.
    Failed,
}

/// What the adapter saw this tick.
#[derive(Clone, Debug)]
pub struct Seen<'a> {
    /// Now, unix ms.
    pub now: u64,
    /// Scheduled occurrences count (autorun is on); when off only manual ones do.
    pub autorun: bool,
    /// A run of the fleet in progress (triggered or not), by id.
    pub going: Option<&'a str>,
    /// How the trigger's run (the claimed one, else [`State::running`]) ended, once its
    /// record says it is over (a record gone counts as [`Outcome::Ok`]).
    pub ended: Option<Outcome>,
    /// Whether the claimed run ([`State::claim`]) has a record, i.e. it started.
    pub claim_started: bool,
    /// The id a run started now gets.
    pub fresh_run_id: &'a str,
}

/// What to do, in order, once the new state is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start a loop run of the fleet under `run_id` for `occurrence`.
    Start {
        /// The occurrence, unix ms.
        occurrence: u64,
        /// The run id (claimed).
        run_id: String,
    },
    /// Ask the run `run_id` to stop at its next iteration boundary (`cancel_previous`).
    Cancel {
        /// The run going.
        run_id: String,
    },
    /// A line for the fleet's channel.
    Note(String),
}

/// One tick of a fleet's trigger: the new state and what to do (module docs).
pub fn step(state: &State, lp: &Loop, seen: &Seen<'_>) -> (State, Vec<Action>) {
    let mut s = state.clone();
    let mut out = Vec::new();
    let show = |t: u64| show_instant(lp.timezone, t);

    // A claim: started, or started now under its id (a failover between claim and start).
    if let Some(claim) = s.claim.clone() {
        if !seen.claim_started {
            out.push(Action::Start { occurrence: claim.occurrence, run_id: claim.run_id });
            return (s, out);
        }
        s.claim = None;
        s.running = Some(claim.run_id);
    }

    // The trigger's run ended.
    if s.running.is_some()
        && let Some(outcome) = seen.ended
    {
        s.running = None;
        match outcome {
            Outcome::Ok => s.failures = 0,
            Outcome::Failed => {
                s.failures = s.failures.saturating_add(1);
                pause_if_due(&mut s, lp, seen.now, &mut out);
            }
        }
    }

    // The occurrence due now, if any: a manual one, else the newest scheduled one that
    // is inside the catch-up window.
    let mut due = s.manual.take();
    if seen.autorun && s.paused_at.is_none() {
        let scheduled = scheduled(&mut s, lp, seen.now, &mut out);
        due = due.or(scheduled);
    }

    let going = seen.going.map(str::to_string).or_else(|| s.running.clone());
    match (due, going) {
        (Some(o), None) => start(&mut s, o, seen, &mut out),
        (Some(o), Some(run)) => match lp.overlap {
            Overlap::Skip => skip(
                &mut s,
                &mut out,
                1,
                format!("occurrence {} skipped: run {run} is still going (loop.overlap: skip)", show(o)),
            ),
            policy if s.queued.is_none() => {
                s.queued = Some(o);
                if policy == Overlap::CancelPrevious {
                    out.push(Action::Note(format!(
                        "occurrence {} waits: run {run} is asked to stop at its next iteration (loop.overlap: \
                         cancel_previous)",
                        show(o)
                    )));
                    out.push(Action::Cancel { run_id: run });
                } else {
                    out.push(Action::Note(format!(
                        "occurrence {} waits for run {run} to end (loop.overlap: queue_one)",
                        show(o)
                    )));
                }
            }
            policy => {
                let note = format!(
                    "occurrence {} skipped: run {run} is still going and occurrence {} already waits (loop.overlap: {})",
                    show(o),
                    show(s.queued.unwrap_or_default()),
                    policy.as_text()
                );
                skip(&mut s, &mut out, 1, note);
            }
        },
        (None, None) => {
            if let Some(q) = s.queued.take() {
                start(&mut s, q, seen, &mut out);
            }
        }
        (None, Some(_)) => {}
    }
    (s, out)
}

/// A start was refused (the fleet's bounds do not resolve, it was stopped meanwhile …):
/// the claim is dropped and the refusal counts as a failed run.
pub fn start_refused(state: &State, lp: &Loop, now: u64, reason: &str) -> (State, Vec<Action>) {
    let mut s = state.clone();
    let mut out = Vec::new();
    if let Some(claim) = s.claim.take() {
        out.push(Action::Note(format!(
            "occurrence {}: the run was refused: {reason}",
            show_instant(lp.timezone, claim.occurrence)
        )));
    }
    s.failures = s.failures.saturating_add(1);
    pause_if_due(&mut s, lp, now, &mut out);
    (s, out)
}

fn start(s: &mut State, occurrence: u64, seen: &Seen<'_>, out: &mut Vec<Action>) {
    let run_id = seen.fresh_run_id.to_string();
    s.claim = Some(Claim { occurrence, run_id: run_id.clone() });
    out.push(Action::Start { occurrence, run_id });
}

fn skip(s: &mut State, out: &mut Vec<Action>, n: u64, note: String) {
    s.skipped = s.skipped.saturating_add(n);
    out.push(Action::Note(note));
}

fn pause_if_due(s: &mut State, lp: &Loop, now: u64, out: &mut Vec<Action>) {
    let n = lp.pause_after_failures;
    if n == 0 || s.failures < n || s.paused_at.is_some() {
        return;
    }
    s.paused_at = Some(now);
    out.push(Action::Note(format!(
        "trigger paused after {n} failed runs in a row (loop.pause_after_failures); `mur fleet start` resumes it"
    )));
    if let Some(q) = s.queued.take() {
        skip(s, out, 1, format!("occurrence {} skipped: the trigger is paused", show_instant(lp.timezone, q)));
    }
}

/// The scheduled occurrence to run now, if any; advances [`State::last`] and skips the
/// rest of those passed (catch-up).
fn scheduled(s: &mut State, lp: &Loop, now: u64, out: &mut Vec<Action>) -> Option<u64> {
    match &lp.trigger {
        Trigger::Interval(d) if !d.duration.is_zero() => {
            let every = d.duration.as_millis() as u64;
            match s.last {
                Some(last) if now.saturating_sub(last) < every => None,
                _ => {
                    s.last = Some(now);
                    Some(now)
                }
            }
        }
        Trigger::Cron(cron) => {
            let Some(last) = s.last else {
                s.last = Some(now);
                return None;
            };
            // Oldest, the one before the newest, and the newest of those passed.
            let (mut count, mut oldest, mut before, mut newest) = (0u64, None, None, None);
            let mut from = last;
            while count < MAX_COUNTED {
                match cron.next_in(lp.timezone, from) {
                    Some(t) if t <= now => {
                        count += 1;
                        oldest.get_or_insert(t);
                        before = newest;
                        newest = Some(t);
                        from = t;
                    }
                    _ => break,
                }
            }
            let (oldest, newest) = (oldest?, newest?);
            s.last = Some(if count == MAX_COUNTED { now } else { newest });
            let window = lp.catchup_window().as_millis() as u64;
            let runs = now.saturating_sub(newest) <= window;
            let missed = count - u64::from(runs);
            if missed > 0 {
                let show = |t: u64| show_instant(lp.timezone, t);
                let more = if count == MAX_COUNTED { " or more" } else { "" };
                let last_missed = if runs { before.unwrap_or(oldest) } else { newest };
                let span =
                    if missed == 1 { show(oldest) } else { format!("{} to {}", show(oldest), show(last_missed)) };
                let why = if runs {
                    format!("the run for {} stands for them (at most one run after downtime)", show(newest))
                } else {
                    format!("older than loop.catchup {}", catchup_text(lp))
                };
                skip(s, out, missed, format!("{missed}{more} missed occurrence(s) skipped ({span}): {why}"));
            }
            runs.then_some(newest)
        }
        _ => None,
    }
}

fn catchup_text(lp: &Loop) -> String {
    lp.catchup.as_ref().map_or_else(|| "90s (the built-in)".to_string(), |c| c.text.clone())
}

#[cfg(test)]
mod tests;
