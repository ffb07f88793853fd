//! The console's pages as HTML (issue #38): pure functions from the cluster's data to a
//! `String`, every piece of text from the cluster escaped ([`escape`]: task texts, results
//! and errors are untrusted). Semantic HTML — landmarks, tables with header cells and
//! captions, labelled form fields — styled by the embedded [`STYLE`] and no script but
//! [`LIVE_SCRIPT`], which swaps the cluster section when the server sends a new one.

use super::timeline::{Entry, Timeline};
use crate::service::ListCursor;
use mur_proto::cluster::{ClusterStatus, TaskRecord};
use mur_proto::task::{Lane, Origin, TaskState};
use std::fmt::Write;

/// The stylesheet, served at `/ui/style.css`.
pub const STYLE: &str = include_str!("console.css");

/// The live-update script, served at `/ui/live.js`: an `EventSource` on `/ui/events`
/// whose `cluster` events replace the cluster section's HTML.
pub const LIVE_SCRIPT: &str = include_str!("live.js");

/// Tasks per page of the task list.
pub const PAGE_SIZE: usize = 50;

/// Every task state, in the order the filter offers them.
pub const STATES: [TaskState; 6] = [
    TaskState::Submitted,
    TaskState::Working,
    TaskState::Completed,
    TaskState::Failed,
    TaskState::Canceled,
    TaskState::Rejected,
];

/// Who is looking, as the pages show it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Viewer {
    /// The token's name, when the request carried one.
    pub token: Option<String>,
    /// Whether the viewer may act (cancel): an admin token, or no token checked.
    pub can_act: bool,
}

/// The task list's filters and where its page starts, as the query string gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskQuery {
    /// Only this capsule's tasks.
    pub capsule: Option<String>,
    /// Only tasks in this state.
    pub state: Option<TaskState>,
    /// Only tasks in this lane.
    pub lane: Option<Lane>,
    /// Only tasks of this origin.
    pub origin: Option<Origin>,
    /// Only tasks older than this one (the next page).
    pub before: Option<ListCursor>,
}

/// HTML-escapes `text` for element content and quoted attribute values: `&`, `<`, `>`,
/// `"` and `'`.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    escape_into(&mut out, text);
    out
}

fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
}

/// A duration for people: `850 ms`, `4.2 s`, `3 min 05 s`, `2 h 07 min`.
pub fn duration(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{} min {:02} s", ms / 60_000, (ms / 1000) % 60),
        _ => format!("{} h {:02} min", ms / 3_600_000, (ms / 60_000) % 60),
    }
}

/// A unix-ms time as RFC 3339 UTC to the second (`2026-12-04T02:47:12Z`).
pub fn time(ms: u64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(at).to_string()
}

/// What a path segment keeps as it is: letters, digits, `-`, `_`, `.` (ids are made of them).
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.');

/// The task's page address.
pub fn task_href(task_id: &str) -> String {
    format!("/ui/tasks/{}", percent_encoding::utf8_percent_encode(task_id, SEGMENT))
}

/// The whole document: head, skip link, navigation (`current` marked), `body` as main.
fn page(title: &str, current: &str, viewer: &Viewer, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 1024);
    out.push_str("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    out.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>");
    escape_into(&mut out, title);
    out.push_str(" · murmur</title>\n<link rel=\"stylesheet\" href=\"/ui/style.css\">\n</head>\n<body>\n");
    out.push_str("<a class=\"skip\" href=\"#main\">Skip to content</a>\n<header>\n<nav aria-label=\"Console\">\n");
    out.push_str("<span class=\"brand\">murmur</span>\n<ul>\n");
    for (href, label) in [("/ui/", "Cluster"), ("/ui/tasks", "Tasks"), ("/ui/approvals", "Approvals")] {
        let mark = if label == current { " aria-current=\"page\"" } else { "" };
        let _ = writeln!(out, "<li><a href=\"{href}\"{mark}>{label}</a></li>");
    }
    out.push_str("</ul>\n");
    if let Some(name) = &viewer.token {
        out.push_str("<form method=\"post\" action=\"/ui/logout\" class=\"who\"><span>token ");
        escape_into(&mut out, name);
        out.push_str(if viewer.can_act { " (admin)" } else { " (read)" });
        out.push_str("</span> <button type=\"submit\">Sign out</button></form>\n");
    }
    out.push_str("</nav>\n</header>\n<main id=\"main\">\n");
    out.push_str(body);
    out.push_str("</main>\n</body>\n</html>\n");
    out
}

