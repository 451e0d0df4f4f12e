"""When the token reader polls the ring next (token_reader.py's module docstring tells why).

The device publishes tokens at the end of each step. PollCadence estimates the step period (an
EWMA of the gaps between cycles that gave running sequences tokens, biased to the short ones;
first tokens alone are no cadence) and answers how long to sleep: coarsely (at most
`max_idle_s`) until `lead` of a step has passed, then every `fine_s` until the step's tokens
appear. Without a cadence it polls every `fine_s` while a request awaits its first token, for at
most `urgent_fine_s` after the latest registration, and every `max_idle_s` otherwise.

While constrained requests (structured output) are active and there is a cadence, it polls every
`fine_s` throughout the step, with no coarse sleep: such a request samples its next token only once
the frontend has read its last one and posted the mask that follows, so a token that sits in the ring
while the reader sleeps toward a predicted step end (the prediction may be late: a step that carries
constrained rows need not last as long as the last one) costs device time directly.
"""

from __future__ import annotations

MAX_STEP_S = 0.1  # a longer gap between publications is no step cadence


class PollCadence:
    def __init__(
        self, fine_s: float = 200e-6, max_idle_s: float = 0.001, lead: float = 0.7, urgent_fine_s: float = 0.05
    ):
        self.fine_s = fine_s  # sleep between cycles while a publication is due
        self.max_idle_s = max_idle_s  # longest sleep between cycles while requests are active
        self.lead = lead  # share of an estimated step after which a publication is due
        self.urgent_fine_s = urgent_fine_s  # without a cadence: fine cycles this long after a registration
        self.step_s: float | None = None  # estimated time between publications (EWMA)
        self._step_at = -1.0  # monotonic time of the last cycle that gave running sequences tokens
        self._registered_at = -1.0  # monotonic time of the latest registration

    def registered(self, now: float) -> None:
        """A request was registered (it awaits its first token)."""
        self._registered_at = now

    def saw_step(self, now: float) -> None:
        """Running sequences got tokens: a step ended. The gap since the previous one updates the
        step period estimate (first tokens do not: a lone prompt's prefill is no cadence)."""
        gap = now - self._step_at
        self._step_at = now
        if self.fine_s / 2 <= gap <= MAX_STEP_S:  # not the rest of one publication, nor a pause
            p = self.step_s
            # Biased to the short gaps, the decode steps: a longer one (a prefill step without
            # decodes, a pause) moves it little, since an estimate too long would put the next
            # step's end before `lead`, where the reader polls only every max_idle_s.
            self.step_s = gap if p is None else p + (0.5 if gap < p else 0.05) * (gap - p)

    def next_wait(self, now: float, awaiting_first: bool, awaiting_mask: bool = False) -> float:
        """How long to sleep before the next cycle. With a step cadence (running sequences got
        tokens within the last 4 estimated steps), coarse sleeps (<= max_idle_s) until `lead` of a
        step has passed since the last one, then fine ones (fine_s) until the step's tokens appear.
        Without one, fine sleeps while a request awaits its first token (`awaiting_first`: a lone
        prompt's prefill), for at most urgent_fine_s after the latest registration (a long prefill,
        a stalled device: a fine cycle costs ~25 % of a core), max_idle_s otherwise. `awaiting_mask`
        (constrained requests are active): fine sleeps throughout a step while there is a cadence."""
        p, since = self.step_s, now - self._step_at
        if p is not None and since < 4 * p:
            if awaiting_mask:
                return self.fine_s
            due = self.lead * p - since
            return self.fine_s if due <= self.fine_s else min(due, self.max_idle_s)
        if awaiting_first and now - self._registered_at < self.urgent_fine_s:
            return self.fine_s
        return self.max_idle_s
