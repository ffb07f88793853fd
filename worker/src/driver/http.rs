//! The HTTP exchange shared by the HTTP drivers: one JSON POST, retried under a [`Policy`],
//! with every attempt logged.
//!
//! - Retried: HTTP 429 and 5xx, connection failures (refused, reset or closed before a
//!   response, a failed body read), per-attempt timeouts, and whatever a driver's body
//!   reader marks retryable ([`Failed::retry`]): for a streamed reply, a stream that
//!   breaks, stalls ([`Policy::idle_timeout`]), ends early or carries a malformed chunk
//!   or a transient in-stream error (issue #28 item 2). Nothing of a failed attempt is
//!   kept, so the whole call is sent again. Not retried: other 4xx, requests that cannot
//!   be built, a body past the SSE decoder's limits, and a non-streamed body that is not
//!   JSON.
//! - The wait before a retry is the server's `Retry-After` (or `retry-after-ms`) when it
//!   sends one, else exponential backoff with full jitter (see [`backoff`]).
//! - Every attempt is recorded as an [`Attempt`]; the caller gets the log with the value
//!   ([`Exchange`]) or with the last error ([`Failure`]).
//! - [`Policy::timeout`] bounds a whole attempt: request, status, headers and the body
//!   read, streamed or not.
//! - An error status's body is parsed as a provider error object ([`ProviderError`]), the
//!   same way for both providers.
//! - [`post_json`] reads and parses the whole body inside the attempt; [`post_read`] reads
//!   a 2xx body with the caller's reader, inside the attempt too. [`post_json_bytes`] takes
//!   a body already serialised; every form serialises at most once, whatever the number of
//!   attempts.
//!
//! The pure parts ([`backoff`], [`next_delay`], [`parse_retry_after`], [`retry_after`],
//! [`retryable_status`]) take their clock and randomness as arguments and are unit-tested
//! without IO.

use super::{Error, ProviderError};
use bytes::Bytes;
use reqwest::header::HeaderMap;
use serde_json::Value;
use std::time::{Duration, Instant, SystemTime};

/// The process's one HTTP client, shared by every driver: a `reqwest::Client` holds a
/// connection pool and loads the system's root certificates when built, which costs
/// milliseconds of CPU (issue #9: per-session clients held the slow-model benchmark at
/// about half its ideal). Cloning it is cheap and shares the pool.
pub fn shared_client() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            mur_nats::tls::install_crypto_provider();
            reqwest::Client::new()
        })
        .clone()
}

/// How long a `Retry-After` longer than [`Policy::max_delay`] may still make us wait.
pub const RETRY_AFTER_CAP: Duration = Duration::from_secs(60);

/// How many bytes of an error body are kept in [`Error::Status`].
const ERROR_BODY_LIMIT: usize = 2048;

/// Retry and timeout settings of an exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Retries after the first attempt; at most `1 + max_retries` attempts are made.
    /// Default 3.
    pub max_retries: u32,
    /// Time allowed for one attempt: sending the request, receiving the status and
    /// headers, and reading the whole body, streamed or not (`inference.timeout_secs`).
    /// Default 300 s.
    pub timeout: Duration,
    /// Longest silence allowed between two pieces of a streamed body
    /// (`inference.idle_timeout_secs`). Default 300 s.
    pub idle_timeout: Duration,
    /// Backoff ceiling before the first retry; it doubles with each further retry.
    /// Default 500 ms.
    pub base_delay: Duration,
    /// Upper bound of the backoff, and of a server's `Retry-After` (see [`next_delay`]).
    /// Default 30 s.
    pub max_delay: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            max_retries: 3,
            timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(300),
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
        }
    }
}

/// One attempt of an exchange, as the caller may record it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// 1-based attempt number.
    pub number: u32,
    /// The HTTP status, when a response came.
    pub status: Option<u16>,
    /// Why the attempt failed (the [`Error`]'s message); `None` when it succeeded.
    pub error: Option<String>,
    /// Milliseconds waited before this attempt (0 for the first).
    pub waited_ms: u64,
    /// Milliseconds the attempt itself took, waiting excluded.
    pub duration_ms: u64,
}

/// A successful exchange: the value and the log of every attempt (the last one succeeded).
#[derive(Debug)]
pub struct Exchange<T> {
    /// What the exchange produced.
    pub value: T,
    /// Every attempt, in order.
    pub attempts: Vec<Attempt>,
}

/// A failed exchange: the last attempt's error and the log of every attempt.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Failure {
    /// Why the last attempt failed. An [`Error::Status`] carries the provider's error body.
    pub error: Error,
    /// Every attempt, in order.
    pub attempts: Vec<Attempt>,
}

impl From<Failure> for Error {
    fn from(failure: Failure) -> Self {
        failure.error
    }
}

