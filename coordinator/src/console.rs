//! The web console at `/ui/` (issue #38), served by the coordinator's `--http` endpoint
//! (and so by `mur dev --http`): the cluster page (`/ui/`, kept current over server-sent
//! events from `/ui/events`), the task list (`/ui/tasks`, filtered and paged) and a task's
//! page (`/ui/tasks/<id>`: record, turn-by-turn timeline, result; cancel), and the fleets'
//! blocked jobs (`/ui/approvals`: approve or deny, recorded as answered by
//! `console:<token name>`, or `console` where no token is checked).
//!
//! Everything is read through the cluster's NATS API, as the CLI reads it
//! (`cluster.status`, `task.list`, `task.get`, `task.cancel`, `fleet.ls`, `fleet.jobs`,
//! `fleet.approve`, `fleet.deny`), and the session's lines
//! from the trace stream; [`render`] makes the HTML (pure) and [`timeline`] groups a
//! task's trace lines.
//!
//! Who may look (issue #31's tokens, through the endpoint's [`Guard`]): when the guard
//! checks tokens (any non-loopback bind; a loopback one once a token exists), a request
//! needs a cluster-wide token — `Authorization: Bearer`, or the `mur_console` cookie the
//! sign-in form sets (HttpOnly, SameSite=Strict, `Secure` over HTTPS, path `/ui`); read
//! scope to watch, admin to cancel. Without one, a page answers 401 with the sign-in form;
//! a bad token is never repeated. A POST from another site (`Sec-Fetch-Site: cross-site`,
//! or an `Origin` that is not this host) is refused, so a page elsewhere cannot act through
//! an open loopback console. Every answer forbids framing and scripts from elsewhere
//! (`Content-Security-Policy`).

pub mod render;
pub mod timeline;

use axum::Router;
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use mur_a2a::auth::Guard;
use mur_nats::clock::{Clock, SystemClock};
use mur_proto::cluster::{Access, ClusterStatus, TaskRecord, TaskRef, api};
use mur_proto::page::Page;
use mur_proto::task::TaskState;
use mur_proto::{SessionId, TaskId};
use render::{TaskQuery, Viewer};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use crate::service::{ListCursor, ListRequest};

/// The cookie the sign-in form sets: the token, for this console's paths only.
pub const COOKIE: &str = "mur_console";

/// How often the live cluster section is rendered again while nothing changes (ages and
/// heartbeats move on).
const LIVE_TICK: Duration = Duration::from_secs(5);

/// How long the live section waits after a change for more before rendering (a burst of
/// record writes is one update).
const LIVE_SETTLE: Duration = Duration::from_millis(250);

/// The console's shared state.
struct Console {
    client: async_nats::Client,
    guard: Guard,
    /// Whether the endpoint is served over HTTPS (the cookie is then `Secure`).
    secure: bool,
}

/// The console's routes, under `/ui`; `secure` when served over HTTPS.
pub fn router(client: async_nats::Client, guard: Guard, secure: bool) -> Router {
    let state = Arc::new(Console { client, guard, secure });
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(cluster))
        .route("/ui/events", get(events))
        .route("/ui/tasks", get(tasks))
        .route("/ui/tasks/{id}", get(task))
        .route("/ui/tasks/{id}/cancel", post(cancel))
        .route("/ui/approvals", get(approvals))
        .route("/ui/approvals/{fleet}/{job}/{answer}", post(answer))
        .route("/ui/login", get(login_form).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/style.css", get(|| async { asset("text/css; charset=utf-8", render::STYLE) }))
        .route("/ui/live.js", get(|| async { asset("text/javascript; charset=utf-8", render::LIVE_SCRIPT) }))
        .layer(axum::middleware::map_response(secure_headers))
        .with_state(state)
}

async fn secure_headers(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'none'; style-src 'self'; script-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // Not `no-referrer`: under it the browser sends `Origin: null` with the console's own
    // forms, which [`cross_site`] refuses.
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.entry(header::CACHE_CONTROL).or_insert(HeaderValue::from_static("no-store"));
    response
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "max-age=300")], body).into_response()
}

