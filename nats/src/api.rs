//! Talking to the coordinator's NATS API (`mur.api.*`, see [`mur_proto::cluster::api`]):
//! the reply scheme the service answers with, [`call`], which every caller uses to send a
//! request and read the answer ([`call_with_headers`] to send headers too), and
//! [`submit`], the one way to submit a task: idempotent, sent again while no coordinator
//! answers.
//!
//! The reply scheme, one for every endpoint:
//! - **success**: the body is the reply value as plain JSON (a [`SubmitReply`], a
//!   [`TaskRecord`], an array…), with no error headers;
//! - **failure**: the NATS micro service error headers are set —
//!   `Nats-Service-Error: <code>: <message>` and `Nats-Service-Error-Code: <status>` (the
//!   [`ErrorCode::status`], 400/404/409/500/503) — so generic micro service tooling sees an
//!   error, and the [`ApiError`] as JSON (`{"code": …, "message": …}`) is in the
//!   [`MUR_API_ERROR`] header, so murmur's clients get the closed error code and the full
//!   message. The coordinator's service sends it with async-nats `respond(Err(..))`, so the
//!   service's stats (`$SRV.STATS`, `nats micro stats`) count the refusal as an error
//!   (issue #29 item 10); that form's body is empty ([`service_error`]).
//!
//! A reply with error headers whose body is an [`ApiError`] (coordinators before issue #29,
//! and [`error_reply`]'s plain replies) is read from the body; one with neither that body
//! nor the [`MUR_API_ERROR`] header (another micro service implementation) is read from
//! the headers alone, its code mapped back from the status.
//!
//! [`SubmitReply`]: mur_proto::cluster::SubmitReply
//! [`TaskRecord`]: mur_proto::cluster::TaskRecord

use async_nats::service::{NATS_SERVICE_ERROR, NATS_SERVICE_ERROR_CODE};
use async_nats::{HeaderMap, Message, RequestErrorKind};
use bytes::Bytes;
use mur_proto::cluster::{ApiError, ErrorCode, SubmitReply, SubmitRequest};
use mur_proto::ids::TaskId;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// How long a client that submits a task goes on sending it while no coordinator answers
/// (`mur task send`, a fleet run's steps, a detached command's completion): a coordinator
/// restart or a leader failover (one lease, 10 s by default) is over well within it.
pub const SUBMIT_PATIENCE: Duration = Duration::from_secs(30);

/// The first wait before [`submit`] sends again; it doubles up to [`SUBMIT_MAX_DELAY`]
/// ([`crate::backoff`]); [`crate::connect::Options::connect_until`] waits the same.
pub(crate) const SUBMIT_FIRST_DELAY: Duration = Duration::from_millis(250);
/// The longest base wait between two sends of [`submit`].
pub(crate) const SUBMIT_MAX_DELAY: Duration = Duration::from_secs(4);

/// Submits a task, sending it again while no coordinator answers: an `unavailable` error
/// (no coordinator answers, one timed out — a restart or a failover under way — or its
/// broker failed) is sent again with the same task id, after a backoff with jitter
/// ([`crate::backoff`]), for up to `patience` (zero: sent once). The coordinator answers a
/// submission it already stored with the stored task, so the task runs once however often
/// it is sent. `request.task_id` is minted here when the caller left it empty. A
/// coordinator older than the `task_id` field (its refusal carries no
/// [`ApiError::api_version`]) refuses it as unknown: sent again without it. Each send carries the W3C trace context of the current span
/// ([`crate::trace_context`]). `retrying` is told each error that will be retried and the
/// wait before the next send (the CLI says it on stderr).
///
/// # Errors
/// The coordinator's refusal, or the last `unavailable` error once the patience is spent.
pub async fn submit(
    client: &async_nats::Client,
    request: &mut SubmitRequest,
    patience: Duration,
    mut retrying: impl FnMut(&ApiError, Duration),
) -> Result<SubmitReply, ApiError> {
    if request.task_id.is_none() {
        request.task_id = Some(TaskId::generate());
    }
    let give_up = tokio::time::Instant::now() + patience;
    let mut delays = crate::backoff::delays(SUBMIT_FIRST_DELAY, SUBMIT_MAX_DELAY);
    loop {
        let headers = crate::trace_context::headers(&tracing::Span::current());
        let body = serde_json::to_vec(&*request).expect("a submit request serializes");
        match call_with_headers(client, mur_proto::cluster::api::TASK_SUBMIT, headers, body).await {
            Ok(reply) => return Ok(reply),
            Err(e) if e.code == ErrorCode::InvalidRequest && request.task_id.is_some() && e.api_version.is_none() => {
                request.task_id = None;
            }
            Err(e) if e.code == ErrorCode::Unavailable => {
                let delay = delays.next().unwrap_or(SUBMIT_MAX_DELAY);
                if tokio::time::Instant::now() + delay >= give_up {
                    return Err(e);
                }
                retrying(&e, delay);
                tokio::time::sleep(delay).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Sends `body` to the API endpoint `subject` and decodes the reply.
///
/// # Errors
/// The service's [`ApiError`] when it refused the request; an `unavailable` error when no
/// coordinator answers (no responders, or the client's request timeout); an `internal`
/// error when the reply is not the JSON expected.
pub async fn call<T: DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    body: impl Into<Bytes>,
) -> Result<T, ApiError> {
    call_with_headers(client, subject, HeaderMap::new(), body).await
}

/// [`call`] with request headers: the W3C `traceparent` of the caller's span (issue #7
/// §Trace context; see [`crate::trace_context::headers`]). Empty headers send a
/// plain request.
///
/// # Errors
/// As [`call`].
pub async fn call_with_headers<T: DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    headers: HeaderMap,
    body: impl Into<Bytes>,
) -> Result<T, ApiError> {
    let body: Bytes = body.into();
    let size = body.len();
    let sent = if headers.is_empty() {
        client.request(subject.to_string(), body).await
    } else {
        client.request_with_headers(subject.to_string(), headers, body).await
    };
    let reply = sent.map_err(|e| match e.kind() {
        RequestErrorKind::NoResponders => ApiError::no_coordinator(subject),
        RequestErrorKind::TimedOut => {
            ApiError::new(ErrorCode::Unavailable, format!("{subject}: the coordinator did not answer in time"))
        }
        RequestErrorKind::MaxPayloadExceeded => ApiError::invalid(format!(
            "{subject}: request not sent: it is {size} bytes, over this cluster's max_payload of {} bytes \
             (in JSON a text's quotes, backslashes and control characters take two bytes or more each)",
            client.server_info().max_payload
        )),
        RequestErrorKind::InvalidSubject => ApiError::invalid(format!("{subject}: request not sent: {e}")),
        _ => ApiError::new(ErrorCode::Unavailable, format!("{subject}: request failed: {e}")),
    })?;
    decode(subject, &reply)
}

/// Decodes a reply under the scheme above.
///
/// # Errors
/// As [`call`].
pub fn decode<T: DeserializeOwned>(subject: &str, reply: &Message) -> Result<T, ApiError> {
    if let Some(err) = reply_error(reply) {
        return Err(err);
    }
    serde_json::from_slice(&reply.payload)
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("{subject}: unexpected reply: {e}")))
}

