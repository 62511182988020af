"""Training steps/s with and without a storm of metrics clients, in one run.

    python -m watchdog.bench.scrape_storm [--clients 200] [--phase-seconds 20]

One process trains the trainer's model (tiny, plain CPU, one torch thread) with the watchdog
sampling every step and its endpoint serving. Phases of equal length follow each other in the
same run: quiet, `--clients` scrapers fetching /metrics back to back, `--clients` half-open
clients (connect, send nothing, reconnect when dropped), `--clients` slow-loris clients (a
header line every second, reconnect when dropped), quiet again. The clients run in a child
process (asyncio), so the figures are what the storm costs the training process: its steps/s,
and the most threads and file descriptors it had during the phase. Beside each storm, one
probe scrapes once a second as Prometheus would (10 s timeout): whether the storm kept a real
scrape from being answered. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from watchdog.commands.cli import OneLineParser
from watchdog.core.numbers import decimal_in, option, parse_port, whole_in

PHASES = (("quiet", None), ("scrapers", "scrape"), ("half-open", "half-open"), ("slow-loris", "slow-loris"),
          ("quiet again", None))
REFUSED_PAUSE_SECONDS = 0.05  # a scraper turned away tries again this much later, as a real one would (later still)
SLOW_LINE_SECONDS = 1.0  # a slow-loris client sends one header line this often
PROBE_EVERY_SECONDS = 1.0  # the probe's scrape interval
PROBE_TIMEOUT_SECONDS = 10.0  # Prometheus's default scrape timeout


# ---- the clients (a child process) -----------------------------------------------------------------

async def _scrape(host: str, port: int, counts: collections.Counter) -> None:
    request = f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            await writer.drain()
            answer = await reader.read()
            writer.close()
        except OSError:
            answer = b""
        if answer.startswith(b"HTTP/1.0 200"):
            counts["served"] += 1
        else:
            counts["turned away"] += 1
            await asyncio.sleep(REFUSED_PAUSE_SECONDS)


async def _reconnecting(host: str, port: int, counts: collections.Counter, hold) -> None:
    """Connect, let `hold(reader, writer)` keep the connection as long as the server allows, and
    connect again: an attacker that comes back every time it is dropped or refused."""
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            counts["connections"] += 1
            await hold(reader, writer)
            counts["dropped by the server"] += 1
            writer.close()
        except OSError:
            counts["refused"] += 1
            await asyncio.sleep(REFUSED_PAUSE_SECONDS)


async def _half_open(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # says nothing; returns when the server drops us


async def _slow_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A request head that never ends: one header line every SLOW_LINE_SECONDS."""
    host = writer.get_extra_info("peername")[0]
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n".encode())
    line = 0
    while not reader.at_eof():
        await writer.drain()
        try:  # the server's hang-up ends the wait early
            await asyncio.wait_for(reader.read(1), SLOW_LINE_SECONDS)
        except asyncio.TimeoutError:
            pass
        writer.write(f"X-Slow-{line}: 1\r\n".encode())
        line += 1


async def _probe(host: str, port: int, counts: collections.Counter) -> None:
    """A real scraper beside the storm: answered or not, and its slowest answer."""
    request = f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    while True:
        started = time.monotonic()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_SECONDS)
            writer.write(request)
            answer = await asyncio.wait_for(reader.read(), PROBE_TIMEOUT_SECONDS - (time.monotonic() - started))
            writer.close()
        except (OSError, asyncio.TimeoutError):
            answer = b""
        took_ms = round((time.monotonic() - started) * 1000)
        if answer.startswith(b"HTTP/1.0 200"):
            counts["probe answered"] += 1
            counts["probe slowest ms"] = max(counts["probe slowest ms"], took_ms)
        else:
            counts["probe not answered"] += 1
        await asyncio.sleep(max(0.0, PROBE_EVERY_SECONDS - (time.monotonic() - started)))


CLIENTS = {"scrape": _scrape,
           "half-open": functools.partial(_reconnecting, hold=_half_open),
           "slow-loris": functools.partial(_reconnecting, hold=_slow_headers)}


async def _clients(host: str, port: int, mode: str, clients: int) -> None:
    counts: collections.Counter = collections.Counter()
    client = CLIENTS[mode]
    tasks = [asyncio.create_task(client(host, port, counts)) for _ in range(clients)]
    tasks.append(asyncio.create_task(_probe(host, port, counts)))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the parent says stop
    for task in tasks:
        task.cancel()
    print(json.dumps(dict(counts)), flush=True)


# ---- the training process --------------------------------------------------------------------------

