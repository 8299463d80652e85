//! The one retry delay of the project: exponential, capped, jittered.
//! Every loop that retries something outside the process (the xDS stream, the
//! CA, the ZDS socket on both ends, the agent's search for a pod's netns)
//! waits with a [`Backoff`], so a fleet of nodes that lost the same peer does
//! not come back to it in step. Pure: no clock, no I/O.

use std::time::Duration;

/// Delays that double from `first` up to `max`; each one handed out is
/// jittered to between half and one and a half times the nominal delay.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    nominal: Duration,
}

impl Backoff {
    pub const fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            first,
            max,
            nominal: first,
        }
    }

    /// The delay to wait now; the next one is twice as long (up to the cap).
    pub fn next_delay(&mut self) -> Duration {
        let now = self.nominal;
        self.nominal = (self.nominal * 2).min(self.max);
        now.mul_f64(0.5 + fastrand::f64())
    }

    /// After a success: the next failure waits the first delay again.
    pub fn reset(&mut self) {
        self.nominal = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_and_reset() {
        let (first, max) = (Duration::from_millis(100), Duration::from_millis(1000));
        let mut b = Backoff::new(first, max);
        let mut nominal = first;
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(
                d >= nominal / 2 && d <= nominal * 3 / 2,
                "{d:?} for {nominal:?}"
            );
            nominal = (nominal * 2).min(max);
        }
        // At the cap, delays stay within the jitter of the cap.
        assert!(b.next_delay() <= max * 3 / 2);
        b.reset();
        assert!(b.next_delay() <= first * 3 / 2);
        // Jitter spreads the delays: 50 draws are not all equal.
        let draws: std::collections::HashSet<_> = (0..50)
            .map(|_| Backoff::new(first, max).next_delay())
            .collect();
        assert!(draws.len() > 1);
    }
}
