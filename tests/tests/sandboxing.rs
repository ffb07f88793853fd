//! Sandboxed capsules (issue #37) end to end: `mur run` and the cluster run real commands
//! under a `sandbox:` block, and each test checks a denial the kernel makes *and* that the
//! allowed counterpart works. Where this kernel cannot enforce a rule, the run must fail
//! closed before any command runs, and the test says so in its output.

use mur_proto::task::Origin;
use mur_proto::task::TaskState;
use mur_tests::capsule::TestCapsule;
use mur_tests::mur::{Run, mur, trace_lines};
use mur_tests::sandbox::Sandbox;
use serde_json::Value;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

/// A scripted capsule that runs its task's text with `sh` and answers the tool's result,
/// confined by the `sandbox:` block `block` (YAML lines indented by two spaces), with
/// `extra` manifest text and `files`.
fn boxed(name: &str, block: &str, extra: &str, files: &[(&str, &str)]) -> TestCapsule {
    let manifest = format!(
        "name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n  max_turns: 5\n\
         capabilities:\n  shell:\n    allow: [sh]\nlifecycle:\n  shell_grace_secs: 3600\n{extra}sandbox:\n{block}"
    );
    let replies =
        "replies:\n  - tool_calls: [{ name: sh, input: { command: \"{{task}}\" } }]\n  - text: \"{{tool_result}}\"\n";
    let mut all = vec![("replies.yaml", replies)];
    all.extend_from_slice(files);
    TestCapsule::new(&manifest, &all)
}

/// A session of `mur run`: the command's result text, the trace and the session folder.
struct Session {
    result: String,
    lines: Vec<Value>,
    dir: PathBuf,
}

/// Runs `command` in `capsule` with `mur run --json`; panics unless the run starts.
fn run(capsule: &TestCapsule, command: &str) -> Session {
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(["--task", command, "--json"]));
    assert_eq!(run.code, 0, "{run:?}");
    let json = run.last_json();
    let dir = PathBuf::from(json["session_dir"].as_str().unwrap_or_else(|| panic!("{run:?}")));
    Session { result: json["result"].as_str().unwrap().to_string(), lines: trace_lines(&dir), dir }
}

/// Runs `command` in `capsule` expecting the run to be refused before any command runs;
/// returns its stderr.
fn refused(capsule: &TestCapsule, command: &str) -> String {
    let marker = capsule.dir().join("ran");
    let task = format!("touch {}; {command}", marker.display());
    let run = Run::of(mur().arg("run").arg(capsule.dir()).args(["--task", &task, "--json"]));
    assert_ne!(run.code, 0, "{run:?}");
    assert!(!marker.exists(), "no command may run: {run:?}");
    run.stderr
}

/// The stdout section of a shell tool's result text.
fn stdout(result: &str) -> &str {
    let start = result.find("\nStdout:\n").map(|i| i + "\nStdout:\n".len()).unwrap_or_else(|| panic!("{result}"));
    let end = result.find("\nStderr:\n").unwrap_or(result.len());
    &result[start..end]
}

/// The exit code in a shell tool's result text.
fn exit_code(result: &str) -> i32 {
    let line = result.lines().find_map(|l| l.strip_prefix("Exit code: ")).unwrap_or_else(|| panic!("{result}"));
    line.trim().parse().unwrap()
}

fn sandbox_lines(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l["event_type"] == "sandbox").collect()
}

/// A folder outside every allowed path, holding `secret` (made by the test).
fn outside() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "s3cret\n").unwrap();
    (dir, secret)
}

