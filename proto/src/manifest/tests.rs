//! Manifest rules, one test per rule, each checking the exact message.
use super::*;

const MINIMAL: &str = "name: demo\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n";

fn env(k: &str) -> Option<String> {
    (k == "TEST_KEY").then(|| "sk-test".to_string())
}

fn load(yaml: &str) -> Result<Manifest, Error> {
    Manifest::from_yaml(yaml, &env)
}

/// The rule lines of an invalid manifest.
fn rules(yaml: &str) -> Vec<String> {
    match load(yaml) {
        Err(Error::Invalid(lines)) => lines,
        other => panic!("expected rule violations, got {other:?}"),
    }
}

fn with_inference(lines: &str) -> String {
    format!("name: demo\nversion: 1.0.0\ninference:\n{lines}")
}

#[test]
fn defaults_follow_the_seeds() {
    let m = load(MINIMAL).unwrap();
    assert_eq!(m.inference.transport, Transport::Http);
    assert_eq!(m.inference.max_turns, 10);
    assert_eq!(m.inference.max_tokens, 8192);
    assert!(!m.inference.stream);
    assert_eq!(m.inference.compaction.threshold, 0.98);
    assert_eq!(m.inference.timeout_secs, 300);
    assert_eq!(m.inference.max_retries, 3);
    assert_eq!(m.inference.max_session_tokens, None);
    assert_eq!(m.context.max_tokens, None);
    assert_eq!(m.context.seed_budget, 0.10);
    assert_eq!(m.context.seed_overflow_margin, 0.10);
    assert_eq!(m.lifecycle.task_acceptance, TaskAcceptance::Single);
    assert_eq!(m.lifecycle.after_task, AfterTask::Exit);
    assert_eq!(m.lifecycle.max_task_reopens, 1);
    assert_eq!(m.lifecycle.shell_grace_secs, 10);
    assert_eq!(m.lifecycle.queue_depth, 1);
    assert_eq!(m.lifecycle.conversation, Conversation::Stateless);
    assert_eq!(m.trace.capture, Capture::Meta);
    assert_eq!(m.inference.system_prompt, SystemPrompt::None);
    assert!(m.hooks.is_empty() && m.tools.is_empty() && m.capabilities.shell_allow.is_empty());
}

#[test]
fn scripted_driver_needs_neither_endpoint_nor_model() {
    let m = load(MINIMAL).unwrap();
    assert_eq!(m.inference.driver, Some(DriverKind::Scripted));
    assert_eq!(m.inference.endpoint, None);
    assert_eq!(m.inference.model, None);
    assert_eq!(m.inference.script.as_deref(), Some("replies.yaml"));
}

#[test]
fn max_turns_zero_is_rejected() {
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  max_turns: 0\n");
    assert_eq!(rules(&y), ["inference.max_turns: must be at least 1, got 0"]);
}

#[test]
fn max_tokens_zero_is_rejected_and_large_values_are_kept() {
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  max_tokens: 0\n");
    assert_eq!(rules(&y), ["inference.max_tokens: must be at least 1, got 0"]);
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  max_tokens: 1000000\n");
    assert_eq!(load(&y).unwrap().inference.max_tokens, 1_000_000);
}

#[test]
fn max_task_reopens_zero_is_accepted() {
    let y = format!("{MINIMAL}lifecycle:\n  max_task_reopens: 0\n");
    assert_eq!(load(&y).unwrap().lifecycle.max_task_reopens, 0);
    let y = format!("{MINIMAL}lifecycle:\n  max_task_reopens: -1\n");
    assert_eq!(rules(&y), ["lifecycle.max_task_reopens: must be at least 0, got -1"]);
}

#[test]
fn compaction_threshold_must_be_in_zero_one() {
    for (v, ok) in [("0", false), ("-0.5", false), ("1.5", false), ("1", true), ("0.5", true)] {
        let y = with_inference(&format!("  driver: scripted\n  script: r.yaml\n  compaction:\n    threshold: {v}\n"));
        if ok {
            assert!(load(&y).is_ok(), "{v}");
        } else {
            let got = rules(&y);
            assert_eq!(got.len(), 1, "{v}");
            assert!(got[0].starts_with("inference.compaction.threshold: must be a number in (0, 1], got"), "{got:?}");
        }
    }
}

#[test]
fn context_max_tokens_zero_is_rejected() {
    let y = format!("{MINIMAL}context:\n  max_tokens: 0\n");
    assert_eq!(rules(&y), ["context.max_tokens: must be at least 1, got 0"]);
    let y = format!("{MINIMAL}context:\n  max_tokens: 1000\n  seed_budget: 0.25\n");
    let m = load(&y).unwrap();
    assert_eq!(m.context.max_tokens, Some(1000));
    assert_eq!(m.context.seed_budget_tokens(), 250);
}

