"""A ``fairgate serve`` process under small connection bounds ([gateway] max_header_bytes, max_headers,
header_timeout_s, body_timeout_s, keep_alive_s, max_connections), driven over raw loopback sockets: an
oversized or over-long head is refused with 431 before authentication and without the server's memory
growing with it, a head or body trickled past its bound gets 408 and holds nothing, an idle connection
is closed, and connections beyond the cap get 503."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import tomlkit

from fairgate.emulator.api import create_app
from fairgate.gateway.config import GatewayConfig, GatewayConfigError, load_gateway_config
from fairgate.harness.process import fairgate_server, free_port, running
from fairgate.harness.threads import serve_in_thread
from tests.gateway.conftest import BODY, EMULATOR, ledger_call, post, write_config

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 0.5
BOUNDS = {
    "max_header_bytes": 16_384,
    "max_headers": 20,
    "header_timeout_s": HEADER_TIMEOUT_S,
    "body_timeout_s": BODY_TIMEOUT_S,
    "keep_alive_s": KEEP_ALIVE_S,
    "max_connections": 3,
}
SLACK_S = 2.0  # scheduling slack on 2 shared cores, on top of a bound
TIMER_EARLY_S = 0.01  # asyncio's timers may fire up to a clock tick early (measured: 0.04 ms, 0.1 ms)


@dataclass
class Served:
    url: str
    key: str
    config: GatewayConfig
    pid: int

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")  # pragma: no cover

    def connect(self) -> socket.socket:
        where = urlsplit(self.url)
        return socket.create_connection((where.hostname, where.port), timeout=10)


def bounded_config(tmp: Path, upstream: str, **bounds: object) -> tuple[Path, dict[str, str]]:
    """``write_config``'s gateway with ``bounds`` added to ``[gateway]``; its path and keys."""
    path, keys = write_config(tmp, [upstream])
    document = tomlkit.parse(path.read_text())
    document["gateway"].update(bounds)
    path.write_text(tomlkit.dumps(document))
    return path, keys


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("bounds")
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = bounded_config(tmp, emulator, **BOUNDS)
        port = free_port()
        server = fairgate_server(["serve", "--config", str(path), "--port", str(port)], port, tmp / "gateway.log")
        with running([server]):
            assert server.popen is not None
            yield Served(server.url, keys["alpha"], load_gateway_config(path), server.popen.pid)


def head(*lines: str, method: str = "GET", path: str = "/health") -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "host: gateway", *lines, "", ""]).encode("latin-1")


def read_answer(sock: socket.socket, timeout_s: float = 10.0) -> tuple[int | None, bytes, float]:
    """The status and body the server sent before closing (None: closed with nothing), and when it closed
    (monotonic s)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    closed = time.monotonic()
    if not data:
        return None, b"", closed
    top, _, body = data.partition(b"\r\n\r\n")
    return int(top.split(b" ", 2)[1]), body, closed


def error_code(body: bytes) -> str:
    return str(json.loads(body)["error"]["code"])


def test_huge_headers_are_refused_with_431_before_auth_and_not_buffered(served: Served) -> None:
    """Five connections each send a 20 MB header after a valid key (the tester's 10 x 20 MB raised RSS by
    208 MB): each gets 431 once the head passes max_header_bytes; the server's RSS stays put."""
    pad = b"a" * (256 * 1024)
    socks = [served.connect() for _ in range(5)]
    before = served.rss_mb()
    started = time.monotonic()
    start = head(f"authorization: Bearer {served.key}", method="POST", path="/v1/completions")
    for sock in socks:
        sock.sendall(start[:-2] + b"x-pad: ")
    sent = dict.fromkeys(socks, 0)
    answered: set[socket.socket] = set()
    while len(answered) < len(socks) and time.monotonic() - started < 20:
        for sock in socks:
            if sock in answered or select.select([sock], [], [], 0)[0] or sent[sock] >= 20 * 1024 * 1024:
                answered.add(sock)
                continue
            try:
                sent[sock] += sock.send(pad)
            except OSError:
                answered.add(sock)
    answers = [read_answer(sock) for sock in socks]
    after = served.rss_mb()
    assert [status for status, _, _ in answers] == [431] * 5
    assert {error_code(body) for _, body, _ in answers} == {"header_fields_too_large"}
    assert after - before < 20, (before, after)
    assert time.monotonic() - started < 10
    for sock in socks:
        sock.close()