#[test]
fn reading_outside_the_allowed_paths_fails_while_the_session_folder_and_read_paths_work() {
    let (_out, secret) = outside();
    let allowed = tempfile::tempdir().unwrap();
    std::fs::write(allowed.path().join("data"), "allowed\n").unwrap();
    let block = format!("  read: [{}]\n", allowed.path().display());
    let capsule = boxed("reader", &block, "", &[]);
    let command = format!(
        "cat {}; echo mine > here && cat here && cat {}/data && cat ./MURMUR.md > /dev/null && echo own-folder",
        secret.display(),
        allowed.path().display()
    );
    let s = run(&capsule, &command);
    assert!(s.result.contains(&format!("cat: {}: Permission denied", secret.display())), "{}", s.result);
    assert!(!s.result.contains("s3cret"), "{}", s.result);
    assert!(s.result.contains("Stdout:\nmine\nallowed\nown-folder\n"), "{}", s.result);
    assert_eq!(std::fs::read_to_string(s.dir.join("here")).unwrap(), "mine\n");

    // One `sandbox` line, right after the `shell` line, with the rules applied.
    let types: Vec<&str> = s.lines.iter().map(|l| l["event_type"].as_str().unwrap()).collect();
    let shell = types.iter().position(|t| *t == "shell").unwrap();
    assert_eq!(types[shell + 1], "sandbox", "{types:?}");
    let line = sandbox_lines(&s.lines)[0];
    assert_eq!(line["tool_name"], "sh");
    assert_eq!(line["network"], "none");
    let shown = |key: &str| -> Vec<String> {
        line[key].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
    };
    assert!(shown("read").contains(&allowed.path().display().to_string()), "{line}");
    assert!(
        shown("read").contains(&std::fs::canonicalize(capsule.dir()).unwrap().display().to_string())
            || shown("read").contains(&capsule.dir().display().to_string()),
        "{line}"
    );
    assert_eq!(shown("write"), [s.dir.display().to_string()]);
    assert!(line["landlock_abi"].as_u64().unwrap() >= 3);
    for m in ["landlock", "seccomp", "no_new_privs"] {
        assert!(shown("enforced_by").contains(&m.to_string()), "{line}");
    }
}

#[test]
fn writing_outside_the_write_paths_fails_while_they_and_the_session_folder_take_writes() {
    let (out, _) = outside();
    let writable = tempfile::tempdir().unwrap();
    let block = format!("  write: [{}]\n", writable.path().display());
    let capsule = boxed("writer", &block, "", &[]);
    let denied = out.path().join("dropped");
    let command = format!(
        "echo no > {}; echo yes > {}/kept && echo session > mine && echo done",
        denied.display(),
        writable.path().display()
    );
    let s = run(&capsule, &command);
    assert!(s.result.contains("Permission denied"), "{}", s.result);
    assert!(s.result.contains("Stdout:\ndone\n"), "{}", s.result);
    assert!(!denied.exists());
    assert_eq!(std::fs::read_to_string(writable.path().join("kept")).unwrap(), "yes\n");
    assert_eq!(std::fs::read_to_string(s.dir.join("mine")).unwrap(), "session\n");
}

/// A `bash` command connecting to 127.0.0.1:`port` and printing `connected <port>`.
fn connect(port: u16) -> String {
    format!("bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected {port}'")
}

#[test]
fn network_none_refuses_a_tcp_connection_that_an_unsandboxed_command_makes() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let capsule = boxed("offline", "  network: none\n", "", &[]);
    let s = run(&capsule, &connect(port));
    assert_ne!(exit_code(&s.result), 0, "{}", s.result);
    assert_eq!(stdout(&s.result), "", "{}", s.result);
    assert!(s.result.contains("Operation not permitted") || s.result.contains("Permission denied"), "{}", s.result);
    // The same command without a sandbox connects.
    let open = mur_tests::capsule::shell_capsule("online");
    let run = Run::of(mur().arg("run").arg(open.dir()).args(["--task", &connect(port), "--json"]));
    let json = run.last_json();
    let dir = PathBuf::from(json["session_dir"].as_str().unwrap());
    let shell = trace_lines(&dir).into_iter().find(|l| l["event_type"] == "shell").unwrap();
    assert_eq!(shell["exit_code"], 0, "{run:?}");
}

#[test]
fn a_port_list_allows_that_port_only() {
    let (allowed, other) = (TcpListener::bind("127.0.0.1:0").unwrap(), TcpListener::bind("127.0.0.1:0").unwrap());
    let (a, b) = (allowed.local_addr().unwrap().port(), other.local_addr().unwrap().port());
    let capsule = boxed("ported", &format!("  network: ['*:{a}']\n"), "", &[]);
    let s = run(&capsule, &format!("{}; {}", connect(b), connect(a)));
    assert!(s.result.contains(&format!("Stdout:\nconnected {a}\n")), "{}", s.result);
    assert_eq!(stdout(&s.result), format!("connected {a}\n"), "{}", s.result);
    assert!(s.result.contains("Permission denied"), "{}", s.result);
    assert_eq!(sandbox_lines(&s.lines)[0]["network"], format!("[*:{a}]"));
}

