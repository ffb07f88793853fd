//! `mur health URL` (issue #32 §Health): asks a process's `/readyz` or `/healthz` (the
//! `--metrics` listener of `mur coordinator`, `mur worker`, `mur dev`) and exits 0 when it
//! answers 2xx, 1 when it answers anything else or does not answer within the timeout, 2
//! when the URL is not one to ask. For health checks in images that have no `curl`
//! (`deploy/docker-compose.yml`).
//!
//! Without `--json` it says `ready` or `not ready: …` (with the answer's body) on stderr;
//! with `--json`, one JSON object on stdout: `{"url", "ready", "status", "body"}`, with
//! `error` instead of `status` and `body` when nothing answered. The URL is printed without
//! its user, password or query.

use anyhow::Result;
use serde_json::{Value, json};
use std::process::ExitCode;
use std::time::Duration;

/// `mur health URL [--timeout-secs N] [--json]`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The endpoint to ask, e.g. `http://127.0.0.1:9464/readyz`.
    url: String,
    /// Seconds to wait for the whole answer.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    timeout_secs: u64,
    /// Print the answer as one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// The URL as printed: scheme, host, port and path (no user, password or query).
fn shown(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.set_query(None);
    shown.set_fragment(None);
    shown.to_string()
}

/// Runs `mur health`.
///
/// # Errors
/// The runtime or the HTTP client cannot be built.
pub fn run(args: Args) -> Result<ExitCode> {
    let url = match reqwest::Url::parse(args.url.trim()) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.has_host() => u,
        Ok(_) => {
            let message = "URL: must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:9464/readyz";
            return Ok(crate::refused(args.json, None, "mur health: ", message));
        }
        Err(e) => {
            let message = format!("URL: {e} (e.g. http://127.0.0.1:9464/readyz)");
            return Ok(crate::refused(args.json, None, "mur health: ", &message));
        }
    };
    let mut client = reqwest::Client::builder().timeout(Duration::from_secs(args.timeout_secs));
    if url.scheme() == "http" {
        // No roots to load for plain HTTP: the nats and prometheus images have no CA
        // certificates, and loading none is an error.
        client = client.tls_certs_only([]);
    }
    let client = client.build()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let answer = runtime.block_on(async {
        let response = client.get(url.clone()).send().await?;
        let status = response.status();
        let body = response.text().await?;
        Ok::<_, reqwest::Error>((status, body))
    });
    let shown = shown(&url);
    let (ready, report) = match answer {
        Ok((status, body)) => {
            let ready = status.is_success();
            let parsed = serde_json::from_str::<Value>(&body).unwrap_or_else(|_| Value::String(body.trim().into()));
            (ready, json!({"url": shown, "ready": ready, "status": status.as_u16(), "body": parsed}))
        }
        // Without the URL: reqwest's message repeats it whole.
        Err(e) => (false, json!({"url": shown, "ready": false, "error": reason(&e.without_url())})),
    };
    if args.json {
        println!("{report}");
    } else if ready {
        eprintln!("ready: {shown} answered {}", report["status"]);
    } else if let Some(error) = report["error"].as_str() {
        eprintln!("mur health: not ready: {shown}: {}", crate::text::printable(error));
    } else {
        let body = match &report["body"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        eprintln!("mur health: not ready: {shown} answered {}: {}", report["status"], crate::text::printable(&body));
    }
    Ok(if ready { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// What went wrong, with its causes (`error sending request: … : Connection refused`).
fn reason(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}