/// A table with a caption, header cells and rows of already-escaped cells; `empty` is
/// said instead when there are no rows.
fn table(out: &mut String, caption: &str, header: &[&str], rows: &[Vec<String>], empty: &str) {
    if rows.is_empty() {
        let _ = writeln!(out, "<p class=\"empty\">{empty}</p>");
        return;
    }
    let _ = write!(out, "<table>\n<caption>{caption}</caption>\n<thead><tr>");
    for h in header {
        let _ = write!(out, "<th scope=\"col\">{h}</th>");
    }
    out.push_str("</tr></thead>\n<tbody>\n");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            let _ = write!(out, "<td>{cell}</td>");
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody>\n</table>\n");
}

fn task_link(task_id: &str) -> String {
    format!("<a href=\"{}\"><code>{}</code></a>", escape(&task_href(task_id)), escape(task_id))
}

/// The cluster page: [`cluster_section`] in a region the live script updates.
pub fn cluster_page(status: &ClusterStatus, now_ms: u64, viewer: &Viewer) -> String {
    let body = format!(
        "<h1>Cluster</h1>\n<div id=\"cluster\" data-live=\"/ui/events\">\n{}</div>\n\
         <script src=\"/ui/live.js\" defer></script>\n",
        cluster_section(status, now_ms)
    );
    page("Cluster", "Cluster", viewer, &body)
}