/// A `bash` command connecting to `host`:`port` and printing `connected <host>:<port>`.
fn connect_to(host: &str, port: u16) -> String {
    format!("bash -c 'exec 3<>/dev/tcp/{host}/{port} && echo connected {host}:{port}'")
}

/// Whether this host can enforce address rules (nftables on a cgroup v2 group); prints
/// why not when it cannot, for the tests that then prove the fail-closed path.
fn fences() -> Result<(), String> {
    mur_worker::sandbox::netfilter::available().inspect_err(|why| {
        println!("this host cannot enforce address rules ({why}): proving the fail-closed path instead");
    })
}

/// Runs `f` on a thread in a network namespace of its own (root only) whose loopback
/// device also holds 192.0.2.1 — a non-loopback address of "this host" that no packet can
/// leave the namespace for; the processes the thread starts are in it too. `None`
/// (printed) where no namespace can be made.
fn in_private_network<T: Send>(f: impl FnOnce() -> T + Send) -> Option<T> {
    std::thread::scope(|scope| {
        scope.spawn(move || {
        // SAFETY: unshare on this thread only (CLONE_NEWNET affects the calling thread).
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            println!("no network namespace ({}): the non-loopback half is not run", std::io::Error::last_os_error());
            return None;
        }
        for args in [&["link", "set", "lo", "up"][..], &["addr", "add", "192.0.2.1/32", "dev", "lo"]] {
            let out = std::process::Command::new("ip").args(args).output();
            if !out.as_ref().is_ok_and(|o| o.status.success()) {
                println!("cannot set up the namespace's loopback (ip {args:?}: {out:?}): the non-loopback half is not run");
                return None;
            }
        }
        Some(f())
    }).join().unwrap()
    })
}

#[test]
fn loopback_reaches_a_loopback_listener_and_not_a_non_loopback_address_of_this_host() {
    let capsule = boxed("looped", "  network: loopback\n", "", &[]);
    if let Err(why) = fences() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let err = refused(&capsule, &connect(listener.local_addr().unwrap().port()));
        assert!(err.contains("sandbox.network: loopback cannot be enforced on this machine"), "{err}");
        assert!(err.contains(&why), "{err}");
        return;
    }
    let ran = in_private_network(|| {
        let listener = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // Unsandboxed, both addresses take the connection.
        for host in ["127.0.0.1", "192.0.2.1"] {
            std::net::TcpStream::connect((host, port)).unwrap_or_else(|e| panic!("{host}:{port} unsandboxed: {e}"));
        }
        let s = run(&capsule, &format!("{}; {}", connect_to("192.0.2.1", port), connect_to("127.0.0.1", port)));
        assert_eq!(stdout(&s.result), format!("connected 127.0.0.1:{port}\n"), "{}", s.result);
        assert!(s.result.contains("192.0.2.1/") && s.result.contains("No route to host"), "{}", s.result);
        let line = sandbox_lines(&s.lines)[0].clone();
        assert_eq!(line["network"], "loopback");
        assert!(line["enforced_by"].as_array().unwrap().contains(&Value::from("nftables")), "{line}");
    });
    if ran.is_none() {
        // Without a namespace: the loopback half on the host's own loopback.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let s = run(&capsule, &connect(port));
        assert_eq!(stdout(&s.result), format!("connected {port}\n"), "{}", s.result);
    }
}

