"""The learning-rate schedule of a run fixed either by a step count or by a wall-clock budget.

Warmup-stable-decay (WSD): linear warmup over `warmup` steps, the peak until the decay starts,
then `floor + (peak - floor) * (1 - sqrt(p))` as the decay's progress p goes 0 -> 1 over the last
`decay` share of the run (Hagele et al. 2024: this cooldown matches a cosine run of the same
length, and the stable phase needs no advance knowledge of the end).

With a budget the run's length is estimated from the measured seconds per step (re-estimated
every step until the decay starts, so the estimate includes the periodic evaluations); the decay
starts at the estimated step (1 - decay) * N and its progress is the larger of the step share and
the time share of what is left, so the LR reaches its floor by the budget even if steps slow down.
A budget run whose held-out loss stops improving in the stable phase begins its decay there
(`start_decay`: WSD's stable phase can end at any step). `max_steps` caps the estimate (a run that would pass over the data too many times ends early,
its decay placed as for a run of that length). The steps reached and the step the decay started
at are recorded: `--steps N --decay-start D`
reruns the same schedule by steps alone.
"""

import math


class Schedule:
    def __init__(self, peak, warmup, decay=0.25, floor=0.02, steps=0, budget_s=0.0, decay_start=0, max_steps=0):
        if steps <= 0 and budget_s <= 0:
            raise ValueError("a schedule needs a step count or a time budget")
        self.peak, self.warmup, self.decay, self.floor = peak, warmup, decay, floor * peak
        self.budget_s = budget_s if steps <= 0 else 0.0
        self.steps = steps if steps > 0 else None
        self.decay_start = decay_start or (round((1 - decay) * steps) if steps > 0 else None)
        self.decay_t = None
        self.calib = None             # (step, elapsed) where timing starts (after the first steps)
        self.max_steps = max_steps    # with a budget: never plan more steps than this (0: no cap)
        self.early = False            # the decay began early, the held-out loss having flattened

    def estimate(self, step, elapsed):
        """Steps that fit in the budget, from the pace since the calibration point."""
        s0, t0 = self.calib
        per = (elapsed - t0) / max(1, step - s0)
        n = step + max(0, int((self.budget_s - elapsed) / per)) if per > 0 else step + 1
        return min(n, self.max_steps) if self.max_steps else n

    def at(self, step, elapsed):
        """(learning rate, finished) for `step` (0-based) at `elapsed` seconds into the run."""
        if self.budget_s:
            if self.calib is None and step >= 3:
                self.calib = (step, elapsed)
            if self.decay_start is None:
                if elapsed >= self.budget_s:
                    self.decay_start, self.decay_t, self.steps = step, elapsed, step
                elif self.calib is not None and step > self.calib[0] + 2:
                    n = self.estimate(step, elapsed)
                    if step >= max(self.warmup, (1 - self.decay) * n):
                        self.decay_start, self.decay_t, self.steps = step, elapsed, max(n, step + 1)
        base = self.peak * min(1.0, (step + 1) / self.warmup) if self.warmup else self.peak
        if self.decay_start is None or step < self.decay_start:
            return base, False
        p = (step - self.decay_start) / max(1, self.steps - self.decay_start)
        if self.budget_s and self.decay_t is not None and self.budget_s > self.decay_t:
            p = max(p, (elapsed - self.decay_t) / (self.budget_s - self.decay_t))
        if p >= 1.0:
            return self.floor, True
        return self.floor + (base - self.floor) * (1 - math.sqrt(p)), False

    def start_decay(self, step, elapsed):
        """Begins the decay now (a budget run whose held-out loss has flattened): it lasts the
        share `decay` of the run so ended. No effect once the decay has begun or by step count."""
        if self.budget_s and self.decay_start is None and step >= self.warmup:
            self.decay_start, self.decay_t = step, elapsed
            self.steps = step + max(1, round(step * self.decay / (1 - self.decay)))
            self.early = True
            return True
        return False

    def record(self, steps_done):
        return {"kind": "wsd", "peak": self.peak, "warmup_steps": self.warmup, "decay_share": self.decay,
                "floor": self.floor, "budget_s": self.budget_s, "decay_start": self.decay_start,
                "planned_steps": self.steps, "steps": steps_done, "decay_began_on_plateau": self.early, "rerun": f"--steps {steps_done} --decay-start {self.decay_start}"}