/// The cluster's state, as `mur cluster status` says it: leader and standbys, lanes per
/// capsule (waiting, oldest age), tasks in flight, workers (free slots, last heartbeat),
/// dead letters, fan-out permits in use and waiting steps. `now_ms` ages the permits.
pub fn cluster_section(s: &ClusterStatus, now_ms: u64) -> String {
    let mut out = String::with_capacity(4096);
    out.push_str(
        "<section aria-labelledby=\"h-leader\">\n<h2 id=\"h-leader\">Coordinators</h2>\n<dl class=\"facts\">\n",
    );
    match &s.leader {
        Some(l) => {
            let _ = writeln!(
                out,
                "<dt>Leader</dt><dd><code>{}</code> (term {}, since {})</dd>",
                escape(&l.instance),
                l.term,
                time(l.since)
            );
        }
        None => out.push_str("<dt>Leader</dt><dd class=\"bad\">none: no coordinator holds the lease</dd>\n"),
    }
    let standbys: Vec<String> = s.standbys.iter().map(|c| format!("<code>{}</code>", escape(&c.instance))).collect();
    let standbys = if standbys.is_empty() { "none".to_string() } else { standbys.join(", ") };
    let _ = writeln!(out, "<dt>Standbys</dt><dd>{standbys}</dd>\n</dl>\n</section>");

    let waiting: u64 = s.lanes.iter().map(|l| l.pending).sum();
    let _ = writeln!(
        out,
        "<section aria-labelledby=\"h-lanes\">\n<h2 id=\"h-lanes\">Lanes <span class=\"count\">{waiting} waiting</span></h2>"
    );
    let rows: Vec<Vec<String>> = s
        .lanes
        .iter()
        .map(|l| {
            vec![
                escape(&l.capsule),
                format!("<span class=\"lane lane-{0}\">{0}</span>", l.lane),
                format!("<span class=\"num\">{}</span>", l.pending),
                duration(l.oldest_age_ms),
            ]
        })
        .collect();
    table(
        &mut out,
        "Tasks waiting, per capsule and lane",
        &["Capsule", "Lane", "Waiting", "Oldest"],
        &rows,
        "No task is waiting.",
    );
    out.push_str("</section>\n");

    let _ = writeln!(
        out,
        "<section aria-labelledby=\"h-flight\">\n<h2 id=\"h-flight\">In flight <span class=\"count\">{}</span></h2>",
        s.in_flight.len()
    );
    let rows: Vec<Vec<String>> = s
        .in_flight
        .iter()
        .map(|t| {
            let cancel = if t.cancel_requested { " (cancel asked)" } else { "" };
            vec![
                task_link(t.task_id.as_str()),
                escape(&t.capsule),
                t.lane.to_string(),
                format!("{}{cancel}", t.state.as_str()),
                t.worker.as_deref().map_or_else(|| "–".to_string(), |w| format!("<code>{}</code>", escape(w))),
                t.attempt.to_string(),
                duration(t.age_ms),
            ]
        })
        .collect();
    table(
        &mut out,
        "Tasks released to workers",
        &["Task", "Capsule", "Lane", "State", "Worker", "Attempt", "Age"],
        &rows,
        "No task is in flight.",
    );
    out.push_str("</section>\n");

    let live = s.workers.iter().filter(|w| w.live);
    let (count, free, slots) = live.fold((0, 0u32, 0u32), |(n, f, t), w| (n + 1, f + w.free, t + w.slots));
    let _ = writeln!(
        out,
        "<section aria-labelledby=\"h-workers\">\n<h2 id=\"h-workers\">Workers <span class=\"count\">{count} live, \
         {free} of {slots} slots free</span></h2>"
    );
    let rows: Vec<Vec<String>> = s
        .workers
        .iter()
        .map(|w| {
            vec![
                format!("<code>{}</code>", escape(&w.worker_id)),
                w.slots.to_string(),
                w.free.to_string(),
                format!("{} ago", duration(w.heartbeat_age_ms)),
                if w.live { "live".to_string() } else { "<span class=\"bad\">silent</span>".to_string() },
            ]
        })
        .collect();
    table(
        &mut out,
        "Workers and their slots",
        &["Worker", "Slots", "Free", "Last heartbeat", "State"],
        &rows,
        "No worker has registered.",
    );
    out.push_str("</section>\n");

    let _ = writeln!(
        out,
        "<section aria-labelledby=\"h-dead\">\n<h2 id=\"h-dead\">Dead letters <span class=\"count\">{}</span></h2>",
        s.dead_letters.len()
    );
    let rows: Vec<Vec<String>> = s
        .dead_letters
        .iter()
        .map(|d| {
            vec![
                task_link(d.task_id.as_str()),
                escape(&d.capsule),
                d.dead_letter.deliveries.to_string(),
                escape(&d.dead_letter.reason),
            ]
        })
        .collect();
    table(
        &mut out,
        "Tasks given up after every delivery failed",
        &["Task", "Capsule", "Deliveries", "Reason"],
        &rows,
        "No dead letters.",
    );
    out.push_str("</section>\n");

    let f = &s.fanout;
    let _ = writeln!(
        out,
        "<section aria-labelledby=\"h-permits\">\n<h2 id=\"h-permits\">Fan-out permits <span class=\"count\">{} in use, \
         {} waiting</span></h2>",
        f.in_use,
        f.waiting.len()
    );
    let holder = |first: String, h: &mur_proto::fanout::Holder| {
        vec![
            first,
            task_link(h.task_id.as_str()),
            escape(&h.step.fleet),
            escape(&h.step.run_id),
            escape(&h.step.step),
            format!("<code>{}</code>", escape(&h.worker)),
            h.step.cap.to_string(),
            duration(now_ms.saturating_sub(h.since)),
        ]
    };
    let header = ["Slot", "Task", "Fleet", "Run", "Step", "Worker", "Cap", "For"];
    let rows: Vec<Vec<String>> = f.holders.iter().map(|h| holder(h.slot.to_string(), &h.holder)).collect();
    table(&mut out, "Permits held", &header, &rows, "No permit is held.");
    let rows: Vec<Vec<String>> = f.waiting.iter().enumerate().map(|(i, h)| holder((i + 1).to_string(), h)).collect();
    let mut waiting_header = header;
    waiting_header[0] = "Place";
    table(&mut out, "Steps waiting for a permit", &waiting_header, &rows, "No step is waiting for a permit.");
    out.push_str("</section>\n");
    out
}

/// `text` cut to `chars` characters, with `…` when cut (then escaped by the caller).
fn clipped(text: &str, chars: usize) -> String {
    let mut out: String = text.chars().take(chars).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}