fn html(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

/// The token a request carries: its `Authorization` header, else the console's cookie.
fn presented(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    if let Some(auth) = headers.get(header::AUTHORIZATION) {
        out.insert(header::AUTHORIZATION, auth.clone());
        return out;
    }
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim().to_string());
    if let Some(token) = cookie
        && let Ok(value) = HeaderValue::from_str(&format!("Bearer {token}"))
    {
        out.insert(header::AUTHORIZATION, value);
    }
    out
}

impl Console {
    fn viewer(&self, headers: &HeaderMap, access: Access) -> Result<Viewer, Refused> {
        admit(&self.guard, headers, access)
    }

    async fn status(&self) -> Result<ClusterStatus, mur_proto::cluster::ApiError> {
        mur_nats::api::call(&self.client, api::CLUSTER_STATUS, Vec::new()).await
    }
}

/// A request [`admit`] turned away: its status (401, 403) and the page saying why.
#[derive(Debug)]
struct Refused(StatusCode, String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        html(self.0, self.1)
    }
}

/// Who is asking, if they may do `access` (a cluster-wide token; admin scope to act);
/// otherwise the page to answer with (401: the sign-in form; 403: what the token may not
/// do).
fn admit(guard: &Guard, headers: &HeaderMap, access: Access) -> Result<Viewer, Refused> {
    let grant = match guard.authenticate(&presented(headers)) {
        Ok(grant) => grant,
        Err(refusal) => {
            let why = if refusal.error.message.contains("no bearer token") {
                "This console needs a token to show the cluster.".to_string()
            } else {
                format!("That token was not accepted ({}).", refusal.error.message)
            };
            return Err(Refused(StatusCode::UNAUTHORIZED, render::login_page(&why)));
        }
    };
    let Some(grant) = grant else { return Ok(Viewer { token: None, can_act: true }) };
    let viewer = Viewer {
        token: Some(grant.name.clone()),
        can_act: Guard::authorize(Some(&grant), None, Access::Write).is_ok(),
    };
    match Guard::authorize(Some(&grant), None, access) {
        Ok(()) => Ok(viewer),
        Err(refusal) => Err(Refused(
            StatusCode::FORBIDDEN,
            render::error_page("Not allowed", &refusal.error.message, &Viewer { can_act: false, ..viewer }),
        )),
    }
}

/// A POST sent by a page of another site.
fn cross_site(headers: &HeaderMap) -> bool {
    let value = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if value("sec-fetch-site").is_some_and(|s| s == "cross-site") {
        return true;
    }
    match (value("origin"), value("host")) {
        (Some("null"), _) => true,
        (Some(origin), Some(host)) => origin.split_once("://").map(|(_, rest)| rest) != Some(host),
        _ => false,
    }
}

fn unavailable(viewer: &Viewer, e: impl std::fmt::Display) -> Response {
    html(StatusCode::SERVICE_UNAVAILABLE, render::error_page("Cluster unavailable", &e.to_string(), viewer))
}

async fn cluster(State(c): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let viewer = match c.viewer(&headers, Access::Read) {
        Ok(v) => v,
        Err(page) => return page.into_response(),
    };
    match c.status().await {
        Ok(status) => html(StatusCode::OK, render::cluster_page(&status, SystemClock.now_ms(), &viewer)),
        Err(e) => unavailable(&viewer, e),
    }
}

