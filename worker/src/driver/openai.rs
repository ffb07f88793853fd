//! The `openai` driver: chat completions against any OpenAI-compatible server.

use super::{Driver, Error, ModelRequest, ModelResponse};
use async_trait::async_trait;

/// Settings of the `openai` driver, from the manifest's `inference:` block.
#[derive(Clone, Debug)]
pub struct Config {
    /// Base URL up to and including `/v1`.
    pub endpoint: String,
    /// Bearer token.
    pub api_key: Option<String>,
    /// Use SSE streaming.
    pub stream: bool,
}

/// The driver.
pub struct OpenAi {
    config: Config,
    client: reqwest::Client,
}

impl OpenAi {
    /// A driver for `config`.
    pub fn new(config: Config) -> Self {
        OpenAi { config, client: reqwest::Client::new() }
    }
}

#[async_trait]
impl Driver for OpenAi {
    fn kind(&self) -> &'static str {
        "openai"
    }

    async fn call(&self, _request: &ModelRequest<'_>) -> Result<ModelResponse, Error> {
        let _ = (&self.config, &self.client);
        Err(Error::Protocol("openai driver not implemented yet".into()))
    }
}