def test_too_many_header_fields_get_431(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(head(*(f"x-field-{i}: {i}" for i in range(30))))
        status, body, _ = read_answer(sock)
    assert status == 431
    assert "more than 20 header fields" in json.loads(body)["error"]["message"]
    with served.connect() as sock:  # 18 fields and host fit the bound of 20
        sock.sendall(head("connection: close", *(f"x-field-{i}: {i}" for i in range(18))))
        assert read_answer(sock)[0] == 200


def test_a_trickled_head_gets_408_after_header_timeout(served: Served) -> None:
    started = time.monotonic()  # before the connection: the server's timer may start when it is accepted
    with served.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: gateway\r\n")
        status = None
        for i in range(int((HEADER_TIMEOUT_S + SLACK_S) / 0.2)):
            if select.select([sock], [], [], 0.2)[0]:
                break
            try:
                sock.sendall(f"x-{i}: 1\r\n".encode())
            except OSError:
                break
        status, body, closed = read_answer(sock)
    assert status == 408
    assert error_code(body) == "request_timeout"
    assert HEADER_TIMEOUT_S - TIMER_EARLY_S <= closed - started < HEADER_TIMEOUT_S + SLACK_S


def test_a_trickled_body_gets_408_and_reserves_nothing(served: Served) -> None:
    """Three clients send a completion's body a byte every 0.2 s: each gets 408 after body_timeout_s (with
    a valid key, so past authentication); the ledger holds no reservation, and the gateway still serves."""
    body = json.dumps(BODY).encode()
    socks = [served.connect() for _ in range(3)]
    started = time.monotonic()
    for sock in socks:
        lines = [f"authorization: Bearer {served.key}", "content-type: application/json"]
        sock.sendall(head(*lines, f"content-length: {len(body)}", method="POST", path="/v1/completions"))
    for byte in body[: int((BODY_TIMEOUT_S + SLACK_S) / 0.2)]:
        if select.select(socks, [], [], 0.2)[0]:
            break
        for sock in socks:
            sock.sendall(bytes([byte]))
    answers = [read_answer(sock) for sock in socks]
    assert [status for status, _, _ in answers] == [408] * 3
    assert {error_code(body) for _, body, _ in answers} == {"request_timeout"}
    assert all(closed - started < BODY_TIMEOUT_S + SLACK_S for _, _, closed in answers)
    for sock in socks:
        sock.close()
    assert ledger_call(served.config, lambda ledger: ledger.reservations()) == []
    answer = post(served.url, served.key)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_an_idle_connection_is_closed_after_keep_alive(served: Served) -> None:
    opened = time.monotonic()
    with served.connect() as sock:  # never sends a byte
        status, _, closed = read_answer(sock)
    assert status is None
    assert KEEP_ALIVE_S - TIMER_EARLY_S <= closed - opened < KEEP_ALIVE_S + SLACK_S
    with served.connect() as sock:  # idle after an answer
        sock.sendall(head())
        sock.settimeout(5)
        data = b""
        while not data.endswith(b'{"status":"ok"}'):
            data += sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        status, _, closed = read_answer(sock)
    assert status is None and closed - answered < KEEP_ALIVE_S + SLACK_S


def test_requests_beyond_max_connections_get_503(served: Served) -> None:
    held = [served.connect() for _ in range(3)]
    for sock in held:  # each holds its connection with a head in progress
        sock.sendall(b"GET /health HTTP/1.1\r\n")
    with served.connect() as sock:
        sock.sendall(head())
        assert read_answer(sock)[0] == 503
    for sock in held:
        sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{served.url}/health", timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_header_bytes", 100),
        ("max_headers", 0),
        ("body_timeout_s", 0),
        ("keep_alive_s", "5"),
        ("max_connections", 0),
    ],
)
def test_bounds_are_validated(tmp_path: Path, key: str, value: object) -> None:
    path, _ = bounded_config(tmp_path, "http://127.0.0.1:9/v1", **{key: value})
    with pytest.raises(GatewayConfigError, match=rf"gateway\.{key}: "):
        load_gateway_config(path)