/// `/ui/events`: a `cluster` event with the cluster section's HTML now, then whenever it
/// changes — after a write to the task records or the worker registry (core NATS
/// subscriptions to the buckets' subjects: no consumer is made), or every [`LIVE_TICK`].
async fn events(State(c): State<Arc<Console>>, headers: HeaderMap) -> Response {
    if let Err(page) = c.viewer(&headers, Access::Read) {
        return page.into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(4);
    tokio::spawn(async move {
        let subjects = [mur_proto::cluster::TASKS_BUCKET, mur_proto::cluster::WORKERS_BUCKET];
        let mut changes = futures::stream::select_all(
            futures::future::join_all(subjects.iter().map(|b| {
                let client = c.client.clone();
                async move { client.subscribe(format!("$KV.{b}.>")).await.ok() }
            }))
            .await
            .into_iter()
            .flatten(),
        );
        let mut last = String::new();
        loop {
            if let Ok(status) = c.status().await {
                let section = render::cluster_section(&status, SystemClock.now_ms());
                if section != last {
                    if tx.send(Ok(Event::default().event("cluster").data(&section))).await.is_err() {
                        return;
                    }
                    last = section;
                }
            }
            tokio::select! {
                _ = tx.closed() => return,
                _ = tokio::time::sleep(LIVE_TICK) => {}
                Some(_) = changes.next() => {
                    // Let a burst of writes settle into one update.
                    let settle = tokio::time::sleep(LIVE_SETTLE);
                    tokio::pin!(settle);
                    loop {
                        tokio::select! {
                            _ = &mut settle => break,
                            more = changes.next() => if more.is_none() { break },
                        }
                    }
                }
            }
        }
    });
    let rx = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    Sse::new(rx).keep_alive(KeepAlive::default()).into_response()
}

/// A field of the query string that is not what it may be.
fn bad_field(field: &str, rule: &str, got: &str) -> String {
    format!("{field}: must be {rule}, got {got:?}")
}

fn choice<T: serde::de::DeserializeOwned>(field: &str, rule: &str, value: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(value.to_string())).map_err(|_| bad_field(field, rule, value))
}

/// The task list's query string as a [`TaskQuery`]: empty fields are no filter; a bad
/// value is refused naming the field and the values it may take.
pub fn parse_query(q: &HashMap<String, String>) -> Result<TaskQuery, String> {
    let get = |k: &str| q.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    let states = render::STATES.map(TaskState::as_str).join(", ");
    let before = match (get("before_at"), get("before_id")) {
        (None, None) => None,
        (Some(at), Some(id)) => Some(ListCursor {
            submitted_at: at.parse().map_err(|_| bad_field("before_at", "a unix time in ms", at))?,
            task_id: id.to_string(),
        }),
        _ => return Err("before_at, before_id: give both or neither".to_string()),
    };
    Ok(TaskQuery {
        capsule: get("capsule").map(str::to_string),
        state: get("state").map(|v| choice("state", &format!("one of {states}"), v)).transpose()?,
        lane: get("lane").map(|v| choice("lane", "one of user, peer, bg", v)).transpose()?,
        origin: get("origin")
            .map(|v| choice("origin", "one of user, peer, schedule, event, completion, system", v))
            .transpose()?,
        before,
    })
}

/// The `task.list` request of one page: one more than a page, to know whether another
/// follows.
fn list_request(query: &TaskQuery) -> ListRequest {
    ListRequest {
        state: query.state,
        limit: Some(render::PAGE_SIZE + 1),
        capsule: query.capsule.clone(),
        context_id: None,
        lane: query.lane,
        origin: query.origin,
        before: query.before.clone(),
    }
}

/// One page of `records` (one more than a page asked): the page, and the cursor of the
/// next one when there is more.
pub fn paged(mut records: Vec<TaskRecord>) -> (Vec<TaskRecord>, Option<ListCursor>) {
    let more = records.len() > render::PAGE_SIZE;
    records.truncate(render::PAGE_SIZE);
    let next = more
        .then(|| records.last().map(|r| ListCursor { submitted_at: r.submitted_at, task_id: r.task_id.to_string() }))
        .flatten();
    (records, next)
}

async fn tasks(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let viewer = match c.viewer(&headers, Access::Read) {
        Ok(v) => v,
        Err(page) => return page.into_response(),
    };
    let query = match parse_query(&q) {
        Ok(query) => query,
        Err(e) => return html(StatusCode::BAD_REQUEST, render::error_page("Bad filter", &e, &viewer)),
    };
    let body = serde_json::to_vec(&list_request(&query)).expect("a list request serializes");
    match mur_nats::api::call::<Page<TaskRecord>>(&c.client, api::TASK_LIST, body).await {
        Ok(page) => {
            let (records, next) = paged(page.items);
            html(StatusCode::OK, render::tasks_page(&records, &query, next.as_ref(), &viewer))
        }
        Err(e) => unavailable(&viewer, e),
    }
}