/// Whether a failed read of a 2xx reply is worth sending the call again: a broken,
/// stalled or timed-out body, a provider error its type marks transient
/// ([`ProviderError::is_transient`]), and, for a stream, a malformed or truncated one
/// (`streamed`). A reply past the SSE limits is not retried (it would be sent again).
pub fn retryable(error: &Error, streamed: bool) -> bool {
    match error {
        Error::Transport(_) | Error::Timeout(_) | Error::Idle(_) => true,
        Error::Provider(e) => e.is_transient(),
        Error::Protocol(_) => streamed,
        Error::Status { .. } | Error::Limit(_) | Error::Process(_) | Error::Script(_) => false,
    }
}

/// Whether an HTTP status is worth retrying: 429 (rate limited) and every 5xx (including
/// Anthropic's 529 "overloaded"). Other statuses are final.
pub fn retryable_status(status: u16) -> bool {
    status == 429 || (500..=599).contains(&status)
}

/// The full-jitter backoff before retry number `retry` (1-based): a uniform pick in
/// `[0, min(max_delay, base_delay * 2^(retry-1)))`, where `unit` is the random pick in
/// `[0, 1)` (clamped into it). Pure: the caller injects the random source.
pub fn backoff(policy: &Policy, retry: u32, unit: f64) -> Duration {
    let factor = 1u32.checked_shl(retry.saturating_sub(1)).unwrap_or(u32::MAX);
    let ceiling = policy.base_delay.saturating_mul(factor).min(policy.max_delay);
    ceiling.mul_f64(unit.clamp(0.0, 1.0))
}

/// The wait before retry number `retry` (1-based): the server's `retry_after` when given,
/// else [`backoff`]. A `retry_after` above [`Policy::max_delay`] is still honoured, up to
/// [`RETRY_AFTER_CAP`] (or `max_delay` if that is larger).
pub fn next_delay(policy: &Policy, retry: u32, retry_after: Option<Duration>, unit: f64) -> Duration {
    match retry_after {
        Some(wait) => wait.min(policy.max_delay.max(RETRY_AFTER_CAP)),
        None => backoff(policy, retry, unit),
    }
}

/// Parses a `Retry-After` value (RFC 9110 §10.2.3): delay-seconds, or an HTTP date which
/// is turned into the time left after `now` (zero if it has passed). `None` when the value
/// is neither.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The wait a response asks for: `retry-after-ms` (milliseconds, sent by OpenAI and
/// Anthropic and honoured by their SDKs) when valid, else `Retry-After` via
/// [`parse_retry_after`].
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let ms = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms >= 0.0);
    if let Some(ms) = ms {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    headers.get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| parse_retry_after(v, now))
}

/// POSTs `body` as JSON and returns the parsed JSON of a 2xx response, retrying under
/// `policy`. The attempt's timeout covers the body read, and a failed read is retried.
///
/// Cancel-safe: the future owns the request and spawns nothing, so dropping it (say, in a
/// `select!` or on shutdown) closes the connection and stops any wait between attempts.
///
/// # Errors
/// A [`Failure`] with the last attempt's error: [`Error::Status`] (with the provider's
/// error body) on a non-2xx status, [`Error::Transport`] when the connection failed,
/// [`Error::Timeout`] when the attempt ran out of time, [`Error::Protocol`] when a 2xx body
/// is not JSON (not retried).
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, String)],
    body: &Value,
    policy: &Policy,
) -> Result<Exchange<Value>, Failure> {
    post_json_bytes(client, url, headers, json_bytes(body), policy).await
}

/// As [`post_json`], with the body already serialised (JSON text, sent as is with
/// `Content-Type: application/json`); retries resend the same bytes.
///
/// # Errors
/// As [`post_json`].
pub async fn post_json_bytes(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, String)],
    body: Bytes,
    policy: &Policy,
) -> Result<Exchange<Value>, Failure> {
    exchange(client, url, headers, &body, policy, read_json).await
}

/// POSTs `body` (JSON text) and reads a 2xx response with `read`, inside the attempt:
/// [`Policy::timeout`] covers the read, and a read that fails with a retryable [`Failed`]
/// sends the whole request again, as a failed status would.
///
/// Cancel-safe, as [`post_json`].
///
/// # Errors
/// As [`post_json`], with `read`'s errors in place of the JSON parse.
pub async fn post_read<T, R, F>(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, String)],
    body: Bytes,
    policy: &Policy,
    read: R,
) -> Result<Exchange<T>, Failure>
where
    R: Fn(reqwest::Response) -> F,
    F: Future<Output = Result<T, Failed>>,
{
    exchange(client, url, headers, &body, policy, read).await
}

