//! Bearer authentication of an A2A endpoint (issue #31 §A2A endpoints authenticate): who
//! may call it ([`Guard`]), the refusals as HTTP and JSON-RPC say them, and the security
//! scheme its agent card declares ([`bearer_card`]).
//!
//! A request carries `Authorization: Bearer <token>` (RFC 6750 §2.1). The [`Guard`] first
//! authenticates it, before its body is read: no token, a header that is not `Bearer …`,
//! or a token the keyring does not know (never made, or revoked) is HTTP 401 with
//! `WWW-Authenticate: Bearer realm="murmur"` and a JSON-RPC error -32031 whose message
//! says which of those it was (1.0 §3.3.2: authentication errors name the scheme
//! required). Then, once the method is known, it authorizes: a token for other capsules,
//! or a read-only token sending or cancelling, is HTTP 403 (`error="insufficient_scope"`)
//! with -32032 naming the rule. No message repeats the token presented.
//!
//! Modes: [`Mode::Required`] checks every request; [`Mode::WhenTokens`] (a loopback
//! address with nothing configured: `mur dev`, a local coordinator) lets requests through
//! while the keyring is empty and checks them from the first token made; [`Mode::Off`]
//! (`--insecure-no-auth`, or `mur run` on loopback without `--token-file`) checks nothing
//! and the card declares no scheme.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use mur_nats::tokens::Keyring;
use mur_proto::cluster::{Access, TokenRecord};
use serde_json::{Value, json};

use crate::jsonrpc::{self, RpcError};

/// JSON-RPC code of a request without a valid token (murmur's own, in the server-error
/// range A2A leaves to implementations; A2A names HTTP 401 with "JSON-RPC custom error").
pub const UNAUTHENTICATED: i64 = -32031;
/// JSON-RPC code of a token that may not do what the request asks (HTTP 403).
pub const PERMISSION_DENIED: i64 = -32032;

/// The name of the security scheme in the card (`securitySchemes` key).
pub const SCHEME_NAME: &str = "bearer";

/// When a [`Guard`] checks tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Nothing is checked (`--insecure-no-auth`; `mur run` on loopback without a token).
    Off,
    /// Checked once the keyring holds a token; open while it is empty (loopback, nothing
    /// configured).
    WhenTokens,
    /// Every request needs a token.
    Required,
}

/// Who may call an endpoint: a mode and the tokens it accepts. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Guard {
    mode: Mode,
    keyring: Keyring,
}

/// A request refused: its HTTP status and the JSON-RPC error to answer with.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// 401 or 403.
    pub status: StatusCode,
    /// -32031 or -32032, and what failed.
    pub error: RpcError,
}

impl Refusal {
    fn unauthenticated(what: &str) -> Refusal {
        Refusal {
            status: StatusCode::UNAUTHORIZED,
            error: RpcError::new(UNAUTHENTICATED, format!("unauthenticated: {what}")),
        }
    }

    fn denied(what: impl std::fmt::Display) -> Refusal {
        Refusal { status: StatusCode::FORBIDDEN, error: RpcError::new(PERMISSION_DENIED, format!("forbidden: {what}")) }
    }

    /// The HTTP response: the status, `WWW-Authenticate` (RFC 6750 §3), and the JSON-RPC
    /// error answering request `id` (null when the body was not read).
    pub fn response(&self, id: &Value) -> Response {
        let challenge = if self.status == StatusCode::FORBIDDEN {
            "Bearer realm=\"murmur\", error=\"insufficient_scope\""
        } else if self.error.message.contains("no bearer token") {
            "Bearer realm=\"murmur\""
        } else {
            "Bearer realm=\"murmur\", error=\"invalid_token\""
        };
        let mut response = (self.status, Json(jsonrpc::failure(id, &self.error))).into_response();
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
        response
    }
}

impl Guard {
    /// A guard checking nothing.
    pub fn off() -> Guard {
        Guard { mode: Mode::Off, keyring: Keyring::new() }
    }

    /// A guard in `mode` over `keyring`.
    pub fn new(mode: Mode, keyring: Keyring) -> Guard {
        Guard { mode, keyring }
    }

    /// Its mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether a request needs a token now.
    pub fn checks(&self) -> bool {
        match self.mode {
            Mode::Off => false,
            Mode::WhenTokens => !self.keyring.is_empty(),
            Mode::Required => true,
        }
    }