/// The query string of `query` (leading `?`, or empty), for links that keep the filters.
pub fn query_string(query: &TaskQuery) -> String {
    let mut q = url::form_urlencoded::Serializer::new(String::new());
    if let Some(c) = &query.capsule {
        q.append_pair("capsule", c);
    }
    if let Some(s) = query.state {
        q.append_pair("state", s.as_str());
    }
    if let Some(l) = query.lane {
        q.append_pair("lane", l.as_str());
    }
    if let Some(o) = query.origin {
        q.append_pair("origin", o.as_str());
    }
    if let Some(b) = &query.before {
        q.append_pair("before_at", &b.submitted_at.to_string());
        q.append_pair("before_id", &b.task_id);
    }
    let q = q.finish();
    if q.is_empty() { q } else { format!("?{q}") }
}

fn select(out: &mut String, name: &str, label: &str, options: &[&str], chosen: Option<&str>) {
    let _ = write!(
        out,
        "<p><label for=\"f-{name}\">{label}</label>\n<select id=\"f-{name}\" name=\"{name}\">\n<option value=\"\">any</option>\n"
    );
    for o in options {
        let mark = if chosen == Some(*o) { " selected" } else { "" };
        let _ = writeln!(out, "<option{mark}>{o}</option>");
    }
    out.push_str("</select></p>\n");
}

/// The task list: the filter form, one page of `records` (newest first), and a link to the
/// next page when `next` is given.
pub fn tasks_page(records: &[TaskRecord], query: &TaskQuery, next: Option<&ListCursor>, viewer: &Viewer) -> String {
    let mut out = String::with_capacity(1024 + records.len() * 400);
    out.push_str("<h1>Tasks</h1>\n<form method=\"get\" action=\"/ui/tasks\" class=\"filters\" role=\"search\" aria-label=\"Filter tasks\">\n");
    out.push_str("<p><label for=\"f-capsule\">Capsule</label>\n<input id=\"f-capsule\" name=\"capsule\" value=\"");
    escape_into(&mut out, query.capsule.as_deref().unwrap_or(""));
    out.push_str("\" autocomplete=\"off\"></p>\n");
    let states: Vec<&str> = STATES.iter().map(|s| s.as_str()).collect();
    select(&mut out, "state", "State", &states, query.state.map(TaskState::as_str));
    let lanes: Vec<&str> = Lane::ALL.iter().map(|l| l.as_str()).collect();
    select(&mut out, "lane", "Lane", &lanes, query.lane.map(Lane::as_str));
    let origins: Vec<&str> = Origin::ALL.iter().map(|o| o.as_str()).collect();
    select(&mut out, "origin", "Origin", &origins, query.origin.map(Origin::as_str));
    out.push_str("<p><button type=\"submit\">Filter</button></p>\n</form>\n");
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            vec![
                task_link(r.task_id.as_str()),
                escape(&r.capsule),
                format!("<span class=\"state state-{0}\">{0}</span>", r.state.as_str()),
                r.lane.to_string(),
                r.origin.to_string(),
                r.exit_status.map_or_else(|| "–".to_string(), |e| e.as_str().to_string()),
                time(r.submitted_at),
                escape(&clipped(&r.text, 80)),
            ]
        })
        .collect();
    let caption = if query.before.is_some() { "Older tasks, newest first" } else { "Tasks, newest first" };
    table(
        &mut out,
        caption,
        &["Task", "Capsule", "State", "Lane", "Origin", "Exit", "Submitted", "Text"],
        &rows,
        "No task matches.",
    );
    out.push_str("<nav aria-label=\"Pages\" class=\"pages\">\n");
    if query.before.is_some() {
        let first = TaskQuery { before: None, ..query.clone() };
        let _ = writeln!(out, "<a href=\"/ui/tasks{}\">Newest</a>", escape(&query_string(&first)));
    }
    if let Some(next) = next {
        let older = TaskQuery { before: Some(next.clone()), ..query.clone() };
        let _ = writeln!(out, "<a href=\"/ui/tasks{}\" rel=\"next\">Older →</a>", escape(&query_string(&older)));
    }
    out.push_str("</nav>\n");
    page("Tasks", "Tasks", viewer, &out)
}

