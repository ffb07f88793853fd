//! The capsule manifest, `murmur.yaml`: its fields, defaults and validation rules.
//!
//! Fields and defaults come from the session-loop seed (turn limit, reopen limit, seeding
//! keys, lifecycle, shell grace), the context seed (compaction) and
//! the runtime reference, §2; the key names follow issue #2. Unknown keys and bad
//! values are errors naming the field path and the rule, for example
//! `inference.max_turns: must be at least 1, got 0`. Loading is pure: the environment used
//! to resolve `${VAR}` in `inference.api_key` is a parameter.

use crate::int::{Int, Real};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeSet;
use std::fmt;

mod mcp;
mod sandbox;
pub use mcp::{DEFAULT_MCP_TIMEOUT_SECS, MCP_TOOL_PREFIX, McpServer, McpTransport};
pub use sandbox::{Endpoint, Network, Sandbox};

/// A validated capsule manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    /// Capsule name: 1–64 chars of `a-z`, `0-9`, `-`, `_`, starting with a letter or digit
    /// (it becomes a NATS subject token on the cluster).
    pub name: String,
    /// Capsule version: a label of 1-64 characters on one line, taken as written (issue #29
    /// decided what a version is). murmur shows it — `mur capsule ls`, the trace's
    /// `session_start`, the agent card — and never compares or orders it: a name's latest
    /// push is its latest, whatever its version, and a bundle is named by its digest. So
    /// any scheme fits (`1.0.0`, `2026.12-rc1`, `7`), and an unquoted YAML number is kept as
    /// the file writes it (`version: 1` is `"1"`, `1.10` is `"1.10"`, not 1.1). A list,
    /// a mapping, an empty or invisible text, or a line break is refused by [`VERSION_RULE`].
    pub version: String,
    /// One-line description for the agent card.
    pub description: Option<String>,
    /// How the model is reached.
    pub inference: Inference,
    /// Context window settings (compaction and seeding).
    pub context: Context,
    /// How long the capsule runs and how many tasks it takes.
    pub lifecycle: Lifecycle,
    /// What the capsule's tools may do.
    pub capabilities: Capabilities,
    /// Hook programs, in declaration order.
    pub hooks: Vec<Hook>,
    /// Extra tools declared as commands.
    pub tools: Vec<ToolDecl>,
    /// What the trace records.
    pub trace: TraceConfig,
    /// How the capsule's commands are confined (issue #37); `None` runs them unconfined.
    pub sandbox: Option<Sandbox>,
    /// The MCP servers whose tools the model may call (issue #35), in declaration order.
    pub mcp_servers: Vec<McpServer>,
}

/// `inference.transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// A model reached through an HTTP driver (default).
    Http,
    /// An agent program that owns its own conversation.
    Process,
}

/// `inference.driver`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverKind {
    /// OpenAI chat completions (any compatible server).
    Openai,
    /// Anthropic Messages API.
    Anthropic,
    /// Replies read from a YAML file, for tests and demos.
    Scripted,
}

impl DriverKind {
    /// The manifest spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            DriverKind::Openai => "openai",
            DriverKind::Anthropic => "anthropic",
            DriverKind::Scripted => "scripted",
        }
    }
}

/// `inference.max_tokens_param`: the request key the `openai` driver puts the output cap
/// under (issue #28 item 5). OpenAI's own API marks `max_tokens` deprecated and refuses it
/// for o-series models, wanting `max_completion_tokens`; many compatible servers know only
/// `max_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaxTokensParam {
    /// `max_tokens`.
    MaxTokens,
    /// `max_completion_tokens`.
    MaxCompletionTokens,
}

impl MaxTokensParam {
    /// The key's spelling, in the manifest and on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            MaxTokensParam::MaxTokens => "max_tokens",
            MaxTokensParam::MaxCompletionTokens => "max_completion_tokens",
        }
    }

    /// The default for an endpoint: `max_completion_tokens` for OpenAI's own API (host
    /// `api.openai.com`), `max_tokens` for any other server.
    pub fn for_endpoint(endpoint: &str) -> MaxTokensParam {
        let rest = endpoint.split_once("://").map_or(endpoint, |(_, rest)| rest);
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
        let host = host.split(':').next().unwrap_or_default().trim_end_matches('.');
        if host.eq_ignore_ascii_case("api.openai.com") {
            MaxTokensParam::MaxCompletionTokens
        } else {
            MaxTokensParam::MaxTokens
        }
    }
}

/// Where the system prompt comes from (`inference.system_prompt` or `system_prompt_file`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SystemPrompt {
    /// No prompt.
    None,
    /// Inline text, trimmed.
    Inline(String),
    /// A file relative to the capsule folder, read verbatim at launch.
    File(String),
}

