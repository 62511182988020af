"""A throwaway local monitoring stack: a real Prometheus scraping a real watched run.

Used by the end-to-end test (tests/test_prometheus_e2e.py) and by the dashboard picture
(deploy/grafana/snapshot.py), so both look at the same thing. The Prometheus configuration and
rules are derived from the shipped deploy/prometheus/prometheus.yml and rules.yml (faster
scrapes, shorter `for:`), never written by hand, so what is tested is what ships.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's own watchdog package
from watchdog.fileio import write_atomically  # noqa: E402 - every file is written whole, through one helper

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RULES_FILE = HERE / "rules.yml"
CONFIG_FILE = HERE / "prometheus.yml"
PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"
JOB = "hbm-watchdog"
METRICS_LINE = re.compile(r"metrics: (http://\S+/metrics)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast_rules(source: Path = RULES_FILE, hold: str = "1s") -> dict:
    """rules.yml with every `for:` cut to `hold`, so a short run can see alerts fire."""
    rules = yaml.safe_load(source.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule and "for" in rule:
                rule["for"] = hold
    return rules


def fast_config(targets: list[str], rules_path: Path, interval: str = "1s") -> dict:
    """prometheus.yml with the given targets, 1s scrapes and evaluations, and the given rules."""
    config = yaml.safe_load(CONFIG_FILE.read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval)
    config["rule_files"] = [str(rules_path)]
    (job,) = [c for c in config["scrape_configs"] if c["job_name"] == JOB]
    job["static_configs"] = [{"targets": targets}]
    return config


class PrometheusError(RuntimeError):
    pass


@dataclass
class Prometheus:
    """A Prometheus process on loopback with its own data directory; `stop()` always cleans up."""

    workdir: Path
    targets: list[str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    external_url: str | None = None  # query an existing server instead (start() is then not called)

    @classmethod
    def existing(cls, url: str) -> "Prometheus":
        return cls(Path("."), [], external_url=url.rstrip("/"))

    @property
    def url(self) -> str:
        return self.external_url or f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "Prometheus":
        self.workdir.mkdir(parents=True, exist_ok=True)
        rules_path = self.workdir / "rules.yml"
        write_atomically(rules_path, yaml.safe_dump(fast_rules(), sort_keys=False))
        config_path = self.workdir / "prometheus.yml"
        write_atomically(config_path, yaml.safe_dump(fast_config(self.targets, rules_path), sort_keys=False))
        log = open(self.workdir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [PROMETHEUS_BIN, f"--config.file={config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_until(lambda: self._ready(), timeout, "Prometheus to become ready", self.log_tail)
        return self

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise PrometheusError(f"Prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def api(self, path: str, **params: object) -> object:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]  # type: ignore[index]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]  # type: ignore[index]

    def firing(self) -> set[str]:
        return {r["metric"]["alertname"] for r in self.query('ALERTS{alertstate="firing"}')}

    def stop(self) -> None:
        stop_process(self.process)


@dataclass
class WatchedRun:
    """A training process that prints `metrics: URL`; its output is kept (bounded) for diagnostics."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    metrics_url: str | None = None
    output: deque = field(default_factory=lambda: deque(maxlen=200))

    def start(self, timeout: float = 90.0) -> "WatchedRun":
        found = threading.Event()
        env = {k: v for k, v in os.environ.items() if k != "HBMWATCH_RESTART_COUNT"}  # a fresh job
        self.process = subprocess.Popen(self.command, cwd=REPO, env={**env, **self.env},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)

        def pump() -> None:  # keep reading so the child never blocks on a full pipe
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                self.output.append(line.rstrip())
                match = METRICS_LINE.search(line)
                if match and self.metrics_url is None:
                    self.metrics_url = match.group(1)
                    found.set()

        threading.Thread(target=pump, name="run-output", daemon=True).start()
        wait_until(lambda: found.is_set() or self.process.poll() is not None, timeout,
                   "the run to print its metrics URL", self.tail)
        if self.metrics_url is None:
            raise RuntimeError(f"run exited with {self.process.returncode} before serving metrics:\n{self.tail()}")
        return self

    @property
    def target(self) -> str:
        assert self.metrics_url is not None
        return urllib.parse.urlsplit(self.metrics_url).netloc

    def tail(self, lines: int = 40) -> str:
        return "\n".join(list(self.output)[-lines:])

    def stop(self) -> None:
        stop_process(self.process)


# The demo run: the instrumented trainer on torch_xla (PJRT CPU, where device buffers live in
# host memory and the watchdog reads RSS) with device tensors leaked every step. The budget sits
# about 450 MiB above the trainer's ~1 GiB footprint: the detector needs ~270 steps (~135 MiB of
# leak) to call the trend, and the footprint moves between runs (1.05 GiB after a reinit here,
# 1.20 GiB in one CI run), so with less room the limit rule acts while the detector still warms
# up, cycle after cycle, and no leak alert ever fires (CI, against a 1300 MiB budget).
DEMO_LEAK = "tensors:512KiB/step"
DEMO_MEMORY_LIMIT = "1500MiB"
DEMO_ENV = {"PJRT_DEVICE": "CPU"}


def leaking_trainer_command(steps: int, leak: str = DEMO_LEAK, memory_limit: str = DEMO_MEMORY_LIMIT) -> list[str]:
    """`hbm-watchdog train` with an injected leak, serving metrics on a free port."""
    return [sys.executable, "-m", "watchdog", "--log-format", "json", "train", "--steps", str(steps),
            "--inject-leak", leak, "--memory-limit", memory_limit, "--sample-every", "1",
            "--metrics-port", "0"]


def wait_until(condition, timeout: float, what: str, diagnostics=lambda: "", interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{diagnostics()}")


def stop_process(process: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM the process group we started, then SIGKILL it if it lingers."""
    if process is None or process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