@dataclass
class Phase:
    name: str
    steps: int
    seconds: float
    max_threads: int
    max_fds: int
    clients: dict

    @property
    def rate(self) -> float:
        return self.steps / self.seconds


class _Peaks:
    """The most threads and fds this process had while watching (sampled every 50 ms)."""

    def __init__(self) -> None:
        self.threads = self.fds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(0.05):
            self.threads = max(self.threads, process.num_threads())
            self.fds = max(self.fds, process.num_fds())

    def stop(self) -> "_Peaks":
        self._stop.set()
        self._thread.join()
        return self


def storm(clients: int, phase_seconds: float) -> list[Phase]:
    import torch

    from watchdog.core.config import WatchdogConfig
    from watchdog.station.exporter import serve_metrics
    from watchdog.runtime.sidecar import Watchdog
    from watchdog.trainer.data import TokenSource
    from watchdog.trainer.loop import TrainConfig, build_state, train_step
    from watchdog.trainer.model import ModelConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TrainConfig(batch_size=1, device="cpu",
                         model=ModelConfig(depth=1, width=16, heads=1, seq_len=8, activation_checkpointing="none"))
    state = build_state(config, torch.device("cpu"))
    data = TokenSource(batch_size=1, seq_len=8, vocab_size=config.model.vocab_size, seed=0)
    step = 0
    phases = []
    with Watchdog(WatchdogConfig(sample_every=1, memory_limit_bytes=64 << 30)) as watchdog, \
            serve_metrics(watchdog.telemetry, 0) as server:
        for name, mode in PHASES:
            child = None
            if mode is not None:
                child = subprocess.Popen([sys.executable, "-m", "watchdog.bench.scrape_storm", "--serve-as-clients",
                                          server.addr, str(server.port), mode, str(clients)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert child.stdout.readline().strip() == "ready"
                time.sleep(1.0)  # let every client reach the server before counting
            peaks = _Peaks()
            first, started = step, time.perf_counter()
            while time.perf_counter() - started < phase_seconds:
                batch = data.batch_at(step)
                train_step(state, batch.tokens, batch.targets, lambda optimizer: optimizer.step())
                watchdog.step(step)
                step += 1
            seconds = time.perf_counter() - started
            peaks.stop()
            counts = {}
            if child is not None:
                counts = json.loads(child.communicate("stop\n", timeout=60)[0].strip().splitlines()[-1])
            phases.append(Phase(name, step - first, seconds, peaks.threads, peaks.fds, counts))
            print(f"{name:12s} {phases[-1].rate:7.1f} steps/s  threads <= {peaks.threads:3d}  fds <= {peaks.fds:3d}"
                  + (f"  clients: {counts}" if counts else ""), flush=True)
    return phases


MAX_CLIENTS = 1000  # one process's clients, each a connection: within the usual 1,024 descriptors


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.scrape_storm", description=__doc__.splitlines()[0])
    made.add_argument("--clients", type=option(whole_in(1, MAX_CLIENTS, "a number of clients")), default=200,
                      help=f"clients of the storm, 1 to {MAX_CLIENTS:,} (default 200)")
    made.add_argument("--phase-seconds", type=option(decimal_in(0.1, 86_400, "a number of seconds")), default=20.0,
                      help="seconds per phase, 0.1 to 86,400 (default 20)")
    return made


def _clients_parser() -> argparse.ArgumentParser:
    """The storm's own child: `--serve-as-clients HOST PORT MODE CLIENTS`, as `storm` starts it."""
    made = OneLineParser(prog="python -m watchdog.bench.scrape_storm --serve-as-clients")
    made.add_argument("host")
    made.add_argument("port", type=option(parse_port))
    made.add_argument("mode", choices=[mode for _, mode in PHASES if mode])
    made.add_argument("clients", type=option(whole_in(1, MAX_CLIENTS, "a number of clients")))
    return made


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--serve-as-clients"]:
        child = _clients_parser().parse_args(argv[1:])
        asyncio.run(_clients(child.host, child.port, child.mode, child.clients))
        return 0
    args = parser().parse_args(argv)
    from watchdog.logs import configure_logging

    configure_logging("json", level="WARNING")
    phases = storm(args.clients, args.phase_seconds)
    quiet = sum(p.steps for p in phases if p.name.startswith("quiet")) / sum(
        p.seconds for p in phases if p.name.startswith("quiet"))
    for phase in phases:
        if not phase.name.startswith("quiet"):
            print(f"{phase.name}: {phase.rate:.1f} steps/s against {quiet:.1f} quiet "
                  f"({phase.rate / quiet:.1%} of it) with {args.clients} clients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
