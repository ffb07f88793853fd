//! The NATS API's requests, replies and wire error, and the validation of a submitted task.

use super::*;

/// The largest task text accepted, in bytes (1 MiB). Note that NATS' default
/// `max_payload` is also 1 MiB, so a text this long needs a server with a larger
/// `max_payload` to travel inside a JSON request.
pub const MAX_TASK_BYTES: usize = 1 << 20;

/// The longest caller-chosen context id, in characters.
pub const MAX_CONTEXT_ID_CHARS: usize = 64;

/// The rule a task's or a fleet job's text breaks, if any: it must hold more than white
/// space, be at most `max_bytes` long, and hold no NUL character (U+0000) — a task's text
/// becomes a command's argument (the `hello` capsule runs it with `sh -c`), and no argument
/// of a program can carry a NUL: the task would run and end in "cannot start sh" (issue
/// #29). Other control characters are the text's own business.
///
/// The rule's words: `must not be empty`, `must not be only whitespace`, `must be at most
/// <max_bytes> bytes, got <n>`, `must not contain a NUL character (U+0000: no command's
/// argument can carry one), found at byte <i>`.
pub fn text_rule(text: &str, max_bytes: usize) -> Option<String> {
    if text.is_empty() {
        Some("must not be empty".to_string())
    } else if text.trim().is_empty() {
        Some("must not be only whitespace".to_string())
    } else if text.len() > max_bytes {
        Some(format!("must be at most {max_bytes} bytes, got {}", text.len()))
    } else {
        text.find('\0').map(|at| {
            format!(
                "must not contain a NUL character (U+0000: no command's argument can carry one), found at byte {at}"
            )
        })
    }
}

/// A task submission (`mur.api.task.submit`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// The capsule to run.
    pub capsule: String,
    /// The task's text, at most [`MAX_TASK_BYTES`].
    pub text: String,
    /// Where the task comes from; `user` when absent. Over the NATS API the caller is an
    /// authenticated client and states it (the design, §A task's way, step 2).
    #[serde(default = "default_origin")]
    pub origin: Origin,
    /// The conversation to continue; a fresh `ctx_…` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_id: Option<String>,
    /// When the task must be over, unix ms: a fleet step inherits the time left on its
    /// loop's clock (the fleet-loops seed, §The bounds: "Every member the loop delegates
    /// to inherits the remaining time"). The worker stops a task still running then; it
    /// ends `deadline_exceeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at: Option<u64>,
    /// Set on a delegated fleet step (issue #11 §The fan-out cap): the worker runs the
    /// task only while it holds one of the first `cap` permits of the cluster-wide
    /// semaphore ([`crate::fanout`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_step: Option<FleetStep>,
    /// Programs the work needs (a fleet's `needs:`, the fleet reference, §1: "passed to
    /// each delegate for dispatch-time preflight"): the worker that takes the task checks
    /// each is on its `PATH` before it starts a session, and ends the task `failed` naming
    /// the missing ones otherwise. At most [`MAX_NEEDS`], each a program name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub needs: Vec<String>,
    /// The task's id (`tsk_…`), minted by the caller so that a submission sent again after
    /// its answer was lost (a coordinator restarting, a timeout) runs the task once: a
    /// record of that id already stored for the same capsule and text is the answer (its
    /// state as it is now); one stored for another task is refused (`conflict`). Absent,
    /// the coordinator mints the id. `mur task send` mints one and retries an unanswered
    /// submission with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    /// The A2A `messageId` of the message the task came from, kept on the record so the
    /// task's history shows the caller's message as a standalone capsule's does (issue #29
    /// item 6). At most [`MAX_MESSAGE_ID_BYTES`], no control characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
}

/// Most bytes of [`SubmitRequest::message_id`].
pub const MAX_MESSAGE_ID_BYTES: usize = 256;

/// Most entries of [`SubmitRequest::needs`].
pub const MAX_NEEDS: usize = 32;

fn default_origin() -> Origin {
    Origin::User
}

/// The fields of a [`FleetStep`], in the order error messages list them.
const FLEET_STEP_FIELDS: [&str; 4] = ["fleet", "run_id", "step", "cap"];

