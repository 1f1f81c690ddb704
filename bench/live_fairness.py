"""Fairness live: tenants' traffic through the gateway against two emulated replicas, with the real
``openai`` client; GPU shares realised in the ledger.

Two modes.

Closed loop (default): four tenants with seed 002's output mix keep their queues full. Each tenant runs
``--clients`` concurrent clients; each request has a 400-token prompt and an output length drawn from the
tenant's lognormal (means 23.7 / 53 / 197 / 353.8 tokens, cv 0.5), sent as ``max_tokens`` with
``ignore_eos``. The replicas use seed 002's cost model (9 ms + 0.55 ms x B + 0.06 ms/token, 24 slots).
One run per policy; prints each tenant's share of the GPU time the ledger billed, and max/min.

Trace (``--trace azure``, issue 4): a window of the Azure LLM inference trace 2023 replayed open loop as two
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
import logging
import math
import os
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fairgate.core.cost import CostModel  # noqa: E402
from fairgate.emulator.api import EmulatorSettings, create_app  # noqa: E402
from fairgate.gateway.app import create_gateway  # noqa: E402
from fairgate.gateway.auth import hash_api_key  # noqa: E402
from fairgate.gateway.config import load_gateway_config  # noqa: E402
from fairgate.ledger import connect  # noqa: E402
from fairgate.ledger.base import tenant_tag  # noqa: E402
from fairgate.sim.experiment import simulate  # noqa: E402
from fairgate.sim.result import NOT_YET  # noqa: E402
from fairgate.sim.scenario import Scenario, load_scenario  # noqa: E402
from fairgate.sim.traces import trace_workload  # noqa: E402
from fairgate.sim.workload import Workload  # noqa: E402
from tests.support.servers import fairgate_process, free_port, serve  # noqa: E402

MIX = {"classify": 23.7, "chat": 53.0, "summarise": 197.0, "agent": 353.8}
PROMPT = "w " * 397  # + 3 tokens of chat overhead = 400
SEED_COST = CostModel(iter_base_ms=9.0, iter_slope_ms=0.55, prefill_ms_per_token=0.06, max_batch=24)
MODEL = "emu"
MAX_MODEL_LEN = 32768


def config_text(
    folder: Path,
    upstreams: list[str],
    policy: str,
    keys: dict[str, str],
    cost: CostModel = SEED_COST,
    policy_params: dict[str, float] | None = None,
    max_queued: int = 1000,
) -> str:
    """The gateway's TOML: one upstream per URL with ``cost``, a SQLite ledger in ``folder``, one tenant per
    key (no quota but ``max_queued`` / ``max_concurrent``), and ``policy`` with ``policy_params``."""
    ups = "".join(
        f'[[upstream]]\nname = "emu-{i}"\nurl = "{u}/v1"\nmodel = "{MODEL}"\nmax_batch = {cost.max_batch}\n'
        f"iter_base_ms = {cost.iter_base_ms!r}\niter_slope_ms = {cost.iter_slope_ms!r}\n"
        f"prefill_ms_per_token = {cost.prefill_ms_per_token!r}\nmax_model_len = {MAX_MODEL_LEN}\n"
        for i, u in enumerate(upstreams)
    )
    params = ""
    if policy_params:
        values = ", ".join(f"{k} = {v!r}" for k, v in policy_params.items())
        params = f"[policy]\n{policy} = {{ {values} }}\n"
    tenants = "".join(f'[quotas.tenants.{t}]\ntier = "t"\n' for t in keys)
    key_tables = "".join(f'[[key]]\ntenant = "{t}"\nhash = "{hash_api_key(k)}"\n' for t, k in keys.items())
    return (
        f'[gateway]\npolicy = "{policy}"\nledger = "sqlite:///{folder}/ledger.db"\n'
        f'journal = "{folder}/journal.jsonl"\n\n{ups}\n{params}[quotas.tiers.t]\non_ledger_unavailable = "reject"\n'
        f"[quotas.defaults]\nmax_queued = {max_queued}\nmax_concurrent = {max_queued}\n{tenants}\n{key_tables}"
    )


# --- closed loop ------------------------------------------------------------------------------------------------


async def load(url: str, keys: dict[str, str], seconds: float, clients: int, seed: int) -> dict[str, int]:
    done = dict.fromkeys(MIX, 0)

    async def worker(tenant: str, index: int) -> None:
        rng = random.Random(f"{seed}-{tenant}-{index}")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys[tenant], max_retries=0, timeout=600)
        sigma2 = math.log1p(0.25)
        mu = math.log(MIX[tenant]) - sigma2 / 2
        while True:
            tokens = max(1, round(rng.lognormvariate(mu, math.sqrt(sigma2))))
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=tokens,
                extra_body={"ignore_eos": True},
            )
            done[tenant] += 1
        await client.close()

    # Interleaved, so no tenant's requests all arrive first.
    tasks = [asyncio.create_task(worker(t, i)) for i in range(clients) for t in MIX]
    await asyncio.sleep(seconds)
    # At the deadline every client hangs up: the gateway cancels the requests in flight and bills what they
    # consumed, so the shares are those of the window, not of a drain where only long requests remain.
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)  # let the gateway settle the cancelled ones
    return done


async def shares(config_path: Path) -> dict[str, float]:
    config = load_gateway_config(config_path)
    ledger = await connect(config.ledger_url, config.quotas)
    gpu = dict.fromkeys(MIX, 0.0)
    for r in await ledger.reservations():
        gpu[r.tenant] += r.billed.gpu_ms
    await ledger.close()
    total = sum(gpu.values())
    return {t: g / total for t, g in gpu.items()}


def run(policy: str, seconds: float, clients: int) -> tuple[dict[str, float], dict[str, int]]:
    folder = Path(tempfile.mkdtemp(prefix="fairgate-live-"))
    keys = {t: f"fg-bench-{t}-{'k' * 20}" for t in MIX}
    settings = EmulatorSettings(model=MODEL)
    with serve(create_app(settings)) as u0, serve(create_app(settings)) as u1:
        path = folder / "fairgate.toml"
        path.write_text(config_text(folder, [u0, u1], policy, keys))
        with serve(create_gateway(load_gateway_config(path))) as gateway:
            done = asyncio.run(load(gateway, keys, seconds, clients, 1))
    return asyncio.run(shares(path)), done


# --- trace replay (issue 4) -------------------------------------------------------------------------------------

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
class Sent:
    """One replayed request, as its client saw it. Times are seconds from the start of the replay."""

    tenant: str
    dispatched_s: float | None = None  # the gateway answered (it streams once the policy picked the request)
    finished_s: float | None = None  # the whole stream was read
    error: str | None = None


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


async def replay(url: str, keys: dict[str, str], workload: Workload) -> dict[str, Sent]:
    """Send ``workload`` open loop through the gateway at ``url`` and hang up at its end.

    Request ``i`` is sent at ``arrival_ns[i]`` after the start, whatever happened to the others, on the
    completions endpoint with a prompt of ``prompt_tokens[i]`` words (the emulator counts a word as a token),
    ``max_tokens = output_tokens[i]`` and ``ignore_eos``, streamed so that the answer's headers tell when the
    gateway dispatched it. At ``duration_ns`` every client hangs up (the gateway stops and bills the requests
    in flight; the ones still queued are never run for their client).

    Returns:
        request id (``request_id``) -> what its client saw.
    """
    loop = asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=len(workload) + 16, max_keepalive_connections=64)
    clients = {
        t: openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key=k,
            max_retries=0,
            timeout=600,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
        )
        for t, k in keys.items()
    }
    sent: dict[str, Sent] = {}
    start = loop.time()

    async def one(i: int) -> None:
        tenant = workload.tenants[workload.tenant_index[i]]
        record = sent[request_id(workload, i)] = Sent(tenant)
        try:
            async with clients[tenant].completions.with_streaming_response.create(
                model=MODEL,
                prompt="w " * workload.prompt_tokens[i],
                max_tokens=workload.output_tokens[i],
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"x-request-id": request_id(workload, i)},
            ) as response:
                record.dispatched_s = loop.time() - start
                async for _ in response.iter_bytes():
                    pass
            record.finished_s = loop.time() - start
        except openai.APIError as exc:
            record.error = f"{type(exc).__name__}: {exc}"

    tasks = []
    for i, arrival_ns in enumerate(workload.arrival_ns):
        delay = start + arrival_ns / 1e9 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.sleep(max(0.0, start + workload.duration_ns / 1e9 - loop.time()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients.values():
        await client.close()
    return sent


async def _billed(config_path: Path) -> dict[str, tuple[str, float]]:
    """Ledger request id -> (tenant, GPU ms billed)."""
    config = load_gateway_config(config_path)
    ledger = await connect(config.ledger_url, config.quotas)
    try:
        return {r.request_id: (r.tenant, r.billed.gpu_ms) for r in await ledger.reservations()}
    finally:
        await ledger.close()


def _emulate_args(settings: EmulatorSettings, port: int) -> list[str]:
    """``fairgate emulate`` arguments for a replica process with ``settings``."""
    return [
        "emulate",
        "--port",
        str(port),
        "--model",
        settings.model,
        "--iter-base-ms",
        str(settings.iter_base_ms),
        "--iter-slope-ms",
        str(settings.iter_slope_ms),
        "--prefill-ms-per-token",
        str(settings.prefill_ms_per_token),
        "--max-batch",
        str(settings.max_batch),
        "--max-model-len",
        str(settings.max_model_len),
    ]


def _emulator_lag(urls: list[str], tenants: list[str]) -> tuple[float, dict[str, float]]:
    """The replicas' timing lag (measured / planned - 1) and, per tenant, the GPU ms the charge rule gives
    on their real iterations (the emulator's ground truth for the live meter, by cache_salt)."""
    planned = measured = 0.0
    truth = dict.fromkeys(tenants, 0.0)
    by_salt = {tenant_tag(t): t for t in tenants}
    for url in urls:
        stats = httpx.get(f"{url}/emulator/stats", timeout=10).json()
        planned += stats["planned_ms"]
        measured += stats["measured_ms"]
        for salt, gpu_ms in stats["charge_rule_ms_by_cache_salt"].items():
            if salt in by_salt:
                truth[by_salt[salt]] += gpu_ms
    return (measured / planned - 1 if planned else 0.0), truth


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
    dispatched = [sent[r].dispatched_s is not None and sent[r].dispatched_s * 1e9 < end_ns for r in ids]
    finished_live = [sent[r].finished_s is not None and sent[r].finished_s * 1e9 < end_ns for r in ids]
    realised_gpu = dict.fromkeys(workload.tenants, 0.0)
    late = 0.0
    for rid, was_dispatched in zip(ids, dispatched):
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
        errors=[f"{r}: {s.error}" for r, s in sent.items() if s.error],
        emulator_lag=lag,
        replica_truth_gpu_ms=truth,
        wall_s=wall_s,
    )