/// The `inference:` block.
#[derive(Clone, Debug, PartialEq)]
pub struct Inference {
    /// `http` (default) or `process`.
    pub transport: Transport,
    /// The HTTP driver; `None` under `process`.
    pub driver: Option<DriverKind>,
    /// Base URL (`openai`: up to and including `/v1`). https anywhere, http only on loopback.
    pub endpoint: Option<String>,
    /// Model name sent to the provider.
    pub model: Option<String>,
    /// API key with `${VAR}` already resolved.
    pub api_key: Option<String>,
    /// Stream responses (SSE). Default false.
    pub stream: bool,
    /// Model calls per task (the session-loop seed, §Turn limit). Default 10, at least 1.
    pub max_turns: u32,
    /// Per-turn output cap sent as the payload's `max_tokens` (or `max_completion_tokens`,
    /// see [`Inference::max_tokens_param`]). Default 8192, at least 1.
    pub max_tokens: u32,
    /// `openai` driver: the key the output cap is sent under; `None` (the default) picks
    /// by endpoint ([`MaxTokensParam::for_endpoint`]). Allowed only with `driver: openai`.
    pub max_tokens_param: Option<MaxTokensParam>,
    /// The system prompt's source.
    pub system_prompt: SystemPrompt,
    /// Compaction settings (the context seed).
    pub compaction: Compaction,
    /// Scripted driver: the replies file, relative to the capsule folder.
    pub script: Option<String>,
    /// Process transport: the program and its arguments.
    pub command: Option<Vec<String>>,
    /// Time allowed for one attempt of a model call, seconds: request, headers and the
    /// whole body, streamed or not (issue #28 item 6). Default 300.
    pub timeout_secs: u64,
    /// HTTP drivers: the longest silence allowed between two pieces of a streamed reply,
    /// seconds; passing it fails the attempt, which is retried. Default `timeout_secs`;
    /// from 1 to `timeout_secs`.
    pub idle_timeout_secs: u64,
    /// Retries after a failed attempt (429, 5xx, connection errors). Default 3.
    pub max_retries: u32,
    /// Session spend ceiling in tokens (the context seed, spend ceilings). Default none.
    pub max_session_tokens: Option<u64>,
}

/// `inference.compaction`.
#[derive(Clone, Debug, PartialEq)]
pub struct Compaction {
    /// Fraction of `context.max_tokens` that triggers compaction; in (0, 1], default 0.98.
    pub threshold: f64,
    /// Model a compaction hook should summarise with (passed to the hook).
    pub model: Option<String>,
    /// Prompt passed to the compaction hook.
    pub system_prompt: Option<String>,
    /// Append one line per committed compaction to `out/compaction-summaries.jsonl`.
    pub dump_summaries: bool,
}

/// The `context:` block.
#[derive(Clone, Debug, PartialEq)]
pub struct Context {
    /// The context window in tokens; absent disables compaction and seeding.
    pub max_tokens: Option<u64>,
    /// Fraction of `max_tokens` a seed may occupy; default 0.10 (the session-loop seed).
    pub seed_budget: f64,
    /// Fraction of the seed ceiling a seed may overflow before it is summarised; default 0.10.
    pub seed_overflow_margin: f64,
}

impl Context {
    /// The seed ceiling: floor(`max_tokens` × `seed_budget`), 0 without `max_tokens`
    /// (the session-loop seed, §Context seeding, first table).
    pub fn seed_budget_tokens(&self) -> u64 {
        self.max_tokens.map_or(0, |m| (m as f64 * self.seed_budget).floor() as u64)
    }
}

/// `lifecycle.task_acceptance` (the session-loop seed, §Capsule lifecycle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskAcceptance {
    /// Runs `task.md` if present, then exits; every incoming message is rejected.
    None,
    /// Accepts one task, runs it, exits (default).
    Single,
    /// Accepts tasks up to `queue_depth`, runs them one at a time.
    Queue,
}

/// `lifecycle.after_task`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterTask {
    /// End the session after the task (default).
    Exit,
    /// Park between tasks (queue capsules).
    Sleep,
}

/// `lifecycle.conversation`: whether tasks of one context share history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Conversation {
    /// Every task starts from an empty history (default).
    Stateless,
    /// Tasks of the same context id continue its conversation.
    Threaded,
}

/// The `lifecycle:` block.
#[derive(Clone, Debug, PartialEq)]
pub struct Lifecycle {
    /// Default `single`.
    pub task_acceptance: TaskAcceptance,
    /// Default `exit`; `sleep` requires `queue`.
    pub after_task: AfterTask,
    /// Reopens per task; default 1, 0 disables (the session-loop seed, §Task reopening).
    pub max_task_reopens: u32,
    /// Seconds before a shell command moves to the background; default 10.
    pub shell_grace_secs: u64,
    /// Tasks that may wait (queue mode); default 1, at least 1.
    pub queue_depth: u32,
    /// Default `stateless`.
    pub conversation: Conversation,
}

