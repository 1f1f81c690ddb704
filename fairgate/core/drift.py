"""The cost model's drift: observed decode step times against the ones it predicts.

The live meter splits an upstream's measured busy time in the proportions of the cost model
(``iter_base_ms + iter_slope_ms * B`` per decode iteration; README, "The charge rule"); a model that no
longer describes the engine (another GPU, a new engine version, a quantised model behind the same name)
shifts charges between short and long requests without changing their sum. Each token after a request's
first arrives one iteration after its previous one, so the gap between two of a request's tokens, taken
while nothing is being prefilled (a prefill lengthens the iteration it is in), is an observed step time at
the current batch size. ``StepDrift`` keeps an exponentially weighted mean of observed / predicted and says
when it leaves ``[1 / (1 + band), 1 + band]`` and when it comes back within half the band (after
``min_steps`` iterations).

The mean's memory is counted in iterations, not observations: the B requests of an iteration each observe
the same step, so each observation weighs ``1 / B`` of one. Weighed one each, 50 observations were one
iteration at B = 48, and the mean followed a single iteration's noise across the band's edge and back: the
demo on a loaded machine logged a drift every half second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fairgate.core.cost import CostModel

# A gap this many times the prediction or more is no step: the request waited (the engine stalled, the
# gateway was slow to read); it would drag the mean by its size alone.
OUTLIER_FACTOR = 5.0
# A gap is no step when the relay was held this fraction of a predicted step or more (its client's write
# blocked) before the read at either end of it: it times the client. On a replica its model describes, a reader
# holding each token 1.5 steps made every other gap 1.5 steps (one token to a read) and the ratio read 1.54;
# one holding every other token 1.4 steps made the gap after each late read 0.6 steps, and the ratio read 0.53
# (tests/gateway/test_step_drift.py): the decode scale it sets would move charges between tenants.
HELD_FRACTION = 0.5


@dataclass
class StepDrift:
    """Observed / predicted decode step time of one upstream, exponentially weighted (``alpha`` per
    iteration, in log space so that 2x and 0.5x weigh alike).

    Attributes:
        cost: the upstream's configured cost model.
        alpha: the weight of each new iteration (0.02: about the last 50 iterations); an observation at
            batch size B weighs ``alpha / B``.
        band: the relative drift tolerated (0.25: a ratio in [0.8, 1.25]).
        min_steps: iterations observed before the ratio is reported.
        steps: observations taken.
        drifted: whether the ratio is out of the band (with hysteresis, below).
    """

    cost: CostModel
    alpha: float = 0.02
    band: float = 0.25
    min_steps: int = 50
    # What it has observed: state, not parameters.
    steps: int = field(default=0, init=False)
    drifted: bool = field(default=False, init=False)
    _iterations: float = field(default=0.0, init=False, repr=False)
    _log_ratio: float = field(default=0.0, init=False, repr=False)

    @property
    def ratio(self) -> float | None:
        """Observed / predicted step time (None until ``min_steps`` iterations)."""
        return math.exp(self._log_ratio) if self._iterations >= self.min_steps - 1e-9 else None

    def observe(self, gap_ms: float, batch: int, held_ms: float = 0.0) -> bool | None:
        """One observed step of ``gap_ms`` at batch size ``batch`` (>= 1); ``held_ms``: the longest the relay
        was held by its reader before the read at either end of the gap (``HELD_FRACTION``). Returns True when
        the ratio has just left the band, False when it has just come back, None otherwise (or for a gap that
        is no step)."""
        batch = max(1, batch)
        predicted = self.cost.iter_base_ms + self.cost.iter_slope_ms * batch
        if (
            gap_ms <= 0
            or predicted <= 0
            or gap_ms >= OUTLIER_FACTOR * predicted
            or held_ms >= HELD_FRACTION * predicted
        ):
            return None
        sample, weight = math.log(gap_ms / predicted), self.alpha / batch
        self._log_ratio = sample if self.steps == 0 else (1 - weight) * self._log_ratio + weight * sample
        self.steps += 1
        self._iterations += 1 / batch
        ratio = self.ratio
        if ratio is None:
            return None
        # Hysteresis: a ratio leaves at the band's edge and comes back only within half of it, so one that
        # hovers at the edge (a loaded machine's emulator, 1.25 +- 0.01) is one drift, not one a second.
        edge = self.band / 2 if self.drifted else self.band
        outside = not 1 / (1 + edge) <= ratio <= 1 + edge
        if outside == self.drifted:
            return None
        self.drifted = outside
        return outside
