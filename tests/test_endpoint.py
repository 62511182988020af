"""The metrics endpoint against clients that do not behave (idle, slow, oversized, too many), and
where every listening socket of the project listens.

Real sockets on 127.0.0.1 in this process, with short deadlines (`EndpointLimits`) so each case
takes a second or two; every loop is bounded and stops by itself. What is asserted is behaviour:
a real scrape is answered, misbehaving clients are cut off, threads and connections stay bounded.
"""

from __future__ import annotations

import errno
import os
import re
import select
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from watchdog.station.endpoint import EndpointLimits, serve_registry
from watchdog.station.exporter import serve_metrics
from watchdog.station.telemetry import Telemetry

SHORT = EndpointLimits(request_deadline_seconds=1.0, head_grace_seconds=0.05)


def scrape(server) -> bytes:
    """A real scrape, as Prometheus makes it (the timeout only keeps a broken server from hanging the test)."""
    with urllib.request.urlopen(server.url, timeout=30) as response:
        assert response.status == 200
        return response.read()


def connect_many(server, count: int) -> list[socket.socket]:
    """`count` connections that send nothing: started at once, non-blocking, like a storm."""
    clients = []
    for _ in range(count):
        client = socket.socket(server_family(server), socket.SOCK_STREAM)
        client.setblocking(False)
        assert client.connect_ex((server.addr, server.port)) in (0, errno.EINPROGRESS)
        clients.append(client)
    return clients


def server_family(server) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in server.addr else socket.AF_INET


def closed_by_server(client: socket.socket) -> bool:
    """The server hung up on this client (end of stream or reset); False while it holds it open."""
    if not select.select([client], [], [], 0)[0]:
        return False
    try:
        return client.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def held(server) -> int:
    return server._httpd.open_connections


