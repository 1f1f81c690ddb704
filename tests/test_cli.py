"""The command line, run as a user runs it: a real subprocess, real files, exit codes and messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fairgate.gateway.demo import DEMO_PHASES
from tests.conftest import fairgate

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "scenarios" / "seed.toml"


def bad(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


SEED_TEXT = SEED.read_text()


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda s: s.replace("max_batch = 24", "max_batch = 0"), "replica.max_batch"),
        (lambda s: s.replace("max_batch = 24", "max_bach = 24"), "replica.max_bach: unknown key"),
        (lambda s: s.replace("duration_s = 120", 'duration_s = "long"'), "run.duration_s"),
        (lambda s: s.replace("mean = 23.7", "mean = -2"), "tenant[0].output.mean"),
        (lambda s: s.replace('dist = "lognormal", mean = 23.7', 'dist = "gamma", mean = 23.7'), "tenant[0].output"),
        (lambda s: s.replace("offered_ms_per_s = 750", "offered_ms_per_s = -1", 1), "tenant[0].offered_ms_per_s"),
        (lambda s: s.split("[[tenant]]")[0], "no tenants"),
        (lambda s: s + "\n[bogus]\nx = 1\n", "bogus: unknown key"),
        (lambda s: s.replace("[run]", "[run"), "not valid TOML"),
    ],
)
def test_bad_scenario_is_one_line_exit_2(tmp_path, edit, expected):
    path = bad(tmp_path, edit(SEED_TEXT))
    done = fairgate("simulate", str(path), "--policy", "fcfs")
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and str(path) in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--policy", "fifo"], "--policy 'fifo': unknown policy"),
        (["--policy", "fcfs", "--seeds", "5-1"], "runs backwards"),
        (["--policy", "fcfs", "--seeds", "x"], "--seeds 'x'"),
        (["--policy", "fcfs", "--flood", "agent"], "--flood 'agent'"),
        (["--policy", "fcfs", "--flood", "nobody=2"], "no such tenant"),
        (["--policy", "fcfs", "--set", "replica.max_batch"], "expected KEY=VALUE"),
        (["--policy", "fcfs", "--set", "tenant.nobody.weight=2"], "no tenant named 'nobody'"),
        (["--policy", "fcfs", "--engine", "turbo"], "--engine 'turbo'"),
        # Hostile input: refused before any work, however large or odd.
        (["-p", "[/]"], "--policy '[/]': unknown policy"),  # brackets are text, not markup
        (["--set", "replica.iter_base_ms=inf"], "replica.iter_base_ms: Input should be a finite number"),
        (["--set", 'replica.max_batch="24"'], "replica.max_batch: Input should be a valid integer"),
        (["--set", "replica.max_batch=true"], "replica.max_batch: Input should be a valid integer"),
        (
            ["--set", "tenant.*.offered_ms_per_s=1e12"],
            "offered_ms_per_s: Input should be less than or equal to 1000000",
        ),
        (["--set", "tenant.*.offered_ms_per_s=0"], "no tenant offers any load"),
        (["--set", 'tenant.agent.output={dist="fixed", value=0}'], "at least 1 output token"),
        (["--set", "run.duration_s=2592000"], "run.duration_s: Input should be less than or equal to 86400"),
        (["--set", "run.seed=-1"], "run.seed"),
        (["--set", 'tenant.chat.name="agent"'], "tenant[3].name: 'agent' is also tenant[1]'s name"),
        (["--set", 'tenant.chat.name=" "'], "must contain a character other than spaces"),
        (["--set", "policy.gpu_fair=1"], "policy.gpu_fair: Input should be a valid dictionary"),
        (["-p", "drr", "--set", "policy.drr.quantum_ms=1e-6"], "policy.drr.quantum_ms"),
        (["--flood", "agent=1e300"], "multiplier in (0, 1000]"),
        (["--seeds", "-1"], "seeds are whole numbers"),
        (["--seeds", "1-1000000000000"], "seeds are whole numbers"),
        (["--seeds", "1,1"], "listed twice"),
        (["--seeds", ""], "--seeds ''"),
        (["--json", ""], "--json: give a file path"),
        (["-p", "fcfs,fcfs"], "listed twice"),
        (["--set", "tenant.*.offered_ms_per_s=900000", "--set", "run.duration_s=80000"], "at most 5,000,000"),
    ],
)
def test_bad_or_hostile_options_exit_2_before_any_work(args, expected):
    done = fairgate("simulate", str(SEED), *args)
    assert done.returncode == 2, (done.stdout[-500:], done.stderr[-500:])
    assert expected in done.stderr and "Traceback" not in done.stderr


def test_missing_scenario_file(tmp_path):
    done = fairgate("simulate", str(tmp_path / "nope.toml"))
    assert done.returncode == 2 and "file not found" in done.stderr


def test_simulate_json_and_plot(tmp_path):
    out = tmp_path / "out.json"
    done = fairgate(
        "simulate",
        str(SEED),
        "--policy",
        "fcfs,gpu_fair",
        "--seeds",
        "1-2",
        "--set",
        "run.duration_s=30",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "plots"),
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["scenario"].endswith("seed.toml")
    policies = {r["policy"]: r for r in document["results"]}
    assert set(policies) == {"fcfs", "gpu_fair"}
    gpu_fair = policies["gpu_fair"]
    assert gpu_fair["busy_ms"] == pytest.approx(gpu_fair["charged_ms"], rel=1e-9)
    assert len(gpu_fair["per_seed"]) == 2 and gpu_fair["max_min_ratio"] < 1.05
    tenant = gpu_fair["tenants"][0]
    assert set(tenant) == {
        "name",
        "gpu_ms",
        "gpu_share",
        "prefill_ms",
        "decode_tokens",
        "requests_finished",
        "mean_output_tokens",
        "ttft_ms",
    }
    assert sum(t["gpu_share"] for t in gpu_fair["tenants"]) == pytest.approx(1.0)
    assert (tmp_path / "plots" / "seed_shares.png").stat().st_size > 10_000
    assert "max/min" in done.stdout


def test_json_to_stdout_is_pure_json():
    done = fairgate("simulate", str(SEED), "--policy", "vtc", "--set", "run.duration_s=10", "--json", "-")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["results"][0]["policy"] == "vtc"


def test_sweep_small_grid(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'policies = ["fcfs", "gpu_fair"]\nlong_tenants = ["agent"]\n'
        '[[axis]]\nkey = "flood.agent"\nvalues = [1, 4]\n'
        '[[axis]]\nkey = "spread"\nvalues = [1, 2]\n'
        '[[axis]]\nkey = "run.duration_s"\nvalues = [20]\n'
    )
    out = tmp_path / "sweep.json"
    done = fairgate(
        "sweep", str(SEED), "--grid", str(grid), "--jobs", "2", "--json", str(out), "--plot", str(tmp_path / "p")
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert len(document["configurations"]) == 4
    assert document["policies"]["gpu_fair"]["worst_max_min_ratio"] < 1.2  # 20 s runs: long outputs still in flight
    assert document["policies"]["fcfs"]["worst_max_min_ratio"] > 3.0
    assert (tmp_path / "p" / "sweep_flood_agent.png").exists()


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[[axis]]\nkey = "flood.nobody"\nvalues = [1]\n', "no tenant 'nobody'"),
        ('[[axis]]\nkey = "replica.max_batch"\nvalues = [0]\n', "replica.max_batch"),
        ('policies = ["fifo"]\n[[axis]]\nkey = "spread"\nvalues = [1]\n', "unknown policy"),
        ('[[axis]]\nkey = "spread"\nvalues = [1]\n', "long_tenants"),
        ('colour = 1\n[[axis]]\nkey = "spread"\nvalues = [1]\n', "colour: unknown key"),
        # Hostile grids: refused before any work, however large or odd.
        ('[[axis]]\nkey = "flood.agent"\nvalues = [1]\n[[axis]]\nkey = "flood.agent"\nvalues = [2]\n', "appears twice"),
        ('policies = []\n[[axis]]\nkey = "flood.agent"\nvalues = [1]\n', "at least one policy"),
        ('[[axis]]\nkey = "flood.agent"\nvalues = [nan]\n', "flood multiplier"),
        ('[[axis]]\nkey = "flood.agent"\nvalues = [inf]\n', "flood multiplier"),
        ('seeds = [-1]\n[[axis]]\nkey = "flood.agent"\nvalues = [1]\n', "seeds"),
        ('seeds = [true]\n[[axis]]\nkey = "flood.agent"\nvalues = [1]\n', "seeds"),
        (
            "".join(
                f'[[axis]]\nkey = "tenant.agent.weight{i}"\nvalues = [{", ".join(["1"] * 100)}]\n' for i in range(4)
            ),
            "configurations (at most 100,000)",
        ),
        (
            '[[axis]]\nkey = "run.duration_s"\nvalues = [86000]\n[[axis]]\nkey = "flood.agent"\nvalues = [900]\n',
            "at most 5,000,000",
        ),
    ],
)
def test_bad_or_hostile_grid_exit_2(tmp_path, text, expected):
    grid = tmp_path / "grid.toml"
    grid.write_text(text)
    done = fairgate("sweep", str(SEED), "--grid", str(grid))
    assert done.returncode == 2, done.stderr[-500:]
    assert expected in done.stderr and str(grid) in done.stderr and "Traceback" not in done.stderr


def test_output_paths_checked_before_any_work(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for option in ("--json", "--markdown"):
        done = fairgate("simulate", str(SEED), option, str(a_file / "x.json"))
        assert done.returncode == 2 and "is a file, not a directory" in done.stderr
    done = fairgate("simulate", str(SEED), "--plot", str(a_file / "plots"))
    assert done.returncode == 2 and "cannot create the directory" in done.stderr


def test_fifo_scenario_is_refused(tmp_path):
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    done = fairgate("simulate", str(fifo))
    assert done.returncode == 2 and "not a regular file" in done.stderr


def test_serve_without_config_runs_the_demo_and_prints_each_tenants_share(tmp_path):
    from fairgate.harness.process import free_port

    done = fairgate("serve", "--port", str(free_port()), "--duration", "8", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "admin            key fg-" in done.stdout and "/dashboard" in done.stdout  # what the user asked for
    assert "key fg-" not in done.stderr and "dashboard" not in done.stderr
    # The first phase keeps within the replica's slots (the TTFT objective holds); the overload comes labelled.
    assert "demo traffic: within capacity for 30 s - 20 requests in flight on 24 slots" in done.stdout
    phased, billed = done.stdout.split("GPU time billed per tenant")
    rows = {line.split("│")[1].strip(): line.split("│")[1:-1] for line in billed.splitlines() if line.startswith("│")}
    assert set(rows) == {"classify", "chat", "summarise", "agent"}
    # Each phase's split, from the live meter, so the overload's even split is not blurred by the others.
    header = next(line for line in phased.splitlines() if line.startswith("┃"))
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == [
        "phase",
        "s",
        "classify",
        "chat",
        "summarise",
        "agent",
    ]
    [phase] = [line.split("│")[1:-1] for line in phased.splitlines() if line.startswith("│")]
    assert phase[0].strip() == "within capacity" and 5 <= int(phase[1]) <= 9
    phase_shares = [float(cell.strip().rstrip(" %")) for cell in phase[2:]]
    assert abs(sum(phase_shares) - 100.0) < 0.5 and all(share > 0 for share in phase_shares)
    shares = [float(cells[4].strip().rstrip(" %")) for cells in rows.values()]
    assert abs(sum(shares) - 100.0) < 0.5 and all(share > 0 for share in shares)  # every tenant was served
    requests = {tenant: int(cells[1]) for tenant, cells in rows.items()}
    assert requests["classify"] > requests["agent"]  # short requests: many more of them for the same GPU time


def test_keys_add_admin_stores_a_hash_that_verifies_and_keeps_the_files_comments(tmp_path):
    from fairgate.gateway.auth import verify_api_key
    from fairgate.gateway.config import load_gateway_config

    config = tmp_path / "fairgate.toml"
    config.write_text((REPO / "config" / "fairgate.example.toml").read_text())
    keys = []
    for _ in range(2):
        done = fairgate("keys", "add-admin", "--config", str(config))
        assert done.returncode == 0, done.stderr
        keys.append(done.stdout.strip())
    hashes = load_gateway_config(config).admin.key_hashes
    assert len(hashes) == 2 and all(verify_api_key(k, h) for k, h in zip(keys, hashes, strict=False))
    assert "# two emulated replicas" in config.read_text().lower() or config.read_text().startswith("#")
    missing = fairgate("keys", "add-admin", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.serial  # the demo's traffic loads the machine; bounded wait
def test_ctrl_c_stops_the_demo_promptly_and_prints_the_shares(tmp_path):
    """Found by a new user: Ctrl-C took 12 s (uvicorn waited for the demo's endless streams, and only one of
    its two servers saw the signal); now the traffic stops, the shares print, the streams close."""
    import signal
    import time

    from fairgate.harness.process import free_port

    proc = subprocess.Popen(
        [sys.executable, "-m", "fairgate", "serve", "--port", str(free_port())],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(8.0)  # started, and serving demo traffic
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        stopped_after_s = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    rows = [line for line in stdout.splitlines() if line.startswith("│")]
    phases = {label for label, _, _ in DEMO_PHASES}  # the per-phase table's rows, printed before the billed one
    tenants = {row.split("│")[1].strip() for row in rows} - phases
    assert tenants == {"classify", "chat", "summarise", "agent"}, stdout
    assert stopped_after_s < 8.0, stopped_after_s  # 1.5 s here; 12 s before


def test_serve_refuses_to_start_on_a_journal_or_ledger_it_cannot_open(tmp_path):
    """Found by a helper: these failed inside uvicorn's start-up with a traceback and exit code 3."""
    example = (REPO / "config" / "fairgate.example.toml").read_text()
    journal = tmp_path / "journal.toml"
    (tmp_path / "a-file").write_text("")  # a folder that cannot be made: a file is in its place
    journal.write_text(example.replace('journal = "state/fairgate-journal.jsonl"', 'journal = "a-file/j.jsonl"', 1))
    from fairgate.harness.process import free_port

    done = fairgate("serve", "--config", str(journal), "--port", str(free_port()))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "gateway.journal: cannot write" in done.stderr and "a-file/j.jsonl" in done.stderr

    ledger = tmp_path / "ledger.toml"  # a file that cannot be created (under a file): the configuration's fault
    unopenable = f'ledger = "sqlite:///{tmp_path}/a-file/l.db"'
    ledger.write_text(example.replace('ledger = "sqlite:///state/fairgate-ledger.db"', unopenable, 1))
    done = fairgate("serve", "--config", str(ledger), "--port", str(free_port()))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "gateway.ledger: cannot open the ledger" in done.stderr, done.stderr


