//! The web console (issue #38) in a real browser: Debian's `chromium` driven through
//! `chromedriver` (WebDriver, the `fantoccini` crate) against a real cluster ([`Sandbox`]:
//! nats-server, a coordinator, a worker with one slot) whose `--http` endpoint serves `/ui/`.
//!
//! With `MUR_CONSOLE_SHOTS=DIR` the test saves a screenshot of each page in DIR (the ones in
//! `docs/console/` come from such a run).

use fantoccini::{Client, ClientBuilder, Locator};
use mur_a2a::auth::{Guard, Mode};
use mur_nats::tokens::Keyring;
use mur_proto::task::{Origin, TaskState};
use mur_tests::capsule::shell_capsule;
use mur_tests::sandbox::Sandbox;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// `chromedriver` on a free loopback port, in a process group of its own: killed with
/// the browsers it started (by that group's id, the driver's pid) when dropped, so a
/// failing test leaves no chromium behind.
struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    fn start() -> Driver {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (Debian's chromium-driver package; .ci/run installs it with chromium)");
        let deadline = Instant::now() + WAIT;
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen on port {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Driver { child, url: format!("http://127.0.0.1:{port}") }
    }

    /// A headless chromium session.
    async fn browser(&self) -> Client {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,1000", "--force-device-scale-factor=1"],
            }),
        );
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("a chromium session")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // By the group this test started (its id is the driver's pid): the driver and its
        // browsers, nothing else.
        // SAFETY: kill(2) with a negative pid signals that process group; no memory is touched.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// Serves the coordinator's HTTP endpoint (console included) with `guard` on a free
/// loopback port; its base URL.
async fn serve(sb: &Sandbox, guard: Guard, stop: CancellationToken) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (client, served) = (sb.client.clone(), base.clone());
    tokio::spawn(async move {
        let stopped = async move { stop.cancelled().await };
        mur_coordinator::http::serve_with(client, listener, served, guard, None, stopped).await.unwrap();
    });
    base
}

/// Saves a screenshot of the page as `<MUR_CONSOLE_SHOTS>/<name>.png`, when asked for.
async fn shot(browser: &Client, name: &str) {
    let Some(dir) = std::env::var_os("MUR_CONSOLE_SHOTS") else { return };
    let png = browser.screenshot().await.expect("screenshot");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(std::path::Path::new(&dir).join(format!("{name}.png")), png).unwrap();
}

/// The cells of every body row of the table in the section headed `heading_id`.
async fn rows(browser: &Client, heading_id: &str) -> Vec<Vec<String>> {
    rows_at(browser, &format!("section[aria-labelledby={heading_id}] tbody tr")).await
}

/// The cells' text of every row `css` finds, read in one script: the live cluster section
/// may be replaced between two WebDriver reads.
async fn rows_at(browser: &Client, css: &str) -> Vec<Vec<String>> {
    let script = "return Array.from(document.querySelectorAll(arguments[0]))\
                  .map(r => Array.from(r.querySelectorAll('td')).map(c => c.innerText));";
    let value = browser.execute(script, vec![serde_json::json!(css)]).await.unwrap();
    serde_json::from_value(value).unwrap()
}

/// The text of the first element `css` finds, read in one script; `None` when there is none.
async fn text(browser: &Client, css: &str) -> Option<String> {
    let script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;";
    serde_json::from_value(browser.execute(script, vec![serde_json::json!(css)]).await.unwrap()).unwrap()
}