#[test]
fn an_address_entry_allows_that_address_and_port_only() {
    let capsule_of = |port: u16| boxed("hosted", &format!("  network: ['127.0.0.1:{port}']\n"), "", &[]);
    let (allowed, other) = (TcpListener::bind("0.0.0.0:0").unwrap(), TcpListener::bind("127.0.0.1:0").unwrap());
    let (a, b) = (allowed.local_addr().unwrap().port(), other.local_addr().unwrap().port());
    let capsule = capsule_of(a);
    if let Err(why) = fences() {
        let err = refused(&capsule, &connect(a));
        assert!(err.contains("sandbox.network cannot be enforced on this machine"), "{err}");
        assert!(err.contains(&why), "{err}");
        return;
    }
    // Another port on the same address (Landlock refuses it), the same port on another
    // loopback address (the fence refuses it), then the entry itself.
    let command =
        format!("{}; {}; {}", connect_to("127.0.0.1", b), connect_to("127.0.0.2", a), connect_to("127.0.0.1", a));
    let s = run(&capsule, &command);
    assert_eq!(stdout(&s.result), format!("connected 127.0.0.1:{a}\n"), "{}", s.result);
    assert!(s.result.contains(&format!("127.0.0.1/{b}: Permission denied")), "{}", s.result);
    assert!(s.result.contains(&format!("127.0.0.2/{a}: No route to host")), "{}", s.result);
    std::net::TcpStream::connect(("127.0.0.2", a)).expect("unsandboxed, 127.0.0.2 takes the connection");
    let line = sandbox_lines(&s.lines)[0];
    assert_eq!(line["network"], format!("[127.0.0.1:{a}]"));
}

#[test]
fn an_address_rule_fails_closed_naming_it_when_nft_is_missing() {
    let capsule = boxed("unfenced", "  network: loopback\n", "", &[]);
    let marker = capsule.dir().join("ran");
    let task = format!("touch {}", marker.display());
    let run = Run::of(
        mur().arg("run").arg(capsule.dir()).args(["--task", &task, "--json"]).env("MUR_NFT", "/nonexistent/nft"),
    );
    assert_ne!(run.code, 0, "{run:?}");
    assert!(!marker.exists(), "no command may run: {run:?}");
    assert!(
        run.stderr.contains(
            "sandbox.network: loopback cannot be enforced on this machine: $MUR_NFT names /nonexistent/nft, which is \
             not a file"
        ),
        "{run:?}"
    );
    let capsule = boxed("named", "  network: ['localhost:80']\n", "", &[]);
    let err = refused(&capsule, "true");
    assert!(err.contains("sandbox.network[0] (localhost:80) cannot be enforced on this machine: the kernel's rules match addresses, not names"), "{err}");
}

#[test]
fn a_fork_bomb_stops_at_pids() {
    let capsule = boxed("forky", "  pids: 16\n", "", &[]);
    let spawn =
        |n: u32| format!("i=0; while [ $i -lt {n} ]; do sleep 5 & i=$((i+1)); done; echo started $i; kill $(jobs -p)");
    let s = run(&capsule, &spawn(64));
    assert_ne!(exit_code(&s.result), 0, "{}", s.result);
    assert!(s.result.contains("Cannot fork"), "{}", s.result);
    assert_eq!(stdout(&s.result), "", "{}", s.result);
    assert!(
        sandbox_lines(&s.lines)[0]["enforced_by"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m.as_str().unwrap().starts_with("cgroup"))
    );
    let s = run(&capsule, &spawn(8));
    assert!(s.result.contains("Stdout:\nstarted 8\n"), "{}", s.result);
}

#[test]
fn a_memory_hog_stops_at_memory_mb() {
    let capsule = boxed("hungry", "  memory_mb: 32\n", "", &[]);
    let hog = |bytes: u64| format!("x=$(head -c {bytes} /dev/zero | tr '\\0' a); echo held ${{#x}}");
    let s = run(&capsule, &hog(256 * 1024 * 1024));
    assert_eq!(exit_code(&s.result), 137, "killed by the OOM killer: {}", s.result);
    assert_eq!(stdout(&s.result), "", "{}", s.result);
    let s = run(&capsule, &hog(1024 * 1024));
    assert!(s.result.contains("Stdout:\nheld 1048576\n"), "{}", s.result);
}

#[test]
fn a_busy_loop_stops_at_cpu_secs() {
    let capsule = boxed("busy", "  cpu_secs: 1\n", "", &[]);
    let s = run(&capsule, "while :; do :; done");
    // SIGXCPU at the limit (SIGKILL a second later for one that ignores it).
    assert!([128 + libc::SIGXCPU, 128 + libc::SIGKILL].contains(&exit_code(&s.result)), "{}", s.result);
    let s = run(&capsule, "echo quick");
    assert!(s.result.contains("Exit code: 0\nStdout:\nquick\n"), "{}", s.result);
}

