//! The pure rules a loop applies (§Three ways a loop ends, §The bounds).

use super::*;

/// Whether `text` converges a `marker:` loop: some line equals the marker after trimming.
/// Whole-line, not substring: prose that mentions the marker does not count.
pub fn marker_matches(text: &str, marker: &str) -> bool {
    let marker = marker.trim();
    !marker.is_empty() && text.lines().any(|l| l.trim() == marker)
}

/// Whether the router's answer to "DONE or CONTINUE?" says done: a standalone word `done`
/// and none of `continue`, `not`, `incomplete` (any case). Anything else keeps going.
pub fn router_says_done(reply: &str) -> bool {
    let words: Vec<String> =
        reply.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_lowercase).collect();
    words.iter().any(|w| w == "done") && !words.iter().any(|w| matches!(w.as_str(), "continue" | "not" | "incomplete"))
}

/// Why a loop stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `done_when` was met (router judgment or marker).
    Converged,
    /// `queue-empty`: an iteration found nothing queued.
    QueueDrained,
    /// A step needs approval; the request is parked and the job is blocked.
    AwaitingApproval,
    /// The kill-switch is set (or could not be read: fail closed).
    Stopped,
    /// The deadline passed.
    Deadline,
    /// No agent-authored progress within the stuck window.
    Stuck,
    /// The next iteration could not be afforded.
    Budget,
    /// The 10 000-iteration diagnostic ceiling.
    MaxIterations,
    /// An iteration's steps failed.
    IterationFailed,
}

impl Stop {
    /// The outcome label (`awaiting-approval`, `queue-drained`, …).
    pub const fn label(self) -> &'static str {
        match self {
            Stop::Converged => "converged",
            Stop::QueueDrained => "queue-drained",
            Stop::AwaitingApproval => "awaiting-approval",
            Stop::Stopped => "stopped",
            Stop::Deadline => "deadline",
            Stop::Stuck => "stuck",
            Stop::Budget => "budget",
            Stop::MaxIterations => "max-iterations",
            Stop::IterationFailed => "iteration-failed",
        }
    }

    /// The channel state the loop ends in: completed, input-required, canceled or failed.
    pub const fn channel_state(self) -> &'static str {
        match self {
            Stop::Converged | Stop::QueueDrained => "completed",
            Stop::AwaitingApproval => "input-required",
            Stop::Stopped => "canceled",
            _ => "failed",
        }
    }

    /// The run record's state: done, blocked, stopped or failed.
    pub const fn run_state(self) -> &'static str {
        match self {
            Stop::Converged | Stop::QueueDrained => "done",
            Stop::AwaitingApproval => "blocked",
            Stop::Stopped => "stopped",
            _ => "failed",
        }
    }

    /// A one-line remedy naming the fleet; none for a loop that finished its work
    /// (`mur-fleet` reference §3 stop table). `blocked_job`: the job an awaiting-approval
    /// stop left blocked, named in the approve command (`<job>` when not known).
    pub fn remedy(self, fleet: &str, blocked_job: Option<&str>) -> Option<String> {
        Some(match self {
            Stop::Converged | Stop::QueueDrained => return None,
            Stop::AwaitingApproval => {
                let job = blocked_job.unwrap_or("<job>");
                format!("approve the parked steps: mur fleet approve {fleet} {job}, then run it again")
            }
            Stop::Stopped => format!("mur fleet start {fleet} clears the kill-switch"),
            Stop::Deadline => {
                format!("raise the deadline: mur fleet run {fleet} --loop --deadline <D>, or limits.deadline")
            }
            Stop::Stuck => format!(
                "no agent progress within the stuck window; check the members, or raise limits.stuck of {fleet}"
            ),
            Stop::Budget => {
                format!("raise the budget: mur fleet run {fleet} --loop --budget-usd <N>, or limits.cost_usd")
            }
            Stop::MaxIterations => {
                format!("fleet {fleet} reached the {ITERATION_CEILING}-iteration diagnostic ceiling; set done_when")
            }
            Stop::IterationFailed => format!("see the failed step in mur fleet jobs {fleet} --all"),
        })
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What the guards see between iterations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardInput {
    /// Time since the loop started.
    pub elapsed: Duration,
    /// The resolved deadline.
    pub deadline: Duration,
    /// The resolved stuck window (`None`: off).
    pub stuck: Option<Duration>,
    /// Time since the last agent-authored channel event (or the loop's start).
    pub since_progress: Duration,
    /// Iterations already run.
    pub iteration: u64,
}

/// The guards checked before each iteration (they never interrupt one): the deadline
/// first, then stuck (never before the first iteration), then the diagnostic ceiling.
pub fn check_guards(g: GuardInput) -> Option<Stop> {
    if g.elapsed >= g.deadline {
        return Some(Stop::Deadline);
    }
    if let Some(window) = g.stuck
        && g.iteration > 0
        && g.since_progress >= window
    {
        return Some(Stop::Stuck);
    }
    if g.iteration >= ITERATION_CEILING {
        return Some(Stop::MaxIterations);
    }
    None
}

/// The time a delegated step inherits: what is left of the loop's deadline, at least 1 s.
pub fn inherited_deadline(deadline: Duration, elapsed: Duration) -> Duration {
    deadline.saturating_sub(elapsed).max(Duration::from_secs(1))
}