/// Decodes a submission's `fleet_step`: an object of exactly [`FLEET_STEP_FIELDS`], the
/// names non-empty, `cap` at least 1. The error names the field (`fleet_step.cap: …`).
fn fleet_step_of(v: &Value) -> Result<FleetStep, String> {
    let Value::Object(m) = v else {
        return Err(format!("fleet_step: must be an object {{fleet, run_id, step, cap}}, got {v}"));
    };
    if let Some(k) = m.keys().find(|k| !FLEET_STEP_FIELDS.contains(&k.as_str())) {
        return Err(format!("fleet_step.{k}: unknown field, expected one of {}", FLEET_STEP_FIELDS.join(", ")));
    }
    let step = serde_json::from_value::<FleetStep>(v.clone()).map_err(|e| format!("fleet_step: {e}"))?;
    for (name, value) in [("fleet", &step.fleet), ("run_id", &step.run_id), ("step", &step.step)] {
        if value.trim().is_empty() {
            return Err(format!("fleet_step.{name}: must not be empty"));
        }
    }
    if step.cap == 0 {
        return Err("fleet_step.cap: must be at least 1, got 0".to_string());
    }
    Ok(step)
}

/// The fields a [`SubmitRequest`] may have, in the order error messages list them.
const SUBMIT_FIELDS: [&str; 9] =
    ["capsule", "text", "origin", "context_id", "deadline_at", "needs", "fleet_step", "task_id", "message_id"];

impl SubmitRequest {
    /// A submission of `text` to `capsule` from `origin`, in a fresh context, with no
    /// deadline and not a fleet step.
    pub fn new(capsule: impl Into<String>, text: impl Into<String>, origin: Origin) -> SubmitRequest {
        SubmitRequest {
            capsule: capsule.into(),
            text: text.into(),
            origin,
            context_id: None,
            deadline_at: None,
            fleet_step: None,
            needs: Vec::new(),
            task_id: None,
            message_id: None,
        }
    }