/// The lines of session `id` from the trace stream, oldest first.
async fn session_lines(client: &async_nats::Client, id: &SessionId) -> Result<Vec<mur_proto::trace::Line>, String> {
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream(mur_proto::cluster::TRACE_STREAM).await.map_err(|e| format!("the trace stream: {e}"))?;
    let mut lines = Vec::new();
    mur_nats::read::messages(&stream, &mur_proto::cluster::trace_subject(id), |m| {
        // A line of an event this build does not know is left out of the timeline.
        if let Ok(line) = serde_json::from_slice(&m.payload) {
            lines.push(line);
        }
    })
    .await
    .map_err(|e| format!("reading the session's trace: {e}"))?;
    Ok(lines)
}

async fn show_task(c: &Console, viewer: &Viewer, id: &str, notice: Option<&str>) -> Response {
    let body = serde_json::to_vec(&TaskRef { task_id: TaskId::unchecked(id) }).expect("a task ref serializes");
    let record: TaskRecord = match mur_nats::api::call(&c.client, api::TASK_GET, body).await {
        Ok(r) => r,
        Err(e) if e.code == mur_proto::cluster::ErrorCode::NotFound => {
            return html(StatusCode::NOT_FOUND, render::error_page("No such task", &e.message, viewer));
        }
        Err(e) => return unavailable(viewer, e),
    };
    let timeline = match &record.session_id {
        None => Err("The task has not started: no session has run it yet.".to_string()),
        Some(session) => session_lines(&c.client, session).await.map(|lines| timeline::of_task(&lines, id)),
    };
    html(StatusCode::OK, render::task_page(&record, timeline.as_ref().map_err(String::as_str), viewer, notice))
}

async fn task(State(c): State<Arc<Console>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    match c.viewer(&headers, Access::Read) {
        Ok(viewer) => show_task(&c, &viewer, &id, None).await,
        Err(page) => page.into_response(),
    }
}

async fn cancel(State(c): State<Arc<Console>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if cross_site(&headers) {
        return html(
            StatusCode::FORBIDDEN,
            render::error_page("Not allowed", "a request from another site", &Viewer::default()),
        );
    }
    let viewer = match c.viewer(&headers, Access::Write) {
        Ok(v) => v,
        Err(page) => return page.into_response(),
    };
    let body = serde_json::to_vec(&TaskRef { task_id: TaskId::unchecked(id.as_str()) }).expect("a task ref serializes");
    let notice = match mur_nats::api::call::<TaskRecord>(&c.client, api::TASK_CANCEL, body).await {
        Ok(r) => format!("Cancel asked: the task is {}.", r.state.as_str()),
        Err(e) => format!("Not canceled: {}", e.message),
    };
    tracing::info!(task = %id, by = viewer.token.as_deref().unwrap_or("-"), %notice, "console cancel");
    show_task(&c, &viewer, &id, Some(&notice)).await
}

/// Every blocked job of every fleet, by fleet name.
async fn parked(
    client: &async_nats::Client,
) -> Result<Vec<(String, mur_proto::fleet::Job)>, mur_proto::cluster::ApiError> {
    use mur_proto::fleet::JobStatus;
    use mur_proto::fleet_store::{FleetSummary, JobsRequest, api as fleet_api};
    let fleets: Vec<FleetSummary> = mur_nats::api::call(client, fleet_api::LIST, Vec::new()).await?;
    let mut out = Vec::new();
    for fleet in fleets.into_iter().filter(|f| f.blocked > 0) {
        let request =
            JobsRequest { fleet: fleet.name.clone(), status: Some(JobStatus::Blocked), ..JobsRequest::default() };
        let body = serde_json::to_vec(&request).expect("a jobs request serializes");
        let jobs: Page<mur_proto::fleet::Job> = mur_nats::api::call(client, fleet_api::JOBS, body).await?;
        out.extend(jobs.items.into_iter().map(|j| (fleet.name.clone(), j)));
    }
    Ok(out)
}