/// The `capabilities:` block.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Capabilities {
    /// Binaries the built-in shell tools may run; one tool per binary, named after it.
    pub shell_allow: Vec<String>,
    /// `capabilities.shell.idempotent` (default false): a shell command found in doubt
    /// at a takeover (started, its worker died before it ended) runs again with the same
    /// `MUR_TOOL_CALL_ID`; off, the model is told it may or may not have taken effect
    /// (issue #34).
    pub shell_idempotent: bool,
}

/// A hook's binding: which event it receives (the runtime reference, §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Binding {
    /// Before the session exists.
    OnStage,
    /// Once per launch, first.
    OnSessionStart,
    /// Once per task, before its first turn.
    OnTaskStart,
    /// After each model response.
    OnInference,
    /// After each tool call.
    OnToolCall,
    /// After each shell command.
    OnShell,
    /// When the context crosses the compaction threshold.
    OnCompaction,
    /// After each attempt of a task.
    OnTaskEnd,
    /// Once per launch, last.
    OnSessionEnd,
}

impl Binding {
    /// The manifest spelling (`"on-task-end"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Binding::OnStage => "on-stage",
            Binding::OnSessionStart => "on-session-start",
            Binding::OnTaskStart => "on-task-start",
            Binding::OnInference => "on-inference",
            Binding::OnToolCall => "on-tool-call",
            Binding::OnShell => "on-shell",
            Binding::OnCompaction => "on-compaction",
            Binding::OnTaskEnd => "on-task-end",
            Binding::OnSessionEnd => "on-session-end",
        }
    }

    /// The only commit policy other than `none` this binding honours, if any.
    pub const fn honoured_policy(self) -> Option<CommitPolicy> {
        match self {
            Binding::OnTaskEnd => Some(CommitPolicy::ReopenTask),
            Binding::OnTaskStart => Some(CommitPolicy::SeedContext),
            Binding::OnCompaction => Some(CommitPolicy::ReplaceContext),
            _ => None,
        }
    }
}

/// `hooks[].execution_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecutionMode {
    /// The runtime waits for the answer (default).
    Blocking,
    /// Queued; the answer is discarded.
    Async,
}

/// `hooks[].commit_policy`: what a hook's answer may change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CommitPolicy {
    /// Observe only (default).
    None,
    /// May veto a task's outcome (`on-task-end`).
    ReopenTask,
    /// May seed the task's context (`on-task-start`).
    SeedContext,
    /// May replace the history (`on-compaction`).
    ReplaceContext,
}

impl CommitPolicy {
    /// The manifest spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            CommitPolicy::None => "none",
            CommitPolicy::ReopenTask => "reopen-task",
            CommitPolicy::SeedContext => "seed-context",
            CommitPolicy::ReplaceContext => "replace-context",
        }
    }
}

/// One entry of `hooks:`.
#[derive(Clone, Debug, PartialEq)]
pub struct Hook {
    /// Unique name; used in `logs/hook-<name>.log`.
    pub name: String,
    /// The event it receives; `None` receives every event except `on-stage`.
    pub binding: Option<Binding>,
    /// Default `blocking`.
    pub execution_mode: ExecutionMode,
    /// Default `none`.
    pub commit_policy: CommitPolicy,
    /// argv, relative to the capsule folder, or `["builtin:compact"]` / `["builtin:memory"]`.
    pub command: Vec<String>,
    /// Per-event deadline in seconds; default 30.
    pub timeout_secs: u64,
    /// One process per session (JSON lines) instead of one per event; default false.
    pub persistent: bool,
}

/// The built-in tools a manifest may list in `tools:` with `command: builtin:<name>`
/// (issue #11 §Agents drive fleets too): queue a job on a fleet, start a run (its id comes
/// back at once), read a run's state and liveness verdict. They work on the cluster only.
pub const BUILTIN_TOOLS: [&str; 3] = ["fleet_send", "fleet_run", "job_status"];

/// One entry of `tools:`: a tool implemented by a command, or a built-in one
/// (`command: builtin:fleet_send`, see [`BUILTIN_TOOLS`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolDecl {
    /// Tool name shown to the model.
    pub name: String,
    /// Description shown to the model.
    pub description: Option<String>,
    /// argv, relative to the capsule folder; the call's input JSON arrives on stdin.
    pub command: Vec<String>,
    /// JSON schema of the input; default `{"type":"object","properties":{}}`.
    pub parameters: Value,
    /// Deadline in seconds; default 300.
    pub timeout_secs: u64,
    /// `idempotent` (default false): a call found in doubt at a takeover (started, its
    /// worker died before it ended) runs again with the same `MUR_TOOL_CALL_ID`; off, the
    /// model is told it may or may not have taken effect (issue #34). Not allowed on a
    /// built-in tool.
    pub idempotent: bool,
}