#[test]
fn another_sessions_folder_is_unreadable() {
    let capsule = boxed("neighbours", "  network: none\n", "", &[]);
    let first = run(&capsule, "echo private > note && cat note");
    assert!(first.result.contains("Stdout:\nprivate\n"), "{}", first.result);
    let other = first.dir.file_name().unwrap().to_str().unwrap();
    let second = run(&capsule, &format!("cat ../{other}/note; ls ../{other}; echo mine > note && cat note"));
    assert!(second.result.contains("Permission denied"), "{}", second.result);
    assert_eq!(stdout(&second.result), "mine\n", "{}", second.result);
}

#[test]
fn a_hook_is_confined_like_a_command() {
    let (_out, secret) = outside();
    let hook = format!(
        "#!/bin/sh\ncat {} > \"$MURMUR_WORKDIR/hook-read\" 2> \"$MURMUR_WORKDIR/hook-err\"\n\
         cat ./murmur.yaml > /dev/null && echo capsule-folder-readable >> \"$MURMUR_WORKDIR/hook-read\"\n\
         cat > /dev/null\necho '{{}}'\n",
        secret.display()
    );
    let extra = "hooks:\n  - name: peek\n    binding: on-task-start\n    command: [./peek.sh]\n";
    let capsule = boxed("hooked", "  network: none\n", extra, &[("peek.sh", &hook)]);
    let s = run(&capsule, "echo ran");
    assert_eq!(std::fs::read_to_string(s.dir.join("hook-read")).unwrap(), "capsule-folder-readable\n");
    let err = std::fs::read_to_string(s.dir.join("hook-err")).unwrap();
    assert!(err.contains("Permission denied"), "{err}");
    // Its own `sandbox` line, as a command's, naming the hook and the event.
    let lines = sandbox_lines(&s.lines);
    let hook = lines.iter().find(|l| l["hook_name"] == "peek").unwrap_or_else(|| panic!("{lines:?}"));
    assert_eq!(hook["event"], "on-task-start");
    assert!(hook.get("tool_name").is_none(), "{hook}");
    assert!(hook["task_id"].as_str().unwrap().starts_with("tsk_"), "{hook}");
    assert_eq!(hook["write"], lines.iter().find(|l| l["tool_name"] == "sh").unwrap()["write"]);
    let types: Vec<&str> = s.lines.iter().map(|l| l["event_type"].as_str().unwrap()).collect();
    let first_sandbox = types.iter().position(|t| *t == "sandbox").unwrap();
    assert!(first_sandbox < types.iter().position(|t| *t == "inference").unwrap(), "after on-task-start: {types:?}");
}