async fn show_approvals(c: &Console, viewer: &Viewer, notice: Option<&str>) -> Response {
    match parked(&c.client).await {
        Ok(parked) => html(StatusCode::OK, render::approvals_page(&parked, viewer, notice)),
        Err(e) => unavailable(viewer, e),
    }
}

async fn approvals(State(c): State<Arc<Console>>, headers: HeaderMap) -> Response {
    match c.viewer(&headers, Access::Read) {
        Ok(viewer) => show_approvals(&c, &viewer, None).await,
        Err(page) => page.into_response(),
    }
}

/// Who an answer given from the console is recorded as: `console:<token name>`, or
/// `console` where no token is checked.
pub fn answered_by(viewer: &Viewer) -> String {
    viewer.token.as_deref().map_or_else(|| "console".to_string(), |name| format!("console:{name}"))
}

/// `POST /ui/approvals/<fleet>/<job>/<approve|deny>`: the same `fleet.approve` and
/// `fleet.deny` `mur fleet approve|deny` send; admin scope.
async fn answer(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    Path((fleet, job, answer)): Path<(String, String, String)>,
) -> Response {
    use mur_proto::fleet_store::{AnswerRequest, api as fleet_api};
    if cross_site(&headers) {
        return html(
            StatusCode::FORBIDDEN,
            render::error_page("Not allowed", "a request from another site", &Viewer::default()),
        );
    }
    let viewer = match c.viewer(&headers, Access::Write) {
        Ok(v) => v,
        Err(page) => return page.into_response(),
    };
    let subject = match answer.as_str() {
        "approve" => fleet_api::APPROVE,
        "deny" => fleet_api::DENY,
        other => {
            let message = format!("answer: must be approve or deny, got {other:?}");
            return html(StatusCode::NOT_FOUND, render::error_page("No such answer", &message, &viewer));
        }
    };
    let by = answered_by(&viewer);
    let request = AnswerRequest { fleet: fleet.clone(), job: job.clone(), by: by.clone() };
    let body = serde_json::to_vec(&request).expect("an answer serializes");
    let notice = match mur_nats::api::call::<mur_proto::fleet::Job>(&c.client, subject, body).await {
        Ok(j) => {
            let approval = j.approval.as_ref();
            let decision = approval.and_then(|a| a.decision).map_or("answered", |d| d.as_str());
            let steps = approval.map(|a| a.steps.join(", ")).unwrap_or_default();
            format!(
                "{decision} job {} of fleet {fleet} (step {steps}) as {by}; the next run of the fleet takes it",
                j.id
            )
        }
        Err(e) => format!("Not answered: {}", e.message),
    };
    tracing::info!(%fleet, %job, %by, %notice, "console approval answer");
    show_approvals(&c, &viewer, Some(&notice)).await
}

async fn login_form(State(c): State<Arc<Console>>, headers: HeaderMap) -> Response {
    match c.viewer(&headers, Access::Read) {
        Ok(_) => Redirect::to("/ui/").into_response(),
        Err(_) => html(StatusCode::OK, render::login_page("Sign in with a token to watch the cluster.")),
    }
}

async fn login(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    if cross_site(&headers) {
        return html(
            StatusCode::FORBIDDEN,
            render::error_page("Not allowed", "a request from another site", &Viewer::default()),
        );
    }
    let token = form.get("token").map(|t| t.trim()).unwrap_or_default();
    let Ok(value) = HeaderValue::from_str(&format!("Bearer {token}")) else {
        return html(
            StatusCode::UNAUTHORIZED,
            render::login_page("token: must be a token from `mur auth token create`."),
        );
    };
    let mut presented = HeaderMap::new();
    presented.insert(header::AUTHORIZATION, value);
    match c.viewer(&presented, Access::Read) {
        Ok(_) => {
            let secure = if c.secure { "; Secure" } else { "" };
            let cookie = format!("{COOKIE}={token}; Path=/ui; HttpOnly; SameSite=Strict{secure}");
            let mut response = Redirect::to("/ui/").into_response();
            if let Ok(v) = HeaderValue::from_str(&cookie) {
                response.headers_mut().insert(header::SET_COOKIE, v);
            }
            response
        }
        Err(page) => page.into_response(),
    }
}

