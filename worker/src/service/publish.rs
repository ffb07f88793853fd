//! Trace lines published to `mur.trace.<session_id>` by a background task, so the session
//! loop never waits on NATS.

use super::*;

/// A [`Sink`] handing trace lines to a background task that publishes them, in order, on
/// the session's trace subject with the core client: no per-line round trip, and a slow
/// server never blocks the loop.
pub(super) struct PublishedSink {
    lines: mpsc::UnboundedSender<(Bytes, Option<String>)>,
}

impl Sink for PublishedSink {
    fn write(&mut self, line: &Line) -> Result<(), trace::Error> {
        let json = serde_json::to_vec(line).map_err(|e| trace::Error(e.to_string()))?;
        // `task_end` is written once per task (the design's invariant 4): a task run again
        // after a crash publishes it with the same message id, which MUR_TRACE drops
        // within its duplicate window.
        let msg_id = match &line.event {
            mur_proto::trace::Event::TaskEnd { task_id, .. } => Some(format!("{task_id}:task_end")),
            _ => None,
        };
        // The publisher only stops after every sender is gone.
        let _ = self.lines.send((json.into(), msg_id));
        Ok(())
    }
}

/// The background task behind a [`PublishedSink`].
pub(super) struct TracePublisher {
    task: tokio::task::JoinHandle<()>,
}

impl TracePublisher {
    pub(super) fn start(client: async_nats::Client, subject: String) -> (PublishedSink, TracePublisher) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Bytes, Option<String>)>();
        let subject = async_nats::Subject::from(subject);
        let task = tokio::spawn(async move {
            while let Some((line, msg_id)) = rx.recv().await {
                let published = match msg_id {
                    Some(id) => {
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
                        client.publish_with_headers(subject.clone(), headers, line).await
                    }
                    None => client.publish(subject.clone(), line).await,
                };
                if let Err(e) = published {
                    tracing::warn!(%subject, error = %e, "publishing a trace line failed");
                }
            }
        });
        (PublishedSink { lines: tx }, TracePublisher { task })
    }

    /// Waits until every line written before the sink was dropped is handed to the
    /// connection. No flush (a round trip to the server) is needed to order them before the
    /// task's terminal record: a connection delivers in order, and the record goes out on
    /// the same connection after them and is awaited, so its acknowledgement means the
    /// server has taken every line before it.
    pub(super) async fn finish(self) {
        let _ = self.task.await;
    }
}
