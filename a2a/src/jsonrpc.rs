//! JSON-RPC 2.0 framing for the A2A binding: the request envelope, response objects and the
//! error codes of A2A 1.0 §9.5 (standard codes) and §5.4 (A2A codes -32001…-32009), which
//! the 0.3 binding shares.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Invalid JSON was received (`JSONParseError`).
pub const PARSE_ERROR: i64 = -32700;
/// The JSON is not a valid request object (`InvalidRequestError`).
pub const INVALID_REQUEST: i64 = -32600;
/// The method does not exist or is not available (`MethodNotFoundError`); also every send
/// to a capsule with `task_acceptance: none` (the runtime reference, §5, L2).
pub const METHOD_NOT_FOUND: i64 = -32601;
/// The method's parameters are invalid (`InvalidParamsError`).
pub const INVALID_PARAMS: i64 = -32602;
/// The server failed (`InternalError`).
pub const INTERNAL_ERROR: i64 = -32603;
/// No task has the id (`TaskNotFoundError`).
pub const TASK_NOT_FOUND: i64 = -32001;
/// The task already ended (`TaskNotCancelableError`).
pub const TASK_NOT_CANCELABLE: i64 = -32002;
/// Push notifications are not supported: the card says `pushNotifications: false`
/// (`PushNotificationNotSupportedError`, 1.0 §3.3.4, §5.4).
pub const PUSH_NOTIFICATION_NOT_SUPPORTED: i64 = -32003;
/// The operation is not supported (`UnsupportedOperationError`).
pub const UNSUPPORTED_OPERATION: i64 = -32004;
/// The message's parts are of no media type the agent takes (`ContentTypeNotSupportedError`).
pub const CONTENT_TYPE_NOT_SUPPORTED: i64 = -32005;
/// The requested `A2A-Version` is not served (`VersionNotSupportedError`, 1.0 §3.6.2).
pub const VERSION_NOT_SUPPORTED: i64 = -32009;

/// A JSON-RPC error object: `{code, message, data?}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RpcError {
    /// One of the codes above.
    pub code: i64,
    /// Human-readable, lowercase.
    pub message: String,
    /// Structured detail, e.g. `{"taskId": …}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    /// An error with `code` and `message`, no data.
    pub fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError { code, message: message.into(), data: None }
    }

    /// The same error carrying `data`.
    pub fn with_data(mut self, data: Value) -> RpcError {
        self.data = Some(data);
        self
    }

    /// -32700.
    pub fn parse(detail: impl std::fmt::Display) -> RpcError {
        RpcError::new(PARSE_ERROR, format!("invalid json payload: {detail}"))
    }

    /// -32600.
    pub fn invalid_request(detail: impl Into<String>) -> RpcError {
        RpcError::new(INVALID_REQUEST, detail)
    }

    /// -32601 for `method`.
    pub fn method_not_found(method: &str) -> RpcError {
        RpcError::new(METHOD_NOT_FOUND, "method not found").with_data(json!({ "method": method }))
    }

    /// -32602.
    pub fn invalid_params(detail: impl std::fmt::Display) -> RpcError {
        RpcError::new(INVALID_PARAMS, format!("invalid parameters: {detail}"))
    }

    /// -32001 for `task_id`.
    pub fn task_not_found(task_id: &str) -> RpcError {
        RpcError::new(TASK_NOT_FOUND, "task not found").with_data(json!({ "taskId": task_id }))
    }

    /// -32002 for `task_id` in `state`.
    pub fn task_not_cancelable(task_id: &str, state: &str) -> RpcError {
        RpcError::new(TASK_NOT_CANCELABLE, format!("task cannot be canceled: it is {state}"))
            .with_data(json!({ "taskId": task_id }))
    }

    /// -32004.
    pub fn unsupported(detail: impl Into<String>) -> RpcError {
        RpcError::new(UNSUPPORTED_OPERATION, detail)
    }

    /// -32009 for the version `asked`, naming the versions served.
    pub fn version_not_supported(asked: &str, supported: &[&str]) -> RpcError {
        RpcError::new(VERSION_NOT_SUPPORTED, format!("a2a version {asked:?} is not supported here"))
            .with_data(json!({ "supportedVersions": supported }))
    }
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "json-rpc error {}: {}", self.code, self.message)
    }
}

impl std::error::Error for RpcError {}

/// A request that passed the envelope checks.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The request id (string, number or null), echoed on the response.
    pub id: Value,
    /// The method name.
    pub method: String,
    /// The params object (`{}` when absent).
    pub params: Value,
    /// A notification: the request has no `id` member. It is carried out, and never
    /// answered (JSON-RPC 2.0 §4.1: "The Server MUST NOT reply to a Notification").
    pub notification: bool,
}

/// 2^53: from here on a float no longer holds every whole number.
const MAX_EXACT_FLOAT: f64 = 9_007_199_254_740_992.0;

