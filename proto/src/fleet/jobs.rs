//! Jobs and their statuses (the fleet reference §4; issue #10).

use super::*;

/// A job's status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    /// Waiting to be claimed.
    Queued,
    /// Claimed by a run.
    Running,
    /// Paused awaiting approval; approval resumes it (not terminal).
    Blocked,
    /// Finished with a result.
    Done,
    /// Finished with an error.
    Failed,
    /// Canceled before it finished.
    Canceled,
}

impl JobStatus {
    /// The stored spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Blocked => "blocked",
            JobStatus::Done => "done",
            JobStatus::Failed => "failed",
            JobStatus::Canceled => "canceled",
        }
    }

    /// Done, failed and canceled are terminal.
    pub const fn is_terminal(self) -> bool {
        matches!(self, JobStatus::Done | JobStatus::Failed | JobStatus::Canceled)
    }

    /// Whether `self → next` is a legal transition: queued → running | canceled;
    /// running → done | failed | canceled | blocked; blocked → running | canceled.
    /// Nothing leaves a terminal status.
    pub const fn can_become(self, next: JobStatus) -> bool {
        use JobStatus::*;
        matches!(
            (self, next),
            (Queued, Running | Canceled)
                | (Running, Done | Failed | Canceled | Blocked)
                | (Blocked, Running | Canceled)
        )
    }

    /// The A2A task state: submitted, working, input-required, completed, failed, canceled.
    pub const fn a2a_state(self) -> &'static str {
        match self {
            JobStatus::Queued => "submitted",
            JobStatus::Running => "working",
            JobStatus::Blocked => "input-required",
            JobStatus::Done => "completed",
            JobStatus::Failed => "failed",
            JobStatus::Canceled => "canceled",
        }
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused job transition.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("job {id}: cannot go from {from} to {to}")]
pub struct TransitionError {
    /// The job.
    pub id: String,
    /// Its status.
    pub from: JobStatus,
    /// The status asked for.
    pub to: JobStatus,
}

/// One unit of work queued on a fleet. Times are unix milliseconds. Serialized as JSON
/// with every field present (`null` when unset), as `mur fleet jobs --json` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// A UUIDv7 (hyphenated): lexical order is creation order.
    pub id: String,
    /// Queued, running, blocked, done, failed or canceled.
    pub status: JobStatus,
    /// The work, as sent.
    pub text: String,
    /// The output of the run that finished it.
    #[serde(default)]
    pub result: Option<String>,
    /// Why it failed (or was canceled).
    #[serde(default)]
    pub error: Option<String>,
    /// The run (a loop's iteration run id, `<id>-<n>`) that claimed it.
    #[serde(default)]
    pub run_id: Option<String>,
    /// Who queued it: `cli`, or `a2a:<agent>`.
    pub source: String,
    /// When it was queued.
    pub created_at: u64,
    /// When a run claimed it.
    #[serde(default)]
    pub started_at: Option<u64>,
    /// When it reached a terminal status.
    #[serde(default)]
    pub finished_at: Option<u64>,
    /// The approval its procedure is waiting for, or the answer given (`hitl`,
    /// the fleet-loops seed, §Unattended runs): set when a run parks a step, answered by
    /// `mur fleet approve` / `mur fleet deny`.
    #[serde(default)]
    pub approval: Option<Approval>,
    /// Outputs of the procedure steps already completed for this job, by step id: the run
    /// after an approval continues from there instead of running them again.
    #[serde(default)]
    pub steps_done: BTreeMap<String, String>,
    /// The W3C `traceparent` of the request that queued it (`mur fleet send`'s span,
    /// through the coordinator's; issue #32 §Fleet runs traced): the iteration that works
    /// on the job is a child of it. Absent when nothing traced the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// A parked approval request of a job (one per blocked run; it covers every step that run
/// parked).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    /// The parked steps' ids, in procedure order.
    pub steps: Vec<String>,
    /// `None` while waiting.
    #[serde(default)]
    pub decision: Option<Decision>,
    /// Who answered.
    #[serde(default)]
    pub by: Option<String>,
    /// When it was answered, unix ms.
    #[serde(default)]
    pub at: Option<u64>,
}

