//! The agent card served at `/.well-known/agent-card.json`.
//!
//! Fields are the 1.0 `AgentCard` (§4.4.1 of the specification; `specification/a2a.proto`):
//! `supportedInterfaces` lists the JSON-RPC endpoint twice, once per protocol version it
//! serves (§3.6.2 lets one URL serve several). Like the official Python SDK's
//! `agent_card_to_dict`, the card also carries the 0.3 top-level fields (`url`,
//! `preferredTransport`, `protocolVersion` from the first interface, `additionalInterfaces`)
//! so 0.3 clients can read it.

use serde::{Deserialize, Serialize};

use mur_proto::Manifest;

/// The protocol binding the endpoint speaks (`AgentInterface.protocolBinding`).
pub const JSONRPC_BINDING: &str = "JSONRPC";

/// What the card says about the capsule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentInfo {
    /// The capsule's name.
    pub name: String,
    /// One line on what it does.
    pub description: String,
    /// The capsule's version.
    pub version: String,
    /// The endpoint URL to advertise; `None` = `http://<bound address>/`.
    pub url: Option<String>,
}

impl AgentInfo {
    /// Name, description and version from the manifest; the URL from the listener.
    pub fn from_manifest(manifest: &Manifest) -> AgentInfo {
        AgentInfo {
            name: manifest.name.clone(),
            description: manifest.description.clone().unwrap_or_else(|| format!("murmur capsule {}", manifest.name)),
            version: manifest.version.clone(),
            url: None,
        }
    }
}

/// `AgentInterface` (§4.4.6 of 1.0).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentInterface {
    /// Where the interface is.
    pub url: String,
    /// `JSONRPC`, `GRPC` or `HTTP+JSON`.
    pub protocol_binding: String,
    /// `Major.Minor` served at this interface.
    pub protocol_version: String,
}

/// `AgentCapabilities`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentCapabilities {
    /// Streaming responses (`SendStreamingMessage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streaming: Option<bool>,
    /// Push notifications.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push_notifications: Option<bool>,
}

/// `AgentSkill`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentSkill {
    /// Unique id.
    pub id: String,
    /// Human-readable name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// Keywords.
    pub tags: Vec<String>,
}

/// A 0.3 `AgentInterface` (`{url, transport}`), for `additionalInterfaces`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegacyInterface {
    /// Where the interface is.
    pub url: String,
    /// The transport.
    pub transport: String,
}

/// The agent card.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentCard {
    /// The capsule's name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// Ordered interfaces, the first preferred.
    pub supported_interfaces: Vec<AgentInterface>,
    /// The capsule's version.
    pub version: String,
    /// What the agent supports.
    pub capabilities: AgentCapabilities,
    /// Media types taken.
    pub default_input_modes: Vec<String>,
    /// Media types produced.
    pub default_output_modes: Vec<String>,
    /// What it can do.
    pub skills: Vec<AgentSkill>,
    /// 0.3: the preferred endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// 0.3: the transport at `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_transport: Option<String>,
    /// 0.3: the protocol version (of the first interface, as the official SDK fills it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<String>,
    /// 0.3: the other interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_interfaces: Vec<LegacyInterface>,
    /// The security schemes (1.0 `securitySchemes`, with the 0.3 fields in each scheme;
    /// [`crate::auth::bearer_card`]); absent when the endpoint checks nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_schemes: Option<serde_json::Value>,
    /// 1.0 `securityRequirements`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_requirements: Option<serde_json::Value>,
    /// 0.3 `security`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security: Option<serde_json::Value>,
}

impl AgentCard {
    /// The first interface speaking `binding` at `version`.
    pub fn interface(&self, binding: &str, version: &str) -> Option<&AgentInterface> {
        self.supported_interfaces.iter().find(|i| i.protocol_binding == binding && i.protocol_version == version)
    }
}

/// The card for a capsule whose JSON-RPC endpoint is `url`: 1.0 preferred, 0.3 also
/// served; streaming, no push notifications; text in and out; one generic skill.
pub fn agent_card(info: &AgentInfo, url: &str) -> AgentCard {
    let interface = |version: &str| AgentInterface {
        url: url.to_string(),
        protocol_binding: JSONRPC_BINDING.to_string(),
        protocol_version: version.to_string(),
    };
    AgentCard {
        name: info.name.clone(),
        description: info.description.clone(),
        supported_interfaces: vec![interface(super::VERSION_1_0), interface(super::VERSION_0_3)],
        version: info.version.clone(),
        capabilities: AgentCapabilities { streaming: Some(true), push_notifications: Some(false) },
        default_input_modes: vec!["text/plain".to_string()],
        default_output_modes: vec!["text/plain".to_string()],
        skills: vec![AgentSkill {
            id: "task".to_string(),
            name: "Run a task".to_string(),
            description: format!(
                "Runs the text of a message as a task of the {} capsule and answers with its result",
                info.name
            ),
            tags: vec!["task".to_string(), "murmur".to_string()],
        }],
        url: Some(url.to_string()),
        preferred_transport: Some(JSONRPC_BINDING.to_string()),
        protocol_version: Some(super::VERSION_1_0.to_string()),
        additional_interfaces: vec![LegacyInterface { url: url.to_string(), transport: JSONRPC_BINDING.to_string() }],
        security_schemes: None,
        security_requirements: None,
        security: None,
    }
}