/// A hook (`on-task-end`) under `network: none` that posts a model call to
/// `$MURMUR_INFERENCE_URL` with bash's `/dev/tcp`, then tries another port on 127.0.0.1 and
/// the endpoint's port on 127.0.0.2; writes what each gave to `gate.*` in the session folder.
const ASKER: &str = r#"#!/bin/bash
cat > /dev/null
out="$MURMUR_WORKDIR/gate"
if [ -z "$MURMUR_INFERENCE_URL" ]; then echo no-url > "$out.reply"; echo '{}'; exit 0; fi
u=${MURMUR_INFERENCE_URL#http://}; hp=${u%%/*}; path=/${u#*/}; host=${hp%:*}; port=${hp##*:}
body='{"messages":[{"role":"user","content":"hi"}]}'
{
  exec 3<>"/dev/tcp/$host/$port" || exit 1
  printf 'POST %s HTTP/1.1
Host: %s
Content-Type: application/json
Content-Length: %d
Connection: close

%s' "$path" "$hp" "${#body}" "$body" >&3
  cat <&3
} > "$out.reply" 2> "$out.err"
(exec 3<>"/dev/tcp/127.0.0.1/$OTHER_PORT") 2> "$out.other" && echo connected >> "$out.other"
(exec 3<>"/dev/tcp/127.0.0.2/$port") 2> "$out.alias" && echo connected >> "$out.alias"
echo '{}'
"#;

#[test]
fn a_hook_under_network_none_reaches_the_inference_endpoint_and_nothing_else() {
    let other = TcpListener::bind("0.0.0.0:0").unwrap();
    let other_port = other.local_addr().unwrap().port();
    let manifest = "name: asking\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: replies.yaml\n  \
                    max_turns: 5\ncapabilities:\n  shell:\n    allow: [sh]\nhooks:\n  - name: asker\n    \
                    binding: on-task-end\n    command: [./asker.sh]\nsandbox:\n  network: none\n";
    let replies = "replies:\n  - tool_calls: [{ name: sh, input: { command: \"{{task}}\" } }]\n  - text: done\n  \
                   - text: from the gate\n";
    let asker = ASKER.replace("$OTHER_PORT", &other_port.to_string());
    let capsule = TestCapsule::new(manifest, &[("replies.yaml", replies), ("asker.sh", &asker)]);
    let s = run(&capsule, "echo ran");
    let read = |name: &str| std::fs::read_to_string(s.dir.join(format!("gate.{name}"))).unwrap_or_default();
    let hook = sandbox_lines(&s.lines).into_iter().find(|l| l["hook_name"] == "asker").cloned().unwrap();
    if let Err(why) = fences() {
        // The endpoint cannot be let through alone: the hook keeps `none` and gets no URL.
        assert_eq!(read("reply"), "no-url\n");
        assert_eq!(hook["network"], "none");
        println!("fail-closed path: the hook ran under network: none without $MURMUR_INFERENCE_URL ({why})");
        return;
    }
    let reply = read("reply");
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}{}", read("err"));
    assert!(reply.ends_with("{\"text\":\"from the gate\"}"), "{reply}");
    let port = hook["network"].as_str().unwrap().trim_start_matches("[127.0.0.1:").trim_end_matches(']').to_string();
    assert_eq!(hook["network"], format!("[127.0.0.1:{port}]"), "{hook}");
    assert!(read("other").contains(&format!("127.0.0.1/{other_port}: Permission denied")), "{}", read("other"));
    assert!(read("alias").contains(&format!("127.0.0.2/{port}: No route to host")), "{}", read("alias"));
    // The loop's own command stays under none; unsandboxed, the other port takes connections.
    let sh = sandbox_lines(&s.lines).into_iter().find(|l| l["tool_name"] == "sh").cloned().unwrap();
    assert_eq!(sh["network"], "none");
    std::net::TcpStream::connect(("127.0.0.1", other_port)).unwrap();
    let call = s.lines.iter().find(|l| l["event_type"] == "inference" && l["origin"] == "hook:asker");
    assert!(call.is_some(), "the hook's call is traced as hook:asker");
}

/// The cluster with `--require-sandbox`: a capsule without a `sandbox:` block is refused
/// (its task fails with the reason and no command runs); a sandboxed one runs confined.
#[tokio::test]
async fn a_worker_requiring_a_sandbox_refuses_bare_capsules_and_confines_the_rest() {
    let mut sb = Sandbox::start(0, 1).await;
    sb.add_worker_with("wkr-boxed", 1, |c| c.require_sandbox = true).await;
    sb.wait_ready(1).await;
    let (_out, secret) = outside();
    let marker = tempfile::tempdir().unwrap();

    let bare = mur_tests::capsule::shell_capsule("bare");
    sb.push(bare.dir()).await;
    let touched = marker.path().join("bare-ran");
    let id = sb.submit("bare", &format!("touch {}", touched.display()), Origin::User).await;
    let r = &sb.wait_all(&[id], Duration::from_secs(60)).await[0];
    assert_eq!(r.state, TaskState::Failed, "{r:?}");
    assert_eq!(
        r.result.as_deref(),
        Some(
            "this worker requires a sandbox (mur worker --require-sandbox) and capsule \"bare\" has no sandbox: block"
        )
    );
    assert!(!touched.exists(), "no command ran");

    let boxed = boxed("boxed", "  network: none\n", "", &[]);
    sb.push(boxed.dir()).await;
    let command = format!("cat {}; echo ours > here && cat here; ls ..", secret.display());
    let id = sb.submit("boxed", &command, Origin::User).await;
    let r = &sb.wait_all(&[id], Duration::from_secs(60)).await[0];
    assert_eq!(r.state, TaskState::Completed, "{r:?}");
    let result = r.result.clone().unwrap_or_default();
    assert!(result.contains(&format!("cat: {}: Permission denied", secret.display())), "{result}");
    assert!(result.contains("Stdout:\nours\n"), "{result}");
    // The sessions folder around this session's is not listable.
    assert!(result.contains("ls: cannot open directory '..': Permission denied"), "{result}");
    sb.shutdown().await;
}