#[test]
fn seed_budget_is_floored() {
    let y = format!("{MINIMAL}context:\n  max_tokens: 999\n");
    assert_eq!(load(&y).unwrap().context.seed_budget_tokens(), 99);
    assert_eq!(load(MINIMAL).unwrap().context.seed_budget_tokens(), 0);
}

#[test]
fn seed_budget_and_margin_ranges() {
    let y = format!("{MINIMAL}context:\n  seed_budget: 0\n  seed_overflow_margin: -0.1\n");
    assert_eq!(
        rules(&y),
        [
            "context.seed_budget: must be a number in (0, 1], got 0",
            "context.seed_overflow_margin: must be a number in [0, 1], got -0.1"
        ]
    );
}

#[test]
fn unknown_keys_are_errors_naming_the_field() {
    let err = load(&format!("{MINIMAL}colour: blue\n")).unwrap_err().to_string();
    assert!(err.starts_with("unknown field `colour`, expected one of"), "{err}");
    let err = load(&with_inference("  driver: scripted\n  script: r.yaml\n  max_turn: 3\n")).unwrap_err().to_string();
    assert!(err.starts_with("inference: unknown field `max_turn`"), "{err}");
    let err = load(&format!("{MINIMAL}lifecycle:\n  task_acceptence: queue\n")).unwrap_err().to_string();
    assert!(err.starts_with("lifecycle: unknown field `task_acceptence`"), "{err}");
}

#[test]
fn bad_enum_values_name_the_field_and_the_allowed_values() {
    let err = load(&with_inference("  transport: grpc\n")).unwrap_err().to_string();
    assert!(err.starts_with("inference.transport: unknown variant `grpc`, expected `http` or `process`"), "{err}");
    let err = load(&with_inference("  driver: gemini\n")).unwrap_err().to_string();
    assert!(
        err.starts_with(
            "inference.driver: unknown variant `gemini`, expected one of `openai`, `anthropic`, `scripted`"
        ),
        "{err}"
    );
    let err = load(&format!("{MINIMAL}lifecycle:\n  task_acceptance: many\n")).unwrap_err().to_string();
    assert!(err.starts_with("lifecycle.task_acceptance: unknown variant `many`"), "{err}");
}

#[test]
fn wrong_types_name_the_field() {
    assert_eq!(
        rules(&with_inference("  driver: scripted\n  script: r.yaml\n  max_turns: lots\n")),
        ["inference.max_turns: must be a whole number, got \"lots\""]
    );
    // A fraction's field says its rule for a value that is no number, or one past f64
    // (which YAML reads as a string), as for one out of its range.
    for (value, shown) in [("half", "\"half\""), ("1e400", "\"1e400\""), ("[0.5]", "a list"), (".inf", "inf")] {
        assert_eq!(
            rules(&format!("{MINIMAL}context:\n  max_tokens: 1000\n  seed_budget: {value}\n")),
            [format!("context.seed_budget: must be a number in (0, 1], got {shown}")]
        );
    }
}

#[test]
fn name_and_version_are_required() {
    let y = "inference:\n  driver: scripted\n  script: r.yaml\n";
    assert_eq!(rules(y), ["name: required", "version: required"]);
    let y = "name: Demo App\nversion: 1\ninference:\n  driver: scripted\n  script: r.yaml\n";
    assert_eq!(
        rules(y),
        ["name: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got \"Demo App\""]
    );
}

#[test]
fn an_unquoted_version_is_kept_as_written_not_read_as_a_number() {
    // YAML would read an unquoted 1.10 as the number 1.1, and 1.0 as 1.
    for (written, kept) in
        [("1.0", "1.0"), ("1.10", "1.10"), ("1", "1"), ("'2.0'", "2.0"), ("1.0.0-rc.1", "1.0.0-rc.1")]
    {
        let y = format!("name: demo\nversion: {written}\ninference:\n  driver: scripted\n  script: r.yaml\n");
        assert_eq!(load(&y).unwrap().version, kept, "version: {written}");
    }
}

/// Issue #29 asked what a version is: a label taken as written (`Manifest::version`), so a
/// YAML number is accepted as its text; a list or a mapping is refused naming the rule
/// (it said `expected a string`).
#[test]
fn a_version_is_a_label_taken_as_written_and_a_list_or_mapping_is_refused_by_its_rule() {
    for (written, kept) in [("1", "1"), ("7", "7"), ("1e3", "1e3"), ("0x10", "0x10"), ("2026-12-01", "2026-12-01")] {
        assert_eq!(load(&MINIMAL.replace("1.0.0", written)).unwrap().version, kept, "version: {written}");
    }
    for (written, kind) in [("[1]", "sequence"), ("{major: 1}", "map")] {
        assert_eq!(
            load(&MINIMAL.replace("1.0.0", written)).unwrap_err().to_string(),
            format!("version: invalid type: {kind}, expected 1-64 characters on one line (1.0.0) at line 2 column 10")
        );
    }
}

