"""``fairgate ledger journal``: what a gateway's emergency journal holds, and the grants parked for review."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import fairgate

GRANT = {
    "type": "grant",
    "id": "emg-1",
    "tenant": "bank",
    "request_id": "twice",
    "input_tokens": 10,
    "max_output_tokens": 100,
    "gpu_ms_estimate": 1.0,
    "model_class": "default",
    "run_id": None,
    "tool_round": False,
    "at_ms": 0.0,
    "ttl_ms": 30_000.0,
    "usage": None,
    "status": "open",
}


def test_the_journal_command_lists_grants_pending_settlements_and_parked_grants(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    none_yet = fairgate("ledger", "journal", str(journal))
    assert none_yet.returncode == 0 and "no such file yet" in none_yet.stdout, none_yet  # nothing to review, said so
    wrong = fairgate("ledger", "journal", str(tmp_path / "no-such-dir" / "journal.jsonl"))
    assert wrong.returncode == 2 and "no such directory" in wrong.stderr and "Traceback" not in wrong.stderr, wrong
    pending = {"type": "pending", "id": "abc-1", "kind": "settle", "final": True, "usage": [5, 6, 7.0]}
    journal.write_text(
        json.dumps({**GRANT, "id": "emg-2", "request_id": "running"}) + "\n" + json.dumps(pending) + "\n"
    )
    parked = {**GRANT, "type": "parked", "usage": [10, 30, 2.0], "reason": "request id 'twice' was settled already"}
    (tmp_path / "journal.parked.jsonl").write_text(json.dumps(parked) + "\n")
    shown = fairgate("ledger", "journal", str(journal), "--json")
    assert shown.returncode == 1, shown.stderr  # something is parked: an operator must look
    document = json.loads(shown.stdout)
    assert [g["request_id"] for g in document["grants"]] == ["running"] and document["pending"] == [pending]
    assert document["parked"][0]["usage"] == [10, 30, 2.0] and "settled already" in document["parked"][0]["reason"]
    table = fairgate("ledger", "journal", str(journal))
    assert table.returncode == 1 and "bank/twice" in table.stdout and "10/30/2.0" in table.stdout, table.stdout


def test_a_bad_journal_line_is_named(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    journal.write_text(json.dumps(GRANT) + "\n{not json\n")
    shown = fairgate("ledger", "journal", str(journal))
    assert shown.returncode == 2 and f"{journal}:2: not a JSON record" in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr
    assert fairgate("ledger", "journal", str(tmp_path)).returncode == 2  # a directory