/// The JSON text of `value` (serialised once, however many attempts send it).
fn json_bytes(value: &Value) -> Bytes {
    Bytes::from(value.to_string())
}

/// A failed attempt, classified: what [`post_read`]'s reader returns.
#[derive(Debug)]
pub struct Failed {
    /// Why the attempt failed.
    pub error: Error,
    /// The HTTP status, when a response came.
    pub status: Option<u16>,
    /// Whether the call may be sent again.
    pub retry: bool,
    /// The wait the server asked for, if it did.
    pub retry_after: Option<Duration>,
}

impl Failed {
    /// A failure of the attempt after a 2xx `status`: retried when `retry`.
    pub fn after(status: u16, error: Error, retry: bool) -> Self {
        Failed { error, status: Some(status), retry, retry_after: None }
    }

    fn transport(error: &reqwest::Error, status: Option<u16>) -> Self {
        Failed {
            error: Error::Transport(describe(error)),
            status,
            // A request that cannot be built (a bad header value, say) fails the same way
            // every time.
            retry: !(error.is_builder() || error.is_redirect()),
            retry_after: None,
        }
    }
}

/// The retry loop. `read` takes a 2xx response inside the attempt (and its timeout).
async fn exchange<T, R, F>(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, String)],
    body: &Bytes,
    policy: &Policy,
    read: R,
) -> Result<Exchange<T>, Failure>
where
    R: Fn(reqwest::Response) -> F,
    F: Future<Output = Result<T, Failed>>,
{
    let mut attempts = Vec::new();
    let mut waited = Duration::ZERO;
    let mut number: u32 = 0;
    loop {
        number = number.saturating_add(1);
        let start = Instant::now();
        let outcome = tokio::time::timeout(policy.timeout, async {
            let resp = send(client, url, headers, body).await?;
            let status = resp.status().as_u16();
            Ok((status, read(resp).await?))
        })
        .await
        .unwrap_or_else(|_| {
            Err(Failed {
                error: Error::Timeout(super::sse::ceil_secs(policy.timeout)),
                status: None,
                retry: true,
                retry_after: None,
            })
        });
        let mut record = Attempt {
            number,
            status: None,
            error: None,
            waited_ms: millis(waited),
            duration_ms: millis(start.elapsed()),
        };
        match outcome {
            Ok((status, value)) => {
                record.status = Some(status);
                attempts.push(record);
                return Ok(Exchange { value, attempts });
            }
            Err(failed) => {
                record.status = failed.status;
                record.error = Some(failed.error.to_string());
                attempts.push(record);
                if !failed.retry || number > policy.max_retries {
                    return Err(Failure { error: failed.error, attempts });
                }
                waited = next_delay(policy, number, failed.retry_after, fastrand::f64());
                tracing::warn!(
                    attempt = number,
                    error = %failed.error,
                    wait_ms = millis(waited),
                    "model call failed, retrying"
                );
                tokio::time::sleep(waited).await;
            }
        }
    }
}

/// Sends the request and returns a 2xx response; any other status is a [`Failed`] with the
/// error body read.
async fn send(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, String)],
    body: &Bytes,
) -> Result<reqwest::Response, Failed> {
    let mut req = client.post(url).header(reqwest::header::CONTENT_TYPE, "application/json").body(body.clone());
    for (name, value) in headers {
        req = req.header(*name, value);
    }
    let resp = req.send().await.map_err(|e| Failed::transport(&e, None))?;
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status().as_u16();
    let retry_after = retry_after(resp.headers(), SystemTime::now());
    // The status is the news; a body that cannot be read only loses the details.
    let text = resp.text().await.unwrap_or_default();
    let provider = ProviderError::from_body(&text).map(Box::new);
    let body = match &provider {
        Some(error) => truncate(&error.to_string(), ERROR_BODY_LIMIT),
        None => truncate(&text, ERROR_BODY_LIMIT),
    };
    Err(Failed {
        error: Error::Status { status, body, provider },
        status: Some(status),
        retry: retryable_status(status),
        retry_after,
    })
}

/// Reads a 2xx body as JSON. A failed read is retried; a body that is not JSON is not.
async fn read_json(resp: reqwest::Response) -> Result<Value, Failed> {
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.map_err(|e| Failed::transport(&e, Some(status)))?;
    serde_json::from_slice(&bytes).map_err(|e| Failed {
        error: Error::Protocol(format!(
            "response body is not JSON ({e}): {}",
            truncate(&String::from_utf8_lossy(&bytes), ERROR_BODY_LIMIT)
        )),
        status: Some(status),
        retry: false,
        retry_after: None,
    })
}