#[test]
fn inference_block_is_required() {
    assert_eq!(rules("name: demo\nversion: 1.0.0\n"), ["inference: required"]);
}

#[test]
fn http_drivers_need_endpoint_and_model() {
    assert_eq!(
        rules(&with_inference("  driver: openai\n")),
        ["inference.endpoint: required when driver is openai", "inference.model: required when driver is openai"]
    );
    assert_eq!(
        rules(&with_inference("  model: x\n")),
        ["inference.driver: required when transport is http (openai, anthropic or scripted)"]
    );
    assert_eq!(rules(&with_inference("  driver: scripted\n")), ["inference.script: required when driver is scripted"]);
    assert_eq!(
        rules(&with_inference(
            "  driver: openai\n  endpoint: https://api.example.com/v1\n  model: m\n  script: r.yaml\n"
        )),
        ["inference.script: allowed only when driver is scripted"]
    );
}

#[test]
fn endpoint_https_anywhere_http_only_on_loopback() {
    let base = |ep: &str| with_inference(&format!("  driver: openai\n  model: m\n  endpoint: {ep}\n"));
    for ok in [
        "https://api.openai.com/v1",
        "http://localhost:8000/v1",
        "http://127.0.0.1:11434/v1",
        "http://127.1.2.3/v1",
        "http://[::1]:8000/v1",
    ] {
        assert!(load(&base(ok)).is_ok(), "{ok}");
    }
    assert_eq!(
        rules(&base("http://10.0.0.5:8000/v1")),
        ["inference.endpoint: plain http is allowed only for loopback hosts, use https: \"http://10.0.0.5:8000/v1\""]
    );
    assert_eq!(
        rules(&base("ftp://example.com/v1")),
        ["inference.endpoint: scheme must be https (or http to a loopback host), got \"ftp\""]
    );
    let got = rules(&base("not a url"));
    assert!(got[0].starts_with("inference.endpoint: not a valid URL"), "{got:?}");
}

#[test]
fn api_key_env_var_is_resolved_at_load() {
    let y = with_inference("  driver: openai\n  model: m\n  endpoint: https://x.example/v1\n  api_key: ${TEST_KEY}\n");
    assert_eq!(load(&y).unwrap().inference.api_key.as_deref(), Some("sk-test"));
    let y =
        with_inference("  driver: openai\n  model: m\n  endpoint: https://x.example/v1\n  api_key: ${MISSING_KEY}\n");
    assert_eq!(rules(&y), ["inference.api_key: environment variable MISSING_KEY is not set"]);
    let y = with_inference("  driver: openai\n  model: m\n  endpoint: https://x.example/v1\n  api_key: literal\n");
    assert_eq!(load(&y).unwrap().inference.api_key.as_deref(), Some("literal"));
}

#[test]
fn system_prompt_sources_are_exclusive() {
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  system_prompt: a\n  system_prompt_file: p.md\n");
    assert_eq!(
        rules(&y),
        ["inference.system_prompt: system_prompt and system_prompt_file are mutually exclusive, give one"]
    );
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  system_prompt: \"  be brief \\n\"\n");
    assert_eq!(load(&y).unwrap().inference.system_prompt, SystemPrompt::Inline("be brief".into()));
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  system_prompt_file: prompt.md\n");
    assert_eq!(load(&y).unwrap().inference.system_prompt, SystemPrompt::File("prompt.md".into()));
}

#[test]
fn process_transport_refuses_http_fields() {
    let y = with_inference(
        "  transport: process\n  command: [./agent.sh]\n  endpoint: https://x.example\n  api_key: k\n  driver: openai\n  max_tokens: 5\n",
    );
    assert_eq!(
        rules(&y),
        [
            "inference.endpoint: not allowed when transport is process (the program owns its own model calls)",
            "inference.api_key: not allowed when transport is process (the program owns its own model calls)",
            "inference.driver: not allowed when transport is process (the program owns its own model calls)",
            "inference.max_tokens: not allowed when transport is process (the program owns its own model calls)",
        ]
    );
    assert_eq!(
        rules(&with_inference("  transport: process\n")),
        ["inference.command: required when transport is process"]
    );
    let m = load(&with_inference("  transport: process\n  command: [./agent.sh, --quiet]\n")).unwrap();
    assert_eq!(m.inference.command, Some(vec!["./agent.sh".to_string(), "--quiet".to_string()]));
    assert_eq!(m.inference.driver, None);
}

