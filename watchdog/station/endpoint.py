"""The scrape endpoint: an HTTP server for a Prometheus registry, bounded whatever its clients do.

It knows nothing of stations or telemetry: it serves any `CollectorRegistry` (exporter.py builds
the watchdog's). It listens on loopback unless told otherwise (`--metrics-address`, like
node-exporter's `--web.listen-address`): a workstation's training job should not serve the
network; a pod sets all interfaces (deploy/k8s). One selector thread does all its socket work and
a fixed pool of threads renders, with a whole-request deadline and room kept for new scrapers
(`PooledWSGIServer`): no number of clients, idle, slow or half-open, can grow its threads or file
descriptors, nor keep a scrape from being answered. Every listening socket of the project is made
here.
"""

from __future__ import annotations

import collections
import errno
import io
import math
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import make_wsgi_app

from watchdog.core.errors import InputError
from watchdog.core.numbers import option, parse_port, shown
from watchdog.logs import get_logger

log = get_logger(__name__)

DEFAULT_PORT = 9400  # clear of libtpu's 8431, the TPU runtime's 8471 and 8476-8479
DEFAULT_ADDRESS = "127.0.0.1"  # this machine only; a pod listens on all interfaces (deploy/k8s)
SCRAPE_WORKERS = 4  # replies rendered at once; a scrape takes about a millisecond
MAX_SCRAPES_PER_SECOND = 10.0  # Prometheus scrapes every 15-60 s; more than this is a storm, paced
MAX_CONNECTIONS = 64  # connections held at once, whatever their state
REQUEST_DEADLINE_SECONDS = 3.0  # a whole request, from accept to the reply's last byte
HEAD_GRACE_SECONDS = 0.25  # a client has this long to send its head before a new one may take its place
MAX_HEAD_BYTES = 16384  # a scrape's head is a few hundred bytes
READ_CHUNK_BYTES = 4096
TURN_AWAY_PAUSE_SECONDS = 0.01  # after turning a scrape away (too many waiting), accept nothing for this long


class _BufferedHandler(WSGIRequestHandler):
    """Answers one request head the acceptor has already read whole, into memory.

    So a worker renders and never touches the client's socket: no client, slow or silent, can
    hold one. `reply` is what to send back (empty when there is nothing to send).
    """

    def setup(self) -> None:
        self.rfile = io.BytesIO(self.request)
        self.wfile = io.BytesIO()

    def finish(self) -> None:
        self.reply = self.wfile.getvalue()

    def log_message(self, format, *args) -> None:  # noqa: A002 - a scrape is not worth a log line
        pass


@dataclass(frozen=True)
class EndpointLimits:
    """What the endpoint grants its clients, whatever they do (see `PooledWSGIServer`)."""

    workers: int = SCRAPE_WORKERS
    max_rate: float = MAX_SCRAPES_PER_SECOND
    max_connections: int = MAX_CONNECTIONS
    request_deadline_seconds: float = REQUEST_DEADLINE_SECONDS
    head_grace_seconds: float = HEAD_GRACE_SECONDS


_READING, _QUEUED, _RENDERING, _WRITING, _CLOSED = range(5)
_LISTENER, _WAKE = object(), object()  # selector tags for the two sockets that are not connections


class _Connection:
    """One client: its socket, its whole-request deadline, the head read so far, the reply left to send."""

    __slots__ = ("sock", "address", "accepted", "deadline", "head", "reply", "state")

    def __init__(self, sock: socket.socket, address, now: float, deadline_seconds: float):
        self.sock, self.address = sock, address
        self.accepted, self.deadline = now, now + deadline_seconds
        self.head = bytearray()
        self.reply = memoryview(b"")
        self.state = _READING