/// A task's page: its record, its result, its timeline (or why there is none), and a
/// cancel button for a viewer who may act while the task is not over. `notice` is a line
/// shown first (what an action did).
pub fn task_page(r: &TaskRecord, timeline: Result<&Timeline, &str>, viewer: &Viewer, notice: Option<&str>) -> String {
    let mut out = String::with_capacity(4096 + r.text.len() + r.result.as_ref().map_or(0, String::len));
    out.push_str("<h1>Task <code>");
    escape_into(&mut out, r.task_id.as_str());
    out.push_str("</code></h1>\n");
    if let Some(notice) = notice {
        let _ = writeln!(out, "<p role=\"status\" class=\"notice\">{}</p>", escape(notice));
    }
    out.push_str("<section aria-labelledby=\"h-record\">\n<h2 id=\"h-record\">Record</h2>\n<dl class=\"facts\">\n");
    let mut fact = |name: &str, value: String| {
        let _ = writeln!(out, "<dt>{name}</dt><dd>{value}</dd>");
    };
    fact("Capsule", escape(&r.capsule));
    fact("State", format!("<span class=\"state state-{0}\">{0}</span>", r.state.as_str()));
    if let Some(e) = r.exit_status {
        fact("Exit", e.as_str().to_string());
    }
    fact("Origin", format!("{} (lane {})", r.origin, r.lane));
    fact("Context", format!("<code>{}</code>", escape(&r.context_id)));
    fact("Submitted", time(r.submitted_at));
    if let Some(at) = r.started_at {
        fact("Started", time(at));
    }
    if let Some(at) = r.ended_at {
        fact(
            "Ended",
            format!("{} ({})", time(at), duration(at.saturating_sub(r.started_at.unwrap_or(r.submitted_at)))),
        );
    }
    if let Some(w) = &r.worker {
        fact("Worker", format!("<code>{}</code>", escape(w)));
    }
    if let Some(s) = &r.session_id {
        fact("Session", format!("<code>{}</code>", escape(s.as_str())));
    }
    fact("Attempt", r.attempt.to_string());
    if let Some(at) = r.cancel_requested_at {
        fact("Cancel asked", time(at));
    }
    if let Some(d) = &r.dead_letter {
        fact("Dead letter", format!("after {} deliveries: {}", d.deliveries, escape(&d.reason)));
    }
    out.push_str("</dl>\n");
    if viewer.can_act && !r.state.is_terminal() && r.cancel_requested_at.is_none() {
        let _ = writeln!(
            out,
            "<form method=\"post\" action=\"{}/cancel\"><button type=\"submit\" class=\"danger\">Cancel task</button></form>",
            escape(&task_href(r.task_id.as_str()))
        );
    }
    out.push_str("<h3>Text</h3>\n<pre class=\"text\">");
    escape_into(&mut out, &r.text);
    out.push_str("</pre>\n</section>\n");

    out.push_str("<section aria-labelledby=\"h-timeline\">\n<h2 id=\"h-timeline\">Timeline</h2>\n");
    match timeline {
        Err(why) => {
            let _ = writeln!(out, "<p class=\"empty\">{}</p>", escape(why));
        }
        Ok(t) if !t.started => {
            out.push_str("<p class=\"empty\">The session's trace has no line of this task yet.</p>\n")
        }
        Ok(t) => timeline_list(&mut out, t),
    }
    out.push_str("</section>\n");

    out.push_str("<section aria-labelledby=\"h-result\">\n<h2 id=\"h-result\">Result</h2>\n");
    match (&r.result, &r.error) {
        (None, None) => out.push_str("<p class=\"empty\">No result yet.</p>\n"),
        (result, error) => {
            if let Some(e) = error {
                let _ = writeln!(out, "<p class=\"bad\">{}</p>", escape(e));
            }
            if let Some(result) = result {
                out.push_str("<pre class=\"text\">");
                escape_into(&mut out, result);
                out.push_str("</pre>\n");
            }
        }
    }
    out.push_str("</section>\n");
    page(&format!("Task {}", r.task_id.as_str()), "Tasks", viewer, &out)
}