    /// Decodes and validates a submission from the raw request body.
    ///
    /// # Errors
    /// An [`ApiError`] with code `invalid_request`: for bytes that are not UTF-8 or not
    /// JSON, the message gives the byte offset (`request: invalid UTF-8 at byte 7`,
    /// `request: invalid JSON at byte 12: …`); otherwise it lists every broken rule, one
    /// `field: rule` per broken rule, joined by `; ` (see [`SubmitRequest::validate`]).
    pub fn parse(bytes: &[u8]) -> Result<SubmitRequest, ApiError> {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| ApiError::invalid(format!("request: invalid UTF-8 at byte {}", e.valid_up_to())))?;
        let value: Value = serde_json::from_str(text).map_err(|e| {
            // A truncated document fails at its end; other errors at the byte read last.
            let at = if e.is_eof() { text.len() } else { byte_offset(text, e.line(), e.column()) };
            ApiError::invalid(format!("request: invalid JSON at byte {at}: {}", strip_position(&e.to_string())))
        })?;
        let Value::Object(map) = value else {
            return Err(ApiError::invalid(format!("request: must be a JSON object, got {}", json_type(&value))));
        };
        let mut errors = Vec::new();
        for key in map.keys() {
            if !SUBMIT_FIELDS.contains(&key.as_str()) {
                errors.push(format!("{key}: unknown field, expected one of {}", SUBMIT_FIELDS.join(", ")));
            }
        }
        let capsule = required_string(&map, "capsule", &mut errors);
        let text = required_string(&map, "text", &mut errors);
        let origin = match map.get("origin") {
            None | Some(Value::Null) => Some(Origin::User),
            Some(Value::String(s)) => match s.parse::<Origin>() {
                Ok(o) => Some(o),
                Err(e) => {
                    errors.push(e.to_string());
                    None
                }
            },
            Some(other) => {
                errors.push(format!("origin: must be a string, got {}", json_type(other)));
                None
            }
        };
        let context_id = match map.get("context_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                errors.push(format!("context_id: must be a string, got {}", json_type(other)));
                None
            }
        };
        let deadline_at = match map.get("deadline_at") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
            Some(other) => {
                errors.push(format!("deadline_at: must be unix milliseconds (a whole number), got {other}"));
                None
            }
        };
        let fleet_step = match map.get("fleet_step") {
            None | Some(Value::Null) => None,
            Some(v) => match fleet_step_of(v) {
                Ok(step) => Some(step),
                Err(e) => {
                    errors.push(e);
                    None
                }
            },
        };
        let needs = match map.get("needs") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
                items.iter().filter_map(|v| v.as_str().map(str::to_string)).collect()
            }
            Some(other) => {
                errors.push(format!("needs: must be an array of program names, got {other}"));
                Vec::new()
            }
        };
        let task_id = match map.get("task_id") {
            None | Some(Value::Null) => None,
            // Checked with the other rules (`rule_errors`), so one answer lists them all.
            Some(Value::String(s)) => Some(TaskId::unchecked(s.clone())),
            Some(other) => {
                errors.push(format!("task_id: must be a string, got {}", json_type(other)));
                None
            }
        };
        let message_id = match map.get("message_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                errors.push(format!("message_id: must be a string, got {}", json_type(other)));
                None
            }
        };
        let request = match (capsule, text, origin) {
            (Some(capsule), Some(text), Some(origin)) if errors.is_empty() => {
                SubmitRequest { capsule, text, origin, context_id, deadline_at, needs, fleet_step, task_id, message_id }
            }
            (capsule, text, _) => {
                // Still report the value rules of the fields that did decode.
                let partial = SubmitRequest {
                    capsule: capsule.unwrap_or_else(|| "x".into()),
                    text: text.unwrap_or_else(|| "x".into()),
                    origin: Origin::User,
                    context_id,
                    deadline_at: None,
                    fleet_step: None,
                    needs,
                    task_id,
                    message_id,
                };
                errors.extend(partial.rule_errors());
                errors.sort_by_key(|e| field_rank(e));
                return Err(ApiError::invalid(errors.join("; ")));
            }
        };
        request.validate()?;
        Ok(request)
    }

    /// Checks the rules of a decoded submission:
    /// - `capsule`: a capsule name ([`is_valid_name`]);
    /// - `text`: [`text_rule`] with [`MAX_TASK_BYTES`] (not empty, at most 1 MiB, no NUL);
    /// - `context_id`, when given: 1–64 characters of `A-Z a-z 0-9 - _ .`, not starting or
    ///   ending with `.` (a `ctx_…` id fits; the id becomes a KV key and a folder name);
    /// - `task_id`, when given: a task id, `tsk_` and 32 lowercase hex digits;
    /// - `message_id`, when given: 1 to [`MAX_MESSAGE_ID_BYTES`] bytes, no control
    ///   characters.
    ///
    /// # Errors
    /// An [`ApiError`] with code `invalid_request` listing every broken rule, for example
    /// `text: must be at most 1048576 bytes, got 1048577`.
    pub fn validate(&self) -> Result<(), ApiError> {
        let errors = self.rule_errors();
        if errors.is_empty() { Ok(()) } else { Err(ApiError::invalid(errors.join("; "))) }
    }

    fn rule_errors(&self) -> Vec<String> {
        let mut errors = Vec::new();
        if !is_valid_name(&self.capsule) {
            errors.push(format!(
                "capsule: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got {:?}",
                self.capsule
            ));
        }
        if let Some(rule) = text_rule(&self.text, MAX_TASK_BYTES) {
            errors.push(format!("text: {rule}"));
        }
        if let Some(ctx) = self.context_id.as_deref().filter(|c| !is_valid_context_id(c)) {
            errors.push(format!(
                "context_id: must be a ctx_ id or 1-64 characters of A-Z, a-z, 0-9, '-', '_' or '.', \
                 not starting or ending with '.' nor holding '..', got {ctx:?}"
            ));
        }
        if let Some(id) = self.task_id.as_deref().filter(|id| !Id::is_valid(IdKind::Task, id)) {
            errors.push(format!("task_id: must be a task id (tsk_ and 32 lowercase hex digits), got {id:?}"));
        }
        if let Some(id) = self
            .message_id
            .as_deref()
            .filter(|id| id.is_empty() || id.len() > MAX_MESSAGE_ID_BYTES || id.chars().any(char::is_control))
        {
            errors.push(format!(
                "message_id: must be 1-{MAX_MESSAGE_ID_BYTES} bytes without control characters, got {} bytes",
                id.len()
            ));
        }
        if self.needs.len() > MAX_NEEDS {
            errors.push(format!("needs: at most {MAX_NEEDS} programs, got {}", self.needs.len()));
        }
        for (i, need) in self.needs.iter().enumerate() {
            if need.is_empty() || need.len() > 255 || need.chars().any(|c| c.is_whitespace() || c.is_control()) {
                errors.push(format!("needs[{i}]: must be a program name (1-255 characters, no spaces), got {need:?}"));
            }
        }
        errors
    }
}

