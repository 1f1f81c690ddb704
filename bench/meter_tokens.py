"""The live meter's cost per relayed token, against its definition, in one run.

``B`` requests decode on one upstream; every iteration each of them gets a token, and the gateway reads the
meter as it books that token (``UpstreamClient._book``: ``token`` then the call's charge). Measured for
``fairgate.core.meter.LiveMeter`` (one integral: O(1) per token) and ``fairgate.core.meter_reference``
(every interval charged to every request in flight: O(B) per token, O(B^2) per iteration), same events, and
the two totals compared. A request leaves and a new one joins every ``--turnover`` iterations (each costs
O(B) in both).

Usage: .venv/bin/python bench/meter_tokens.py [--iterations 400] [--batches 4,16,64] [--turnover 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairgate.core.cost import CostModel
from fairgate.core.meter import LiveMeter
from fairgate.core.meter_reference import ReferenceMeter

COST = CostModel(9.0, 0.55, 0.06, 256)
ITERATION_MS = 12.0


class Meter(Protocol):
    def start(self, request_id: str, tenant: str, prompt_tokens: int, now_ms: float, sequences: int = 1) -> object: ...
    def first_token(self, request_id: str, now_ms: float) -> object: ...
    def token(self, now_ms: float) -> object: ...
    def finish(self, request_id: str, now_ms: float) -> object: ...
    def charged_ms(self, request_id: str) -> float: ...


def drive(meter: Meter, batch: int, iterations: int, turnover: int) -> tuple[float, int, float]:
    """Seconds spent, tokens metered and GPU ms charged to the requests still in flight at the end."""
    now, serial, tokens = 0.0, 0, 0
    live: list[str] = []
    for _ in range(batch):
        live.append(f"r{serial}")
        meter.start(live[-1], "t", 100, now)
        serial += 1
    start = time.perf_counter()
    for iteration in range(iterations):
        now += ITERATION_MS
        for index, request_id in enumerate(live):
            now += 0.01  # the burst of one iteration's tokens, as the gateway reads them
            meter.first_token(request_id, now) if iteration == 0 else meter.token(now)
            meter.charged_ms(request_id)
            tokens += 1
            if index == 0 and iteration % turnover == turnover - 1:
                meter.finish(request_id, now)
                live[0] = f"r{serial}"
                meter.start(live[0], "t", 100, now)
                serial += 1
    elapsed = time.perf_counter() - start
    return elapsed, tokens, sum(meter.charged_ms(r) for r in live)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--batches", default="4,16,64")
    parser.add_argument("--turnover", type=int, default=8)
    args = parser.parse_args()
    print(f"{'B':>4} {'integral us/token':>18} {'reference us/token':>19} {'ratio':>7} {'charges agree':>14}")
    for batch in (int(b) for b in args.batches.split(",")):
        fast = drive(LiveMeter(COST, 0.0), batch, args.iterations, args.turnover)
        slow = drive(ReferenceMeter(COST, 0.0), batch, args.iterations, args.turnover)
        fast_us, slow_us = fast[0] / fast[1] * 1e6, slow[0] / slow[1] * 1e6
        agree = abs(fast[2] - slow[2]) <= 1e-6 * max(1.0, slow[2])
        print(f"{batch:>4} {fast_us:>18.2f} {slow_us:>19.2f} {slow_us / fast_us:>6.1f}x {agree!s:>14}")


if __name__ == "__main__":
    main()