#[test]
fn lifecycle_values_and_combinations() {
    let y = format!(
        "{MINIMAL}lifecycle:\n  task_acceptance: queue\n  after_task: sleep\n  queue_depth: 4\n  shell_grace_secs: 0\n"
    );
    let m = load(&y).unwrap();
    assert_eq!(m.lifecycle.task_acceptance, TaskAcceptance::Queue);
    assert_eq!(m.lifecycle.after_task, AfterTask::Sleep);
    assert_eq!(m.lifecycle.queue_depth, 4);
    assert_eq!(m.lifecycle.shell_grace_secs, 0);
    let y = format!("{MINIMAL}lifecycle:\n  after_task: sleep\n");
    assert_eq!(rules(&y), ["lifecycle.after_task: sleep requires task_acceptance: queue"]);
    let y = format!("{MINIMAL}lifecycle:\n  task_acceptance: queue\n  queue_depth: 0\n");
    assert_eq!(rules(&y), ["lifecycle.queue_depth: must be at least 1, got 0"]);
}

#[test]
fn shell_allow_lists_binary_names() {
    let y = format!("{MINIMAL}capabilities:\n  shell:\n    allow: [sh, git, cargo]\n");
    assert_eq!(load(&y).unwrap().capabilities.shell_allow, ["sh", "git", "cargo"]);
    let y = format!("{MINIMAL}capabilities:\n  shell:\n    allow: [/bin/sh, sh, sh]\n");
    assert_eq!(
        rules(&y),
        [
            "capabilities.shell.allow[0]: must be a binary name without '/' or spaces, got \"/bin/sh\"",
            "capabilities.shell.allow[2]: duplicate binary \"sh\""
        ]
    );
}

