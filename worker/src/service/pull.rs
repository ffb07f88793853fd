//! The worker's pull requests for dispatches: one per free slot ([`Puller`]).

use super::*;

/// The worker's pull requests on the `workers` consumer: one request for one message per
/// free slot, all standing at once, answered on one inbox. A dispatch published while a
/// slot is free finds a request waiting at the server and goes out at once; a worker never
/// asks for more messages than it has free slots, so it never hoards work it cannot start.
///
/// Each request expires at the server after [`FETCH_EXPIRY`] (the server answers `408`)
/// and is sent again while its slot is still free; one with no answer at all
/// [`LOST_PULL`] after that (a restarted server forgets them) is given up on.
pub(super) struct Puller {
    consumer: PullConsumer,
    context: jetstream::Context,
    inbox: async_nats::Subject,
    answers: async_nats::Subscriber,
    /// When each unanswered request was sent, oldest first.
    waiting: std::collections::VecDeque<tokio::time::Instant>,
}

impl Puller {
    pub(super) async fn start(
        client: &async_nats::Client,
        context: jetstream::Context,
        consumer: PullConsumer,
    ) -> Result<Puller, async_nats::SubscribeError> {
        let inbox = async_nats::Subject::from(client.new_inbox());
        let answers = client.subscribe(inbox.clone()).await?;
        Ok(Puller { consumer, context, inbox, answers, waiting: Default::default() })
    }

    /// Requests outstanding.
    pub(super) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sends requests until `free` slots each have one.
    pub(super) async fn cover(&mut self, free: usize) -> Result<(), String> {
        while self.waiting.len() < free {
            let request =
                jetstream::consumer::pull::BatchConfig { batch: 1, expires: Some(FETCH_EXPIRY), ..Default::default() };
            self.consumer.request_batch(request, self.inbox.clone()).await.map_err(|e| e.to_string())?;
            self.waiting.push_back(tokio::time::Instant::now());
        }
        Ok(())
    }

    /// When the oldest request will count as lost, if one is out.
    pub(super) fn lost_at(&self) -> Option<tokio::time::Instant> {
        self.waiting.front().map(|sent| *sent + FETCH_EXPIRY + LOST_PULL)
    }

    /// Forgets the requests unanswered for too long.
    pub(super) fn forget_lost(&mut self) {
        let now = tokio::time::Instant::now();
        while self.lost_at().is_some_and(|at| at <= now) {
            tracing::debug!("a pull request went unanswered: sending another");
            self.waiting.pop_front();
        }
    }

    /// The next answer to a request: a dispatch, `None` for an expired request, an error
    /// for any other status. Cancel-safe.
    pub(super) async fn next(&mut self) -> Result<Option<jetstream::Message>, String> {
        let Some(message) = self.answers.next().await else {
            return Err("the pull subscription ended".into());
        };
        let status = message.status.unwrap_or(async_nats::StatusCode::OK);
        if status == async_nats::StatusCode::IDLE_HEARTBEAT {
            return Ok(None);
        }
        self.waiting.pop_front();
        match status {
            async_nats::StatusCode::OK => Ok(Some(jetstream::Message { message, context: self.context.clone() })),
            async_nats::StatusCode::TIMEOUT => Ok(None),
            other => Err(format!("pull request answered {other}: {}", message.description.unwrap_or_default())),
        }
    }
}