/// Whether `id` is acceptable as a context id: a `ctx_…` id, or 1–64 characters of
/// `A-Z a-z 0-9 - _ .` that neither start nor end with `.` nor hold `..` (it is a part of
/// a KV key: an empty token is no key).
pub fn is_valid_context_id(id: &str) -> bool {
    Id::is_valid(IdKind::Context, id)
        || (!id.is_empty()
            && id.len() <= MAX_CONTEXT_ID_CHARS
            && !id.starts_with('.')
            && !id.ends_with('.')
            && !id.contains("..")
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')))
}

/// The answer to a submission: the new task's id and state (`submitted`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitReply {
    /// `tsk_…`.
    pub task_id: TaskId,
    /// Its state on acceptance.
    pub state: TaskState,
}

/// Names one task (`mur.api.task.get`, `mur.api.task.cancel`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRef {
    /// `tsk_…`.
    pub task_id: TaskId,
}

/// What went wrong with an API request, as a small set (the conventions, §7 item 2). Non
/// exhaustive: a newer coordinator may answer a code this build does not know, which reads
/// as [`ErrorCode::Unknown`], so a client matches on codes, never on an error's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The request broke a rule; the message names the field. Retrying it will not help.
    InvalidRequest,
    /// The task or capsule named does not exist.
    NotFound,
    /// The request conflicts with the current state (cancelling a finished task).
    Conflict,
    /// A bug or an unexpected server answer.
    Internal,
    /// JetStream or the coordinator is not reachable now; retry later.
    Unavailable,
    /// A code this build does not know (a newer coordinator's); read as `"unknown"`.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// The wire name (`"invalid_request"`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Internal => "internal",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Unknown => "unknown",
        }
    }

    /// The HTTP-like status a NATS micro service error header carries (400, 404, 409,
    /// 500, 503).
    pub const fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::Internal => 500,
            ErrorCode::Unavailable => 503,
            ErrorCode::Unknown => 500,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error an API request gets back, as JSON: `{"code": "invalid_request", "message":
/// "text: must not be empty"}`. Displays as `<code>: <message>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// The kind of failure.
    pub code: ErrorCode,
    /// What went wrong, for people: lowercase, naming the field and the rule.
    pub message: String,
    /// The [`api::VERSION`] of the coordinator that answered; `None` for an error the
    /// client made itself (no coordinator answered) or one from a coordinator older than
    /// the versioned API (which, for one, refuses a [`SubmitRequest::task_id`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<u32>,
}

impl ApiError {
    /// An error of `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), api_version: None }
    }

    /// An `invalid_request` error.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidRequest, message)
    }

    /// The `unavailable` error of a request to `subject` that no coordinator subscribes to
    /// (NATS answered "no responders"): it says what to start, `<subject>: no coordinator
    /// answers (no responders); start one with `mur coordinator`, or `mur dev` for a
    /// cluster on this machine` (issue #29: it named no remedy).
    pub fn no_coordinator(subject: &str) -> ApiError {
        ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "{subject}: no coordinator answers (no responders); start one with `mur coordinator`, \
                 or `mur dev` for a cluster on this machine"
            ),
        )
    }
}

