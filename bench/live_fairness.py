"""Fairness live: tenants' traffic through the gateway against two emulated replicas, with the real
``openai`` client; GPU shares realised in the ledger.

Two modes.

Closed loop (default): four tenants with seed 002's output mix keep their queues full. Each tenant runs
``--clients`` concurrent clients; each request has a 400-token prompt and an output length drawn from the
tenant's lognormal (means 23.7 / 53 / 197 / 353.8 tokens, cv 0.5), sent as ``max_tokens`` with
``ignore_eos``. The replicas use seed 002's cost model (9 ms + 0.55 ms x B + 0.06 ms/token, 24 slots).
One run per policy; prints each tenant's share of the GPU time the ledger billed, and max/min.

Trace (``--trace azure``): a window of the Azure LLM inference trace 2023 replayed open loop as two
tenants, ``code`` (the code trace) and ``conv`` (the conversation trace), time-compressed by ``--speedup``;
then the simulator on exactly the same requests. Prints, per policy, the GPU shares the simulator predicts,
those the ledger realised, and their difference in percentage points. See ``run_trace`` for what is compared.

Usage: .venv/bin/python bench/live_fairness.py [--seconds 60] [--policies gpu_fair,fcfs,vtc] [--clients 16]
       .venv/bin/python bench/live_fairness.py --trace azure [--seconds 60] [--start 1080] [--speedup 2]
                                               [--policies gpu_fair,fcfs] [--max-requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fairgate.core.policies.params import PolicyConfig  # noqa: E402
from fairgate.harness.config import TenantSpec  # noqa: E402
from fairgate.harness.loadgen import LoadGenerator, Request, TenantLoad  # noqa: E402
from fairgate.harness.logs import quiet_hang_ups  # noqa: E402
from fairgate.harness.records import RequestRecord  # noqa: E402
from fairgate.harness.replica import ReplicaModel  # noqa: E402
from fairgate.harness.run import run_on_stack  # noqa: E402
from fairgate.harness.stack import StackSpec, replicas, start_stack  # noqa: E402
from fairgate.ledger.config import LimitsConfig  # noqa: E402
from fairgate.sim.experiment import simulate  # noqa: E402
from fairgate.sim.result import NOT_YET  # noqa: E402
from fairgate.sim.scenario import Scenario, load_scenario  # noqa: E402
from fairgate.sim.traces import trace_workload  # noqa: E402
from fairgate.sim.workload import Workload  # noqa: E402

MIX = {"classify": 23.7, "chat": 53.0, "summarise": 197.0, "agent": 353.8}
MODEL = "emu"
MAX_MODEL_LEN = 32768
SEED_REPLICA = ReplicaModel(9.0, 0.55, 0.06, 24, MAX_MODEL_LEN)  # seed 002's cost model, 24 slots


def stack_spec(
    tenants: list[str],
    policy: str,
    replica: ReplicaModel,
    count: int,
    processes: bool,
    max_queued: int,
    params: PolicyConfig | None = None,
) -> StackSpec:
    """``count`` replicas with ``replica``'s cost model behind one gateway with ``policy`` (and its
    ``[policy]`` parameters), an SQLite ledger, tenants with no quota but ``max_queued`` / ``max_concurrent``."""
    tenant_specs = tuple(TenantSpec(t) for t in tenants)
    limits = LimitsConfig(max_queued=max_queued, max_concurrent=max_queued)
    return StackSpec(
        tenant_specs, policy, replicas(count, MODEL), replica, processes, policy_params=params, defaults=limits
    )


# --- closed loop ------------------------------------------------------------------------------------------------


def run(policy: str, seconds: float, clients: int) -> tuple[dict[str, float], dict[str, int]]:
    """Each tenant's share of the GPU time the ledger billed, and its requests completed, over ``seconds``
    of ``clients`` closed-loop clients per tenant (lognormal outputs of seed 002's means, 400-token prompts).
    At the end every client hangs up: the gateway bills what the requests in flight consumed, so the shares
    are those of the window, not of a drain where only long requests remain."""
    spec = stack_spec(list(MIX), policy, SEED_REPLICA, 2, False, 1000)
    loads = [TenantLoad(t, clients=clients, mean_output_tokens=mean, prompt_tokens=400) for t, mean in MIX.items()]
    result = run_on_stack(spec, loads, seconds, seed=1)
    gpu = dict.fromkeys(MIX, 0.0)
    for r in result.reservations:
        gpu[r.tenant] += r.billed.gpu_ms
    done = {t: result.history.stats(t).completed for t in MIX}
    return _shares(gpu), done


# --- trace replay -----------------------------------------------------------------------------------------------

TRACE_FILES = {"code": "azure_llm_2023_code.csv", "conv": "azure_llm_2023_conv.csv"}
"""Tenant -> file of the Azure LLM inference trace 2023 in the traces directory."""
TRACE_SCENARIO = REPO / "scenarios" / "replay.toml"
"""Cost model of the replay (seed 002's: 9 ms + 0.55 ms x B + 0.06 ms/token, 24 slots), used by both sides."""
TRACE_REPLICAS = 2


def traces_dir() -> Path:
    """The real traces: ``$FAIRGATE_TRACES_DIR``, else ``../shared/data/traces`` beside the checkout (the
    lookup of ``tests/conftest.py``)."""
    return Path(os.environ.get("FAIRGATE_TRACES_DIR") or REPO.parent / "shared" / "data" / "traces")


def trace_paths(directory: Path | None = None) -> dict[str, Path]:
    """Tenant -> trace file (which may not exist)."""
    directory = directory or traces_dir()
    return {tenant: directory / name for tenant, name in TRACE_FILES.items()}


def trace_scenario(replicas: int = TRACE_REPLICAS) -> Scenario:
    """``scenarios/replay.toml`` with ``replicas`` replicas: the simulator's side of the comparison."""
    return load_scenario(TRACE_SCENARIO, [f"replica.replicas={replicas}"], require_tenants=False)


def azure_window(
    start_s: float, seconds: float, speedup: float, max_requests: int, directory: Path | None = None
) -> Workload:
    """The requests of both Azure traces in trace time ``[start_s, start_s + seconds * speedup)``, arriving
    ``speedup`` times faster: a workload of ``seconds`` (replay seconds), tenants ``code`` and ``conv``.
    Only the first ``max_requests`` arrivals are kept (a bound on the run; the duration stays ``seconds``)."""
    files = [f"{tenant}={path}" for tenant, path in trace_paths(directory).items()]
    workload, _ = trace_workload(files, "azure", start_s=start_s, duration_s=seconds * speedup, speedup=speedup)
    if len(workload) > max_requests:
        n = max_requests
        workload = Workload(
            workload.tenants,
            workload.arrival_ns[:n],
            workload.tenant_index[:n],
            workload.prompt_tokens[:n],
            workload.output_tokens[:n],
            workload.duration_ns,
        )
    return workload


@dataclass
class TraceRun:
    """One policy on one trace window: the simulator's prediction beside the live run.

    Attributes:
        policy: policy name.
        predicted / realised: tenant -> share (0-1) of the GPU time charged in the window.
        predicted_gpu_ms / realised_gpu_ms: tenant -> GPU ms behind those shares.
        arrived: tenant -> requests in the window.
        admitted_sim / dispatched_live: tenant -> requests that got a slot before the deadline.
        finished_sim / finished_live: tenant -> requests done before the deadline.
        late_gpu_ms: GPU ms the ledger billed to requests dispatched after the deadline (not counted).
        errors: requests that failed (anything but the hang-up at the deadline).
        emulator_lag: measured / planned iteration time of the emulators, minus 1 (0.02: 2 % slow).
        wall_s: wall time of the live run, s.
    """

    policy: str
    predicted: dict[str, float]
    realised: dict[str, float]
    predicted_gpu_ms: dict[str, float]
    realised_gpu_ms: dict[str, float]
    arrived: dict[str, int]
    admitted_sim: dict[str, int]
    dispatched_live: dict[str, int]
    finished_sim: dict[str, int]
    finished_live: dict[str, int]
    late_gpu_ms: float
    errors: list[str] = field(default_factory=list)
    emulator_lag: float = 0.0
    wall_s: float = 0.0
    replica_truth_gpu_ms: dict[str, float] = field(default_factory=dict)  # the replicas' own charge-rule totals

    def difference_pp(self) -> dict[str, float]:
        """tenant -> realised minus predicted share, percentage points."""
        return {t: (self.realised[t] - self.predicted[t]) * 100 for t in self.predicted}


def _shares(gpu_ms: dict[str, float]) -> dict[str, float]:
    total = sum(gpu_ms.values())
    return {t: (g / total if total > 0 else 0.0) for t, g in gpu_ms.items()}


def _count(workload: Workload, which: list[bool]) -> dict[str, int]:
    counts = dict.fromkeys(workload.tenants, 0)
    for i, yes in enumerate(which):
        if yes:
            counts[workload.tenants[workload.tenant_index[i]]] += 1
    return counts


def request_id(workload: Workload, i: int) -> str:
    """The ``X-Request-Id`` of request ``i`` (the ledger's request id)."""
    return f"{workload.tenants[workload.tenant_index[i]]}-{i}"


def replay_requests(workload: Workload) -> list[Request]:
    """Request ``i`` at ``arrival_ns[i]`` after the start, whatever happened to the others, on the completions
    endpoint with a prompt of ``prompt_tokens[i]`` words (the emulator counts a word as a token) and
    ``max_tokens = output_tokens[i]``, streamed so that the answer's headers tell when the gateway dispatched
    it."""
    return [
        Request(
            workload.tenants[workload.tenant_index[i]],
            request_id(workload, i),
            workload.output_tokens[i],
            workload.prompt_tokens[i],
            chat=False,
            at_s=arrival_ns / 1e9,
        )
        for i, arrival_ns in enumerate(workload.arrival_ns)
    ]


def run_trace(policy: str, workload: Workload, scenario: Scenario) -> TraceRun:
    """``workload`` live (gateway + ``scenario.replicas`` emulated replicas) and in the simulator, under ``policy``.

    What is compared: each tenant's share of the GPU time charged in the window ``[0, duration)``. The
    simulator stops there (no iteration starts at or after the end; requests running then are charged the
    iterations they ran). Live, every client hangs up at the end: the gateway bills each request in flight
    the GPU time its meter attributed to it so far, and the requests still queued are never run for their
    client. The live share counts the requests the gateway dispatched before the end (its streamed answer
    had begun); the queued requests it dispatches afterwards, only to find their client gone, are left out
    (``late_gpu_ms``). Both sides use the same requests, cost model, replicas, ``max_batch`` and policy
    parameters (the scenario's, written into the gateway's ``[policy]``).
    """
    predicted_run = simulate(scenario, workload, policy)
    predicted_gpu = {t: predicted_run.tenant_gpu_ms[k] for k, t in enumerate(workload.tenants)}
    started = time.monotonic()
    sent, billed, (lag, truth) = _live(policy, workload, scenario)
    wall_s = time.monotonic() - started

    end_ns = workload.duration_ns
    ids = [request_id(workload, i) for i in range(len(workload))]
    records = [sent.get(r) for r in ids]  # None: hung up on before it was sent
    dispatched = [r is not None and r.headers_s is not None and r.headers_s * 1e9 < end_ns for r in records]
    finished_live = [r is not None and r.outcome == "ok" and (r.ended_s or 0.0) * 1e9 < end_ns for r in records]
    realised_gpu = dict.fromkeys(workload.tenants, 0.0)
    late = 0.0
    for rid, was_dispatched in zip(ids, dispatched, strict=True):
        if rid not in billed:
            continue  # never reserved
        tenant, gpu_ms = billed[rid]
        if was_dispatched:
            realised_gpu[tenant] += gpu_ms
        else:
            late += gpu_ms
    admitted_sim = [t != NOT_YET and t < end_ns for t in predicted_run.admit_ns]
    finished_sim = [t != NOT_YET and t <= end_ns for t in predicted_run.finish_ns]
    return TraceRun(
        policy=policy,
        predicted=_shares(predicted_gpu),
        realised=_shares(realised_gpu),
        predicted_gpu_ms=predicted_gpu,
        realised_gpu_ms=realised_gpu,
        arrived=_count(workload, [True] * len(workload)),
        admitted_sim=_count(workload, admitted_sim),
        dispatched_live=_count(workload, dispatched),
        finished_sim=_count(workload, finished_sim),
        finished_live=_count(workload, finished_live),
        late_gpu_ms=late,
        errors=[f"{rid}: {r.error}" for rid, r in sent.items() if r.outcome not in ("ok", "cut")],
        emulator_lag=lag,
        replica_truth_gpu_ms=truth,
        wall_s=wall_s,
    )


def _live(
    policy: str, workload: Workload, scenario: Scenario
) -> tuple[dict[str, RequestRecord], dict[str, tuple[str, float]], tuple[float, dict[str, float]]]:
    """The live side of ``run_trace``: replicas with the scenario's cost model and the gateway, each in a
    process of its own (as deployed: in one process they would delay each other's token delivery, and the
    gateway's meter reads token arrival times), a fresh SQLite ledger, the replay; every client hangs up at
    the workload's end. Returns what the clients saw by request id, the ledger's (tenant, GPU ms) by request
    id, and the replicas' timing lag and charge-rule GPU ms per tenant (``TraceRun.emulator_lag``)."""
    cost = scenario.cost
    replica = ReplicaModel(
        cost.iter_base_ms, cost.iter_slope_ms, cost.prefill_ms_per_token, cost.max_batch, MAX_MODEL_LEN
    )
    params = PolicyConfig.model_validate({policy: dict(scenario.policy_spec(policy).params.get(policy, {}))})
    spec = stack_spec(list(workload.tenants), policy, replica, scenario.replicas, True, len(workload) + 1, params)
    with quiet_hang_ups(), start_stack(spec, keep_folder=True) as stack:

        async def go() -> dict[str, RequestRecord]:
            connections = len(workload) + 16
            async with LoadGenerator(stack.url, stack.keys, MODEL, max_connections=connections) as generator:
                await generator.run_requests(replay_requests(workload), until_s=workload.duration_ns / 1e9)
                return {r.request_id: r for r in generator.history.records}

        sent = asyncio.run(go())
        stats = asyncio.run(stack.replica_stats())
    # The stack has stopped: the gateway billed every request it still held (dispatched after the end).
    try:
        billed = {r.request_id: (r.tenant, r.billed.gpu_ms) for r in asyncio.run(stack.reservations())}
    finally:
        shutil.rmtree(stack.folder, ignore_errors=True)
    planned, measured = sum(s.planned_ms for s in stats), sum(s.measured_ms for s in stats)
    truth = {t: sum(s.by_tenant(workload.tenants)[t] for s in stats) for t in workload.tenants}
    return sent, billed, ((measured / planned - 1 if planned else 0.0), truth)


def print_trace_run(result: TraceRun) -> None:
    diff = result.difference_pp()
    cells = "  ".join(
        f"{t} {result.predicted[t] * 100:5.1f}% -> {result.realised[t] * 100:5.1f}% ({diff[t]:+.1f} pp)"
        for t in result.predicted
    )
    print(f"  {result.policy:10s} predicted -> realised  {cells}")
    counts = "  ".join(
        f"{t} {result.arrived[t]} arrived, {result.admitted_sim[t]} / {result.dispatched_live[t]} "
        f"started, {result.finished_sim[t]} / {result.finished_live[t]} finished"
        for t in result.arrived
    )
    total = sum(result.realised_gpu_ms.values())
    print(f"  {'':10s} sim / live: {counts}")
    print(
        f"  {'':10s} GPU ms sim {sum(result.predicted_gpu_ms.values()):,.0f} live {total:,.0f}; "
        f"after the end {result.late_gpu_ms:,.0f}; emulator lag {result.emulator_lag * 100:+.1f} %; "
        f"{len(result.errors)} errors; {result.wall_s:.1f} s"
    )
    if result.replica_truth_gpu_ms:
        truth = _shares(result.replica_truth_gpu_ms)
        billed = _shares({t: result.realised_gpu_ms[t] for t in truth})
        print(
            f"  {'':10s} replicas' charge rule (whole run): "
            + "  ".join(f"{t} {truth[t] * 100:5.1f}% (billed {billed[t] * 100:5.1f}%)" for t in truth)
        )
    for error in result.errors[:5]:
        print(f"  {'':10s} {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", choices=["azure"], help="replay the Azure 2023 code + conversation traces")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each run (replay seconds)")
    parser.add_argument(
        "--policies", default=None, help="default: gpu_fair,fcfs,vtc (closed loop), gpu_fair,fcfs (trace)"
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=48,
        help="closed loop: concurrent clients per tenant (48: each alone could fill both replicas)",
    )
    parser.add_argument("--start", type=float, default=1080.0, help="trace: window start, trace seconds")
    parser.add_argument("--speedup", type=float, default=2.0, help="trace: arrivals this many times faster")
    parser.add_argument("--max-requests", type=int, default=3000, help="trace: replay at most this many requests")
    args = parser.parse_args()
    if args.trace:
        workload = azure_window(args.start, args.seconds, args.speedup, args.max_requests)
        scenario = trace_scenario()
        counts = _count(workload, [True] * len(workload))
        print(
            f"Azure 2023 trace from {args.start:g} s, {args.speedup:g}x: {args.seconds:g} s, "
            f"{', '.join(f'{t} {n} requests' for t, n in counts.items())}; {scenario.replicas} emulated "
            f"replicas x {scenario.cost.max_batch} slots"
        )
        for policy in (args.policies or "gpu_fair,fcfs").split(","):
            print_trace_run(run_trace(policy, workload, scenario))
        return
    print(f"{args.seconds:g} s per policy, {args.clients} clients per tenant, 2 emulated replicas x 24 slots")
    for policy in (args.policies or "gpu_fair,fcfs,vtc").split(","):
        share, done = run(policy, args.seconds, args.clients)
        ratio = max(share.values()) / min(share.values())
        cells = "  ".join(f"{t} {share[t] * 100:5.1f}% ({done[t]} req)" for t in MIX)
        print(f"  {policy:10s} {cells}   max/min {ratio:.3f}")


if __name__ == "__main__":
    main()
