//! The HTTP exchange shared by the HTTP drivers: one JSON POST and its response.
//! (Retries, backoff and timeouts belong here: issue #3.)

use super::Error;
use serde_json::Value;

/// POSTs `body` to `url` with `headers` and returns the successful response.
///
/// # Errors
/// [`Error::Status`] on a non-2xx status, [`Error::Transport`] when the connection fails.
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, String)],
    body: &Value,
) -> Result<reqwest::Response, Error> {
    let mut req = client.post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req.send().await.map_err(|e| Error::Transport(e.to_string()))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        let body: String = body.chars().take(2048).collect();
        return Err(Error::Status { status: status.as_u16(), body });
    }
    Ok(resp)
}