fn timeline_list(out: &mut String, t: &Timeline) {
    let turns = t.turns().count();
    let _ = writeln!(
        out,
        "<p>{turns} turn{}{}</p>",
        if turns == 1 { "" } else { "s" },
        if t.ended { "" } else { ", still running" }
    );
    out.push_str("<ol class=\"timeline\">\n");
    for entry in &t.entries {
        match entry {
            Entry::Note { kind, text } => {
                let _ = writeln!(out, "<li class=\"note note-{kind}\">{}</li>", escape(text));
            }
            Entry::Turn(turn) => {
                let _ = write!(
                    out,
                    "<li class=\"turn\"><h3>Turn {}</h3>\n<p>model call: <strong>{}</strong>, {} tokens in, {} out, {}",
                    turn.turn,
                    turn.decision,
                    turn.input_tokens,
                    turn.output_tokens,
                    duration(turn.duration_ms)
                );
                if let Some(o) = &turn.origin {
                    let _ = write!(out, " ({})", escape(o));
                }
                out.push_str("</p>\n");
                if !turn.attempts.is_empty() || !turn.calls.is_empty() {
                    out.push_str("<ul>\n");
                    for a in &turn.attempts {
                        let _ = writeln!(out, "<li class=\"attempt\">{}</li>", escape(a));
                    }
                    for c in &turn.calls {
                        let _ = write!(
                            out,
                            "<li class=\"call\">tool <code>{}</code> {}: {} B in, {} B out, {}",
                            escape(&c.tool),
                            if c.ok { "ok" } else { "<span class=\"bad\">error</span>" },
                            c.input_bytes,
                            c.output_bytes,
                            duration(c.duration_ms)
                        );
                        for d in &c.details {
                            let _ = write!(out, "<br><code>{}</code>", escape(d));
                        }
                        out.push_str("</li>\n");
                    }
                    out.push_str("</ul>\n");
                }
                out.push_str("</li>\n");
            }
        }
    }
    out.push_str("</ol>\n");
}

/// The approvals page: every blocked job of every fleet (`fleet`, job) with what it asks
/// (the job's text), the steps its run parked and what the run said so far; approve and
/// deny buttons for a viewer who may act while it is unanswered, the answer (who, when)
/// once given, until the next run takes the job. `notice` is a line shown first (what an answer
/// did).
pub fn approvals_page(parked: &[(String, mur_proto::fleet::Job)], viewer: &Viewer, notice: Option<&str>) -> String {
    let mut out = String::with_capacity(1024 + parked.len() * 600);
    out.push_str("<h1>Approvals</h1>\n");
    if let Some(notice) = notice {
        let _ = writeln!(out, "<p role=\"status\" class=\"notice\">{}</p>", escape(notice));
    }
    if parked.is_empty() {
        out.push_str("<p class=\"empty\">No job waits for an approval.</p>\n");
    }
    for (fleet, job) in parked {
        let steps = job.approval.as_ref().map(|a| a.steps.join(", ")).unwrap_or_default();
        let _ = writeln!(
            out,
            "<article class=\"approval\" aria-label=\"job {id}\">\n<h2>Fleet {fleet}, job <code>{id}</code></h2>\n\
             <dl class=\"facts\">\n<dt>Steps parked</dt><dd>{steps}</dd>\n<dt>Queued by</dt><dd>{source}</dd>\n\
             <dt>Queued</dt><dd>{queued}</dd>\n<dt>Run</dt><dd>{run}</dd>\n</dl>",
            fleet = escape(fleet),
            id = escape(&job.id),
            steps = escape(&steps),
            source = escape(&job.source),
            queued = time(job.created_at),
            run = escape(job.run_id.as_deref().unwrap_or("–")),
        );
        let answer = job.approval.as_ref().and_then(|a| a.decision.map(|d| (d, a.by.as_deref(), a.at)));
        if let Some((decision, by, at)) = answer {
            let _ = writeln!(
                out,
                "<p class=\"answer\">{} by {}{}; the next run of the fleet takes it.</p>",
                decision.as_str(),
                escape(by.unwrap_or("?")),
                at.map(|at| format!(" at {}", time(at))).unwrap_or_default()
            );
        }
        out.push_str("<h3>Asked</h3>\n<pre class=\"text\">");
        escape_into(&mut out, &job.text);
        out.push_str("</pre>\n");
        if let Some(result) = &job.result {
            out.push_str("<h3>The run so far</h3>\n<pre class=\"text\">");
            escape_into(&mut out, result);
            out.push_str("</pre>\n");
        }
        if viewer.can_act && answer.is_none() {
            let base = format!(
                "/ui/approvals/{}/{}",
                percent_encoding::utf8_percent_encode(fleet, SEGMENT),
                percent_encoding::utf8_percent_encode(&job.id, SEGMENT)
            );
            let _ = writeln!(
                out,
                "<div class=\"answers\"><form method=\"post\" action=\"{b}/approve\"><button type=\"submit\">Approve</button></form>\n\
                 <form method=\"post\" action=\"{b}/deny\"><button type=\"submit\" class=\"danger\">Deny</button></form></div>",
                b = escape(&base)
            );
        }
        out.push_str("</article>\n");
    }
    page("Approvals", "Approvals", viewer, &out)
}

