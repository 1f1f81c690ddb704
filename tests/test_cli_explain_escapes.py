"""``fairgate explain`` prints request fields an attacker chose (model, messages, ids): terminal escape
sequences in them reach the operator's terminal as visible text, never as escape sequences."""

from __future__ import annotations

import json

from fairgate.cli_ops import explain_lines, printable
from tests.conftest import fairgate
from tests.gateway.conftest import post, serve_stack

# Clears the screen, sets the window title, and hides what follows (a bidi override and a bell too).
HOSTILE = "emu\x1b[2J\x1b]0;owned\x07\u202e\x9b31m"


def test_printable_escapes_control_and_format_characters_only():
    assert printable("model emu, 1,024 tokens: ok") == "model emu, 1,024 tokens: ok"
    assert printable("caf\u00e9 \u6a21\u578b") == "caf\u00e9 \u6a21\u578b"
    assert printable(HOSTILE) == "emu\\x1b[2J\\x1b]0;owned\\x07\\u202e\\x9b31m"
    assert printable("a\nb\tc\rd\x7f") == "a\\nb\\tc\\rd\\x7f"


def test_explain_shows_escape_sequences_from_a_request_as_text(tmp_path):
    with serve_stack(tmp_path) as stack:
        body = {"model": HOSTILE, "prompt": "x", "max_tokens": 2}
        reply = post(stack.url, stack.keys["alpha"], body, {"X-Request-Id": "esc-1"})
        assert reply.status_code == 404, reply.text
        log = stack.config.event_log_path
    assert log is not None
    [record] = [json.loads(line) for line in log.read_text().splitlines() if '"esc-1"' in line]
    assert record["model"] == HOSTILE  # the log keeps what was sent; only the terminal view escapes it
    done = fairgate("explain", "esc-1", "--log", str(log))
    assert done.returncode == 0, done.stderr
    assert not any(c in done.stdout for c in "\x1b\x07\u202e\x9b"), repr(done.stdout)
    assert "model emu\\x1b[2J\\x1b]0;owned\\x07\\u202e\\x9b31m:" in done.stdout


def test_explain_lines_escape_every_field_of_a_forged_log_record():
    record = {
        "event": "rejected",
        "ts": 1_700_000_000.0,
        "tenant_hash": "0123456789abcdef\x1b[8m",
        "delegate_hash": None,
        "model": "m\x1b[1m",
        "reason": "invalid\x1b[5m",
        "dimension": "max\x1b[7m",
        "status": 400,
        "after_admission": False,
        "message": "bad\x1b[0m",
        "retry_after_s": None,
    }
    text = "\n".join(explain_lines("id\x1b[3m", [record], {}))
    assert "\x1b" not in text
    assert text.count("\\x1b[") == 7, text  # the reason twice


def test_a_bad_log_line_is_named_with_its_escape_sequences_as_text(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text("\x1b[2J\x1b]0;owned\x07 not json\n")
    done = fairgate("explain", "any", "--log", str(log))
    assert done.returncode == 2
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr, repr(done.stderr)
    assert f"{log}:1: not a JSON record" in done.stderr and "\\x1b[2J\\x1b]0;owned\\x07 not json" in done.stderr