/// Waits, at most [`WAIT`], until `check` holds of the page; panics with the last value.
async fn until<T: std::fmt::Debug>(
    browser: &Client,
    what: &str,
    mut read: impl AsyncFnMut(&Client) -> T,
    check: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        let value = read(browser).await;
        if check(&value) {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}: still {value:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_shows_a_waiting_user_task_live_a_timeline_of_turns_and_asks_a_remote_viewer_for_a_token() {
    let sb = Sandbox::start(1, 1).await;
    let capsule = shell_capsule("console");
    sb.push(capsule.dir()).await;
    let stop = CancellationToken::new();
    // A loopback `mur dev --http` with no token made: open (Mode::WhenTokens, empty keyring).
    let open = serve(&sb, Guard::new(Mode::WhenTokens, Keyring::new()), stop.clone()).await;
    let driver = Driver::start();
    let browser = driver.browser().await;

    // The only slot is held by a task that waits for a file; a user task waits behind it.
    let release = capsule.dir().join("release");
    let blocker = sb
        .submit(
            "console",
            &format!("until [ -f {0} ]; do sleep 0.05; done; echo released", release.display()),
            Origin::User,
        )
        .await;
    let deadline = Instant::now() + WAIT;
    while sb.record(&blocker).await.state != TaskState::Working {
        assert!(Instant::now() < deadline, "the blocker never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waiting = sb.submit("console", "echo '<script>window.pwned=1</script>'", Origin::User).await;

    browser.goto(&format!("{open}/ui/")).await.unwrap();
    // Worker heartbeats bring the busy slot a moment after the task starts: wait for both.
    let (lanes, flight, workers, heading) = until(
        &browser,
        "a waiting user task and a busy slot",
        async |b| {
            let lanes = rows(b, "h-lanes").await;
            (lanes, rows(b, "h-flight").await, rows(b, "h-workers").await, text(b, "#h-workers").await)
        },
        |(lanes, _, workers, _)| !lanes.is_empty() && workers.first().is_some_and(|w| w[2] == "0"),
    )
    .await;
    assert_eq!(lanes.len(), 1, "{lanes:?}");
    assert_eq!(lanes[0][..3], ["console", "user", "1"]);
    assert_eq!(flight.len(), 1, "{flight:?}");
    assert_eq!(
        [flight[0][0].as_str(), flight[0][1].as_str(), flight[0][3].as_str()],
        [blocker.as_str(), "console", "working"]
    );
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0][..3], ["wkr-test-0", "1", "0"], "one slot, busy");
    assert_eq!(workers[0][4], "live");
    assert_eq!(heading.as_deref(), Some("Workers 1 live, 0 of 1 slots free"));
    shot(&browser, "cluster").await;

    // A third task, waiting in the peer lane, canceled from its page (no token checked: may act).
    let doomed = sb.submit("console", "echo never", Origin::Peer).await;
    browser.goto(&format!("{open}/ui/tasks/{doomed}")).await.unwrap();
    browser.find(Locator::Css("form[action$='/cancel'] button")).await.unwrap().click().await.unwrap();
    let notice = until(&browser, "the cancel", async |b| text(b, "[role=status]").await, |n| n.is_some()).await;
    assert_eq!(notice.as_deref(), Some("Cancel asked: the task is canceled."));
    assert!(browser.find(Locator::Css("form[action$='/cancel']")).await.is_err(), "offered again");
    assert_eq!(sb.record(&doomed).await.state, TaskState::Canceled);

    // Released, both tasks run; the open page follows over server-sent events, unreloaded.
    browser.goto(&format!("{open}/ui/")).await.unwrap();
    until(&browser, "the page before the release", async |b| rows(b, "h-lanes").await, |r| r.len() == 1).await;
    std::fs::write(&release, "").unwrap();
    sb.wait_all(&[blocker.clone(), waiting.clone()], WAIT).await;
    until(
        &browser,
        "the live cluster section",
        async |b| {
            let flight = text(b, "section[aria-labelledby=h-flight] p.empty").await;
            (flight, text(b, "section[aria-labelledby=h-lanes] p.empty").await)
        },
        |(flight, lanes)| {
            flight.as_deref() == Some("No task is in flight.") && lanes.as_deref() == Some("No task is waiting.")
        },
    )
    .await;

    // The task list: both tasks, newest first, the script in the text shown as text.
    browser.goto(&format!("{open}/ui/tasks")).await.unwrap();
    let list = rows_at(&browser, "main table tbody tr").await;
    assert_eq!(list.len(), 3, "{list:?}");
    assert_eq!(list[0][..6], [doomed.as_str(), "console", "canceled", "peer", "peer", "canceled"]);
    assert_eq!(list[1][..6], [waiting.as_str(), "console", "completed", "user", "user", "ok"]);
    assert_eq!(list[1][7], "echo '<script>window.pwned=1</script>'");
    assert_eq!(list[2][0], blocker);
    let pwned = browser.execute("return window.pwned === undefined", vec![]).await.unwrap();
    assert_eq!(pwned, serde_json::json!(true), "the task's script ran");
    // Filtered to the `bg` lane: nothing.
    browser.goto(&format!("{open}/ui/tasks?lane=bg")).await.unwrap();
    let empty = browser.find(Locator::Css("main p.empty")).await.unwrap().text().await.unwrap();
    assert_eq!(empty, "No task matches.");
    // Filtered to the `peer` lane: the canceled one, the filter form showing the choice.
    browser.goto(&format!("{open}/ui/tasks?lane=peer")).await.unwrap();
    let peer = rows_at(&browser, "main table tbody tr").await;
    assert_eq!(peer.iter().map(|r| r[0].as_str()).collect::<Vec<_>>(), [doomed.as_str()]);
    assert_eq!(text(&browser, "#f-lane option:checked").await.as_deref(), Some("peer"));
    browser.goto(&format!("{open}/ui/tasks")).await.unwrap();
    shot(&browser, "tasks").await;

    // The task's page: its record, its two turns (a shell call, then the answer), its result.
    browser.find(Locator::LinkText(&waiting)).await.unwrap().click().await.unwrap();
    let turns = until(
        &browser,
        "the timeline's turns",
        async |b| {
            let mut t = Vec::new();
            for h in b.find_all(Locator::Css("ol.timeline li.turn h3")).await.unwrap() {
                t.push(h.text().await.unwrap());
            }
            t
        },
        |t| !t.is_empty(),
    )
    .await;
    assert_eq!(turns, ["Turn 0", "Turn 1"]);
    let call = browser.find(Locator::Css("ol.timeline li.turn li.call")).await.unwrap().text().await.unwrap();
    assert!(call.starts_with("tool sh ok: "), "{call}");
    assert!(call.contains("$ echo '<script>window.pwned=1</script>' → exit 0"), "{call}");
    let notes: Vec<String> = {
        let mut n = Vec::new();
        for li in browser.find_all(Locator::Css("ol.timeline li.note")).await.unwrap() {
            n.push(li.text().await.unwrap());
        }
        n
    };
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert_eq!(notes[0], "started from cluster, origin user, lane user");
    assert!(notes[1].starts_with("ended ok after "), "{notes:?}");
    let result =
        browser.find(Locator::Css("section[aria-labelledby=h-result] pre")).await.unwrap().text().await.unwrap();
    assert_eq!(result, "ran: echo '<script>window.pwned=1</script>'");
    assert_eq!(browser.execute("return window.pwned === undefined", vec![]).await.unwrap(), serde_json::json!(true));
    shot(&browser, "task").await;

    // Bound elsewhere than loopback, the endpoint's guard requires a token: the page asks
    // for one, a wrong one is refused without being repeated, the right one signs in.
    let token = mur_nats::tokens::generate().unwrap();
    let guarded = serve(&sb, Guard::new(Mode::Required, Keyring::of_token("ops", &token)), stop.clone()).await;
    browser.goto(&format!("{guarded}/ui/")).await.unwrap();
    assert_eq!(browser.find(Locator::Css("h1")).await.unwrap().text().await.unwrap(), "Sign in");
    let alert = browser.find(Locator::Css("[role=alert]")).await.unwrap().text().await.unwrap();
    assert_eq!(alert, "This console needs a token to show the cluster.");
    let label = browser.find(Locator::Css("label[for=token]")).await.unwrap().text().await.unwrap();
    assert_eq!(label, "Token");
    assert!(browser.find(Locator::Css("#h-lanes")).await.is_err(), "the cluster is not shown");
    shot(&browser, "login").await;
    let wrong = "mur_0123456789abcdef";
    browser.find(Locator::Id("token")).await.unwrap().send_keys(wrong).await.unwrap();
    browser.find(Locator::Css("form.login button")).await.unwrap().click().await.unwrap();
    let alert = until(
        &browser,
        "the refusal",
        async |b| match b.find(Locator::Css("[role=alert]")).await {
            Ok(e) => e.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        },
        |a| a.contains("not accepted"),
    )
    .await;
    assert_eq!(alert, "That token was not accepted (unauthenticated: unknown or revoked token).");
    assert!(!browser.source().await.unwrap().contains(wrong), "the wrong token is echoed");
    browser.find(Locator::Id("token")).await.unwrap().send_keys(&token).await.unwrap();
    browser.find(Locator::Css("form.login button")).await.unwrap().click().await.unwrap();
    let who = until(
        &browser,
        "signed in",
        async |b| match b.find(Locator::Css("header .who span")).await {
            Ok(e) => e.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        },
        |w| !w.is_empty(),
    )
    .await;
    assert_eq!(who, "token ops (admin)");
    assert!(browser.find(Locator::Css("#h-lanes")).await.is_ok());
    assert!(!browser.source().await.unwrap().contains(&token), "the token is in the page");

    browser.close().await.unwrap();
    drop(driver);
    stop.cancel();
    sb.shutdown().await;
}

/// A fleet whose first step is `destructive`: a run parks it and the job goes `blocked`
/// (as in `fleet_procedure.rs`).
const GATE: &str = "\
name: gate
members: [writer, critic]
procedure:
  - id: deploy
    member: writer
    task: Deploy it.
    tier: destructive
  - id: check
    member: critic
    task: Check it.
";

/// A scripted capsule answering every task with `reply`.
fn replying(name: &str, reply: &str) -> mur_tests::capsule::TestCapsule {
    mur_tests::capsule::TestCapsule::new(
        &format!("name: {name}\nversion: 1.0.0\ninference:\n  driver: scripted\n  script: r.yaml\n"),
        &[("r.yaml", format!("replies:\n  - text: {reply:?}\n").as_str())],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_approval_granted_from_the_page_is_recorded_with_who_answered_and_the_next_run_continues() {
    let sb = Sandbox::start(1, 4).await;
    for c in [replying("writer", "Deployed."), replying("critic", "Checked.")] {
        sb.push(c.dir()).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.yaml");
    std::fs::write(&path, GATE).unwrap();
    sb.fleet_ok(&["apply", path.to_str().unwrap()]);
    let job = sb.fleet_ok(&["send", "gate", "Ship <b>v2</b>."]).sent_job_id();
    let parked = sb.fleet_blocking(&["run", "gate"]).await;
    assert_eq!(parked.code, 1, "{parked:?}");

    let token = mur_nats::tokens::generate().unwrap();
    let stop = CancellationToken::new();
    let base = serve(&sb, Guard::new(Mode::Required, Keyring::of_token("ops", &token)), stop.clone()).await;
    let driver = Driver::start();
    let browser = driver.browser().await;
    browser.goto(&format!("{base}/ui/login")).await.unwrap();
    browser.find(Locator::Id("token")).await.unwrap().send_keys(&token).await.unwrap();
    browser.find(Locator::Css("form.login button")).await.unwrap().click().await.unwrap();
    until(&browser, "signed in", async |b| text(b, "header .who span").await, |w| w.is_some()).await;

    browser.goto(&format!("{base}/ui/approvals")).await.unwrap();
    let heading = text(&browser, "article.approval h2").await;
    assert_eq!(heading.as_deref(), Some(format!("Fleet gate, job {job}").as_str()));
    let facts = text(&browser, "article.approval dl").await.unwrap();
    assert!(facts.contains("Steps parked\tdeploy") || facts.contains("Steps parked\ndeploy"), "{facts:?}");
    assert_eq!(text(&browser, "article.approval pre").await.as_deref(), Some("Ship <b>v2</b>."));
    shot(&browser, "approvals").await;

    browser
        .find(Locator::Css("article.approval form[action$='/approve'] button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let notice = until(&browser, "the answer", async |b| text(b, "[role=status]").await, |n| n.is_some()).await;
    assert_eq!(
        notice.as_deref(),
        Some(
            format!(
                "approved job {job} of fleet gate (step deploy) as console:ops; the next run of the fleet takes it"
            )
            .as_str()
        )
    );
    assert_eq!(
        text(&browser, "article.approval p.answer").await.map(|a| a.split(" at ").next().unwrap_or("").to_string()),
        Some("approved by console:ops".to_string())
    );
    assert!(browser.find(Locator::Css("article.approval form")).await.is_err(), "answered twice");
    let jobs: serde_json::Value =
        serde_json::from_str(sb.fleet_ok(&["jobs", "gate", "--all", "--json"]).stdout.trim()).unwrap();
    assert_eq!(jobs[0]["approval"]["decision"], "approved");
    assert_eq!(jobs[0]["approval"]["by"], "console:ops");

    // The next run takes the job and runs the approved step.
    let next = sb.fleet_blocking(&["run", "gate"]).await;
    assert_eq!(next.code, 0, "{next:?}");
    let jobs: serde_json::Value =
        serde_json::from_str(sb.fleet_ok(&["jobs", "gate", "--all", "--json"]).stdout.trim()).unwrap();
    assert_eq!(jobs[0]["status"], "done", "{jobs}");

    browser.close().await.unwrap();
    drop(driver);
    stop.cancel();
    sb.shutdown().await;
}