#[test]
fn hooks_get_defaults_and_staging_checks() {
    let y = format!(
        "{MINIMAL}hooks:\n  - name: gate\n    binding: on-task-end\n    commit_policy: reopen-task\n    command: [./gate.sh]\n"
    );
    let h = &load(&y).unwrap().hooks[0];
    assert_eq!(h.execution_mode, ExecutionMode::Blocking);
    assert_eq!(h.timeout_secs, 30);
    assert!(!h.persistent);
    assert_eq!(h.command, ["./gate.sh"]);

    let y = format!(
        "{MINIMAL}hooks:\n  - name: a\n    binding: on-task-end\n    execution_mode: async\n    commit_policy: reopen-task\n    command: x\n"
    );
    assert_eq!(
        rules(&y),
        [
            "hooks[0].execution_mode: hook \"a\" (binding on-task-end, commit_policy reopen-task): an async hook's answer is discarded, so its commit_policy must be none"
        ]
    );
    let y = format!("{MINIMAL}hooks:\n  - name: s\n    binding: on-stage\n    execution_mode: async\n    command: x\n");
    assert_eq!(
        rules(&y),
        ["hooks[0].execution_mode: hook \"s\" (binding on-stage, commit_policy none): on-stage hooks must be blocking"]
    );
    let y = format!(
        "{MINIMAL}hooks:\n  - name: m\n    binding: on-inference\n    commit_policy: reopen-task\n    command: x\n"
    );
    assert_eq!(
        rules(&y),
        [
            "hooks[0].commit_policy: hook \"m\" (binding on-inference, commit_policy reopen-task): binding on-inference can only honour none"
        ]
    );
    let y = format!(
        "{MINIMAL}hooks:\n  - name: m\n    binding: on-task-start\n    commit_policy: replace-context\n    command: x\n"
    );
    assert_eq!(
        rules(&y),
        [
            "hooks[0].commit_policy: hook \"m\" (binding on-task-start, commit_policy replace-context): binding on-task-start can only honour none or seed-context"
        ]
    );
    let y = format!("{MINIMAL}hooks:\n  - name: m\n    command: builtin:nope\n");
    assert_eq!(
        rules(&y),
        ["hooks[0].command: unknown built-in hook \"builtin:nope\" (builtin:compact, builtin:memory)"]
    );
    let y = format!("{MINIMAL}hooks:\n  - name: m\n    command: x\n  - name: m\n    command: y\n");
    assert_eq!(rules(&y), ["hooks[1].name: duplicate hook name \"m\""]);
    let err = load(&format!("{MINIMAL}hooks:\n  - name: m\n    binding: on-everything\n    command: x\n"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("hooks[0].binding: unknown variant `on-everything`"), "{err}");
}

#[test]
fn declared_tools_need_a_command_and_unique_names() {
    let y = format!(
        "{MINIMAL}capabilities:\n  shell:\n    allow: [sh]\ntools:\n  - name: lookup\n    command: [./lookup.sh]\n  - name: sh\n    command: x\n  - name: bad\n"
    );
    assert_eq!(
        rules(&y),
        [
            "tools[2].command: required",
            "tools[1].name: duplicate tool name \"sh\" (shell tools are named after their binary)"
        ]
    );
    let y = format!("{MINIMAL}tools:\n  - name: lookup\n    command: [./lookup.sh]\n");
    let t = &load(&y).unwrap().tools[0];
    assert_eq!(t.parameters, serde_json::json!({"type": "object", "properties": {}}));
    assert_eq!(t.timeout_secs, 300);
}

#[test]
fn idempotent_is_off_by_default_on_tools_and_shell_and_refused_where_it_cannot_apply() {
    let y = format!("{MINIMAL}capabilities:\n  shell:\n    allow: [sh]\ntools:\n  - name: lookup\n    command: x\n");
    let m = load(&y).unwrap();
    assert!(!m.tools[0].idempotent && !m.capabilities.shell_idempotent);
    let y = format!(
        "{MINIMAL}capabilities:\n  shell:\n    allow: [sh]\n    idempotent: true\ntools:\n  - name: lookup\n    command: x\n    idempotent: true\n"
    );
    let m = load(&y).unwrap();
    assert!(m.tools[0].idempotent && m.capabilities.shell_idempotent);
    let y = format!(
        "{MINIMAL}capabilities:\n  shell:\n    idempotent: true\ntools:\n  - name: send\n    command: builtin:fleet_send\n    idempotent: false\n"
    );
    assert_eq!(
        rules(&y),
        [
            "capabilities.shell.idempotent: allowed only with capabilities.shell.allow (no shell tool to apply to)",
            "tools[0].idempotent: a built-in tool decides its own retries; remove it",
        ]
    );
    let err = load(&format!("{MINIMAL}tools:\n  - name: t\n    command: x\n    idempotent: maybe\n")).unwrap_err();
    assert!(err.to_string().starts_with("tools[0].idempotent: invalid type"), "{err}");
}

#[test]
fn every_broken_rule_is_reported_at_once() {
    let y = "name: demo\nversion: 1\ninference:\n  driver: scripted\n  script: r.yaml\n  max_turns: 0\n  max_tokens: 0\nlifecycle:\n  queue_depth: 0\n";
    assert_eq!(rules(y).len(), 3);
}

#[test]
fn a_built_in_tool_must_be_one_of_the_three_and_keeps_its_own_parameters() {
    let y = format!("{MINIMAL}tools:\n  - name: send\n    command: builtin:fleet_send\n");
    let m = Manifest::from_yaml(&y, &|_| None).unwrap();
    assert_eq!(m.tools[0].command, ["builtin:fleet_send"]);
    let y =
        format!("{MINIMAL}tools:\n  - name: t\n    command: builtin:fleet_stop\n    parameters: {{type: object}}\n");
    assert_eq!(
        rules(&y),
        [
            "tools[0].command: unknown built-in tool \"builtin:fleet_stop\" (builtin:fleet_send, builtin:fleet_run, builtin:job_status)",
            "tools[0].parameters: a built-in tool has its own; remove it",
        ]
    );
    let y = format!("{MINIMAL}tools:\n  - name: t\n    command: builtin:fleet_run extra\n");
    assert_eq!(rules(&y), ["tools[0].command: builtin:fleet_run takes no arguments, got \"extra\""]);
    let y = format!("{MINIMAL}tools:\n  - name: t\n    command: [builtin:nope, x]\n");
    assert_eq!(
        rules(&y),
        [
            "tools[0].command: unknown built-in tool \"builtin:nope x\" (builtin:fleet_send, builtin:fleet_run, builtin:job_status)"
        ]
    );
}

#[test]
fn counts_beyond_u32_are_refused_not_wrapped_around() {
    // 2^32 once became 0 turns (and a queue depth of 0 refused every task).
    let over = "4294967296";
    let cases = [
        (
            with_inference(&format!("  driver: scripted\n  script: r.yaml\n  max_turns: {over}\n")),
            "inference.max_turns",
        ),
        (
            with_inference(&format!("  driver: scripted\n  script: r.yaml\n  max_tokens: {over}\n")),
            "inference.max_tokens",
        ),
        (
            with_inference(&format!("  driver: scripted\n  script: r.yaml\n  max_retries: {over}\n")),
            "inference.max_retries",
        ),
        (format!("{MINIMAL}lifecycle:\n  max_task_reopens: {over}\n"), "lifecycle.max_task_reopens"),
        (format!("{MINIMAL}lifecycle:\n  task_acceptance: queue\n  queue_depth: {over}\n"), "lifecycle.queue_depth"),
    ];
    for (y, field) in cases {
        assert_eq!(rules(&y), [format!("{field}: must be at most 4294967295, got 4294967296")], "{field}");
    }
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  max_turns: 4294967295\n");
    assert_eq!(load(&y).unwrap().inference.max_turns, u32::MAX);
}

#[test]
fn integers_past_64_bits_are_refused_by_the_fields_range_and_fractions_as_not_whole() {
    // Past 64 bits serde said `invalid type: integer `…` as u128, expected i64`.
    let past = "99999999999999999999999";
    let y = with_inference(&format!("  driver: scripted\n  script: r.yaml\n  max_turns: {past}\n"));
    assert_eq!(rules(&y), [format!("inference.max_turns: must be at most 4294967295, got {past}")]);
    let y = format!("{MINIMAL}lifecycle:\n  shell_grace_secs: {past}\n");
    assert_eq!(rules(&y), [format!("lifecycle.shell_grace_secs: must be at most 9223372036854775807, got {past}")]);
    let y = format!("{MINIMAL}lifecycle:\n  shell_grace_secs: -{past}\n");
    assert_eq!(rules(&y), [format!("lifecycle.shell_grace_secs: must be at least 0, got -{past}")]);
    let y = format!("{MINIMAL}lifecycle:\n  shell_grace_secs: 9223372036854775807\n");
    assert_eq!(load(&y).unwrap().lifecycle.shell_grace_secs, 9_223_372_036_854_775_807);
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  max_turns: 1.5\n");
    assert_eq!(rules(&y), ["inference.max_turns: must be a whole number, got 1.5"]);
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  max_turns: 1e27\n");
    assert_eq!(rules(&y), ["inference.max_turns: must be a whole number, got 1e27"]);
    let y = with_inference("  driver: scripted\n  script: r.yaml\n  max_turns: \"5\"\n");
    assert_eq!(rules(&y), ["inference.max_turns: must be a whole number, got \"5\""]);
}

#[test]
fn a_block_of_the_wrong_type_is_named_as_a_mapping_not_an_internal_type() {
    let err = load("name: demo\nversion: 1.0.0\ninference: 5\n").unwrap_err().to_string();
    assert_eq!(err, "inference: invalid type: integer `5`, expected a mapping at line 3 column 12");
}

#[test]
fn a_version_is_one_line_of_1_to_64_characters() {
    // Written YAML-quoted, each reads back in the message as Rust quotes it: the same text.
    for bad in ["\"\"", "\"  \"", "\"1.0\\n2.0\"", &format!("\"{}\"", "1".repeat(65))] {
        assert_eq!(
            rules(&MINIMAL.replace("version: 1.0.0", &format!("version: {bad}"))),
            [format!("version: must be 1-64 characters on one line (1.0.0), got {bad}")],
        );
    }
    assert_eq!(load(&MINIMAL.replace("1.0.0", "2026.12-rc1")).unwrap().version, "2026.12-rc1");
    // Nothing visible (a zero-width space, a BOM, a soft hyphen and a space) is as empty.
    assert_eq!(
        rules(&MINIMAL.replace("version: 1.0.0", "version: \"\\u200B\\uFEFF\\u00AD \"")),
        ["version: must be 1-64 characters on one line (1.0.0), got \"\\u{200b}\\u{feff}\\u{ad} \""],
    );
    assert_eq!(load(&MINIMAL.replace("1.0.0", "\"\\u200B1.0\"")).unwrap().version, "\u{200b}1.0");
}

#[test]
fn a_leading_byte_order_mark_is_read_past() {
    let m = load(&format!("\u{feff}{MINIMAL}")).unwrap();
    assert_eq!(m.name, "demo");
}

#[test]
fn a_sandbox_block_is_read_with_its_limits_and_an_absent_one_is_none() {
    assert_eq!(load(MINIMAL).unwrap().sandbox, None);
    let y = format!(
        "{MINIMAL}sandbox:\n  read: [/usr, /etc/ssl, ~/.cargo]\n  write: [/tmp]\n  network: none\n  memory_mb: 2048\n  \
         pids: 256\n  cpu_secs: 600\n"
    );
    let s = load(&y).unwrap().sandbox.unwrap();
    assert_eq!(s.read, ["/usr", "/etc/ssl", "~/.cargo"]);
    assert_eq!(s.write, ["/tmp"]);
    assert_eq!(s.network, Network::None);
    assert_eq!((s.memory_mb, s.pids, s.cpu_secs), (Some(2048), Some(256), Some(600)));
    let bare = load(&format!("{MINIMAL}sandbox:\n")).unwrap().sandbox;
    assert_eq!(
        bare,
        load(&format!("{MINIMAL}sandbox: {{}}\n")).unwrap().sandbox,
        "sandbox: alone is a block of defaults"
    );
    let s = load(&format!("{MINIMAL}sandbox: {{}}\n")).unwrap().sandbox.unwrap();
    assert_eq!(
        (s.network, s.memory_mb, s.pids, s.cpu_secs),
        (Network::None, None, None, None),
        "network defaults to none"
    );
    let s = load(&format!("{MINIMAL}sandbox:\n  network: loopback\n")).unwrap().sandbox.unwrap();
    assert_eq!(s.network, Network::Loopback);
    let s = load(&format!("{MINIMAL}sandbox:\n  network: ['*:443', '127.0.0.1:8080']\n")).unwrap().sandbox.unwrap();
    assert_eq!(s.network.to_string(), "[*:443, 127.0.0.1:8080]");
}

#[test]
fn sandbox_rules_name_the_field() {
    let err = load(&format!("{MINIMAL}sandbox:\n  memory: 5\n")).unwrap_err().to_string();
    assert!(err.starts_with("sandbox: unknown field `memory`, expected one of"), "{err}");
    let y = format!(
        "{MINIMAL}sandbox:\n  read: ['']\n  write: ['~root/x']\n  network: [localhost]\n  memory_mb: 0\n  pids: 0\n  \
         cpu_secs: 0\n"
    );
    assert_eq!(
        rules(&y),
        [
            "sandbox.read[0]: must be a path, got \"\"",
            "sandbox.write[0]: ~ stands for the capsule home alone (~/dir), got \"~root/x\"",
            "sandbox.network[0]: must be host:port (*:443, 127.0.0.1:8080, [::1]:80, api.example.com:443), got \
             \"localhost\"",
            "sandbox.memory_mb: must be at least 1, got 0",
            "sandbox.pids: must be at least 1, got 0",
            "sandbox.cpu_secs: must be at least 1, got 0",
        ]
    );
    assert_eq!(
        rules(&format!("{MINIMAL}sandbox:\n  network: everything\n")),
        ["sandbox.network: must be none, loopback or a list of host:port, got \"everything\""]
    );
}

#[test]
fn an_mcp_servers_block_is_read_with_its_transports_and_defaults() {
    let y = format!(
        "{MINIMAL}mcp_servers:\n  - name: git\n    command: [uvx, mcp-server-git, --repository, .]\n    env: {{ GIT_AUTHOR_NAME: murmur, KEY: \"${{TEST_KEY}}\" }}\n    tools: [git_status, git_diff]\n    timeout_secs: 60\n    idempotent: [git_status]\n  - name: docs\n    url: https://mcp.example.com/mcp\n    headers: {{ Authorization: \"Bearer ${{TEST_KEY}}\" }}\n"
    );
    let m = load(&y).unwrap();
    assert_eq!(
        m.mcp_servers,
        vec![
            McpServer {
                name: "git".into(),
                transport: McpTransport::Stdio {
                    command: vec!["uvx".into(), "mcp-server-git".into(), "--repository".into(), ".".into()],
                    env: [("GIT_AUTHOR_NAME".to_string(), "murmur".to_string()), ("KEY".into(), "sk-test".into())]
                        .into_iter()
                        .collect(),
                },
                tools: Some(vec!["git_status".into(), "git_diff".into()]),
                timeout_secs: 60,
                idempotent: vec!["git_status".into()],
            },
            McpServer {
                name: "docs".into(),
                transport: McpTransport::Http {
                    url: "https://mcp.example.com/mcp".into(),
                    headers: [("Authorization".to_string(), "Bearer sk-test".to_string())].into_iter().collect(),
                },
                tools: None,
                timeout_secs: 300,
                idempotent: vec![],
            },
        ]
    );
    assert_eq!(load(MINIMAL).unwrap().mcp_servers, vec![]);
}

#[test]
fn mcp_server_rules_name_the_field() {
    let err = load(&format!("{MINIMAL}mcp_servers:\n  - name: git\n    command: [x]\n    cwd: /tmp\n"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("mcp_servers[0]: unknown field `cwd`, expected one of"), "{err}");
    let y = format!(
        "{MINIMAL}mcp_servers:\n  - name: git\n    command: [a]\n  - name: git\n    command: [b]\n  - name: both\n    \
         command: [c]\n    url: https://x.example/mcp\n  - name: neither\n  - name: Bad.Name\n    command: [d]\n  - \
         name: web\n    url: http://example.com/mcp\n    env: {{A: b}}\n  - name: t\n    command: [e]\n    headers: {{A: \
         b}}\n    timeout_secs: 0\n    tools: [x, x]\n    idempotent: [x, \"\", y, x]\n  - name: u\n    url: https://x.example/mcp\n    headers: {{A: \
         \"${{NOPE}}\"}}\n"
    );
    assert_eq!(
        rules(&y),
        [
            "mcp_servers[1].name: duplicate MCP server name \"git\"",
            "mcp_servers[2].command: give command (stdio) or url (streamable HTTP), not both",
            "mcp_servers[3].command: required: give command (stdio) or url (streamable HTTP)",
            "mcp_servers[4].name: must be 1-64 characters of a-z, 0-9, '-' or '_', starting with a letter or digit, got \
             \"Bad.Name\"",
            "mcp_servers[5].env: allowed only with command (a server at an url has its own)",
            "mcp_servers[5].url: plain http is allowed only for loopback hosts, use https: \"http://example.com/mcp\"",
            "mcp_servers[6].headers: allowed only with url",
            "mcp_servers[6].tools[1]: duplicate tool \"x\"",
            "mcp_servers[6].idempotent[1]: must be a tool name, got \"\"",
            "mcp_servers[6].idempotent[2]: must be one of the tools offered (mcp_servers[6].tools), got \"y\"",
            "mcp_servers[6].idempotent[3]: duplicate tool \"x\"",
            "mcp_servers[6].timeout_secs: must be at least 1, got 0",
            "mcp_servers[7].headers.A: environment variable NOPE is not set",
        ]
    );
}

#[test]
fn idle_timeout_defaults_to_the_call_timeout_and_may_not_exceed_it() {
    let openai = "  driver: openai\n  endpoint: http://127.0.0.1:1/v1\n  model: m\n";
    let m = load(&with_inference(&format!("{openai}  timeout_secs: 8\n"))).unwrap();
    assert_eq!((m.inference.timeout_secs, m.inference.idle_timeout_secs), (8, 8));
    let m = load(&with_inference(&format!("{openai}  timeout_secs: 8\n  idle_timeout_secs: 3\n"))).unwrap();
    assert_eq!(m.inference.idle_timeout_secs, 3);
    assert_eq!(
        rules(&with_inference(&format!("{openai}  timeout_secs: 8\n  idle_timeout_secs: 9\n"))),
        ["inference.idle_timeout_secs: must be at most inference.timeout_secs (8), got 9"]
    );
    assert_eq!(
        rules(&with_inference(&format!("{openai}  idle_timeout_secs: 0\n"))),
        ["inference.idle_timeout_secs: must be at least 1, got 0"]
    );
    assert_eq!(
        rules(&with_inference("  transport: process\n  command: [./a.sh]\n  idle_timeout_secs: 5\n")),
        ["inference.idle_timeout_secs: not allowed when transport is process (the program owns its own model calls)"]
    );
}

#[test]
fn max_tokens_param_is_openai_only_and_names_its_values() {
    let openai = "  driver: openai\n  endpoint: http://127.0.0.1:1/v1\n  model: m\n";
    let m = load(&with_inference(openai)).unwrap();
    assert_eq!(m.inference.max_tokens_param, None);
    let m = load(&with_inference(&format!("{openai}  max_tokens_param: max_completion_tokens\n"))).unwrap();
    assert_eq!(m.inference.max_tokens_param, Some(MaxTokensParam::MaxCompletionTokens));
    let m = load(&with_inference(&format!("{openai}  max_tokens_param: max_tokens\n"))).unwrap();
    assert_eq!(m.inference.max_tokens_param, Some(MaxTokensParam::MaxTokens));
    let anthropic = "  driver: anthropic\n  endpoint: https://api.anthropic.com\n  model: m\n";
    assert_eq!(
        rules(&with_inference(&format!("{anthropic}  max_tokens_param: max_tokens\n"))),
        ["inference.max_tokens_param: allowed only when driver is openai"]
    );
    let err = load(&with_inference(&format!("{openai}  max_tokens_param: max_output_tokens\n"))).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("inference.max_tokens_param"), "{text}");
    assert!(text.contains("max_completion_tokens"), "{text}");
}

#[test]
fn the_output_cap_key_defaults_by_endpoint_host() {
    use MaxTokensParam::{MaxCompletionTokens, MaxTokens};
    for (endpoint, want) in [
        ("https://api.openai.com/v1", MaxCompletionTokens),
        ("https://API.openai.com:443/v1/", MaxCompletionTokens),
        ("https://user@api.openai.com./v1", MaxCompletionTokens),
        ("https://api.openai.com.evil.example/v1", MaxTokens),
        ("https://example.com/api.openai.com/v1", MaxTokens),
        ("http://127.0.0.1:8080/v1", MaxTokens),
        ("https://my-resource.openai.azure.com/openai/v1", MaxTokens),
    ] {
        assert_eq!(MaxTokensParam::for_endpoint(endpoint), want, "{endpoint}");
    }
}
