//! The `mur` binary starts and documents its commands. (This test also makes
//! `cargo test --workspace` build the binary that the `tests/` crate runs.)

use std::process::Command;

#[test]
fn help_lists_every_command() {
    let out = Command::new(env!("CARGO_BIN_EXE_mur")).arg("--help").output().expect("run mur");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in ["run", "trace", "task", "capsule", "dev", "coordinator", "worker"] {
        assert!(text.contains(cmd), "{cmd} missing from:\n{text}");
    }
}

/// A reader that leaves early (`mur trace steps … | head -1`) ends `mur` by SIGPIPE, as it
/// ends `cat`, not with a panic on the failed print (exit 101).
#[test]
fn a_reader_that_leaves_early_ends_mur_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("ses_pipe");
    std::fs::create_dir_all(&session).unwrap();
    // Enough rows to overflow a pipe's buffer many times over.
    let line = |i: usize| {
        format!(
            r#"{{"event_type":"task_start","session_id":"ses_pipe","task_id":"tsk_{i}","lane":"user","origin":"user"}}"#
        )
    };
    let lines: Vec<String> = (0..20_000).map(line).collect();
    std::fs::write(session.join("trace.jsonl"), lines.join("\n")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mur"))
        .args(["trace", "steps", session.to_str().unwrap()])
        .env_remove("NATS_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run mur");
    let mut first = [0u8; 16];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    drop(child.stdout.take()); // the reader leaves
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

fn refused(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_mur")).args(args).env_remove("NATS_URL").output().expect("run mur");
    assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
    assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Bad arguments are refused before anything connects, naming the argument and the rule
/// (no server listens at the default URL here).
#[test]
fn bad_arguments_are_refused_naming_the_argument_before_connecting() {
    for id in ["", "*", ">", "a.b"] {
        assert_eq!(
            refused(&["job", "status", id]),
            format!("mur: RUN_ID: must be letters, digits, '-' or '_' (a run id or <run id>-<n>), got {id:?}\n")
        );
    }
    let err = refused(&["task", "ls", "--state", "bogus"]);
    assert!(err.contains("invalid value 'bogus' for '--state <STATE>'"), "{err}");
    assert!(err.contains("[possible values: submitted, working, completed, failed, canceled, rejected]"), "{err}");
    for cmd in ["worker", "dev"] {
        let err = refused(&[cmd, "--slots", "0"]);
        assert!(err.contains("invalid value '0' for '--slots <SLOTS>': 0 is not in 1..="), "{err}");
    }
}

/// No server at the URL: the command says where it looked, what to do, and the cause once
/// (the client's error names its cause and gives it again as its source: it was said twice).
#[test]
fn an_unreachable_server_is_named_with_its_cause_said_once() {
    // A port nobody listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("nats://127.0.0.1:{port}");
    assert_eq!(
        refused(&["capsule", "ls", "--server", &url]),
        format!(
            "mur: cannot reach NATS at {url} (start a cluster with `mur dev`, or set --server / NATS_URL): IO error: Connection refused (os error 111)\n"
        )
    );
}

/// With `--json` a failure is one JSON object on stderr, `{"code": …, "error": …}`, with the
/// exit status 2 and nothing on stdout: a refused command line is `invalid_request` with
/// clap's rule and its context on one line; a failure that is not the coordinator's
/// refusal has code `null`. A `--json` after `--` is a value, not the flag.
#[test]
fn with_json_a_failure_is_one_json_object_on_stderr_with_its_code() {
    assert_eq!(
        refused(&["task", "ls", "--state", "bogus", "--json"]),
        "{\"code\":\"invalid_request\",\"error\":\"invalid value 'bogus' for '--state <STATE>' \
         [possible values: submitted, working, completed, failed, canceled, rejected]\"}\n"
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("nats://127.0.0.1:{port}");
    let err = refused(&["capsule", "ls", "--server", &url, "--json"]);
    let parsed: serde_json::Value = serde_json::from_str(&err).expect("one JSON object");
    assert_eq!(
        parsed,
        serde_json::json!({"code": null, "error": format!(
            "cannot reach NATS at {url} (start a cluster with `mur dev`, or set --server / NATS_URL): IO error: Connection refused (os error 111)"
        )})
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // (A server URL refused before anything connects: `mur task send` tries an unreachable
    // one again for 30 s.)
    assert!(
        refused(&["task", "send", "--server", "http://127.0.0.1:1", "greeter", "--", "--json"])
            .starts_with("mur: --server / NATS_URL: "),
        "after `--`, --json is the task's text"
    );
    // A command line the CLI refuses itself, past clap, is `invalid_request` too.
    let said: serde_json::Value = serde_json::from_str(&refused(&["job", "status", "a.b", "--json"])).unwrap();
    assert_eq!(
        said,
        serde_json::json!({"code": "invalid_request",
            "error": "RUN_ID: must be letters, digits, '-' or '_' (a run id or <run id>-<n>), got \"a.b\""})
    );
    let said: serde_json::Value = serde_json::from_str(&refused(&["task", "send", "greeter", "--json"])).unwrap();
    assert_eq!(said["code"], "invalid_request", "{said}");
}

/// A `--server` URL of a scheme the client does not speak is refused naming the schemes
/// that work, before anything connects (issue #29: `http://…` said it could not reach NATS,
/// as though the server were down); a password in it is never printed.
#[test]
fn a_server_url_of_another_scheme_is_refused_naming_the_schemes_that_work() {
    assert_eq!(
        refused(&["capsule", "ls", "--server", "http://127.0.0.1:4222"]),
        "mur: --server / NATS_URL: http://127.0.0.1:4222: the scheme must be nats:// or tls:// (or none: HOST:PORT \
         means nats://), got http://; an HTTP URL is a capsule's or coordinator's A2A endpoint, for \
         `mur task send --url URL`\n"
    );
    let said: serde_json::Value =
        serde_json::from_str(&refused(&["task", "ls", "--server", "wss://ann:s3cret@example.com", "--json"])).unwrap();
    assert_eq!(
        said,
        serde_json::json!({"code": "invalid_request", "error": "--server / NATS_URL: wss://ann:***@example.com: the \
                           scheme must be nats:// or tls:// (or none: HOST:PORT means nats://), got wss://"})
    );
    // An unreachable server's URL is printed without its password too.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let said = refused(&["capsule", "ls", "--server", &format!("nats://ann:s3cret@127.0.0.1:{port}")]);
    assert!(said.starts_with(&format!("mur: cannot reach NATS at nats://ann:***@127.0.0.1:{port} (")), "{said}");
    assert!(!said.contains("s3cret"), "{said}");
}
