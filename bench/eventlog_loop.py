"""The request log's cost on the event loop: ``EventLog.observe`` per request event (what the loop pays now:
queue the event) against formatting the record as JSON (what the writer thread pays for it), in one run.

The writer thread still runs under the GIL, so the process's CPU is not smaller; what moves is the work off
the event loop's path between two requests' steps.

Usage: .venv/bin/python bench/eventlog_loop.py [--events 20000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from fairgate.gateway.eventlog import EventLog
from fairgate.gateway.observe import Admitted, Finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="request pairs (admitted + finished)")
    args = parser.parse_args()
    events: list[Admitted | Finished] = []
    for i in range(args.events):
        events.append(Admitted(f"r-{i}", "alpha", None, "m", "res", 3, 4, 5.5, 1.7e9))
        events.append(Finished(f"r-{i}", "alpha", "m", "u", "completed", 1.0, 2.0, None, 3, 4, 2.5, 5.5, 4, 1.7e9))
    with tempfile.TemporaryDirectory() as folder:
        sink = EventLog(Path(folder) / "events.jsonl", ["alpha"], flush_every_s=0.5)
        sink.start()
        started = time.perf_counter()
        for event in events:
            sink.observe(event)
        observe_s = (time.perf_counter() - started) / len(events)
        sink.flush()
        sink.close()
        sample = events[: min(len(events), 4_000)]
        started = time.perf_counter()
        for event in sample:
            json.dumps(sink.record_of(event), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        format_s = (time.perf_counter() - started) / len(sample)
    print(f"observe() on the event loop: {observe_s * 1e6:.1f} us/event")
    print(f"formatting a record (the writer thread's work): {format_s * 1e6:.1f} us/event")
    print(f"ratio formatting / observe: {format_s / observe_s:.1f}x")


if __name__ == "__main__":
    main()
