//! `mur trace steps|show`: reads a session's `trace.jsonl` (the runtime reference,
//! §6). SESSION may be omitted (the latest), a full id, a unique suffix, or a path to a
//! session folder or its `trace.jsonl`.

use anyhow::{Context, Result};
use comfy_table::{Table, presets::NOTHING};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::ExitCode;

/// `mur trace …`
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// One row per turn (decision, tool, duration), with a row per task.
    Steps(Args),
    /// A summary of the session, with a Tasks section when it ran more than one task.
    Show(Args),
    /// Follow the cluster's trace stream live, one line per event.
    Tail {
        /// Only sessions of this capsule.
        #[arg(long)]
        capsule: Option<String>,
        #[command(flatten)]
        conn: crate::nats::Connection,
        /// Print the raw JSON lines.
        #[arg(long)]
        json: bool,
    },
}

/// Which session to read.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Session: omitted = latest; a full id; a unique suffix; or a path.
    session: Option<String>,
    /// Where sessions live [default: workdir].
    #[arg(long, value_name = "DIR", conflicts_with = "server")]
    workdir: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Read the session from a cluster's trace stream at this NATS URL instead of a local
    /// workdir. Without it, NATS_URL is used when set, unless --workdir is given or SESSION
    /// is a path.
    #[arg(long = "server", value_name = "URL")]
    server: Option<String>,
}

/// Where [`Args`] reads the session from.
#[derive(Debug, PartialEq, Eq)]
enum Source {
    /// The cluster's trace stream at this NATS URL.
    Cluster(String),
    /// A local workdir.
    Local(PathBuf),
}

impl Args {
    /// `--server`, else `--workdir`, else a SESSION that is a path (local), else NATS_URL
    /// when set, else the local `workdir`: an explicit local choice is never overridden by
    /// the environment.
    fn source(&self, nats_url: Option<String>) -> Source {
        if let Some(url) = &self.server {
            return Source::Cluster(url.clone());
        }
        if let Some(dir) = &self.workdir {
            return Source::Local(dir.clone());
        }
        let a_path = self.session.as_deref().is_some_and(|s| std::path::Path::new(s).exists());
        match nats_url.filter(|u| !u.trim().is_empty()) {
            Some(url) if !a_path => Source::Cluster(url),
            _ => Source::Local(PathBuf::from("workdir")),
        }
    }
}

/// The lines of a session from the cluster's trace stream (`mur.trace.<session_id>`);
/// SESSION may be a full id or a unique suffix.
async fn cluster_lines(url: &str, session: Option<&str>) -> Result<(String, Vec<Value>)> {
    use futures::StreamExt;
    let conn = crate::nats::Connection::from_env(url);
    let client = conn.connect("mur trace").await?;
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(mur_proto::cluster::TRACE_STREAM).await.context("the trace stream")?;
    let mut subjects = Vec::new();
    let mut info = stream.info_with_subjects(mur_proto::cluster::TRACE_SUBJECTS).await.context("listing sessions")?;
    while let Some(s) = info.next().await {
        let (subject, _) = s.context("listing sessions")?;
        subjects.push(subject);
    }
    subjects.sort();
    let ids: Vec<String> = subjects
        .iter()
        .filter_map(|s| s.strip_prefix(mur_proto::cluster::TRACE_SUBJECT_PREFIX))
        .map(str::to_string)
        .collect();
    let id = match session {
        None => ids.last().cloned().ok_or_else(|| anyhow::anyhow!("no sessions in the cluster's trace stream"))?,
        Some(s) => {
            let m: Vec<&String> = ids.iter().filter(|id| *id == s || id.ends_with(s)).collect();
            match m.as_slice() {
                [one] => (*one).clone(),
                [] => anyhow::bail!("no session matching {s:?} in the cluster's trace stream"),
                _ => anyhow::bail!("{s:?} matches {} sessions; give more characters", m.len()),
            }
        }
    };
    // One pass whose consumer is deleted when it is over (issue #29 item 3).
    let mut lines = Vec::new();
    let mut bad = None;
    mur_nats::read::messages(
        &stream,
        &mur_proto::cluster::trace_subject(&mur_proto::SessionId::unchecked(id.as_str())),
        |m| match serde_json::from_slice(&m.payload) {
            Ok(line) => lines.push(line),
            Err(e) => bad = bad.take().or(Some(e)),
        },
    )
    .await
    .context("reading the session")?;
    if let Some(e) = bad {
        return Err(e).context("a trace line is not JSON");
    }
    Ok((id, lines))
}