/// The sign-in page: a form taking a token (a password field, never filled in again);
/// `message` says why it is shown.
pub fn login_page(message: &str) -> String {
    let body = format!(
        "<h1>Sign in</h1>\n<p role=\"alert\">{}</p>\n\
         <form method=\"post\" action=\"/ui/login\" class=\"login\">\n\
         <p><label for=\"token\">Token</label>\n\
         <input id=\"token\" name=\"token\" type=\"password\" autocomplete=\"off\" required></p>\n\
         <p class=\"hint\">A token from <code>mur auth token create NAME</code>: read scope to watch, admin to act. \
         It is kept in a cookie for this console only.</p>\n\
         <p><button type=\"submit\">Sign in</button></p>\n</form>\n",
        escape(message)
    );
    page("Sign in", "", &Viewer::default(), &body)
}

/// A page saying what went wrong (`message` escaped).
pub fn error_page(title: &str, message: &str, viewer: &Viewer) -> String {
    page(title, "", viewer, &format!("<h1>{}</h1>\n<p class=\"bad\">{}</p>\n", escape(title), escape(message)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_proto::cluster::{LaneStatus, WorkerStatus};
    use serde_json::json;

    fn record(text: &str) -> TaskRecord {
        serde_json::from_value(json!({
            "task_id": "tsk_1", "capsule": "demo", "capsule_digest": "d", "context_id": "ctx_1", "text": text,
            "origin": "user", "lane": "user", "state": "working", "attempt": 1, "submitted_at": 1_700_000_000_000u64,
            "started_at": 1_700_000_001_000u64, "session_id": "ses_1", "worker": "wkr_1",
        }))
        .unwrap()
    }

    fn status() -> ClusterStatus {
        serde_json::from_value(json!({
            "at": 0, "leader": {"instance": "coord-a", "term": 3, "since": 0},
            "standbys": [{"instance": "coord-b", "at": 0}], "lanes": [], "in_flight": [], "dead_letters": [],
            "workers": [], "fanout": {"in_use": 0, "holders": [], "waiting": []},
        }))
        .unwrap()
    }

    #[test]
    fn escape_turns_every_markup_character_into_an_entity() {
        assert_eq!(escape(r#"<a href="x">'&'</a>"#), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }

    #[test]
    fn a_task_text_with_a_script_tag_is_shown_escaped_on_its_page_and_in_the_list() {
        let r = record("<script>alert('x')</script> & more");
        let viewer = Viewer::default();
        let html = task_page(&r, Err("no trace"), &viewer, None);
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(html.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; more"));
        let list = tasks_page(std::slice::from_ref(&r), &TaskQuery::default(), None, &viewer);
        assert!(!list.contains("<script>alert"));
        assert!(list.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"));
        // The capsule filter echoes what was asked, escaped too.
        let query = TaskQuery { capsule: Some("\"><script>".into()), ..TaskQuery::default() };
        let list = tasks_page(&[], &query, None, &viewer);
        assert!(list.contains("value=\"&quot;&gt;&lt;script&gt;\""), "{list}");
    }

    #[test]
    fn the_cluster_section_shows_a_waiting_user_lane_and_the_workers_free_slots() {
        let mut s = status();
        s.lanes.push(LaneStatus { capsule: "demo".into(), lane: Lane::User, pending: 2, oldest_age_ms: 4_200 });
        s.workers.push(WorkerStatus {
            worker_id: "wkr_1".into(),
            slots: 1,
            free: 0,
            heartbeat_age_ms: 300,
            live: true,
        });
        let html = cluster_section(&s, 0);
        assert!(html.contains("<td>demo</td><td><span class=\"lane lane-user\">user</span></td><td><span class=\"num\">2</span></td><td>4.2 s</td>"), "{html}");
        assert!(html.contains("Lanes <span class=\"count\">2 waiting</span>"));
        assert!(html.contains("1 live, 0 of 1 slots free"));
        assert!(html.contains("<td>300 ms ago</td><td>live</td>"));
        assert!(html.contains("<code>coord-a</code> (term 3"));
        assert!(html.contains("<dt>Standbys</dt><dd><code>coord-b</code></dd>"));
        assert!(html.contains("No task is in flight."));
    }

    #[test]
    fn the_cancel_button_is_offered_only_to_a_viewer_who_may_act_on_a_running_task() {
        let r = record("t");
        let reader = Viewer { token: Some("watch".into()), can_act: false };
        let admin = Viewer { token: Some("ops".into()), can_act: true };
        assert!(!task_page(&r, Err(""), &reader, None).contains("Cancel task"));
        assert!(task_page(&r, Err(""), &admin, None).contains("action=\"/ui/tasks/tsk_1/cancel\""));
        let mut done = r.clone();
        done.state = TaskState::Completed;
        assert!(!task_page(&done, Err(""), &admin, None).contains("Cancel task"));
        assert!(task_page(&r, Err(""), &reader, None).contains("token watch (read)"));
    }

    #[test]
    fn the_next_page_link_keeps_the_filters_and_carries_the_cursor() {
        let query = TaskQuery { state: Some(TaskState::Completed), lane: Some(Lane::Bg), ..TaskQuery::default() };
        let cursor = ListCursor { submitted_at: 42, task_id: "tsk_9".into() };
        let html = tasks_page(&[], &query, Some(&cursor), &Viewer::default());
        assert!(
            html.contains(
                "href=\"/ui/tasks?state=completed&amp;lane=bg&amp;before_at=42&amp;before_id=tsk_9\" rel=\"next\""
            ),
            "{html}"
        );
        assert!(html.contains("<option selected>completed</option>"));
    }

    #[test]
    fn durations_read_in_the_unit_that_fits() {
        assert_eq!(duration(850), "850 ms");
        assert_eq!(duration(4_200), "4.2 s");
        assert_eq!(duration(185_000), "3 min 05 s");
        assert_eq!(duration(7_620_000), "2 h 07 min");
        assert_eq!(time(1_700_000_000_000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn a_blocked_job_is_listed_with_its_parked_steps_and_answers_only_for_an_admin() {
        let job: mur_proto::fleet::Job = serde_json::from_value(json!({
            "id": "0190-ab", "status": "blocked", "text": "Ship <v2>", "source": "cli", "created_at": 0,
            "run_id": "run_1", "result": "[deploy] awaits approval",
            "approval": {"steps": ["deploy"], "decision": null, "by": null, "at": null},
        }))
        .unwrap();
        let parked = [("gate".to_string(), job)];
        let admin = Viewer { token: Some("ops".into()), can_act: true };
        let html = approvals_page(&parked, &admin, Some("approved"));
        assert!(html.contains("<h2>Fleet gate, job <code>0190-ab</code></h2>"), "{html}");
        assert!(html.contains("<dt>Steps parked</dt><dd>deploy</dd>"));
        assert!(html.contains("<pre class=\"text\">Ship &lt;v2&gt;</pre>"));
        assert!(html.contains("action=\"/ui/approvals/gate/0190-ab/approve\""));
        assert!(html.contains("action=\"/ui/approvals/gate/0190-ab/deny\""));
        let reader = Viewer { token: Some("watch".into()), can_act: false };
        assert!(!approvals_page(&parked, &reader, None).contains("<form method=\"post\" action=\"/ui/approvals"));
        assert!(approvals_page(&[], &reader, None).contains("No job waits for an approval."));
        let mut answered = parked.clone();
        let approval = answered[0].1.approval.as_mut().unwrap();
        approval.decision = Some(mur_proto::fleet::Decision::Approved);
        approval.by = Some("console:<ops>".into());
        approval.at = Some(1_700_000_000_000);
        let html = approvals_page(&answered, &admin, None);
        assert!(
            html.contains("<p class=\"answer\">approved by console:&lt;ops&gt; at 2023-11-14T22:13:20Z; the next run"),
            "{html}"
        );
        assert!(!html.contains("/approve\""), "an answered job is not answered again");
    }
}