/// The answer to an approval request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    /// The parked steps run when the job runs next.
    Approved,
    /// The parked steps fail ("denied") when the job runs next; their `on_failure` applies.
    Denied,
}

impl Decision {
    /// `approved` or `denied`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Decision::Approved => "approved",
            Decision::Denied => "denied",
        }
    }
}

impl Job {
    /// A queued job with a fresh UUIDv7 id.
    pub fn new(text: impl Into<String>, source: impl Into<String>, now_ms: u64) -> Job {
        Job::with_id(uuid::Uuid::now_v7(), text, source, now_ms)
    }

    /// A queued job with the given id.
    pub fn with_id(id: uuid::Uuid, text: impl Into<String>, source: impl Into<String>, now_ms: u64) -> Job {
        Job {
            id: id.hyphenated().to_string(),
            status: JobStatus::Queued,
            text: text.into(),
            result: None,
            error: None,
            run_id: None,
            source: source.into(),
            created_at: now_ms,
            started_at: None,
            finished_at: None,
            approval: None,
            steps_done: BTreeMap::new(),
            traceparent: None,
        }
    }

    /// Moves the job to `next`, stamping `started_at` on its first claim and `finished_at`
    /// on a terminal status.
    ///
    /// # Errors
    /// A transition [`JobStatus::can_become`] refuses; the job is unchanged.
    pub fn transition(&mut self, next: JobStatus, now_ms: u64) -> Result<(), TransitionError> {
        if !self.status.can_become(next) {
            return Err(TransitionError { id: self.id.clone(), from: self.status, to: next });
        }
        self.status = next;
        if next == JobStatus::Running && self.started_at.is_none() {
            self.started_at = Some(now_ms);
        }
        if next.is_terminal() {
            self.finished_at = Some(now_ms);
        }
        Ok(())
    }

    /// Claims the job for a run: → running, with the run id.
    ///
    /// # Errors
    /// As [`Job::transition`].
    pub fn claim(&mut self, run_id: &str, now_ms: u64) -> Result<(), TransitionError> {
        self.transition(JobStatus::Running, now_ms)?;
        self.run_id = Some(run_id.to_string());
        Ok(())
    }
}

/// Which jobs `mur fleet jobs` lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFilter {
    /// `--all`: include terminal jobs.
    pub all: bool,
    /// `--since <run-id>`: only jobs whose run id starts with it (any status).
    pub since: Option<String>,
    /// `--status S`: only jobs in status S (with `--since`, or among those listed without).
    pub status: Option<JobStatus>,
}

impl JobFilter {
    /// Whether `job` is listed: with `--since`, by run-id prefix; otherwise non-terminal
    /// jobs, or every job with `--all`; with `--status`, only those in it.
    pub fn matches(&self, job: &Job) -> bool {
        let listed = match &self.since {
            Some(since) => run_id_matches(job.run_id.as_deref(), since),
            // A status asked for is listed whether or not it is terminal.
            None => self.all || self.status.is_some() || !job.status.is_terminal(),
        };
        listed && self.status.is_none_or(|s| s == job.status)
    }
}

/// Whether a blocked job's approval request has been answered, so the next run takes it.
pub fn is_answered(job: &Job) -> bool {
    job.status == JobStatus::Blocked && job.approval.as_ref().is_some_and(|a| a.decision.is_some())
}

/// The job a run works on next: the oldest blocked job whose approval was answered (it
/// continues from where it was parked, §Unattended runs: "the next run continues from
/// there"), else the oldest queued one ([`next_queued`]).
pub fn next_job(jobs: &[Job]) -> Option<&Job> {
    jobs.iter().filter(|j| is_answered(j)).min_by(|a, b| a.id.cmp(&b.id)).or_else(|| next_queued(jobs))
}

/// The oldest queued job (ids are UUIDv7, so the smallest id is the oldest).
pub fn next_queued(jobs: &[Job]) -> Option<&Job> {
    jobs.iter().filter(|j| j.status == JobStatus::Queued).min_by(|a, b| a.id.cmp(&b.id))
}