def _live(
    policy: str, workload: Workload, scenario: Scenario
) -> tuple[dict[str, Sent], dict[str, tuple[str, float]], tuple[float, dict[str, float]]]:
    """The live side of ``run_trace``: replicas with the scenario's cost model, a gateway with a fresh SQLite
    ledger, the replay. Returns what the clients saw, the ledger's (tenant, GPU ms) by request id, and the
    replicas' timing lag (``TraceRun.emulator_lag``)."""
    cost = scenario.cost
    settings = EmulatorSettings(
        model=MODEL,
        iter_base_ms=cost.iter_base_ms,
        iter_slope_ms=cost.iter_slope_ms,
        prefill_ms_per_token=cost.prefill_ms_per_token,
        max_batch=cost.max_batch,
        max_model_len=MAX_MODEL_LEN,
    )
    keys = {t: f"fg-bench-{t}-{'k' * 20}" for t in workload.tenants}
    params = dict(scenario.policy_spec(policy).params.get(policy, {}))
    hang_ups = _QuietHangUps()
    logging.getLogger("asyncio").addFilter(hang_ups)
    try:
        with tempfile.TemporaryDirectory(prefix="fairgate-trace-") as tmp:
            folder = Path(tmp)
            path = folder / "fairgate.toml"
            with ExitStack() as gateway_stack, ExitStack() as replicas:
                # Replicas in processes of their own, as deployed: in this process they would share
                # the interpreter with the gateway and delay each other's token delivery.
                upstreams = [
                    replicas.enter_context(fairgate_process(_emulate_args(settings, port), port))
                    for port in (free_port() for _ in range(scenario.replicas))
                ]
                path.write_text(
                    config_text(folder, upstreams, policy, keys, cost, params, max_queued=len(workload) + 1)
                )
                # The gateway in its own process too: its meter reads token arrival times, which the
                # replay's clients would delay if they shared its interpreter.
                gateway_port = free_port()
                gateway = gateway_stack.enter_context(
                    fairgate_process(["serve", "--config", str(path), "--port", str(gateway_port)], gateway_port)
                )
                sent = asyncio.run(replay(gateway, keys, workload))
                lag = _emulator_lag(upstreams, list(workload.tenants))
                # The replicas stop before the gateway: the gateway does not notice that a queued request's
                # client hung up until it dispatches it, and each such dispatch would make a replica prefill
                # a prompt nobody reads (seconds of shutdown after a backlog); now it fails at once.
            billed = asyncio.run(_billed(path))
    finally:
        logging.getLogger("asyncio").removeFilter(hang_ups)
    return sent, billed, lag


class _QuietHangUps(logging.Filter):
    """Drops asyncio's "socket.send() raised exception." warnings: a server that writes to connections whose
    peer just closed them logs one per write, and at the end of a replay every client hangs up at once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "socket.send() raised exception."


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