/// The error a reply carries, if it has the micro service error headers.
fn reply_error(reply: &Message) -> Option<ApiError> {
    let headers = reply.headers.as_ref()?;
    let status = headers.get(NATS_SERVICE_ERROR_CODE);
    let text = headers.get(NATS_SERVICE_ERROR);
    if status.is_none() && text.is_none() {
        return None;
    }
    if let Ok(err) = serde_json::from_slice::<ApiError>(&reply.payload) {
        return Some(err);
    }
    if let Some(err) = headers.get(MUR_API_ERROR).and_then(|v| serde_json::from_str::<ApiError>(v.as_str()).ok()) {
        return Some(err);
    }
    let code = match status.map(|s| s.as_str().trim()) {
        Some("400") => ErrorCode::InvalidRequest,
        Some("404") => ErrorCode::NotFound,
        Some("409") => ErrorCode::Conflict,
        Some("503") => ErrorCode::Unavailable,
        _ => ErrorCode::Internal,
    };
    Some(ApiError::new(code, text.map_or("service error", |t| t.as_str()).to_string()))
}

/// The longest error text put in the `Nats-Service-Error` header, in bytes (the body keeps
/// the whole message).
const MAX_HEADER_TEXT: usize = 512;

/// The header of a failure reply that carries the whole [`ApiError`] as JSON (one line:
/// JSON escapes line breaks), for replies whose body is empty ([`service_error`]).
pub const MUR_API_ERROR: &str = "Mur-Api-Error";

/// The `Nats-Service-Error` text for `err`: `<code>: <message>` on one line, cut to
/// [`MAX_HEADER_TEXT`] bytes.
fn header_text(err: &ApiError) -> String {
    // Header values cannot hold line breaks.
    let mut text = err.to_string().replace(['\r', '\n'], " ");
    if text.len() > MAX_HEADER_TEXT {
        let mut cut = MAX_HEADER_TEXT;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// `err` as the coordinator answers it: stamped with this build's
/// [`mur_proto::cluster::api::VERSION`], so a client tells the coordinator's API by number.
fn versioned(err: &ApiError) -> ApiError {
    ApiError { api_version: Some(mur_proto::cluster::api::VERSION), ..err.clone() }
}

/// The headers and body of a failure reply for `err` published by hand (not through a
/// micro service endpoint): the error headers, and the [`ApiError`] JSON (versioned) as
/// the body.
pub fn error_reply(err: &ApiError) -> (HeaderMap, Bytes) {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_SERVICE_ERROR, header_text(err).as_str());
    headers.insert(NATS_SERVICE_ERROR_CODE, err.code.status().to_string().as_str());
    let body = serde_json::to_vec(&versioned(err)).expect("an ApiError serializes");
    (headers, Bytes::from(body))
}

/// A micro service endpoint's failure reply for `err`, to pass to async-nats
/// `Request::respond_with_headers(Err(error), headers)`: the service counts it in its
/// stats' `errors` and sets the error headers from `error` (`<code>: <message>`, the
/// status); `headers` carry the whole [`ApiError`] JSON (versioned) in [`MUR_API_ERROR`],
/// since that reply's body is empty.
pub fn service_error(err: &ApiError) -> (async_nats::service::error::Error, HeaderMap) {
    let error = async_nats::service::error::Error { status: header_text(err), code: usize::from(err.code.status()) };
    let mut headers = HeaderMap::new();
    let json = serde_json::to_string(&versioned(err)).expect("an ApiError serializes");
    headers.insert(MUR_API_ERROR, json.as_str());
    (error, headers)
}