def held_once_settled(server, within: float = 10.0) -> int:
    """Connections still held once the selector thread has handled the last closes: it sees a
    client's close at its next wake-up, later on a loaded machine (a bound, not a timing)."""
    deadline = time.monotonic() + within
    while held(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    return held(server)


def test_a_scrape_is_answered_while_300_idle_connections_are_open():
    with serve_metrics(Telemetry(), 0, limits=SHORT) as server:
        threads = threading.active_count()
        idle = connect_many(server, 300)
        try:
            most_held = 0
            for _ in range(3):  # several scrapes while the storm goes on
                assert b"hbmwatch_build_info" in scrape(server)
                most_held = max(most_held, held(server))
                assert threading.active_count() == threads
            assert most_held <= SHORT.max_connections
            assert sum(closed_by_server(c) for c in idle) > 0  # the idle ones made room
        finally:
            for client in idle:
                client.close()
        assert b"hbmwatch_build_info" in scrape(server)  # and after they are gone


def test_when_every_place_is_held_by_an_idle_client_a_new_scraper_takes_the_oldest_ones_place():
    limits = EndpointLimits(max_connections=4, request_deadline_seconds=30.0, head_grace_seconds=0.05)
    with serve_metrics(Telemetry(), 0, limits=limits) as server:
        idle = connect_many(server, limits.max_connections)
        try:
            for _ in range(200):  # until the server holds all of them (each pass is 10 ms; it takes ~1)
                if held(server) == limits.max_connections:
                    break
                time.sleep(0.01)
            assert held(server) == limits.max_connections
            scrape(server)  # long before any idle client reached its 30 s deadline
            assert closed_by_server(idle[0])
            assert held(server) <= limits.max_connections
        finally:
            for client in idle:
                client.close()


def test_slow_clients_are_cut_off_at_their_whole_request_deadline_and_scrapes_go_on():
    """Six clients that each send a header line every 0.1 s (a slow-loris): every read is lively,
    so only a deadline on the whole request ends them."""
    with serve_metrics(Telemetry(), 0, limits=SHORT) as server:
        threads = threading.active_count()
        slow = [socket.create_connection((server.addr, server.port), timeout=5) for _ in range(6)]
        lines_sent = [0] * len(slow)
        cut = [False] * len(slow)
        try:
            for client in slow:
                client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            for line in range(60):  # 6 s of trickling at most: six times their deadline
                for i, client in enumerate(slow):
                    if cut[i] or closed_by_server(client):
                        cut[i] = True
                        continue
                    try:
                        client.sendall(b"X-Slow-%d: 1\r\n" % line)
                        lines_sent[i] += 1
                    except OSError:
                        cut[i] = True
                if line % 5 == 0:
                    assert b"hbmwatch_build_info" in scrape(server)
                    assert threading.active_count() == threads
                if all(cut):
                    break
                time.sleep(0.1)
            assert all(cut), f"still connected after {lines_sent} header lines"
            assert min(lines_sent) >= 1  # they were served like anyone else until their time ran out
        finally:
            for client in slow:
                client.close()
        assert held_once_settled(server) == 0


def test_a_client_that_never_reads_its_reply_is_cut_off_and_holds_no_worker():
    """The reply is sent by the selector thread under the same deadline: a client with a full
    receive window costs a place, never a worker."""
    limits = EndpointLimits(workers=1, request_deadline_seconds=1.0, head_grace_seconds=0.05)
    with serve_metrics(Telemetry(), 0, limits=limits) as server:
        stuck = socket.socket(server_family(server), socket.SOCK_STREAM)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's smallest window
        stuck.connect((server.addr, server.port))
        try:
            stuck.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert b"hbmwatch_build_info" in scrape(server)  # the single worker is free for others
        finally:
            stuck.close()


def read_all(client: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := client.recv(1 << 16):
            chunks.append(chunk)
    except OSError:  # reset: turned away
        pass
    return b"".join(chunks)


def test_a_storm_of_scrapes_is_paced_and_what_cannot_be_served_in_time_is_turned_away():
    """Complete requests, 40 at once, against 5 renders a second and a 1 s deadline: a few are
    served, the rest turned away at once instead of holding places, and the endpoint recovers."""
    limits = EndpointLimits(max_rate=5.0, request_deadline_seconds=1.0, head_grace_seconds=0.05)
    with serve_metrics(Telemetry(), 0, limits=limits) as server:
        threads = threading.active_count()
        storm = [socket.create_connection((server.addr, server.port), timeout=10) for _ in range(40)]
        try:
            for client in storm:
                client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            served = sum(read_all(client).startswith(b"HTTP/1.0 200") for client in storm)
        finally:
            for client in storm:
                client.close()
        assert 1 <= served < len(storm)
        assert threading.active_count() == threads
        assert b"hbmwatch_build_info" in scrape(server)


@pytest.mark.parametrize("head", [b"GET /metrics HTTP/1.0\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
                                  b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" * 3000])
def test_an_oversized_head_is_refused_and_costs_nothing(head):
    with serve_metrics(Telemetry(), 0, limits=SHORT) as server:
        with socket.create_connection((server.addr, server.port), timeout=5) as client:
            try:
                client.sendall(head)
                answer = client.recv(1 << 16)
            except OSError:  # reset or broken pipe: hung up on mid-send, as it should be
                answer = b""
            assert b"hbmwatch_" not in answer
        assert b"hbmwatch_build_info" in scrape(server)


def test_a_malformed_request_line_gets_an_http_error_not_a_hang():
    with serve_metrics(Telemetry(), 0, limits=SHORT) as server:
        with socket.create_connection((server.addr, server.port), timeout=5) as client:
            client.sendall(b"GET /metrics HTTP/9\r\n\r\n")
            assert b"400" in client.recv(1 << 16)  # an error page, then the end of the connection
            assert client.recv(1) == b""


# ---- every listening socket: loopback unless told otherwise -----------------------------------------

PACKAGE = Path(__file__).resolve().parents[1]
LISTENING_CALLS = re.compile(r"\.listen\(|make_server\(|start_http_server\(|HTTPServer\(|TCPServer\(|"
                             r"start_server\(|create_server\(|serve_forever\(")


def test_the_endpoint_is_the_only_code_that_opens_a_listening_socket():
    """So the loopback default below is the default of every server the project starts: a new
    listener anywhere else fails here, and goes through `serve_registry` instead."""
    sources = [*(PACKAGE / "watchdog").rglob("*.py"), *(PACKAGE / "deploy").rglob("*.py")]
    offenders = sorted(str(p.relative_to(PACKAGE)) for p in sources
                       if LISTENING_CALLS.search(p.read_text()) and p.name != "endpoint.py")
    assert offenders == []


@pytest.fixture
def listening(monkeypatch) -> list[str]:
    """The address of every socket that starts listening while the test runs."""
    addresses: list[str] = []
    listen = socket.socket.listen

    def spy(self, *args):
        addresses.append(self.getsockname()[0])
        return listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", spy)
    return addresses


def test_the_endpoint_functions_listen_on_loopback_by_default(listening):
    from prometheus_client import CollectorRegistry

    with serve_metrics(Telemetry(), 0), serve_registry(CollectorRegistry(), 0):
        pass
    assert listening == ["127.0.0.1", "127.0.0.1"]


class _Stop(Exception):
    """Raised by a stubbed run, once the server it was started beside is listening."""


def run_watch(monkeypatch, *flags: str) -> None:
    """`hbm-watchdog watch` in this process, up to its daemon's start (stubbed: no target is watched)."""
    from watchdog.commands import watch
    from watchdog.commands.cli import build_parser
    from watchdog.daemon.loop import Daemon

    monkeypatch.setattr(Daemon, "run", lambda self: 0)
    args = build_parser().parse_args(["watch", "--pid", str(os.getppid()), "--metrics-port", "0", *flags])
    assert watch.run(args) == 0


def run_train(monkeypatch, *flags: str) -> None:
    """`hbm-watchdog train` in this process, up to its first step (stubbed: nothing is trained)."""
    from watchdog.commands.cli import build_parser
    from watchdog.trainer import cli, loop

    def train(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(loop, "train", train)
    args = build_parser().parse_args(["train", "--device", "cpu", "--memory-limit", "1GiB", "--metrics-port", "0",
                                      *flags])
    with pytest.raises(_Stop):
        cli.run(args)


@pytest.mark.parametrize("run", [run_watch, run_train], ids=["watch", "train"])
def test_every_command_that_serves_metrics_listens_on_loopback_unless_told(run, listening, monkeypatch):
    run(monkeypatch)
    assert listening == ["127.0.0.1"]
    run(monkeypatch, "--metrics-address", "0.0.0.0")
    assert listening == ["127.0.0.1", "0.0.0.0"]


def test_the_replicated_trainer_is_given_the_listen_address(monkeypatch):
    """`train --num-devices N` starts one endpoint per replica, in processes of its own: the address
    reaches them from the command line (the replicas call `serve_metrics` with it)."""
    from watchdog.commands.cli import build_parser
    from watchdog.trainer import cli, multi

    given = []
    monkeypatch.setattr(multi, "train_replicated", lambda config, n, **kwargs: given.append(kwargs) or 0)
    for flags in ([], ["--metrics-address", "::"]):
        cli.run(build_parser().parse_args(["train", "--num-devices", "2", "--metrics-port", "0", *flags]))
    assert [kwargs["metrics_address"] for kwargs in given] == ["127.0.0.1", "::"]