    /// Authenticates a request by its headers: the token's record, or `None` when nothing
    /// is checked.
    ///
    /// # Errors
    /// A [`Refusal`] (401): no token, a malformed `Authorization`, an unknown or revoked
    /// token.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Option<TokenRecord>, Refusal> {
        if !self.checks() {
            return Ok(None);
        }
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(Refusal::unauthenticated(
                "no bearer token: send `Authorization: Bearer <token>` (`mur task send --token-file FILE` or \
                 MUR_A2A_TOKEN; an operator makes tokens with `mur auth token create NAME`)",
            ));
        };
        let text = value.to_str().unwrap_or_default().trim();
        let token = match text.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() => token.trim(),
            _ => return Err(Refusal::unauthenticated("the Authorization header is not `Bearer <token>`")),
        };
        self.keyring.check(token).map(Some).ok_or_else(|| Refusal::unauthenticated("unknown or revoked token"))
    }

    /// Whether `grant` (from [`Guard::authenticate`]) may do `access` on `capsule` (`None`:
    /// the whole cluster).
    ///
    /// # Errors
    /// A [`Refusal`] (403) naming the rule.
    pub fn authorize(grant: Option<&TokenRecord>, capsule: Option<&str>, access: Access) -> Result<(), Refusal> {
        match grant {
            None => Ok(()),
            Some(grant) => grant.allows(capsule, access).map_err(Refusal::denied),
        }
    }

    /// [`Guard::authenticate`] then [`Guard::authorize`]: the token's record, if checked.
    ///
    /// # Errors
    /// The first [`Refusal`].
    pub fn admit(
        &self,
        headers: &HeaderMap,
        capsule: Option<&str>,
        access: Access,
    ) -> Result<Option<TokenRecord>, Refusal> {
        let grant = self.authenticate(headers)?;
        Guard::authorize(grant.as_ref(), capsule, access)?;
        Ok(grant)
    }
}

/// `card` declaring the bearer scheme, in both shapes served: 1.0's `securitySchemes`
/// (`{"bearer": {"httpAuthSecurityScheme": {"scheme": "Bearer"}}}`, the proto's JSON) and
/// `securityRequirements` (`[{"schemes": {"bearer": {"list": []}}}]`), and 0.3's fields as
/// the official Python SDK's `agent_card_to_dict` adds them for older clients — the same
/// scheme object carrying `type: "http"` and `scheme` at its top, and `security:
/// [{"bearer": []}]`.
pub fn bearer_card(mut card: crate::card::AgentCard) -> crate::card::AgentCard {
    let description = "A murmur A2A token (`mur auth token create`) in `Authorization: Bearer <token>`";
    card.security_schemes = Some(json!({
        SCHEME_NAME: {
            "httpAuthSecurityScheme": { "scheme": "Bearer", "description": description },
            "type": "http",
            "scheme": "Bearer",
            "description": description,
        }
    }));
    card.security_requirements = Some(json!([{ "schemes": { SCHEME_NAME: { "list": [] } } }]));
    card.security = Some(json!([{ SCHEME_NAME: [] }]));
    card
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn a_required_guard_tells_a_missing_a_malformed_and_an_unknown_token_apart() {
        let token = mur_nats::tokens::generate().unwrap();
        let guard = Guard::new(Mode::Required, Keyring::of_token("local", &token));
        let said = |auth: Option<&str>| guard.authenticate(&headers(auth)).unwrap_err().error.message;
        assert!(said(None).contains("no bearer token"));
        assert!(said(Some("Basic abc")).contains("not `Bearer <token>`"));
        let wrong = said(Some("Bearer mur_0000"));
        assert!(wrong.contains("unknown or revoked token") && !wrong.contains("mur_0000"), "{wrong}");
        let ok = guard.authenticate(&headers(Some(&format!("bearer {token}")))).unwrap();
        assert_eq!(ok.map(|g| g.name), Some("local".to_string()));
    }

    #[test]
    fn a_loopback_guard_is_open_until_a_token_exists_and_off_checks_nothing() {
        let keyring = Keyring::new();
        let guard = Guard::new(Mode::WhenTokens, keyring.clone());
        assert_eq!(guard.authenticate(&headers(None)), Ok(None));
        let token = mur_nats::tokens::generate().unwrap();
        keyring.insert(Keyring::of_token("x", &token).check(&token).unwrap());
        assert!(guard.authenticate(&headers(None)).is_err());
        assert_eq!(Guard::off().authenticate(&headers(None)), Ok(None));
    }

    #[test]
    fn a_refusal_is_a_401_with_a_challenge_and_a_json_rpc_error() {
        let refusal = Refusal::unauthenticated("unknown or revoked token");
        let response = refusal.response(&Value::Null);
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        let challenge = response.headers().get(header::WWW_AUTHENTICATE).unwrap().to_str().unwrap();
        assert!(challenge.starts_with("Bearer "), "{challenge}");
        let denied = Refusal::denied("token \"a\" is not valid for capsule \"b\"").response(&json!(1));
        assert_eq!(denied.status(), StatusCode::FORBIDDEN);
    }
}