fn load(args: &Args) -> Result<(PathBuf, Vec<Value>)> {
    let workdir = match args.source(std::env::var("NATS_URL").ok()) {
        Source::Cluster(url) => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let (id, lines) = rt.block_on(cluster_lines(&url, args.session.as_deref()))?;
            return Ok((
                PathBuf::from(mur_proto::cluster::trace_subject(&mur_proto::SessionId::unchecked(id.as_str()))),
                lines,
            ));
        }
        Source::Local(dir) => dir,
    };
    let dir = mur_worker::workdir::find_session(&workdir, args.session.as_deref()).map_err(anyhow::Error::msg)?;
    let path = dir.join("trace.jsonl");
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok((path.clone(), parse_lines(&bytes, &path)?))
}

/// The JSON lines of a `trace.jsonl`, blank lines skipped. A last line without its line
/// break that does not parse was cut short (the session was killed while writing it): it
/// is left out with a note on stderr, so the trace of a killed session still reads.
///
/// # Errors
/// Any other line that is not JSON, named by its line number.
fn parse_lines(text: &[u8], path: &std::path::Path) -> Result<Vec<Value>> {
    let mut lines = Vec::new();
    let all: Vec<&[u8]> = text.strip_suffix(b"\n").unwrap_or(text).split(|b| *b == b'\n').collect();
    let count = all.len();
    for (i, line) in all.into_iter().enumerate() {
        if line.trim_ascii().is_empty() {
            continue;
        }
        // Bytes, not text: a line cut inside a multi-byte character is still the last line.
        match serde_json::from_slice(line) {
            Ok(v) => lines.push(v),
            Err(e) if i + 1 == count && !text.ends_with(b"\n") => {
                eprintln!("note: {}: line {} is cut short ({e}); left out", path.display(), i + 1);
            }
            Err(e) => return Err(e).with_context(|| format!("{}: line {} is not JSON", path.display(), i + 1)),
        }
    }
    Ok(lines)
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

fn n(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// The rows of `mur trace steps`: a `task` row at each `task_start`, a `turn` row per
/// `inference` line with its decision, first tool and the duration of that turn's first
/// tool call (the model call's when it called none).
pub fn steps(lines: &[Value]) -> Vec<Value> {
    let mut rows: Vec<Value> = Vec::new();
    for line in lines {
        match s(line, "event_type") {
            "task_start" => rows.push(json!({
                "kind": "task",
                "task_id": s(line, "task_id"),
                "lane": s(line, "lane"),
                "origin": s(line, "origin"),
                "source": s(line, "source"),
            })),
            "inference" => rows.push(json!({
                "kind": "turn",
                "task_id": s(line, "task_id"),
                "turn": n(line, "turn"),
                "decision": s(line, "decision"),
                "tool": line.get("tool_name").cloned().unwrap_or(Value::Null),
                "model_ms": n(line, "duration_ms"),
                "tool_ms": Value::Null,
                "origin": line.get("origin").cloned().unwrap_or(Value::Null),
            })),
            "tool_call" => {
                if let Some(last) = rows.last_mut()
                    && last["kind"] == "turn"
                    && last["tool_ms"].is_null()
                {
                    last["tool_ms"] = json!(n(line, "duration_ms"));
                }
            }
            _ => {}
        }
    }
    rows
}

/// `mur trace tail`: prints every trace line published from now on.
/// The detail `mur trace tail` prints after a line's session id and event type.
fn tail_detail(line: &Value) -> String {
    match s(line, "event_type") {
        "task_start" => {
            format!("{} lane {} origin {}", s(line, "task_id"), s(line, "lane"), s(line, "origin"))
        }
        "inference" => {
            format!("turn {} {} {}", n(line, "turn"), s(line, "decision"), s(line, "tool_name"))
        }
        "tool_call" => {
            format!("{} {} {} ms", s(line, "tool_name"), s(line, "status"), n(line, "duration_ms"))
        }
        "task_end" => {
            format!("{} {} ({} turns)", s(line, "task_id"), s(line, "exit_status"), n(line, "turns"))
        }
        "session_start" => format!("{} {}", s(line, "capsule_name"), s(line, "capsule_version")),
        "shell" => format!(
            "exit {} {} ms: {}",
            line["exit_code"],
            n(line, "duration_ms"),
            crate::text::cell(s(line, "command"), 60)
        ),
        _ => String::new(),
    }
}

fn tail(capsule: Option<String>, conn: crate::nats::Connection, json: bool) -> Result<ExitCode> {
    use futures::StreamExt;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let client = conn.connect("mur trace tail").await?;
        let mut sub = client.subscribe(mur_proto::cluster::TRACE_SUBJECTS).await?;
        let mut keep: std::collections::HashSet<String> = Default::default();
        while let Some(msg) = sub.next().await {
            let Ok(line) = serde_json::from_slice::<Value>(&msg.payload) else { continue };
            let sid = s(&line, "session_id").to_string();
            if let Some(c) = &capsule {
                if line["event_type"] == "session_start" && s(&line, "capsule_name") == c {
                    keep.insert(sid.clone());
                }
                if !keep.contains(&sid) {
                    continue;
                }
            }
            if json {
                println!("{line}");
            } else {
                let detail = tail_detail(&line);
                println!("{sid}  {:<16} {detail}", s(&line, "event_type"));
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    match cmd {
        Command::Tail { capsule, conn, json } => return tail(capsule, conn, json),
        Command::Steps(args) => {
            let (_, lines) = load(&args)?;
            let session = lines.first().map(|l| s(l, "session_id").to_string()).unwrap_or_default();
            let rows = steps(&lines);
            let turns = rows.iter().filter(|r| r["kind"] == "turn").count();
            if args.json {
                println!("{}", json!({"session_id": session, "turns": turns, "rows": rows}));
                return Ok(ExitCode::SUCCESS);
            }
            println!("Session {session}  ({turns} turns)");
            let mut table = Table::new();
            table.load_preset(NOTHING);
            for r in &rows {
                if r["kind"] == "task" {
                    table.add_row(vec![
                        "task".to_string(),
                        r["task_id"].as_str().unwrap_or("").to_string(),
                        format!("lane {}", r["lane"].as_str().unwrap_or("")),
                        format!("origin {}", r["origin"].as_str().unwrap_or("")),
                    ]);
                } else {
                    let ms = r["tool_ms"].as_u64().unwrap_or_else(|| r["model_ms"].as_u64().unwrap_or(0));
                    table.add_row(vec![
                        format!("{:>4}", r["turn"]),
                        r["decision"].as_str().unwrap_or("").to_string(),
                        r["tool"].as_str().unwrap_or("—").to_string(),
                        format!("{ms} ms"),
                    ]);
                }
            }
            println!("{table}");
        }
        Command::Show(args) => {
            let (path, lines) = load(&args)?;
            let summary = show(&lines);
            if args.json {
                println!("{summary}");
                return Ok(ExitCode::SUCCESS);
            }
            println!("Session {}", summary["session_id"].as_str().unwrap_or(""));
            println!("  trace       {}", path.display());
            println!(
                "  capsule     {} {}",
                summary["capsule"].as_str().unwrap_or(""),
                summary["version"].as_str().unwrap_or("")
            );
            println!(
                "  model       {} ({})",
                summary["model"].as_str().unwrap_or(""),
                summary["driver"].as_str().unwrap_or("")
            );
            // The totals come from `session_end`: a running or killed session has none.
            let total = |k: &str| if summary[k].is_null() { "-".to_string() } else { summary[k].to_string() };
            println!("  exit        {}", summary["exit_status"].as_str().unwrap_or("(running or killed)"));
            println!("  duration    {} ms", total("duration_ms"));
            println!("  turns       {}", total("turns"));
            println!("  tokens      {} in / {} out (estimated)", total("input_tokens"), total("output_tokens"));
            println!("  tool calls  {} ({} shell)", total("tool_calls"), total("shell_calls"));
            let tasks = summary["tasks"].as_array().cloned().unwrap_or_default();
            if tasks.len() > 1 {
                println!("\nTasks");
                let mut table = Table::new();
                table.load_preset(NOTHING);
                for t in tasks {
                    let id = t["task_id"].as_str().unwrap_or("");
                    table.add_row(vec![
                        id.chars().take(16).collect::<String>(),
                        t["lane"].as_str().unwrap_or("").to_string(),
                        t["exit_status"].as_str().unwrap_or("").to_string(),
                        format!("{} turns", t["turns"]),
                        format!("{} reopens", t["reopen_count"]),
                    ]);
                }
                println!("{table}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The summary `mur trace show` prints.
pub fn show(lines: &[Value]) -> Value {
    let mut out = json!({"tasks": []});
    let mut tasks: Vec<Value> = Vec::new();
    for line in lines {
        match s(line, "event_type") {
            "session_start" => {
                out["session_id"] = json!(s(line, "session_id"));
                out["capsule"] = json!(s(line, "capsule_name"));
                out["version"] = json!(s(line, "capsule_version"));
                out["model"] = json!(s(line, "model"));
                out["driver"] = json!(s(line, "driver"));
            }
            "task_start" => {
                tasks.push(json!({"task_id": s(line, "task_id"), "lane": s(line, "lane"), "origin": s(line, "origin")}))
            }
            "task_end" => {
                if let Some(t) = tasks.iter_mut().rev().find(|t| t["task_id"] == line["task_id"]) {
                    for k in ["exit_status", "turns", "reopen_count", "duration_ms"] {
                        t[k] = line.get(k).cloned().unwrap_or(json!(0));
                    }
                }
            }
            "session_end" => {
                out["exit_status"] = line["exit_status"].clone();
                out["duration_ms"] = line["duration_ms"].clone();
                out["turns"] = line["total_turns"].clone();
                out["input_tokens"] = line["total_input_tokens"].clone();
                out["output_tokens"] = line["total_output_tokens"].clone();
                out["tool_calls"] = line["total_tool_calls"].clone();
                out["shell_calls"] = line["total_shell_calls"].clone();
            }
            _ => {}
        }
    }
    out["tasks"] = json!(tasks);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_details_name_what_each_event_did() {
        let shell =
            serde_json::json!({"event_type": "shell", "exit_code": 3, "duration_ms": 12, "command": "make\ntest"});
        assert_eq!(tail_detail(&shell), "exit 3 12 ms: make test");
        let end = serde_json::json!({"event_type": "task_end", "task_id": "tsk_1", "exit_status": "ok", "turns": 2});
        assert_eq!(tail_detail(&end), "tsk_1 ok (2 turns)");
        assert_eq!(tail_detail(&serde_json::json!({"event_type": "hook_fault"})), "");
    }

    #[test]
    fn a_last_line_cut_short_is_left_out_and_any_other_bad_line_is_an_error() {
        let path = std::path::Path::new("t/trace.jsonl");
        let whole = "{\"event_type\":\"session_start\"}\n\n{\"event_type\":\"task_start\"}\n";
        assert_eq!(parse_lines(whole.as_bytes(), path).unwrap().len(), 2);
        let cut = format!("{whole}{{\"event_type\":\"tur");
        let lines = parse_lines(cut.as_bytes(), path).unwrap();
        assert_eq!(lines.iter().map(|l| s(l, "event_type")).collect::<Vec<_>>(), ["session_start", "task_start"]);
        // A bad line with its line break was written whole: an error naming its number.
        let bad = format!("{whole}{{\"event_type\":\"tur\n");
        assert_eq!(parse_lines(bad.as_bytes(), path).unwrap_err().to_string(), "t/trace.jsonl: line 4 is not JSON");
        let middle = "{\"a\":1}\nnope\n{\"b\":2}";
        assert_eq!(parse_lines(middle.as_bytes(), path).unwrap_err().to_string(), "t/trace.jsonl: line 2 is not JSON");
        // Cut inside a multi-byte character (✓ is three bytes): still the last line, left out.
        let mut mid_char = format!("{whole}{{\"command\":\"echo ✓\"}}").into_bytes();
        mid_char.truncate(mid_char.len() - 4);
        assert_eq!(parse_lines(&mid_char, path).unwrap().len(), 2);
    }
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn source(argv: &[&str], nats_url: Option<&str>) -> Source {
        let cli = Cli::try_parse_from(std::iter::once("steps").chain(argv.iter().copied())).unwrap();
        cli.args.source(nats_url.map(str::to_string))
    }

    #[test]
    fn an_explicit_workdir_or_a_session_path_wins_over_nats_url() {
        let url = Some("nats://elsewhere:4222");
        let cluster = Source::Cluster("nats://elsewhere:4222".into());
        assert_eq!(source(&[], url), cluster);
        assert_eq!(source(&["ses_1"], url), cluster);
        assert_eq!(source(&["--workdir", "/tmp/wd"], url), Source::Local("/tmp/wd".into()));
        let here = std::env::temp_dir();
        assert_eq!(source(&[here.to_str().unwrap()], url), Source::Local("workdir".into()));
        assert_eq!(source(&["--server", "nats://a:1"], url), Source::Cluster("nats://a:1".into()));
        assert_eq!(source(&[], None), Source::Local("workdir".into()));
        assert_eq!(source(&[], Some("")), Source::Local("workdir".into()));
    }

    #[test]
    fn workdir_and_server_together_are_refused() {
        let err = Cli::try_parse_from(["steps", "--workdir", "wd", "--server", "nats://a:1"]).err().unwrap();
        assert!(err.to_string().contains("cannot be used with"), "{err}");
    }
}