fn required_string(map: &Map<String, Value>, field: &str, errors: &mut Vec<String>) -> Option<String> {
    match map.get(field) {
        None | Some(Value::Null) => {
            errors.push(format!("{field}: required"));
            None
        }
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            errors.push(format!("{field}: must be a string, got {}", json_type(other)));
            None
        }
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Orders error lines by the field they name, in [`SUBMIT_FIELDS`] order (unknown fields
/// first), so messages are stable whatever the JSON key order.
fn field_rank(error: &str) -> usize {
    let field = error.split([':', '[']).next().unwrap_or_default();
    SUBMIT_FIELDS.iter().position(|f| *f == field).map_or(0, |i| i + 1)
}

/// The byte offset of serde_json's 1-based `line` and byte `column` in `text`: the byte at
/// which the parser stopped.
fn byte_offset(text: &str, line: usize, column: usize) -> usize {
    let line_start: usize = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    (line_start + column.saturating_sub(1)).min(text.len())
}

/// serde_json's message without its ` at line L column C` suffix (the offset replaces it).
fn strip_position(message: &str) -> &str {
    message.rfind(" at line ").map_or(message, |i| &message[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(bytes: &[u8]) -> String {
        let err = SubmitRequest::parse(bytes).unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest, "{err}");
        err.message
    }

    #[test]
    fn a_minimal_submission_defaults_to_the_user_origin() {
        let req = SubmitRequest::parse(br#"{"capsule":"hello","text":"hi"}"#).unwrap();
        assert_eq!(req, SubmitRequest::new("hello", "hi", Origin::User), "every optional field absent");
        let req =
            SubmitRequest::parse(br#"{"capsule":"a-1","text":"x","origin":"peer","context_id":"ctx-from-caller"}"#)
                .unwrap();
        assert_eq!((req.origin, req.context_id.as_deref()), (Origin::Peer, Some("ctx-from-caller")));
    }

    #[test]
    fn invalid_utf8_is_reported_with_its_byte_offset() {
        assert_eq!(invalid(b"{\"capsule\":\"\xff\"}"), "request: invalid UTF-8 at byte 12");
    }

    #[test]
    fn invalid_json_is_reported_with_its_byte_offset() {
        assert_eq!(invalid(br#"{"capsule": }"#), "request: invalid JSON at byte 12: expected value");
        assert_eq!(invalid(b"{\n  \"text\": \"a\",\n  oops"), "request: invalid JSON at byte 19: key must be a string");
        assert_eq!(invalid(br#"{"capsule":"a""#), "request: invalid JSON at byte 14: EOF while parsing an object");
        assert_eq!(invalid(b"[1]"), "request: must be a JSON object, got an array");
    }

    #[test]
    fn capsule_must_be_a_valid_name() {
        assert_eq!(
            invalid(br#"{"capsule":"Hello","text":"x"}"#),
            r#"capsule: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got "Hello""#
        );
        assert_eq!(invalid(br#"{"text":"x"}"#), "capsule: required");
        assert_eq!(invalid(br#"{"capsule":7,"text":"x"}"#), "capsule: must be a string, got a number");
    }

    #[test]
    fn text_must_hold_more_than_whitespace_and_at_most_one_mebibyte() {
        let at_limit = serde_json::to_vec(&serde_json::json!({"capsule": "c", "text": "a".repeat(MAX_TASK_BYTES)}));
        assert!(SubmitRequest::parse(&at_limit.unwrap()).is_ok());
        let over = serde_json::to_vec(&serde_json::json!({"capsule": "c", "text": "a".repeat(MAX_TASK_BYTES + 1)}));
        assert_eq!(invalid(&over.unwrap()), "text: must be at most 1048576 bytes, got 1048577");
        assert_eq!(invalid(br#"{"capsule":"c","text":""}"#), "text: must not be empty");
        assert_eq!(invalid(br#"{"capsule":"c","text":" \n\t "}"#), "text: must not be only whitespace");
        assert_eq!(invalid(br#"{"capsule":"c"}"#), "text: required");
    }

    /// Issue #29: a task holding a NUL was accepted, ran, and ended `completed`/`ok` with
    /// "cannot start sh".
    #[test]
    fn a_text_holding_a_nul_is_refused_naming_the_rule_and_where() {
        assert_eq!(
            invalid(br#"{"capsule":"c","text":"echo a\u0000b"}"#),
            "text: must not contain a NUL character (U+0000: no command's argument can carry one), found at byte 6"
        );
        // Other control characters are allowed.
        assert!(SubmitRequest::parse(br#"{"capsule":"c","text":"printf '\u0001\u001b[1m'"}"#).is_ok());
    }

    #[test]
    fn origin_must_be_one_of_the_six() {
        assert_eq!(
            invalid(br#"{"capsule":"c","text":"x","origin":"admin"}"#),
            r#"origin: must be one of user, peer, schedule, event, completion, system, got "admin""#
        );
        assert_eq!(invalid(br#"{"capsule":"c","text":"x","origin":1}"#), "origin: must be a string, got a number");
    }

    #[test]
    fn context_id_must_be_a_ctx_id_or_a_safe_segment() {
        let ok = |ctx: &str| {
            let body = serde_json::json!({"capsule": "c", "text": "x", "context_id": ctx}).to_string();
            SubmitRequest::parse(body.as_bytes()).map(|r| r.context_id.unwrap())
        };
        assert_eq!(ok("ctx_0123456789abcdef0123456789abcdef").unwrap(), "ctx_0123456789abcdef0123456789abcdef");
        assert!(ok("Build.42_x-y").is_ok());
        assert!(ok(&"a".repeat(64)).is_ok());
        for bad in ["", "a/b", "..", "x..y", ".hidden", "trailing.", "sp ace", "a=b", "é", &"a".repeat(65)] {
            assert_eq!(
                ok(bad).unwrap_err().message,
                format!(
                    "context_id: must be a ctx_ id or 1-64 characters of A-Z, a-z, 0-9, '-', '_' or '.', \
                     not starting or ending with '.' nor holding '..', got {bad:?}"
                )
            );
        }
    }

    #[test]
    fn task_id_when_given_must_be_a_task_id() {
        let parsed = |id: Value| {
            let body = serde_json::json!({"capsule": "c", "text": "x", "task_id": id}).to_string();
            SubmitRequest::parse(body.as_bytes()).map(|r| r.task_id)
        };
        let id = "tsk_0123456789abcdef0123456789abcdef";
        assert_eq!(parsed(Value::from(id)).unwrap().as_deref(), Some(id));
        assert_eq!(parsed(Value::Null).unwrap(), None);
        for bad in ["", "tsk_1", "ctx_0123456789abcdef0123456789abcdef", "tsk_0123456789ABCDEF0123456789ABCDEF"] {
            assert_eq!(
                parsed(Value::from(bad)).unwrap_err().message,
                format!("task_id: must be a task id (tsk_ and 32 lowercase hex digits), got {bad:?}")
            );
        }
        assert_eq!(parsed(Value::from(7)).unwrap_err().message, "task_id: must be a string, got a number");
        // Absent from what is sent when not given: older coordinators read it as before.
        let sent = serde_json::to_value(SubmitRequest::new("c", "x", Origin::User)).unwrap();
        assert!(sent.get("task_id").is_none(), "{sent}");
    }

    #[test]
    fn a_message_id_is_kept_on_the_record_and_bounded() {
        let request = SubmitRequest::parse(br#"{"capsule":"c","text":"t","message_id":"msg-1"}"#).unwrap();
        assert_eq!(request.message_id.as_deref(), Some("msg-1"));
        let record = TaskRecord::submitted(TaskId::unchecked("tsk_1"), request, "d".into(), 5);
        assert_eq!(record.message_id.as_deref(), Some("msg-1"));
        let long = format!(r#"{{"capsule":"c","text":"t","message_id":"{}"}}"#, "m".repeat(257));
        assert_eq!(
            invalid(long.as_bytes()),
            "message_id: must be 1-256 bytes without control characters, got 257 bytes"
        );
        assert_eq!(
            invalid(br#"{"capsule":"c","text":"t","message_id":7}"#),
            "message_id: must be a string, got a number"
        );
    }

    #[test]
    fn every_broken_rule_is_listed_in_field_order() {
        assert_eq!(
            invalid(br#"{"text":"","extra":1,"capsule":"B A D","context_id":"a/b"}"#),
            "extra: unknown field, expected one of capsule, text, origin, context_id, deadline_at, needs, fleet_step, task_id, message_id; \
             capsule: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got \"B A D\"; \
             text: must not be empty; \
             context_id: must be a ctx_ id or 1-64 characters of A-Z, a-z, 0-9, '-', '_' or '.', not starting or \
             ending with '.' nor holding '..', got \"a/b\""
        );
    }

    #[test]
    fn api_errors_travel_as_json_and_display_with_their_code() {
        let err = ApiError::new(ErrorCode::NotFound, "task tsk_1 not found");
        let json = serde_json::to_string(&err).unwrap();
        assert_eq!(json, r#"{"code":"not_found","message":"task tsk_1 not found"}"#);
        assert_eq!(serde_json::from_str::<ApiError>(&json).unwrap(), err);
        assert_eq!(err.to_string(), "not_found: task tsk_1 not found");
        let codes = [
            ErrorCode::InvalidRequest,
            ErrorCode::NotFound,
            ErrorCode::Conflict,
            ErrorCode::Internal,
            ErrorCode::Unavailable,
        ];
        let statuses: Vec<_> = codes.iter().map(|c| (c.as_str(), c.status())).collect();
        assert_eq!(
            statuses,
            [("invalid_request", 400), ("not_found", 404), ("conflict", 409), ("internal", 500), ("unavailable", 503)]
        );
    }

    #[test]
    fn a_deadline_is_unix_milliseconds_and_reaches_the_record() {
        let r = SubmitRequest::parse(br#"{"capsule":"c","text":"t","deadline_at":1700000000000}"#).unwrap();
        assert_eq!(r.deadline_at, Some(1_700_000_000_000));
        let record = TaskRecord::submitted(TaskId::unchecked("tsk_1"), r, "d".into(), 0);
        assert_eq!(record.deadline_at, Some(1_700_000_000_000));
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","deadline_at":"soon"}"#).unwrap_err();
        assert_eq!(err.message, "deadline_at: must be unix milliseconds (a whole number), got \"soon\"");
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","deadline_at":-5}"#).unwrap_err();
        assert_eq!(err.message, "deadline_at: must be unix milliseconds (a whole number), got -5");
    }

    #[test]
    fn a_fleet_step_reaches_the_record_and_a_bad_one_is_refused_by_field() {
        let body = br#"{"capsule":"c","text":"t","fleet_step":{"fleet":"f","run_id":"r-0","step":"m","cap":3}}"#;
        let r = SubmitRequest::parse(body).unwrap();
        let record = TaskRecord::submitted(TaskId::unchecked("tsk_1"), r, "d".into(), 0);
        let step = record.fleet_step.unwrap();
        assert_eq!((step.fleet.as_str(), step.run_id.as_str(), step.step.as_str(), step.cap), ("f", "r-0", "m", 3));
        let err = SubmitRequest::parse(
            br#"{"capsule":"c","text":"t","fleet_step":{"fleet":"f","run_id":"r","step":"m","cap":0}}"#,
        )
        .unwrap_err();
        assert_eq!(err.message, "fleet_step.cap: must be at least 1, got 0");
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","fleet_step":{"fleet":"f"}}"#).unwrap_err();
        assert_eq!(err.message, "fleet_step: missing field `run_id`");
        for (body, message) in [
            (
                r#"{"fleet":"f","run_id":"r","step":"m","cap":3,"capp":9}"#,
                "fleet_step.capp: unknown field, expected one of fleet, run_id, step, cap",
            ),
            (r#"{"fleet":" ","run_id":"r","step":"m","cap":3}"#, "fleet_step.fleet: must not be empty"),
            (r#"{"fleet":"f","run_id":"","step":"m","cap":3}"#, "fleet_step.run_id: must not be empty"),
            (r#""f""#, "fleet_step: must be an object {fleet, run_id, step, cap}, got \"f\""),
        ] {
            let full = format!(r#"{{"capsule":"c","text":"t","fleet_step":{body}}}"#);
            assert_eq!(SubmitRequest::parse(full.as_bytes()).unwrap_err().message, message, "{body}");
        }
    }

    #[test]
    fn needs_are_program_names_and_reach_the_record() {
        let r = SubmitRequest::parse(br#"{"capsule":"c","text":"t","needs":["cargo","/usr/bin/git"]}"#).unwrap();
        assert_eq!(r.needs, ["cargo", "/usr/bin/git"]);
        let record = TaskRecord::submitted(TaskId::unchecked("tsk_1"), r, "d".into(), 0);
        assert_eq!(record.needs, ["cargo", "/usr/bin/git"]);
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(json["needs"], serde_json::json!(["cargo", "/usr/bin/git"]));
        let none = SubmitRequest::parse(br#"{"capsule":"c","text":"t"}"#).unwrap();
        assert!(serde_json::to_value(&none).unwrap().get("needs").is_none(), "left out when empty");
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"","needs":["ok","two words",""]}"#).unwrap_err();
        assert_eq!(
            err.message,
            "text: must not be empty; needs[1]: must be a program name (1-255 characters, no spaces), got \"two words\"; \
             needs[2]: must be a program name (1-255 characters, no spaces), got \"\""
        );
        let err = SubmitRequest::parse(br#"{"capsule":"c","text":"t","needs":"cargo"}"#).unwrap_err();
        assert_eq!(err.message, "needs: must be an array of program names, got \"cargo\"");
    }
}