/// Reads a JSON-RPC 2.0 request from a body. On failure returns the id to answer with (null
/// when unknown) and the error: -32700 for bad JSON; -32600 for a batch, a missing or wrong
/// `jsonrpc`, a missing method, an id that is not a string, number or null (or a whole
/// number beyond 64 bits, which could not be echoed as sent), or params that are not an
/// object.
pub fn parse_request(body: &[u8]) -> Result<Request, (Value, RpcError)> {
    let value: Value = serde_json::from_slice(body).map_err(|e| (Value::Null, RpcError::parse(e)))?;
    let Value::Object(mut object) = value else {
        let what = if value.is_array() { "batch requests are not supported" } else { "request must be an object" };
        return Err((Value::Null, RpcError::invalid_request(what)));
    };
    let notification = !object.contains_key("id");
    let id = object.remove("id").unwrap_or(Value::Null);
    if !(id.is_string() || id.is_number() || id.is_null()) {
        return Err((Value::Null, RpcError::invalid_request("id must be a string, a number or null")));
    }
    // A whole number beyond 64 bits is read as a float and could not be echoed as sent
    // (18446744073709551617 came back as 1.8446744073709552e19): refused, not changed.
    if id.as_f64().is_some_and(|f| id.is_f64() && f.fract() == 0.0 && f.abs() >= MAX_EXACT_FLOAT) {
        return Err((Value::Null, RpcError::invalid_request("id: a whole number must fit in 64 bits")));
    }
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err((id, RpcError::invalid_request("jsonrpc must be exactly \"2.0\"")));
    }
    let method = match object.remove("method") {
        Some(Value::String(m)) if !m.is_empty() => m,
        _ => return Err((id, RpcError::invalid_request("method is required"))),
    };
    let params = match object.remove("params") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(p @ Value::Object(_)) => p,
        Some(_) => return Err((id, RpcError::invalid_request("params must be an object"))),
    };
    Ok(Request { id, method, params, notification })
}

/// `{"jsonrpc":"2.0","id":…,"result":…}`.
pub fn success(id: &Value, result: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "result": result })
}

/// `{"jsonrpc":"2.0","id":…,"error":{…}}`.
pub fn failure(id: &Value, error: &RpcError) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "error": error })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_are_checked_in_json_rpc_order() {
        let code = |body: &str| parse_request(body.as_bytes()).map(|_| 0).unwrap_or_else(|(_, e)| e.code);
        assert_eq!(code("{not json"), PARSE_ERROR);
        assert_eq!(code("[]"), INVALID_REQUEST);
        assert_eq!(code(r#"{"id":1,"method":"GetTask"}"#), INVALID_REQUEST);
        assert_eq!(code(r#"{"jsonrpc":"1.0","id":1,"method":"GetTask"}"#), INVALID_REQUEST);
        assert_eq!(code(r#"{"jsonrpc":"2.0","id":{},"method":"GetTask"}"#), INVALID_REQUEST);
        assert_eq!(code(r#"{"jsonrpc":"2.0","id":1}"#), INVALID_REQUEST);
        assert_eq!(code(r#"{"jsonrpc":"2.0","id":1,"method":"GetTask","params":[1]}"#), INVALID_REQUEST);
        let ok = parse_request(br#"{"jsonrpc":"2.0","id":"a","method":"GetTask"}"#).unwrap();
        assert_eq!((ok.id, ok.method.as_str(), ok.params), (json!("a"), "GetTask", json!({})));
        let (id, _) = parse_request(br#"{"jsonrpc":"2.0","id":7}"#).unwrap_err();
        assert_eq!(id, json!(7), "a known id is echoed on the error");
        // Whole numbers that fit 64 bits are echoed exactly; one beyond is refused.
        let big = parse_request(br#"{"jsonrpc":"2.0","id":18446744073709551615,"method":"GetTask"}"#).unwrap();
        assert_eq!(big.id.to_string(), "18446744073709551615");
        let low = parse_request(br#"{"jsonrpc":"2.0","id":-9223372036854775808,"method":"GetTask"}"#).unwrap();
        assert_eq!(low.id.to_string(), "-9223372036854775808");
        let (id, e) = parse_request(br#"{"jsonrpc":"2.0","id":18446744073709551617,"method":"GetTask"}"#).unwrap_err();
        assert_eq!(
            (id, e.code, e.message.as_str()),
            (Value::Null, INVALID_REQUEST, "id: a whole number must fit in 64 bits")
        );
        assert_eq!(parse_request(br#"{"jsonrpc":"2.0","id":1.5,"method":"GetTask"}"#).unwrap().id, json!(1.5));
    }

    #[test]
    fn responses_carry_the_request_id() {
        let err = RpcError::task_not_found("tsk_1");
        assert_eq!(
            failure(&json!(2), &err),
            json!({"jsonrpc":"2.0","id":2,"error":{"code":-32001,"message":"task not found","data":{"taskId":"tsk_1"}}})
        );
        assert_eq!(success(&json!("x"), json!({})), json!({"jsonrpc":"2.0","id":"x","result":{}}));
    }
}