async fn logout(State(c): State<Arc<Console>>) -> Response {
    let secure = if c.secure { "; Secure" } else { "" };
    let mut response = Redirect::to("/ui/login").into_response();
    let cookie = format!("{COOKIE}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0{secure}");
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use mur_nats::tokens::Keyring;
    use mur_proto::task::Lane;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn a_query_string_becomes_filters_and_a_bad_value_names_its_field() {
        let query = parse_query(&q(&[("capsule", "demo"), ("lane", "user"), ("state", ""), ("origin", "")])).unwrap();
        assert_eq!(query, TaskQuery { capsule: Some("demo".into()), lane: Some(Lane::User), ..TaskQuery::default() });
        assert_eq!(
            parse_query(&q(&[("lane", "fast")])).unwrap_err(),
            "lane: must be one of user, peer, bg, got \"fast\""
        );
        assert!(
            parse_query(&q(&[("state", "done")])).unwrap_err().starts_with("state: must be one of submitted, working")
        );
        assert_eq!(
            parse_query(&q(&[("before_at", "x"), ("before_id", "tsk_1")])).unwrap_err(),
            "before_at: must be a unix time in ms, got \"x\""
        );
        assert_eq!(
            parse_query(&q(&[("before_id", "tsk_1")])).unwrap_err(),
            "before_at, before_id: give both or neither"
        );
    }

    #[test]
    fn the_token_comes_from_the_authorization_header_or_else_the_console_cookie() {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, HeaderValue::from_static("theme=dark; mur_console=mur_abc"));
        assert_eq!(presented(&h).get(header::AUTHORIZATION).unwrap(), "Bearer mur_abc");
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer mur_def"));
        assert_eq!(presented(&h).get(header::AUTHORIZATION).unwrap(), "Bearer mur_def");
        assert!(presented(&HeaderMap::new()).is_empty());
    }

    #[test]
    fn a_post_from_another_site_is_told_apart_from_one_of_this_console() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert!(!cross_site(&headers(&[("host", "127.0.0.1:8080"), ("origin", "http://127.0.0.1:8080")])));
        assert!(cross_site(&headers(&[("host", "127.0.0.1:8080"), ("origin", "https://evil.example")])));
        assert!(cross_site(&headers(&[("host", "127.0.0.1:8080"), ("sec-fetch-site", "cross-site")])));
        assert!(cross_site(&headers(&[("origin", "null")])));
        assert!(!cross_site(&headers(&[("host", "127.0.0.1:8080")])), "no Origin: a same-site navigation");
    }

    #[test]
    fn a_page_of_one_more_than_the_page_size_says_where_the_next_starts() {
        let record = |i: u64| -> TaskRecord {
            serde_json::from_value(serde_json::json!({
                "task_id": format!("tsk_{i:03}"), "capsule": "c", "capsule_digest": "d", "context_id": "ctx",
                "text": "t", "origin": "user", "lane": "user", "state": "submitted", "attempt": 0, "submitted_at": 1000 - i,
            }))
            .unwrap()
        };
        let (page, next) = paged((0..=render::PAGE_SIZE as u64).map(record).collect());
        assert_eq!(page.len(), render::PAGE_SIZE);
        let last = (render::PAGE_SIZE - 1) as u64;
        assert_eq!(next, Some(ListCursor { submitted_at: 1000 - last, task_id: format!("tsk_{last:03}") }));
        let (page, next) = paged((0..3).map(record).collect());
        assert_eq!((page.len(), next), (3, None));
    }

    #[test]
    fn a_checking_guard_without_a_token_answers_the_sign_in_form_and_a_read_token_may_not_act() {
        let token = mur_nats::tokens::generate().unwrap();
        let keyring = Keyring::of_token("watch", &token);
        let mut record = keyring.check(&token).unwrap();
        record.scope = mur_proto::cluster::Scope::Read;
        let keyring = Keyring::new();
        keyring.insert(record);
        let guard = Guard::new(mur_a2a::auth::Mode::Required, keyring);
        let refused = admit(&guard, &HeaderMap::new(), Access::Read).unwrap_err();
        assert_eq!(refused.0, StatusCode::UNAUTHORIZED);
        assert!(refused.1.contains("This console needs a token"));
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, HeaderValue::from_str(&format!("{COOKIE}={token}")).unwrap());
        let viewer = admit(&guard, &h, Access::Read).unwrap();
        assert_eq!(viewer, Viewer { token: Some("watch".into()), can_act: false });
        assert_eq!(admit(&guard, &h, Access::Write).unwrap_err().0, StatusCode::FORBIDDEN);
        // Nothing checked (a loopback `mur dev` before any token exists): open, and may act.
        assert_eq!(
            admit(&Guard::off(), &HeaderMap::new(), Access::Write).unwrap(),
            Viewer { token: None, can_act: true }
        );
    }

    #[test]
    fn an_answer_is_recorded_as_the_console_and_the_tokens_name() {
        assert_eq!(answered_by(&Viewer { token: Some("ops".into()), can_act: true }), "console:ops");
        assert_eq!(answered_by(&Viewer { token: None, can_act: true }), "console");
    }

    /// The task list's render cost over 10,000 tasks, paged (issue #38; figures in
    /// docs/benchmarks.md): every page of 50 rendered, against the baseline of encoding the
    /// same records as the `task.list` reply's JSON, in the same process.
    /// `cargo test -p mur-coordinator --release --lib console_render_figures -- --ignored --nocapture`
    #[test]
    #[ignore = "a benchmark: prints figures"]
    fn console_render_figures_for_ten_thousand_tasks() {
        use std::time::Instant;
        let records: Vec<TaskRecord> = (0..10_000u64)
            .map(|i| {
                serde_json::from_value(serde_json::json!({
                    "task_id": format!("tsk_{i:08}"), "capsule": format!("capsule-{}", i % 7), "capsule_digest": "d",
                    "context_id": format!("ctx_{i}"), "text": format!("task {i}: <b>summarise</b> the report & reply {}", "x".repeat(200)),
                    "origin": "user", "lane": "user", "state": "completed", "exit_status": "ok", "attempt": 1,
                    "submitted_at": 1_700_000_000_000u64 + i, "result": "y".repeat(500),
                }))
                .unwrap()
            })
            .collect();
        let viewer = Viewer::default();
        let query = TaskQuery::default();
        for round in 0..3 {
            let (mut render_ns, mut json_ns, mut bytes) = (0u128, 0u128, 0usize);
            for start in (0..records.len()).step_by(render::PAGE_SIZE) {
                // One more than a page, as the console asks `task.list` for.
                let page: Vec<TaskRecord> = records[start..records.len().min(start + render::PAGE_SIZE + 1)].to_vec();
                let t = Instant::now();
                let json = serde_json::to_vec(&page).unwrap();
                json_ns += t.elapsed().as_nanos();
                std::hint::black_box(json);
                let t = Instant::now();
                let (page, next) = paged(page);
                let html = render::tasks_page(&page, &query, next.as_ref(), &viewer);
                render_ns += t.elapsed().as_nanos();
                bytes += html.len();
                std::hint::black_box(html);
            }
            let pages = (10_000 / render::PAGE_SIZE) as u128;
            println!(
                "round {round}: {pages} pages of {}: render {:.1} µs/page, baseline (the page's JSON) {:.1} µs/page, \
                 ratio {:.2}, {} KiB/page",
                render::PAGE_SIZE,
                render_ns as f64 / pages as f64 / 1000.0,
                json_ns as f64 / pages as f64 / 1000.0,
                render_ns as f64 / json_ns as f64,
                bytes / pages as usize / 1024
            );
        }
    }
}