/// An error and its sources, joined with `: ` (reqwest's own message omits the cause,
/// such as "connection refused").
fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The first `limit` bytes of `text`, cut at a character boundary.
pub(crate) fn truncate(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn policy(base_ms: u64, max_ms: u64) -> Policy {
        Policy {
            base_delay: Duration::from_millis(base_ms),
            max_delay: Duration::from_millis(max_ms),
            ..Policy::default()
        }
    }

    #[test]
    fn default_policy_matches_the_documented_values() {
        let p = Policy::default();
        assert_eq!(p.max_retries, 3);
        assert_eq!(p.timeout, Duration::from_secs(300));
        assert_eq!(p.idle_timeout, Duration::from_secs(300));
        assert_eq!(p.base_delay, Duration::from_millis(500));
        assert_eq!(p.max_delay, Duration::from_secs(30));
    }

    #[test]
    fn backoff_doubles_up_to_max_delay_and_scales_with_the_random_pick() {
        let p = policy(500, 30_000);
        let ceilings: Vec<u128> = (1..=8).map(|r| backoff(&p, r, 1.0).as_millis()).collect();
        assert_eq!(ceilings, [500, 1000, 2000, 4000, 8000, 16_000, 30_000, 30_000]);
        assert_eq!(backoff(&p, 3, 0.0), Duration::ZERO);
        assert_eq!(backoff(&p, 3, 0.25), Duration::from_millis(500));
        // Out-of-range picks are clamped; huge retry numbers do not overflow.
        assert_eq!(backoff(&p, 1, 7.0), Duration::from_millis(500));
        assert_eq!(backoff(&p, 1, -1.0), Duration::ZERO);
        assert_eq!(backoff(&p, u32::MAX, 1.0), Duration::from_secs(30));
    }

    #[test]
    fn backoff_is_full_jitter_over_a_seeded_source() {
        let p = policy(100, 10_000);
        let mut rng = fastrand::Rng::with_seed(7);
        let picks: Vec<Duration> = (0..200).map(|_| backoff(&p, 4, rng.f64())).collect();
        assert!(picks.iter().all(|d| *d < Duration::from_millis(800)));
        // Full jitter spreads over the whole range, not just near the ceiling.
        assert!(picks.iter().any(|d| *d < Duration::from_millis(100)));
        assert!(picks.iter().any(|d| *d > Duration::from_millis(700)));
        let mut again = fastrand::Rng::with_seed(7);
        let replay: Vec<Duration> = (0..200).map(|_| backoff(&p, 4, again.f64())).collect();
        assert_eq!(picks, replay);
    }

    #[test]
    fn retry_after_wins_over_backoff_and_is_capped_at_sixty_seconds() {
        let p = policy(500, 30_000);
        let secs = Duration::from_secs;
        assert_eq!(next_delay(&p, 1, Some(secs(1)), 0.9), secs(1));
        assert_eq!(next_delay(&p, 1, Some(secs(0)), 0.9), secs(0));
        // Above max_delay it is still honoured, up to 60 s.
        assert_eq!(next_delay(&p, 1, Some(secs(45)), 0.9), secs(45));
        assert_eq!(next_delay(&p, 1, Some(secs(3600)), 0.9), secs(60));
        // A max_delay above 60 s is the cap then.
        let long = policy(500, 120_000);
        assert_eq!(next_delay(&long, 1, Some(secs(90)), 0.9), secs(90));
        assert_eq!(next_delay(&p, 2, None, 0.5), Duration::from_millis(500));
    }

    #[test]
    fn retry_after_parses_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(parse_retry_after("1", now), Some(Duration::from_secs(1)));
        assert_eq!(parse_retry_after(" 120 ", now), Some(Duration::from_secs(120)));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:50:07 GMT", now), Some(Duration::from_secs(30)));
        // A date in the past means "now".
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("-1", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("", now), None);
    }

    #[test]
    fn retry_after_ms_header_takes_precedence() {
        let now = SystemTime::UNIX_EPOCH;
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h, now), None);
        h.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(2)));
        h.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after(&h, now), Some(Duration::from_millis(250)));
        h.insert("retry-after-ms", HeaderValue::from_static("garbage"));
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(2)));
    }

    #[test]
    fn only_rate_limits_and_server_errors_are_retryable_statuses() {
        for s in [429, 500, 502, 503, 504, 529, 599] {
            assert!(retryable_status(s), "{s}");
        }
        for s in [200, 301, 400, 401, 403, 404, 408, 409, 413, 422, 600] {
            assert!(!retryable_status(s), "{s}");
        }
    }

    #[test]
    fn error_bodies_are_truncated_at_a_char_boundary() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("héllo", 3), "hé");
        assert_eq!(truncate("abc", 10), "abc");
    }

    #[test]
    fn timeouts_round_up_to_whole_seconds() {
        use crate::driver::sse::ceil_secs;
        assert_eq!(ceil_secs(Duration::from_millis(200)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(300)), 300);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
    }
}
