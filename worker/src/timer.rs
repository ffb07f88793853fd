//! An exact sleep for a model that answers after a set time (the scripted driver's
//! `delay_ms`, the testkit's fake servers): [`sleep`] ends within a few tens of
//! microseconds of its deadline, where `tokio::time::sleep` ends 1–2 ms late (its timer
//! wheel ticks in whole milliseconds, rounds a deadline up, and parks with a timeout in
//! milliseconds). A scripted reply that is to come "after 200 ms" then does, and a
//! benchmark's ideal is not missed by the fixture's own clock (issue #9).
//!
//! One thread holds every deadline in an ordered map and waits on a channel with a timeout
//! (a futex with a nanosecond deadline, under the kernel's 50 µs timer slack); at each
//! deadline it completes the sleeper's oneshot, which wakes its task at once. A sleep
//! dropped before its deadline (its task cancelled) takes its deadline out of the map.

use std::collections::BTreeMap;
use std::sync::OnceLock;
#[cfg(test)]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// A deadline in the timer's map: when, then which sleep (numbered as they start), so two
/// sleeps with the same deadline end in the order they began.
type Key = (Instant, u64);

enum Request {
    /// A sleep until the key's instant; its oneshot is completed then.
    Add(Key, oneshot::Sender<()>),
    /// The sleep was dropped before its deadline.
    Cancel(Key),
}

/// The number the next sleep takes.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// How many deadlines the timer thread holds (kept for the tests only).
#[cfg(test)]
static PENDING: AtomicUsize = AtomicUsize::new(0);

/// Sleeps until `duration` from now has passed, to within the kernel's timer slack.
pub async fn sleep(duration: Duration) {
    sleep_until(Instant::now() + duration).await;
}

/// Sleeps until `deadline`, to within the kernel's timer slack.
pub async fn sleep_until(deadline: Instant) {
    let (tx, rx) = oneshot::channel();
    let key = (deadline, NEXT.fetch_add(1, Ordering::Relaxed));
    let timer = timer();
    if timer.send(Request::Add(key, tx)).is_err() {
        // The timer thread is gone (it never is while the process runs): tokio's timer.
        tokio::time::sleep_until(deadline.into()).await;
        return;
    }
    // Dropped before the deadline, the sleep takes its deadline back out of the map.
    let cancel = Cancel { key, timer: Some(timer) };
    let _ = rx.await;
    cancel.disarm();
}

/// Sends [`Request::Cancel`] when dropped armed: the sleep ended before its deadline.
struct Cancel {
    key: Key,
    timer: Option<mpsc::Sender<Request>>,
}

impl Cancel {
    fn disarm(mut self) {
        self.timer = None;
    }
}

impl Drop for Cancel {
    fn drop(&mut self) {
        if let Some(timer) = self.timer.take() {
            let _ = timer.send(Request::Cancel(self.key));
        }
    }
}

fn timer() -> mpsc::Sender<Request> {
    static TIMER: OnceLock<mpsc::Sender<Request>> = OnceLock::new();
    TIMER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Request>();
            std::thread::Builder::new()
                .name("exact-timer".into())
                .spawn(move || run(&rx))
                .expect("spawning the timer thread");
            tx
        })
        .clone()
}

fn run(requests: &mpsc::Receiver<Request>) {
    // By deadline, then by the sleep's number, earliest first.
    let mut due: BTreeMap<Key, oneshot::Sender<()>> = BTreeMap::new();
    loop {
        let now = Instant::now();
        while let Some(entry) = due.first_entry().filter(|e| e.key().0 <= now) {
            let _ = entry.remove().send(());
        }
        #[cfg(test)]
        PENDING.store(due.len(), Ordering::Relaxed);
        let request = match due.first_key_value() {
            None => requests.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(((at, _), _)) => requests.recv_timeout(at.saturating_duration_since(now)),
        };
        match request {
            Ok(Request::Add(key, tx)) => {
                due.insert(key, tx);
            }
            // A cancel that comes after its deadline has passed finds nothing: harmless.
            Ok(Request::Cancel(key)) => {
                due.remove(&key);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sixty_four_exact_sleeps_at_once_never_end_before_their_deadlines() {
        let start = Instant::now();
        let ends = futures::future::join_all((0..64u64).map(|i| async move {
            let deadline = start + Duration::from_millis(50 + i % 4);
            sleep_until(deadline).await;
            (deadline, Instant::now())
        }))
        .await;
        for (deadline, ended) in ends {
            assert!(ended >= deadline, "ended {:?} before its deadline", deadline - ended);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sleep_dropped_before_its_deadline_leaves_nothing_behind_in_the_timer() {
        // Other tests of this binary may sleep meanwhile: count this test's hour-long sleeps,
        // which nothing else starts, by the timer's total before and after.
        let before = PENDING.load(Ordering::Relaxed);
        let sleeps: Vec<_> = (0..100).map(|_| tokio::spawn(sleep(Duration::from_secs(3600)))).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while PENDING.load(Ordering::Relaxed) < before + 100 {
            assert!(Instant::now() < deadline, "the timer never held the 100 sleeps");
            tokio::task::yield_now().await;
        }
        for s in &sleeps {
            s.abort();
        }
        while PENDING.load(Ordering::Relaxed) > before {
            assert!(Instant::now() < deadline, "{} deadlines left", PENDING.load(Ordering::Relaxed) - before);
            sleep(Duration::from_millis(1)).await;
        }
    }
}
