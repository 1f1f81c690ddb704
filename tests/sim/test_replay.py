"""Real traces through the simulator: a slice of Azure 2023 (code + conversation as two tenants) and of
BurstGPT (tenants by Model), every policy, via the CLI as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fairgate.core import POLICY_NAMES
from fairgate.sim.experiment import run_workload
from fairgate.sim.scenario import load_scenario
from fairgate.sim.traces import trace_workload
from tests.conftest import fairgate

REPO = Path(__file__).resolve().parents[2]


def test_azure_slice_every_policy(traces_dir):
    scenario = load_scenario(REPO / "scenarios" / "replay.toml", ["replica.replicas=1"], require_tenants=False)
    workload, summary = trace_workload(
        [f"code={traces_dir / 'azure_llm_2023_code.csv'}", f"conv={traces_dir / 'azure_llm_2023_conv.csv'}"],
        "azure",
        start_s=0,
        duration_s=120,
    )
    assert workload.tenants == ["code", "conv"] and summary.requests["conv"] > summary.requests["code"] > 50
    for policy in POLICY_NAMES:
        run = run_workload(scenario, workload, policy).mean
        assert run.charged_ms == pytest.approx(run.busy_ms, rel=1e-9)
        assert sum(t.requests_finished for t in run.tenants) > 200
        assert all(t.ttft_ms["p99"] >= t.ttft_ms["p50"] > 0 for t in run.tenants)


def test_burstgpt_slice_by_model_through_the_cli(traces_dir, tmp_path):
    out = tmp_path / "burst.json"
    done = fairgate(
        "replay",
        str(traces_dir / "burstgpt1_first7days.csv"),
        "--format",
        "burstgpt",
        "--tenant-by",
        "Model",
        "--scenario",
        str(REPO / "scenarios" / "replay.toml"),
        "--set",
        "replica.replicas=1",
        "--speedup",
        "50",
        "--duration",
        "43200",
        "--policy",
        "fcfs,gpu_fair",
        "--json",
        str(out),
        "--plot",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert "failed rows" in done.stderr
    document = json.loads(out.read_text())
    for result in document["results"]:
        assert [t["name"] for t in result["tenants"]] == ["ChatGPT", "GPT-4"]
        assert sum(t["gpu_share"] for t in result["tenants"]) == pytest.approx(1.0)
        assert result["tenants"][0]["requests_finished"] > 100
    assert (tmp_path / "replay_burstgpt1_first7days_shares.png").exists()
    assert "draining to the last request" in done.stderr
    for result in document["results"]:
        assert result["unfinished"] == 0
        assert result["service_diff_max"] >= result["service_diff_avg"] > 0


def test_azure_replay_drains_by_default_and_cut_leaves_the_queue(traces_dir):
    # Ten minutes of Azure code + conversation on one replica is overloaded: at the window's end requests wait.
    scenario = load_scenario(REPO / "scenarios" / "replay.toml", ["replica.replicas=1"], require_tenants=False)
    files = [f"code={traces_dir / 'azure_llm_2023_code.csv'}", f"conv={traces_dir / 'azure_llm_2023_conv.csv'}"]
    workload, _ = trace_workload(files, "azure", start_s=0, duration_s=600)
    drained = run_workload(scenario, workload, "fcfs").mean
    cut = run_workload(scenario, workload, "fcfs", drain=False).mean
    assert drained.unfinished == 0
    assert cut.unfinished > 100
    finished = sum(t.requests_finished for t in drained.tenants)
    assert finished == len(workload) == sum(t.requests_finished for t in cut.tenants) + cut.unfinished
    # The requests a cut drops are the ones that waited longest: the drained TTFT tail is longer.
    assert max(t.ttft_ms["p99"] for t in drained.tenants) > max(t.ttft_ms["p99"] for t in cut.tenants)
    assert drained.busy_ms > cut.busy_ms


def test_replay_bad_trace_is_exit_2(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,10\n")
    scenario = str(REPO / "scenarios" / "replay.toml")
    done = fairgate("replay", str(bad), "--format", "azure", "--scenario", scenario, timeout=120)
    assert done.returncode == 2
    assert "GeneratedTokens" in done.stderr and str(bad) in done.stderr and "Traceback" not in done.stderr
