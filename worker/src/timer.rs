//! An exact sleep for a model that answers after a set time (the scripted driver's
//! `delay_ms`, the testkit's fake servers): [`sleep`] ends within a few tens of
//! microseconds of its deadline, where `tokio::time::sleep` ends 1–2 ms late (its timer
//! wheel ticks in whole milliseconds, rounds a deadline up, and parks with a timeout in
//! milliseconds). A scripted reply that is to come "after 200 ms" then does, and a
//! benchmark's ideal is not missed by the fixture's own clock (issue #9).
//!
//! One thread holds every deadline in an ordered map and waits on a channel with a timeout
//! (a futex with a nanosecond deadline, under the kernel's 50 µs timer slack); at each
//! deadline it completes the sleeper's oneshot, which wakes its task at once.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

type Request = (Instant, oneshot::Sender<()>);

/// Sleeps until `duration` from now has passed, to within the kernel's timer slack.
pub async fn sleep(duration: Duration) {
    sleep_until(Instant::now() + duration).await;
}

/// Sleeps until `deadline`, to within the kernel's timer slack.
pub async fn sleep_until(deadline: Instant) {
    let (tx, rx) = oneshot::channel();
    if timer().send((deadline, tx)).is_err() {
        // The timer thread is gone (it never is while the process runs): tokio's timer.
        tokio::time::sleep_until(deadline.into()).await;
        return;
    }
    let _ = rx.await;
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
    // By deadline, then by arrival (the sequence number), earliest first.
    let mut due: BTreeMap<(Instant, u64), oneshot::Sender<()>> = BTreeMap::new();
    let mut next = 0u64;
    loop {
        let now = Instant::now();
        while let Some(entry) = due.first_entry().filter(|e| e.key().0 <= now) {
            let _ = entry.remove().send(());
        }
        let request = match due.first_key_value() {
            None => requests.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(((at, _), _)) => requests.recv_timeout(at.saturating_duration_since(now)),
        };
        match request {
            Ok((at, tx)) => {
                next += 1;
                due.insert((at, next), tx);
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
}
