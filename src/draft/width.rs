//! How wide to draft: the published probe-2 / widen-to-7 policy, with pauses after misses.
//!
//! Contract: [`WidthPolicy::width`] is the drafts to ask for now (0 while paused); it learns
//! only from verifies' outcomes ([`WidthPolicy::record`]) and single steps ([`WidthPolicy::tick`]).
//! It changes how many tokens a step may emit, never which.

use super::EWMA;

/// Draft width: probe with `probe` tokens; all accepted -> `max`; some -> max(probe, min(max,
/// 2 x accepted)); none -> pause for `pause_steps` single steps (doubling while probes keep
/// failing, up to `max_pause_steps`), then probe again — unless the drafter's recent record is good
/// (a moving average of the accepted share of at least [`GOOD_RECORD`]): then one miss only sends
/// it back to the probe width. A trained drafter's first draft is wrong now and then (on the demo
/// model about one verify in four); pausing it for 8+ steps each time threw away a third of its
/// tokens, while a drafter that keeps missing still pauses after its record falls.
#[derive(Clone, Debug)]
pub struct WidthPolicy {
    pub probe: usize,
    pub max: usize,
    pub pause_steps: usize,
    pub max_pause_steps: usize,
    width: usize,
    paused: usize,
    next_pause: usize,
    /// Moving average of accepted / proposed per verify (0 before any).
    record: f64,
}

/// A drafter whose moving average of accepted drafts is at least this is not paused by one miss.
pub const GOOD_RECORD: f64 = 0.5;

impl Default for WidthPolicy {
    fn default() -> Self {
        WidthPolicy::new(2, 7, 8, 128)
    }
}

impl WidthPolicy {
    pub fn new(probe: usize, max: usize, pause_steps: usize, max_pause_steps: usize) -> Self {
        let probe = probe.max(1);
        let max = max.max(probe);
        WidthPolicy {
            probe,
            max,
            pause_steps,
            max_pause_steps,
            width: probe,
            paused: 0,
            next_pause: pause_steps,
            record: 0.0,
        }
    }

    /// Drafts to ask for now (0 while paused).
    pub fn width(&self) -> usize {
        if self.paused > 0 { 0 } else { self.width }
    }

    /// One token fed without drafts: a pause runs down.
    pub fn tick(&mut self) {
        self.paused = self.paused.saturating_sub(1);
    }

    /// The outcome of one verify: `accepted` of `proposed` drafts.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let good = self.record >= GOOD_RECORD;
        self.record += EWMA * (accepted as f64 / proposed as f64 - self.record);
        if accepted == 0 && good {
            self.width = self.probe;
            return;
        }
        if accepted == 0 {
            // The published runtime stops for the request; pausing lets a later cycle in the
            // output still be found (a paused drafter costs nothing).
            self.paused = self.next_pause;
            self.next_pause = (self.next_pause * 2).clamp(1, self.max_pause_steps.max(1));
            self.width = self.probe;
            return;
        }
        self.next_pause = self.pause_steps;
        self.width = if accepted >= proposed { self.max } else { (2 * accepted).clamp(self.probe, self.max) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn width_policy_as_published() {
        let mut w = WidthPolicy::default();
        assert_eq!(w.width(), 2);
        w.record(2, 2);
        assert_eq!(w.width(), 7, "full match widens to the max");
        w.record(7, 3);
        assert_eq!(w.width(), 6, "partial: 2 x accepted");
        w.record(6, 1);
        assert_eq!(w.width(), 2, "partial: at least the probe");
        w.record(2, 1);
        assert_eq!(w.width(), 2);
        w.record(2, 2);
        w.record(7, 5);
        assert_eq!(w.width(), 7, "partial: at most the max");
        w.record(3, 3);
        assert_eq!(w.width(), 7, "all of a short proposal is a full match");
        w.record(0, 0);
        assert_eq!(w.width(), 7, "no proposal changes nothing");
    }

    #[test]
    fn zero_accepted_pauses_then_probes_again_with_backoff() {
        let mut w = WidthPolicy::new(2, 7, 3, 8);
        w.record(2, 2);
        w.record(7, 0);
        for _ in 0..3 {
            assert_eq!(w.width(), 0);
            w.tick();
        }
        assert_eq!(w.width(), 2, "after the pause it probes at 2");
        w.record(2, 0);
        for _ in 0..6 {
            assert_eq!(w.width(), 0, "a second failure pauses twice as long");
            w.tick();
        }
        assert_eq!(w.width(), 2);
        w.record(2, 0);
        for _ in 0..8 {
            assert_eq!(w.width(), 0, "the pause is capped");
            w.tick();
        }
        w.record(2, 1);
        w.record(2, 0);
        assert_eq!(w.width(), 0);
        for _ in 0..3 {
            w.tick();
        }
        assert_eq!(w.width(), 2, "an acceptance resets the backoff");
    }

    #[test]
    fn a_drafter_with_a_good_record_is_not_paused_by_one_miss() {
        let mut w = WidthPolicy::new(2, 7, 3, 8);
        for _ in 0..6 {
            w.record(7, 7);
        }
        w.record(7, 0);
        assert_eq!(w.width(), 2, "one miss: back to the probe, no pause");
        w.record(2, 0);
        assert_eq!(w.width(), 2, "the record (0.62) is still good");
        w.record(2, 0);
        assert_eq!(w.width(), 0, "a third miss in a row: the record fell below the bar, so it pauses");
    }
}