def example_with_a_key() -> str:
    """config/fairgate.example.toml with a key for tenant ``chat`` (the example has none: a gateway refuses
    to start without one)."""
    from fairgate.gateway.auth import hash_api_key

    key = hash_api_key("fg-test-chat-" + "c" * 24)
    return (REPO / "config" / "fairgate.example.toml").read_text() + f'\n[[key]]\ntenant = "chat"\nhash = "{key}"\n'


def test_serve_refuses_to_start_with_no_key_at_all(tmp_path):
    config = tmp_path / "fairgate.toml"
    config.write_text((REPO / "config" / "fairgate.example.toml").read_text())
    from fairgate.harness.process import free_port

    done = fairgate("serve", "--config", str(config), "--port", str(free_port()), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert (
        "nobody could call this gateway" in done.stderr and f"fairgate keys add TENANT --config {config}" in done.stderr
    )


def test_serve_starts_while_its_ledger_server_does_not_answer(tmp_path, monkeypatch):
    """An outage is not a configuration error: the gateway starts and serves each tier's outage policy. A
    ledger other processes may share, with no delegation secret, is warned of once: each process would sign
    dashboard links with its own secret (found by a new user: a link made on one pod got 401 on another)."""
    monkeypatch.delenv("FAIRGATE_DELEGATION_SECRET", raising=False)
    example = example_with_a_key()
    from fairgate.harness.process import free_port

    ledger = tmp_path / "ledger.toml"  # nothing listens on that port
    ledger.write_text(
        example.replace(
            'ledger = "sqlite:///state/fairgate-ledger.db"', f'ledger = "postgresql://127.0.0.1:{free_port()}/test"', 1
        )
    )
    done = fairgate("serve", "--config", str(ledger), "--port", str(free_port()), "--duration", "3", cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "the ledger does not answer" in done.stderr + done.stdout
    warned = [line for line in done.stderr.splitlines() if "FAIRGATE_DELEGATION_SECRET is not set" in line]
    assert len(warned) == 1 and "fails (401) on the other processes" in warned[0], done.stderr
    monkeypatch.setenv("FAIRGATE_DELEGATION_SECRET", "k" * 32)
    shared = fairgate("serve", "--config", str(ledger), "--port", str(free_port()), "--duration", "2", cwd=tmp_path)
    assert shared.returncode == 0 and "DELEGATION_SECRET" not in shared.stderr + shared.stdout, shared.stderr


def test_ledger_commands_take_the_ledger_from_a_gateway_config(tmp_path):
    """Found by a new user: `fairgate ledger usage T --quotas gateway.toml` wanted --ledger as well."""
    example = (REPO / "config" / "fairgate.example.toml").read_text()
    config = tmp_path / "gateway.toml"
    config.write_text(example)
    done = fairgate("ledger", "usage", "chat", "--quotas", str(config), cwd=tmp_path)
    # The operator commands never create a ledger: the one the config names (relative to it) must exist.
    assert done.returncode == 2 and "ledger" in done.stderr and str(tmp_path) in done.stderr, done.stderr
    import asyncio

    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    async def create() -> None:
        loaded = load_gateway_config(config)
        await (await connect(loaded.ledger_url, loaded.quotas)).close()

    asyncio.run(create())
    done = fairgate("ledger", "usage", "chat", "--quotas", str(config))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tenant"] == "chat" and json.loads(done.stdout)["requests"] == 0
    done = fairgate("ledger", "usage", "chat", "--quotas", str(SEED))
    assert done.returncode == 2 and "--ledger not given" in done.stderr


@pytest.mark.parametrize("after_s", [0.05, 0.2, 0.5, 1.0, 3.0])
def test_ctrl_c_at_any_moment_of_the_start_stops_serve_without_a_traceback(tmp_path, after_s):
    """Found by a helper: a Ctrl-C while the command line loaded printed a traceback. Whenever it comes (while
    the libraries load, typer builds the commands, the config is read, the servers start, or once they serve)
    ``fairgate serve`` ends with exit code 130 or 0, and no traceback. SIGINT is set to its default in the
    child, as in a terminal (a shell's background job starts with it ignored, and then it never arrives)."""
    import signal
    import time

    from fairgate.harness.process import free_port
    from tests.conftest import machine_slowdown

    config = tmp_path / "fairgate.toml"
    config.write_text(example_with_a_key())
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "fairgate"), "serve", "--config", str(config), "--port", str(free_port())],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # The moments are those of the machine the speed probe is sized on: on a slower one the interpreter's
        # own start, before any of fairgate's code runs, lasts past 0.05 s (2.7x slow: a Ctrl-C there was
        # CPython's "Fatal Python error: init_import_site", exit 1, which no program can catch).
        time.sleep(after_s * max(1.0, machine_slowdown()))
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode in (0, 130) and "Traceback" not in output, (proc.returncode, output[-2000:])