class PooledWSGIServer(WSGIServer):
    """A WSGI server that costs the training process a bounded share, and always answers a scrape.

    prometheus_client's server starts a thread per connection and never times one out: 200
    half-open clients made 219 threads and 206 fds. A pool that hands each worker a connection
    fixes the threads but not the starvation: 300 clients that connect and send nothing, or six
    that send a header line every 2 s, kept every worker waiting on them, and no scrape was
    answered while they went on. So here the client's socket never reaches a worker:

    - One thread (`serve_forever`) does all the socket work, non-blocking, through a selector: it
      accepts, buffers each request head until it is complete, and sends each reply.
    - Every connection has a whole-request deadline (`request_deadline_seconds`, from accept to
      the reply's last byte): a client that trickles bytes is cut off when it runs out, however
      lively each read was. A per-read timeout alone let a slow-loris live for ever.
    - At most `max_connections` are held. When full, a new client takes the place of the oldest
      one still sending its head once that one has had `head_grace_seconds` to send it (a real
      scraper sends its whole head at once, within milliseconds): idle and slow clients cannot
      keep a new scraper out, and churning them costs at most `max_connections / head_grace`
      accepts a second. Until then new clients wait in the kernel's listen backlog, for free.
    - Only a complete head goes to the `workers`, at most `max_rate` a second (Prometheus scrapes
      every 15-60 s; more is a storm, paced); a worker turns it into a reply in memory
      (`_BufferedHandler`), and the selector thread sends it. Heads beyond what that pace can
      render before their deadline are turned away at once (and then nothing is accepted for
      TURN_AWAY_PAUSE_SECONDS), so neither a storm of scrapes nor its dead residue in the
      backlog holds the places a new scraper needs, and turning them away costs little.

    So the endpoint has `workers + 1` threads and at most `max_connections` open connections, and
    a storm of clients cannot take the interpreter from the training loop.
    """

    # The kernel's listen backlog (capped by net.core.somaxconn). Deep enough that a few hundred
    # clients held out (idle ones reconnecting as fast as they are dropped) wait in it rather than
    # fill it: a full backlog drops a new scraper's SYN, and its retries back off for seconds. It
    # costs this process nothing until a connection is accepted, and every one is then cheap to
    # turn away, so what queues there drains at the selector's speed.
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, *,
                 limits: EndpointLimits = EndpointLimits()):
        self.address_family = family
        self.limits = limits
        self._interval = 1.0 / limits.max_rate
        # complete heads waiting for a worker: no more than the pace can render before their deadline,
        # so a storm of scrapes (or its dead residue in the backlog) is turned away at once, not held
        self._queue_bound = max(1, math.ceil(limits.request_deadline_seconds * limits.max_rate))
        self._stopping = threading.Event()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)  # a full pipe means the selector is already due to wake
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()  # complete heads, to the workers
        self._replies: queue.SimpleQueue = queue.SimpleQueue()  # rendered replies, back to the selector
        self._connections: dict[socket.socket, _Connection] = {}  # touched by the selector thread only
        self._queued: collections.deque[_Connection] = collections.deque()
        self._idle_workers = limits.workers
        self._next_handoff = 0.0
        self._accept_paused_until = 0.0
        self._selector: selectors.BaseSelector | None = None
        self._workers = [threading.Thread(target=self._work, name=f"hbm-watchdog-metrics-worker-{i}", daemon=True)
                         for i in range(limits.workers)]
        for worker in self._workers:
            worker.start()
        super().__init__(address, _BufferedHandler)  # a failed bind calls server_close, which stops the workers
        self.socket.setblocking(False)

    @property
    def open_connections(self) -> int:
        """Connections held now (a len() of the selector thread's table: safe to read from any thread)."""
        return len(self._connections)

    # -- the selector thread -------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept, read heads, hand them to the workers and send their replies, until `shutdown`."""
        with selectors.DefaultSelector() as selector:
            self._selector = selector
            selector.register(self._wake_reader, selectors.EVENT_READ, _WAKE)
            listening = False
            try:
                while not self._stopping.is_set():
                    now = time.monotonic()
                    self._expire(now)
                    self._dispatch(now)
                    if self._can_accept(now) != listening:
                        listening = not listening
                        if listening:
                            selector.register(self.socket, selectors.EVENT_READ, _LISTENER)
                        else:
                            selector.unregister(self.socket)
                    for key, _ in selector.select(self._timeout(now, listening, poll_interval)):
                        if key.data is _LISTENER:
                            self._accept()
                        elif key.data is _WAKE:
                            self._take_replies()
                        elif key.data.state == _READING:
                            self._read(key.data)
                        elif key.data.state == _WRITING:
                            self._write(key.data)
            finally:
                for connection in list(self._connections.values()):
                    self._close(connection)
                self._selector = None

    def _can_accept(self, now: float) -> bool:
        if now < self._accept_paused_until:
            return False
        return len(self._connections) < self.limits.max_connections or self._evictable(now) is not None

    def _evictable(self, now: float) -> _Connection | None:
        """The oldest connection still sending its head, once it has had its grace; None if none has."""
        reading = [c for c in self._connections.values() if c.state == _READING]
        oldest = min(reading, key=lambda c: c.accepted, default=None)
        return oldest if oldest is not None and now - oldest.accepted >= self.limits.head_grace_seconds else None

    def _timeout(self, now: float, listening: bool, poll_interval: float) -> float:
        """Until the next thing due: a deadline, a paced hand-off, an eviction, the end of an accept pause."""
        due = [c.deadline for c in self._connections.values() if c.state != _RENDERING]
        if self._queued and self._idle_workers:
            due.append(self._next_handoff)
        if not listening:
            reading = [c.accepted for c in self._connections.values() if c.state == _READING]
            if reading:
                due.append(min(reading) + self.limits.head_grace_seconds)
            if self._accept_paused_until > now:
                due.append(self._accept_paused_until)
        return min([poll_interval, *(max(0.0, t - now) for t in due)])

    def _accept(self) -> None:
        # a few at a time, reading between batches: a scraper just accepted gets to send its head
        # before newer clients could push it out
        for _ in range(max(1, self.limits.max_connections // 4)):
            now = time.monotonic()
            if now < self._accept_paused_until:
                return
            if len(self._connections) >= self.limits.max_connections:
                oldest = self._evictable(now)
                if oldest is None:
                    return
                self._close(oldest)
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the client gave up: try again a little later
                self._accept_paused_until = now + TURN_AWAY_PAUSE_SECONDS
                return
            sock.setblocking(False)
            connection = _Connection(sock, address, now, self.limits.request_deadline_seconds)
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)
            self._read(connection)  # a client that waited in the backlog has usually sent its head already

    def _read(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(READ_CHUNK_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data or len(connection.head) + len(data) > MAX_HEAD_BYTES:
            self._close(connection)  # hung up, or not a scrape
            return
        searched_from = max(0, len(connection.head) - 3)
        connection.head += data
        if connection.head.find(b"\r\n\r\n", searched_from) < 0 and connection.head.find(b"\n\n", searched_from) < 0:
            return
        if sum(1 for c in self._queued if c.state == _QUEUED) >= self._queue_bound:
            # a storm of scrapes (or its dead residue in the backlog): this one could not be rendered
            # before its deadline. Turned away at once, but at a bounded rate, so the storm costs little.
            self._close(connection)
            self._accept_paused_until = time.monotonic() + TURN_AWAY_PAUSE_SECONDS
            return
        self._selector.unregister(connection.sock)
        connection.state = _QUEUED
        self._queued.append(connection)

    def _dispatch(self, now: float) -> None:
        """Complete heads to free workers, oldest first, paced to `max_rate`."""
        while self._queued and self._idle_workers and now >= self._next_handoff:
            connection = self._queued.popleft()
            if connection.state != _QUEUED:
                continue  # closed at its deadline while it waited
            connection.state = _RENDERING
            self._idle_workers -= 1
            self._next_handoff = now + self._interval
            self._handoff.put(connection)

    def _take_replies(self) -> None:
        try:
            while self._wake_reader.recv(READ_CHUNK_BYTES):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                connection, reply = self._replies.get_nowait()
            except queue.Empty:
                return
            self._idle_workers += 1
            if connection.state != _RENDERING:
                continue
            if not reply or time.monotonic() >= connection.deadline:
                self._close(connection)
                continue
            connection.reply = memoryview(reply)
            connection.state = _WRITING
            self._selector.register(connection.sock, selectors.EVENT_WRITE, connection)
            self._write(connection)

    def _write(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.reply)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(connection)
            return
        connection.reply = connection.reply[sent:]
        if not connection.reply:
            try:
                connection.sock.shutdown(socket.SHUT_WR)  # the reply is whole: end of response for the client
            except OSError:
                pass
            self._close(connection)

    def _expire(self, now: float) -> None:
        """Whatever has outlived its whole-request deadline goes (a reply being rendered is judged when it comes back)."""
        for connection in [c for c in self._connections.values() if c.deadline <= now and c.state != _RENDERING]:
            self._close(connection)

    def _close(self, connection: _Connection) -> None:
        if connection.state in (_READING, _WRITING):
            self._selector.unregister(connection.sock)
        connection.state = _CLOSED
        self._connections.pop(connection.sock, None)
        connection.sock.close()

    # -- the workers ---------------------------------------------------------------------------

    def _work(self) -> None:
        while (connection := self._handoff.get()) is not None:
            try:
                reply = _BufferedHandler(bytes(connection.head), connection.address, self).reply
            except Exception:  # noqa: BLE001 - a request the handler could not parse gets no answer
                reply = b""
            self._replies.put((connection, reply))
            self._wake()

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"x")
        except OSError:  # the pipe is full (already awake) or closed (shutting down)
            pass

    # -- stopping ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake()

    def server_close(self) -> None:
        self.shutdown()
        super().server_close()
        for _ in self._workers:
            self._handoff.put(None)
        for worker in self._workers:
            worker.join(timeout=5)
        self._wake_reader.close()
        self._wake_writer.close()


@dataclass
class MetricsServer:
    """A running endpoint. `addr` and `port` are the ones actually bound (port 0 asks for any free one)."""

    addr: str
    port: int
    registry: CollectorRegistry
    _httpd: PooledWSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._httpd.server_close()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_metrics_options(group) -> None:
    """`--metrics-port` and `--metrics-address`: the same endpoint options for `train` and `watch`."""
    group.add_argument("--metrics-port", type=option(parse_port), help="serve Prometheus metrics (0: any free port)")
    group.add_argument("--metrics-address", default=DEFAULT_ADDRESS, metavar="HOST",
                       help="interface the metrics endpoint listens on (default %(default)s: this machine only; "
                            "0.0.0.0 or :: for all, as in a pod)")


def serve_registry(registry: CollectorRegistry, port: int = DEFAULT_PORT, *, local_rank: int = 0,
                   addr: str = DEFAULT_ADDRESS, limits: EndpointLimits = EndpointLimits()) -> MetricsServer:
    """Serve `/metrics` for `registry` on `addr`, port `port + local_rank` (port 0: any free port).

    One process per local rank shares a host (and, with hostNetwork on GKE, the node's ports),
    so each rank offsets the base port by its local rank; the actual URL is logged. Every
    listening socket of the project is made here, on loopback unless `addr` says otherwise.
    """
    if not isinstance(port, int) or isinstance(port, bool) or port < 0:
        raise InputError(f"metrics port must be a non-negative integer, got {port!r}")
    if not isinstance(local_rank, int) or local_rank < 0:
        raise InputError(f"local rank must be a non-negative integer, got {local_rank!r}")
    bind_port = port + local_rank if port else 0
    if bind_port > 65535:
        raise InputError(f"metrics port {port} + local rank {local_rank} is above 65535")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, bind_port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        httpd = PooledWSGIServer(sockaddr[:2], family, limits=limits)
    except UnicodeError:  # "." or a 64-character label: no host name the resolver can even encode
        raise InputError(f"cannot serve metrics on {shown(str(addr))}: not a host name or an address") from None
    except OSError as exc:  # a name that does not resolve (gaierror) included
        if exc.errno == errno.EADDRINUSE:
            raise InputError(f"metrics port {bind_port} on {addr} is already in use "
                             f"(base {port} + local rank {local_rank}); pick another with --metrics-port") from None
        raise InputError(f"cannot serve metrics on {addr}:{bind_port}: {exc.strerror or exc}") from None
    httpd.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=httpd.serve_forever, name=f"hbm-watchdog-metrics-{local_rank}", daemon=True)
    thread.start()
    server = MetricsServer(str(httpd.server_address[0]), int(httpd.server_port), registry, httpd, thread)
    log.info("metrics_serving", url=server.url, addr=server.addr, port=server.port, local_rank=local_rank)
    return server
