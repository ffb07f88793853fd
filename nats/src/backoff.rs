//! The one backoff every retry loop uses: exponential (factor 2) from a first delay up to a
//! cap, each delay with jitter — a random part of up to the delay itself is added, so a
//! delay is in `[d, 2d)` — so that processes that failed together (a coordinator
//! restarting under many clients) do not all retry in step. The sequence is backon's
//! `ExponentialBuilder`; this module only fixes its shape.

use std::time::Duration;

/// The delays to wait between attempts: `first`, then doubling up to `max`, each with
/// jitter (so one delay is at most twice `max`). Endless: the caller decides when to stop.
pub fn delays(first: Duration, max: Duration) -> impl Iterator<Item = Duration> + Send {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_min_delay(first)
        .with_max_delay(max)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_the_first_up_to_the_cap_each_with_up_to_its_own_length_of_jitter() {
        let (first, max) = (Duration::from_millis(250), Duration::from_secs(4));
        let base = [250, 500, 1000, 2000, 4000, 4000, 4000].map(Duration::from_millis);
        for _ in 0..50 {
            let got: Vec<Duration> = delays(first, max).take(base.len()).collect();
            for (d, b) in got.iter().zip(base) {
                assert!(*d >= b && *d < b * 2, "{d:?} is not in [{b:?}, {:?})", b * 2);
            }
        }
    }
}
