"""Upstreams added and taken out by a reload (``fairgate.gateway.upstream_reload``): a replica added takes
requests at once; one taken out takes no new request while a stream it runs goes on to its end, billed what its
client received, then its client is closed; what a reload cannot do to upstreams is refused, the running
ones kept."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import tomlkit

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.observe import Finished
from fairgate.gateway.state import GatewayState, state_of
from fairgate.harness.threads import serve_in_thread
from tests.gateway.conftest import EMULATOR, Stack, write_config
from tests.gateway.test_reload_quotas import streamed_tokens, streaming

ADMIN = f"fg-test-admin-{'u' * 24}"


class Finishes:
    """Which upstream served each finished request."""

    def __init__(self) -> None:
        self.upstream: dict[str, str] = {}

    def observe(self, event: object) -> None:
        if isinstance(event, Finished):
            self.upstream[event.request_id] = event.upstream


@contextmanager
def two_replicas(tmp: Path) -> Iterator[tuple[Stack, GatewayState, Finishes, str]]:
    """A gateway in front of one replica (``emu-0``) and a second replica's URL, not yet configured."""
    finishes = Finishes()
    with serve_in_thread(create_app(EMULATOR)) as first, serve_in_thread(create_app(EMULATOR)) as second:
        path, keys = write_config(tmp, [first], admin_key=ADMIN)
        app = create_gateway(load_gateway_config(path), observers=[finishes])
        with serve_in_thread(app) as url:
            yield Stack(url, keys, path, load_gateway_config(path)), state_of(app), finishes, second


def reload(stack: Stack) -> httpx.Response:
    return httpx.post(f"{stack.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)


def set_upstreams(path: Path, tables: list[dict[str, Any]]) -> None:
    document = tomlkit.parse(path.read_text())
    upstreams = tomlkit.aot()
    for table in tables:
        upstreams.append(tomlkit.item(table))
    document["upstream"] = upstreams
    path.write_text(tomlkit.dumps(document))


def first_table(path: Path) -> dict[str, Any]:
    return dict(tomlkit.parse(path.read_text())["upstream"][0].unwrap())


def complete(stack: Stack, request_id: str, tokens: int = 5) -> httpx.Response:
    body = {"model": "emu", "prompt": "a b", "max_tokens": tokens, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "X-Request-Id": request_id}
    return httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=30)


def test_a_replica_swapped_by_a_reload_drains_its_stream_and_the_new_one_serves(tmp_path: Path) -> None:
    with two_replicas(tmp_path) as (stack, state, finishes, second):
        old = first_table(stack.config_path)
        with streaming(stack, "across", 300) as lines:
            set_upstreams(stack.config_path, [{**old, "name": "emu-1", "url": f"{second}/v1"}])
            answer = reload(stack)
            assert answer.status_code == 200 and "upstream" in answer.json()["applied"], answer.text
            draining = {u.name: u.retired for u in state.dispatcher.upstreams()}
            assert draining == {"emu-0": True, "emu-1": False}  # emu-0 still runs the stream
            metrics = httpx.get(f"{stack.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
            assert 'fairgate_upstream_up{model="emu",upstream="emu-0"} 0.0' in metrics  # draining: takes none
            assert all(complete(stack, f"after-{i}").status_code == 200 for i in range(4))
        time.sleep(0.2)  # the stream's release, on the gateway's loop
        reservations = {r.request_id: r for r in stack.reservations()}
        gone = [u.name for u in state.dispatcher.upstreams()], sorted(state.upstreams)
    assert streamed_tokens(lines) == 300 == reservations["across"].billed.output_tokens
    assert finishes.upstream["across"] == "emu-0"
    assert {finishes.upstream[f"after-{i}"] for i in range(4)} == {"emu-1"}
    assert gone == (["emu-1"], ["emu-1"])  # emu-0 forgotten and its client closed once its stream ended
    assert all(reservations[f"after-{i}"].status == "settled" for i in range(4))


def test_what_a_reload_cannot_do_to_upstreams_is_refused_and_they_keep_serving(tmp_path: Path) -> None:
    with two_replicas(tmp_path) as (stack, state, _, second):
        old = first_table(stack.config_path)
        good = stack.config_path.read_text()
        refusals = {
            "upstream 'emu-0' changed": [{**old, "max_batch": 8}],
            "pool 'other' is not running": [old, {**old, "name": "emu-9", "url": f"{second}/v1", "model": "other"}],
        }
        for message, tables in refusals.items():
            set_upstreams(stack.config_path, tables)
            refused = reload(stack)
            assert refused.status_code == 400 and message in refused.json()["error"]["message"], refused.text
            stack.config_path.write_text(good)
        # Taken out while it runs a stream, a replica's name is not reused for another table until the stream
        # ends; configured again unchanged (a reload undone), it serves again.
        with streaming(stack, "long", 300):
            set_upstreams(stack.config_path, [{**old, "name": "emu-1", "url": f"{second}/v1"}])
            assert reload(stack).json()["upstreams_removed"] == ["emu-0"]
            set_upstreams(stack.config_path, [{**old, "name": "emu-1", "url": f"{second}/v1"}, {**old, "max_batch": 8}])
            refused = reload(stack)
            assert refused.status_code == 400 and "'emu-0' is still draining" in refused.text, refused.text
            set_upstreams(stack.config_path, [{**old, "name": "emu-1", "url": f"{second}/v1"}, old])
            back = reload(stack)
            assert back.status_code == 200 and back.json()["upstreams_added"] == ["emu-0"], back.text
        assert complete(stack, "still").status_code == 200
        serving = sorted((u.name, u.max_batch, u.retired) for u in state.dispatcher.upstreams())
        assert serving == [("emu-0", 4, False), ("emu-1", 4, False)] and sorted(state.upstreams) == ["emu-0", "emu-1"]


def test_an_admin_write_that_cannot_be_saved_puts_the_upstreams_back_as_they_ran(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A hand edit swapping the replicas comes in with an admin write; the file cannot be written, so the
    running configuration is put back: the replica taken out (still draining its stream) serves again and the
    one added is gone, as the file on disk says."""
    with two_replicas(tmp_path) as (stack, state, _, second):
        old = first_table(stack.config_path)

        def cannot_rename(self) -> None:  # type: ignore[no-untyped-def]
            self.discard()
            raise PermissionError("injected: rename refused")

        with streaming(stack, "long", 300):
            before = stack.config_path.read_text()
            set_upstreams(stack.config_path, [{**old, "name": "emu-1", "url": f"{second}/v1"}])
            edited = stack.config_path.read_text()
            monkeypatch.setattr("fairgate.keyfile.Staged.commit", cannot_rename)
            answer = httpx.post(
                f"{stack.url}/admin/keys",
                json={"tenant": "alpha", "name": "laptop"},
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=30,
            )
            monkeypatch.undo()
            assert answer.status_code >= 400, answer.text
            serving = sorted((u.name, u.retired) for u in state.dispatcher.upstreams())
            assert serving == [("emu-0", False)] and [u.name for u in state.config.upstreams] == ["emu-0"]
            assert stack.config_path.read_text() == edited != before
        assert complete(stack, "after").status_code == 200
        assert reload(stack).json()["upstreams_added"] == ["emu-1"]  # the file's swap, applied now