/// `trace.capture`: how much of tool calls the trace keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Capture {
    /// Sizes and timings only.
    None,
    /// Inputs, sizes and timings (default).
    #[default]
    Meta,
    /// Also tool outputs.
    Content,
}

/// The `trace:` block.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TraceConfig {
    /// Default `meta`.
    pub capture: Capture,
}

/// Why a manifest was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Error {
    /// The text is not YAML of the manifest's shape (an unknown key, a wrong type, an enum
    /// value outside its set); the message names the field path and the line.
    #[error("{0}")]
    Parse(String),
    /// The shape is right but values break rules; one line per broken rule.
    #[error("{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

// ---------------------------------------------------------------------------------------
// Raw shape: every field optional, unknown keys refused; numbers wide so that the rule,
// not the integer type, produces the message.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct Raw {
    name: Option<String>,
    /// Read as the scalar's text, quoted or not: an unquoted `1.10` stays `1.10` (YAML's
    /// number reading would make it 1.1), `1.0` stays `1.0`.
    version: Option<Label>,
    description: Option<String>,
    inference: Option<RawInference>,
    context: Option<RawContext>,
    lifecycle: Option<RawLifecycle>,
    capabilities: Option<RawCapabilities>,
    hooks: Option<Vec<RawHook>>,
    tools: Option<Vec<RawTool>>,
    trace: Option<RawTrace>,
    /// `sandbox:` written with no value is a block of defaults, not an absent one.
    #[serde(default, deserialize_with = "sandbox::present")]
    sandbox: Option<Option<sandbox::RawSandbox>>,
    mcp_servers: Option<Vec<mcp::RawMcpServer>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawInference {
    transport: Option<Transport>,
    driver: Option<DriverKind>,
    endpoint: Option<String>,
    model: Option<String>,
    api_key: Option<String>,
    stream: Option<bool>,
    max_turns: Option<Int>,
    max_tokens: Option<Int>,
    max_tokens_param: Option<MaxTokensParam>,
    system_prompt: Option<String>,
    system_prompt_file: Option<String>,
    compaction: Option<RawCompaction>,
    script: Option<String>,
    command: Option<Argv>,
    timeout_secs: Option<Int>,
    idle_timeout_secs: Option<Int>,
    max_retries: Option<Int>,
    max_session_tokens: Option<Int>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawCompaction {
    threshold: Option<Real>,
    model: Option<String>,
    system_prompt: Option<String>,
    dump_summaries: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawContext {
    max_tokens: Option<Int>,
    seed_budget: Option<Real>,
    seed_overflow_margin: Option<Real>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawLifecycle {
    task_acceptance: Option<TaskAcceptance>,
    after_task: Option<AfterTask>,
    max_task_reopens: Option<Int>,
    shell_grace_secs: Option<Int>,
    queue_depth: Option<Int>,
    conversation: Option<Conversation>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawCapabilities {
    shell: Option<RawShell>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawShell {
    allow: Option<Vec<String>>,
    idempotent: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawHook {
    name: Option<String>,
    binding: Option<Binding>,
    execution_mode: Option<ExecutionMode>,
    commit_policy: Option<CommitPolicy>,
    command: Option<Argv>,
    timeout_secs: Option<Int>,
    persistent: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawTool {
    name: Option<String>,
    description: Option<String>,
    command: Option<Argv>,
    parameters: Option<Value>,
    timeout_secs: Option<Int>,
    idempotent: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
struct RawTrace {
    capture: Option<Capture>,
}

/// A command: a list of strings, or one string naming the program alone.
#[derive(Deserialize)]
#[serde(untagged)]
enum Argv {
    One(String),
    Many(Vec<String>),
}

impl Argv {
    fn into_vec(self) -> Vec<String> {
        match self {
            Argv::One(s) => vec![s],
            Argv::Many(v) => v,
        }
    }
}

/// Collects rule violations as `path: rule` lines.
#[derive(Default)]
struct Rules(Vec<String>);

impl Rules {
    fn fail(&mut self, path: &str, rule: impl fmt::Display) {
        self.0.push(format!("{path}: {rule}"));
    }

    /// An integer field with a lower bound and a default, at most `i64::MAX`.
    fn int(&mut self, path: &str, value: Option<Int>, min: i64, default: i64) -> i64 {
        self.bounded(path, value, min, i64::MAX, default)
    }

    /// [`Rules::int`] for a field held as a `u32` (a count): also at most `u32::MAX`, so a
    /// larger value is refused rather than wrapped around to a small one.
    fn count(&mut self, path: &str, value: Option<Int>, min: u32, default: u32) -> u32 {
        self.bounded(path, value, min, u32::MAX, default)
    }

    /// `value` if it is in `min..=max`, else `default` and the rule broken.
    fn bounded<T>(&mut self, path: &str, value: Option<Int>, min: T, max: T, default: T) -> T
    where
        T: Copy + Into<i128> + TryFrom<i128>,
    {
        let Some(value) = value else { return default };
        value.within(min, max).unwrap_or_else(|rule| {
            self.fail(path, rule);
            default
        })
    }

    /// A fraction in (0, 1] (or [0, max] with `zero_ok`).
    fn fraction(&mut self, path: &str, value: Option<Real>, default: f64, zero_ok: bool) -> f64 {
        let Some(value) = value else { return default };
        match value.number() {
            Some(v) if v.is_finite() && v <= 1.0 && if zero_ok { v >= 0.0 } else { v > 0.0 } => v,
            _ => {
                let range = if zero_ok { "[0, 1]" } else { "(0, 1]" };
                self.fail(path, format_args!("must be a number in {range}, got {value}"));
                default
            }
        }
    }
}

/// A scalar's text as written, quoted or not (`1.10`, `1`, `true`); a list or a mapping
/// is refused naming the rule (`invalid type: sequence, expected 1-64 characters on one
/// line (1.0.0)`).
struct Label(String);

impl<'de> Deserialize<'de> for Label {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Label, D::Error> {
        struct Scalar;
        impl serde::de::Visitor<'_> for Scalar {
            type Value = Label;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(VERSION_RULE.trim_start_matches("must be "))
            }
            fn visit_str<E>(self, v: &str) -> Result<Label, E> {
                Ok(Label(v.to_string()))
            }
        }
        // As a string: serde_yaml_ng hands a plain scalar's text as written (YAML's number
        // reading would make `1.10` 1.1).
        deserializer.deserialize_string(Scalar)
    }
}

/// Whether `c` shows as something: not white space and not one of the invisible
/// format characters (zero-width space and joiners, word joiner, soft hyphen, BOM, Hangul
/// fillers), so a `version` of only those reads as empty and is refused.
fn is_visible(c: char) -> bool {
    !c.is_whitespace()
        && !matches!(
            c,
            '\u{00AD}'
                | '\u{034F}'
                | '\u{115F}'
                | '\u{1160}'
                | '\u{180E}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2060}'..='\u{2064}'
                | '\u{3164}'
                | '\u{FEFF}'
                | '\u{FFA0}'
        )
}

/// Whether `name` is a valid capsule, hook or tool name: 1–64 chars of `a-z 0-9 - _`,
/// starting with a letter or digit.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// The rule of a manifest's `version` (see [`Manifest::version`]).
pub const VERSION_RULE: &str = "must be 1-64 characters on one line (1.0.0)";
const NAME_RULE: &str = "must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit";

/// Replaces every `${VAR}` in `value` with `env(VAR)`; an unset variable is an error
/// naming it. Text without `${` is returned unchanged.
pub fn resolve_env(value: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return Err(format!("unterminated ${{ in {value:?}"));
        };
        let var = &after[..end];
        if var.is_empty() || !var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!("invalid variable name {var:?}"));
        }
        match env(var) {
            Some(v) => out.push_str(&v),
            None => return Err(format!("environment variable {var} is not set")),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Whether an endpoint URL is acceptable: `https` to any host, `http` only to a loopback
/// host (`localhost`, `127.0.0.0/8`, `::1`). Returns the rule broken otherwise.
pub fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let url = url::Url::parse(endpoint).map_err(|e| format!("not a valid URL ({e}): {endpoint:?}"))?;
    match url.scheme() {
        "https" => Ok(()),
        "http" => {
            let loopback = match url.host() {
                Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
                Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
                Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
                None => false,
            };
            if loopback {
                Ok(())
            } else {
                Err(format!("plain http is allowed only for loopback hosts, use https: {endpoint:?}"))
            }
        }
        other => Err(format!("scheme must be https (or http to a loopback host), got {other:?}")),
    }
}

impl Manifest {
    /// Parses and validates `murmur.yaml` text. `env` resolves `${VAR}` in
    /// `inference.api_key`.
    ///
    /// # Errors
    /// [`Error::Parse`] for YAML that does not fit the shape (an unknown key, a wrong
    /// type, an enum value outside its set), naming the field path; [`Error::Invalid`]
    /// listing every broken rule, one `path: rule` line each.
    pub fn from_yaml(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Manifest, Error> {
        let raw: Raw = serde_yaml_ng::from_str(crate::without_bom(text)).map_err(|e| Error::Parse(e.to_string()))?;
        validate(raw, env)
    }
}

fn validate(raw: Raw, env: &dyn Fn(&str) -> Option<String>) -> Result<Manifest, Error> {
    let mut r = Rules::default();

    let name = match raw.name {
        None => {
            r.fail("name", "required");
            String::new()
        }
        Some(n) => {
            if !is_valid_name(&n) {
                r.fail("name", format_args!("{NAME_RULE}, got {n:?}"));
            }
            n
        }
    };
    let version = match raw.version {
        None => {
            r.fail("version", "required");
            String::new()
        }
        Some(Label(v)) => {
            if !v.chars().any(is_visible) || v.len() > 64 || v.chars().any(char::is_control) {
                r.fail("version", format_args!("{VERSION_RULE}, got {v:?}"));
            }
            v
        }
    };

    let inference = match raw.inference {
        None => {
            r.fail("inference", "required");
            None
        }
        Some(i) => Some(validate_inference(i, env, &mut r)),
    };

    let rc = raw.context.unwrap_or(RawContext { max_tokens: None, seed_budget: None, seed_overflow_margin: None });
    let context = Context {
        max_tokens: rc.max_tokens.map(|v| r.int("context.max_tokens", Some(v), 1, 1) as u64),
        seed_budget: r.fraction("context.seed_budget", rc.seed_budget, 0.10, false),
        seed_overflow_margin: r.fraction("context.seed_overflow_margin", rc.seed_overflow_margin, 0.10, true),
    };

    let rl = raw.lifecycle.unwrap_or(RawLifecycle {
        task_acceptance: None,
        after_task: None,
        max_task_reopens: None,
        shell_grace_secs: None,
        queue_depth: None,
        conversation: None,
    });
    let lifecycle = Lifecycle {
        task_acceptance: rl.task_acceptance.unwrap_or(TaskAcceptance::Single),
        after_task: rl.after_task.unwrap_or(AfterTask::Exit),
        max_task_reopens: r.count("lifecycle.max_task_reopens", rl.max_task_reopens, 0, 1),
        shell_grace_secs: r.int("lifecycle.shell_grace_secs", rl.shell_grace_secs, 0, 10) as u64,
        queue_depth: r.count("lifecycle.queue_depth", rl.queue_depth, 1, 1),
        conversation: rl.conversation.unwrap_or(Conversation::Stateless),
    };
    if lifecycle.after_task == AfterTask::Sleep && lifecycle.task_acceptance != TaskAcceptance::Queue {
        r.fail("lifecycle.after_task", "sleep requires task_acceptance: queue");
    }

    let shell = raw.capabilities.and_then(|c| c.shell);
    let shell_idempotent = shell.as_ref().and_then(|s| s.idempotent);
    let shell_allow = shell.and_then(|s| s.allow).unwrap_or_default();
    if shell_idempotent.is_some() && shell_allow.is_empty() {
        r.fail(
            "capabilities.shell.idempotent",
            "allowed only with capabilities.shell.allow (no shell tool to apply to)",
        );
    }
    let shell_idempotent = shell_idempotent.unwrap_or(false);
    let mut seen = BTreeSet::new();
    for (i, bin) in shell_allow.iter().enumerate() {
        let path = format!("capabilities.shell.allow[{i}]");
        if bin.is_empty() || bin.contains('/') || bin.chars().any(char::is_whitespace) {
            r.fail(&path, format_args!("must be a binary name without '/' or spaces, got {bin:?}"));
        } else if !seen.insert(bin.clone()) {
            r.fail(&path, format_args!("duplicate binary {bin:?}"));
        }
    }

    let hooks = raw
        .hooks
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, h)| validate_hook(i, h, &mut r))
        .collect::<Vec<_>>();
    let mut hook_names = BTreeSet::new();
    for (i, h) in hooks.iter().enumerate() {
        if !h.name.is_empty() && !hook_names.insert(h.name.clone()) {
            r.fail(&format!("hooks[{i}].name"), format_args!("duplicate hook name {:?}", h.name));
        }
    }

    let tools = raw
        .tools
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, t)| validate_tool(i, t, &mut r))
        .collect::<Vec<_>>();
    let mut tool_names: BTreeSet<String> = shell_allow.iter().cloned().collect();
    for (i, t) in tools.iter().enumerate() {
        if !t.name.is_empty() && !tool_names.insert(t.name.clone()) {
            r.fail(
                &format!("tools[{i}].name"),
                format_args!("duplicate tool name {:?} (shell tools are named after their binary)", t.name),
            );
        }
    }

    let trace = TraceConfig { capture: raw.trace.and_then(|t| t.capture).unwrap_or_default() };
    let sandbox = raw.sandbox.map(|s| sandbox::validate(s.unwrap_or_default(), &mut r));
    let mcp_servers = mcp::validate(raw.mcp_servers.unwrap_or_default(), env, &mut r);

    if !r.0.is_empty() {
        return Err(Error::Invalid(r.0));
    }
    Ok(Manifest {
        name,
        version,
        description: raw.description,
        inference: inference.expect("inference present when no rule failed"),
        context,
        lifecycle,
        capabilities: Capabilities { shell_allow, shell_idempotent },
        hooks,
        tools,
        trace,
        sandbox,
        mcp_servers,
    })
}

fn validate_inference(i: RawInference, env: &dyn Fn(&str) -> Option<String>, r: &mut Rules) -> Inference {
    let transport = i.transport.unwrap_or(Transport::Http);
    let process = transport == Transport::Process;
    if process {
        for (field, present) in [
            ("endpoint", i.endpoint.is_some()),
            ("api_key", i.api_key.is_some()),
            ("driver", i.driver.is_some()),
            ("max_tokens", i.max_tokens.is_some()),
            ("max_tokens_param", i.max_tokens_param.is_some()),
            ("idle_timeout_secs", i.idle_timeout_secs.is_some()),
        ] {
            if present {
                r.fail(
                    &format!("inference.{field}"),
                    "not allowed when transport is process (the program owns its own model calls)",
                );
            }
        }
        if i.command.is_none() {
            r.fail("inference.command", "required when transport is process");
        }
    } else {
        if i.command.is_some() {
            r.fail("inference.command", "allowed only when transport is process");
        }
        match i.driver {
            None => r.fail("inference.driver", "required when transport is http (openai, anthropic or scripted)"),
            Some(DriverKind::Scripted) => {
                if i.script.is_none() {
                    r.fail("inference.script", "required when driver is scripted");
                }
            }
            Some(kind) => {
                if i.endpoint.is_none() {
                    r.fail("inference.endpoint", format_args!("required when driver is {}", kind.as_str()));
                }
                if i.model.is_none() {
                    r.fail("inference.model", format_args!("required when driver is {}", kind.as_str()));
                }
            }
        }
        if i.script.is_some() && i.driver != Some(DriverKind::Scripted) {
            r.fail("inference.script", "allowed only when driver is scripted");
        }
        if i.max_tokens_param.is_some() && i.driver != Some(DriverKind::Openai) {
            r.fail("inference.max_tokens_param", "allowed only when driver is openai");
        }
    }
    if let Some(ep) = &i.endpoint
        && !process
        && let Err(rule) = check_endpoint(ep)
    {
        r.fail("inference.endpoint", rule);
    }
    let api_key = match i.api_key {
        Some(k) if !process => match resolve_env(&k, env) {
            Ok(v) => Some(v),
            Err(rule) => {
                r.fail("inference.api_key", rule);
                None
            }
        },
        _ => None,
    };
    let command = i.command.map(Argv::into_vec);
    if let Some(c) = &command
        && (c.is_empty() || c[0].is_empty())
    {
        r.fail("inference.command", "must name a program");
    }
    let system_prompt = match (i.system_prompt, i.system_prompt_file) {
        (Some(_), Some(_)) => {
            r.fail("inference.system_prompt", "system_prompt and system_prompt_file are mutually exclusive, give one");
            SystemPrompt::None
        }
        (Some(p), None) => SystemPrompt::Inline(p.trim().to_string()),
        (None, Some(f)) => SystemPrompt::File(f),
        (None, None) => SystemPrompt::None,
    };
    let rc = i.compaction.unwrap_or(RawCompaction {
        threshold: None,
        model: None,
        system_prompt: None,
        dump_summaries: None,
    });
    let compaction = Compaction {
        threshold: r.fraction("inference.compaction.threshold", rc.threshold, 0.98, false),
        model: rc.model,
        system_prompt: rc.system_prompt,
        dump_summaries: rc.dump_summaries.unwrap_or(false),
    };
    let timeout_secs = r.int("inference.timeout_secs", i.timeout_secs, 1, 300) as u64;
    let idle_timeout_secs = match i.idle_timeout_secs {
        None => timeout_secs,
        Some(v) => {
            let idle = r.int("inference.idle_timeout_secs", Some(v), 1, 1) as u64;
            if idle > timeout_secs {
                r.fail(
                    "inference.idle_timeout_secs",
                    format_args!("must be at most inference.timeout_secs ({timeout_secs}), got {idle}"),
                );
            }
            idle
        }
    };
    Inference {
        transport,
        driver: if process { None } else { i.driver },
        endpoint: if process { None } else { i.endpoint },
        model: i.model,
        api_key,
        stream: i.stream.unwrap_or(false),
        max_turns: r.count("inference.max_turns", i.max_turns, 1, 10),
        max_tokens: r.count("inference.max_tokens", i.max_tokens, 1, 8192),
        system_prompt,
        compaction,
        script: i.script,
        command,
        timeout_secs,
        idle_timeout_secs,
        max_tokens_param: if process { None } else { i.max_tokens_param },
        max_retries: r.count("inference.max_retries", i.max_retries, 0, 3),
        max_session_tokens: i.max_session_tokens.map(|v| r.int("inference.max_session_tokens", Some(v), 1, 1) as u64),
    }
}

fn validate_hook(i: usize, h: RawHook, r: &mut Rules) -> Hook {
    let path = |f: &str| format!("hooks[{i}].{f}");
    let name = match h.name {
        None => {
            r.fail(&path("name"), "required");
            String::new()
        }
        Some(n) => {
            if !is_valid_name(&n) {
                r.fail(&path("name"), format_args!("{NAME_RULE}, got {n:?}"));
            }
            n
        }
    };
    let command = match h.command.map(Argv::into_vec) {
        None => {
            r.fail(&path("command"), "required");
            Vec::new()
        }
        Some(c) if c.is_empty() || c[0].is_empty() => {
            r.fail(&path("command"), "must name a program");
            c
        }
        Some(c) => {
            if let Some(b) = c[0].strip_prefix("builtin:")
                && !matches!(b, "compact" | "memory")
            {
                r.fail(
                    &path("command"),
                    format_args!("unknown built-in hook {:?} (builtin:compact, builtin:memory)", c[0]),
                );
            }
            c
        }
    };
    let execution_mode = h.execution_mode.unwrap_or(ExecutionMode::Blocking);
    let commit_policy = h.commit_policy.unwrap_or(CommitPolicy::None);
    // Staging checks (issue #4; the runtime reference, §2 "Validation at staging").
    let who = format!(
        "hook {name:?} (binding {}, commit_policy {})",
        h.binding.map_or("<all>", Binding::as_str),
        commit_policy.as_str()
    );
    if execution_mode == ExecutionMode::Async && commit_policy != CommitPolicy::None {
        r.fail(
            &path("execution_mode"),
            format_args!("{who}: an async hook's answer is discarded, so its commit_policy must be none"),
        );
    }
    if h.binding == Some(Binding::OnStage) && execution_mode != ExecutionMode::Blocking {
        r.fail(&path("execution_mode"), format_args!("{who}: on-stage hooks must be blocking"));
    }
    if let Some(b) = h.binding
        && commit_policy != CommitPolicy::None
        && b.honoured_policy() != Some(commit_policy)
    {
        let honoured = b.honoured_policy().map_or("none".to_string(), |p| format!("none or {}", p.as_str()));
        r.fail(&path("commit_policy"), format_args!("{who}: binding {} can only honour {honoured}", b.as_str()));
    }
    Hook {
        name,
        binding: h.binding,
        execution_mode,
        commit_policy,
        command,
        timeout_secs: r.int(&path("timeout_secs"), h.timeout_secs, 1, 30) as u64,
        persistent: h.persistent.unwrap_or(false),
    }
}

fn validate_tool(i: usize, t: RawTool, r: &mut Rules) -> ToolDecl {
    let path = |f: &str| format!("tools[{i}].{f}");
    let name = match t.name {
        None => {
            r.fail(&path("name"), "required");
            String::new()
        }
        Some(n) => {
            if !is_valid_name(&n) {
                r.fail(&path("name"), format_args!("{NAME_RULE}, got {n:?}"));
            }
            n
        }
    };
    let command = match t.command.map(Argv::into_vec) {
        None => {
            r.fail(&path("command"), "required");
            Vec::new()
        }
        Some(c) => {
            if c.is_empty() || c[0].is_empty() {
                r.fail(&path("command"), "must name a program");
            } else if let Some(b) = c[0].strip_prefix("builtin:") {
                // `builtin:fleet_run extra` (one string) or `[builtin:fleet_run, extra]`.
                let (name, args) = match b.split_once(char::is_whitespace) {
                    Some((name, more)) => (name, std::iter::once(more.trim()).chain(c[1..].iter().map(String::as_str))),
                    None => (b, std::iter::once("").chain(c[1..].iter().map(String::as_str))),
                };
                let args: Vec<&str> = args.filter(|a| !a.is_empty()).collect();
                if BUILTIN_TOOLS.contains(&name) && !args.is_empty() {
                    r.fail(
                        &path("command"),
                        format_args!("builtin:{name} takes no arguments, got {:?}", args.join(" ")),
                    );
                } else if !BUILTIN_TOOLS.contains(&name) {
                    r.fail(
                        &path("command"),
                        format_args!(
                            "unknown built-in tool {:?} (builtin:fleet_send, builtin:fleet_run, builtin:job_status)",
                            c.join(" ")
                        ),
                    );
                }
                if t.parameters.is_some() {
                    r.fail(&path("parameters"), "a built-in tool has its own; remove it");
                }
                if t.idempotent.is_some() {
                    r.fail(&path("idempotent"), "a built-in tool decides its own retries; remove it");
                }
            }
            c
        }
    };
    let parameters = match t.parameters {
        None => serde_json::json!({"type": "object", "properties": {}}),
        Some(p) if p.is_object() => p,
        Some(_) => {
            r.fail(&path("parameters"), "must be a JSON schema object");
            Value::Null
        }
    };
    ToolDecl {
        name,
        description: t.description,
        command,
        parameters,
        timeout_secs: r.int(&path("timeout_secs"), t.timeout_secs, 1, 300) as u64,
        idempotent: t.idempotent.unwrap_or(false),
    }
}

#[cfg(test)]
mod tests;
