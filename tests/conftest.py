"""Shared helpers for tests that run `hbm-watchdog` as a real process."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import hypothesis
import pytest
import warm_children

pytest_plugins = ("pytester",)  # tests/test_lanes.py runs small suites under this conftest

# Property tests explore new examples on a developer's machine; under CI they draw the same ones
# every run, so a red CI is a failure anyone can reproduce, not a draw that the next run misses.
hypothesis.settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")

REPO = Path(__file__).resolve().parents[1]

# The suite starts several hundred Python processes, each importing watchdog, and every xdist
# worker rewrites the test modules' asserts. With PYTHONDONTWRITEBYTECODE set (container images
# often set it), each of them compiles all of that from source again: about 0.3 s per child and
# 8 s per worker here. The caches go to the checkout's own (git-ignored) __pycache__ folders.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Every torch_xla program in the suite, in process or in a child (they inherit the environment),
# compiles with the XLA CPU backend's optimisation level 1 instead of its default 2. Compiling
# the trainer's step is most of what a short trainer run costs here (about 25 CPU-s at 2 against
# 15 at 1, for 3 steps), while a step runs no slower at 1 and computes the same losses bit for
# bit; PJRT CPU cannot reuse compiled programs across processes (no executable deserialisation),
# so a persistent cache is no help. A user's XLA_FLAGS choice of level is left alone.
# transformers and accelerate put a model on the XLA device by themselves whenever torch_xla is
# installed, deciding once, at import. In-process tests run Hugging Face on the CPU (a fast test must
# not start torch_xla's runtime); the XLA run is its own process, which sets USE_TORCH_XLA=1.
os.environ.setdefault("USE_TORCH_XLA", "0")

# One OpenMP thread per process: the suite runs one xdist worker per core, each starting children
# beside it. torch's CPU ops (the CPU trainer, Lightning and Hugging Face on the CPU) otherwise run a
# team of one thread per core, whose barriers spin-wait on a core the other worker holds. Measured
# here: two 300-step CPU trainer runs side by side took 48.5 s together, 8.5 s with one thread each;
# a CPU run beside an XLA run, 18.8 s against 9.2 (XLA's own runs are unaffected). A user's choice
# is left alone, and a child that sets its own keeps it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

XLA_TEST_FLAGS = "--xla_backend_optimization_level=1"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()


# The trainer's model for the end-to-end runs of hundreds of steps: one transformer block instead
# of two. On PJRT CPU a step's cost is mostly tracing its ops, so one block runs about twice the
# steps per second. The injected leak per step is the same; resident memory after compiling is about
# 45 MB lower (1.00 against 1.05 GB), which moves a 4 MiB/step run's OOM about 11 steps later.
ONE_BLOCK = ["--depth", "1"]


def settled_job_memory() -> int:
    """The job's memory (this process and its children, each page counted once, as the watchdog
    judges it) once garbage is collected and freed pages are handed back: the base of an in-process
    test's budget, so an earlier test's garbage freed mid-test does not widen the room the test
    meant to give."""
    import gc

    from watchdog.readers.host_memory import job_memory
    from watchdog.readers.sources import release_host_memory

    gc.collect()
    release_host_memory()
    return job_memory()


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A new memory cgroup limited to `limit_bytes` (cgroup v2, else v1's memory controller); yields
    the path of its `cgroup.procs`. Skips where this machine lets no one make one."""
    name = f"hbm-watchdog-test-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup")
    candidates = []
    if "memory" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else False:
        candidates.append((v2 / name, "memory.max"))
    if (v2 / "memory" / "memory.limit_in_bytes").exists():
        candidates.append((v2 / "memory" / name, "memory.limit_in_bytes"))
    reasons = []
    for path, limit_file in candidates:
        try:
            path.mkdir()
        except OSError as exc:
            reasons.append(f"{path}: {exc.strerror}")
            continue
        try:
            (path / limit_file).write_text(str(limit_bytes))
            yield path / "cgroup.procs"
            return
        finally:
            for _ in range(50):  # the killed or exited child may take a moment to leave it
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
    pytest.skip("no memory cgroup can be made here: " + ("; ".join(reasons) or "no memory controller mounted"))


def kernel_count(pid: int | None = None) -> int:
    """The job's memory as the kernel counts it, read here independently of the watchdog's reader:
    the process and every descendant psutil finds, each one's `Pss_Anon + Pss_Shmem` from its
    `smaps_rollup` (every page once; file-backed pages left out)."""
    import psutil

    root = psutil.Process(pid)
    return sum(own_count(process.pid) for process in [root, *root.children(recursive=True)])


def own_count(pid: int) -> int:
    """One process's share of its anonymous and shared pages (`Pss_Anon + Pss_Shmem`); 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    kib = dict((line.split(":")[0], int(line.split()[1])) for line in text.splitlines()[1:] if line.strip())
    return (kib.get("Pss_Anon", 0) + kib.get("Pss_Shmem", 0)) * 1024


def hbm_watchdog_env(**extra: str) -> dict[str, str]:
    """The environment for a child `hbm-watchdog`: torch_xla on PJRT CPU, JSON logs, repo importable."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(REPO)}
    for name in ("HBMWATCH_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)  # each child is a first start unless its test says otherwise
    for name in ("PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE", "PT_XLA_DEBUG_MAX_FRAME", "HBMWATCH_COMPILE_ANALYSIS_PID"):
        env.pop(name, None)  # each child decides its own compile analysis
    env.update(extra)
    return env


def run_python(code: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None,
               fresh: bool = False) -> str:
    """Run `python -c CODE ARGS...` in a new process and return its stdout.

    torch_xla's runtime starts once per process, so each XLA scenario gets its own. A child that
    exits non-zero fails the calling test with the tail of its stderr.
    """
    return run_python_args(["-c", code, *args], timeout=timeout, env=env, fresh=fresh).stdout


def run_python_args(args: list[str], *, timeout: float = 300, env: dict[str, str] | None = None,
                    fresh: bool = False) -> subprocess.CompletedProcess:
    """`python ARGS...` in a new process (a script file, where Python frames must name real lines).

    The process is forked from an interpreter that already imported torch (tests/warm_children.py),
    which saves each child 6 to 9 CPU-seconds. `fresh`: a new interpreter instead, for a test of
    what a program imports."""
    out = python(args, timeout=timeout, env=env, fresh=fresh)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def python(args: list[str], *, timeout: float, env: dict[str, str] | None = None, fresh: bool = False
           ) -> subprocess.CompletedProcess:
    """`python ARGS...` run to its end with its output captured, warm unless `fresh` (run_python_args)."""
    env = env or hbm_watchdog_env()
    if not fresh and warm_children.can_fork(env):
        return warm_children.run(args, env=env, cwd=str(REPO), timeout=timeout)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


def torchrun(job: Path, out: Path, *args: str, ranks: int = 2, max_restarts: int = 2,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchrun --standalone` of a script in tests/jobs with `ranks` processes, each rank's stdout and
    stderr under out/logs/<run>/attempt_<N>/<rank>/; a group still running after `timeout` seconds
    is killed whole and fails the test (a hang is a failure, never a stuck suite).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch 2.5-2.9 reuse one rendezvous store across torchrun's
    restarts, and a restarted gloo group could read the previous attempt's addresses from it (seen
    here: a connection refused in init_process_group, or a group that never formed)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.5", f"--log-dir={out / 'logs'}",
               "--redirects=3", str(job), str(out), *args]
    env = hbm_watchdog_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", USE_TORCH_XLA="0")
    with subprocess.Popen(command, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as group:
        try:
            output, _ = group.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(group.pid, signal.SIGKILL)
            output, _ = group.communicate()
            pytest.fail(f"torchrun {job.name} {' '.join(args)} still running after {timeout:g} s: "
                        f"{output[-2000:]}")
    return subprocess.CompletedProcess(command, group.returncode, output, "")


def rank_logs(out: Path, rank: int, attempt: int) -> list[dict]:
    """The JSON log records of one rank in one attempt of a `torchrun` run."""
    (path,) = out.glob(f"logs/*/attempt_{attempt}/{rank}/stderr.log")
    return json_lines(path.read_text())


def logged(source: "list[dict] | str | subprocess.CompletedProcess", name: str) -> list[dict]:
    """The log records of event `name`, from records, a log's text, or a finished child's stderr."""
    if isinstance(source, subprocess.CompletedProcess):
        source = source.stderr
    records = json_lines(source) if isinstance(source, str) else source
    return [r for r in records if r.get("event") == name]


def json_lines(text: str) -> list[dict]:
    """The structured log records in a child's stderr (other lines are skipped)."""
    records = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def watchdog_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None, json_logs: bool = True
                 ) -> subprocess.CompletedProcess:
    """`hbm-watchdog [--log-format json] ARGS...` in a new process, warm as run_python_args; returns
    the CompletedProcess whatever its exit status."""
    return python(["-m", "watchdog", *(["--log-format", "json"] if json_logs else []), *args], timeout=timeout, env=env)


@pytest.fixture
def run_cli():
    """watchdog_cli, for a test that takes it as a fixture."""
    return watchdog_cli


HANG_GUARD_SECONDS = 60.0  # a bound for a call that should return at once: a hang guard, not a timing


def without_hanging(call, fifo: Path | None = None):
    """`call()`'s result, or the exception it raised, once it has returned; fails the test if it has
    not within HANG_GUARD_SECONDS (run in a daemon thread, so a regression cannot hang the suite).
    `fifo`: a FIFO a stuck call may be waiting on in open(), released on failure so the thread ends."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_SECONDS)
    if thread.is_alive():
        if fifo is not None and fifo.is_fifo():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{call} did not return within {HANG_GUARD_SECONDS:g} s")
    return outcome["error"] if "error" in outcome else outcome["result"]


def pytest_collection_modifyitems(config, items):
    """Long runs first, spread over the workers; then the other slow tests; the fast ones last, and
    of those the ones that use the bench corpora at the very end (`_group`).

    pytest-xdist's work stealing first hands each worker an equal, consecutive share of this order,
    and an idle worker later steals from the end of a busy one's queue. A long run (`long`: a
    minute or more) left in the middle of one share stays there while the short ones around it
    are stolen, and the run ends with that worker alone. So each share starts with its own turn
    of the long runs, and what is stolen from its end is short. Every worker orders the same items
    the same way (xdist requires it); without workers it is the plain order: long, slow, fast."""
    items.sort(key=_group)  # stable: the files' own order within each group
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    long_runs = [item for item in items if _group(item) == 0]
    if workers > 1 and long_runs:
        items[:] = _long_runs_at_each_share_start(long_runs, items[len(long_runs):], workers)


def pytest_collection_finish(session):
    """Everything collection imported (torch, torch_xla, Lightning, the test modules: half a million
    objects that live until the worker ends) goes to the garbage collector's permanent generation.
    Every later collection, and every census the forensics take (`gc.get_objects`,
    `gc.get_referrers`), would walk it again: the forensics tests took 3-5 s each instead of 1.
    What a test creates is tracked as before; a test whose holder must be found by a census
    creates that holder itself (a frozen container is invisible to `gc.get_referrers`)."""
    gc.collect()
    gc.freeze()


FAST_LANE = "not slow"
_WHOLLY_SLOW = re.compile(r"^pytestmark\s*=\s*(\[[^\]]*)?pytest\.mark\.slow\b", re.M)


def pytest_ignore_collect(collection_path, config):
    """In the fast lane, a test module marked slow as a whole is not even imported: its imports
    (transformers alone is 4 s) would cost every worker that time for tests it then deselects."""
    if (config.getoption("markexpr", "").strip() == FAST_LANE and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and _WHOLLY_SLOW.search(collection_path.read_text())):
        return True
    return None


_CORPORA = frozenset({"synthetic_corpus_0", "real_corpus_shipped"})  # the session fixtures below


def _group(item) -> int:
    if item.get_closest_marker("long") is not None:
        return 0
    if item.get_closest_marker("slow") is not None:
        return 1
    # The bench corpora (1.5 million samples, alive for the rest of the worker's session) are built
    # after `pytest_collection_finish` froze the rest, so collections and censuses walk them: the
    # tests that use them go last, when nothing is left to slow down.
    return 3 if _uses_a_corpus(item) else 2


def _uses_a_corpus(item) -> bool:
    """The test asks for a corpus fixture, directly or as a parameter naming it (`getfixturevalue`)."""
    params = getattr(getattr(item, "callspec", None), "params", {}).values()
    return bool(_CORPORA.intersection(getattr(item, "fixturenames", ()))
                or _CORPORA.intersection(p for p in params if isinstance(p, str)))


def _long_runs_at_each_share_start(long_runs: list, rest: list, workers: int) -> list:
    """The order whose consecutive shares, cut as xdist's work stealing cuts them (what is left,
    divided by the workers left), each begin with every `workers`-th long run."""
    ordered, left, others = [], len(long_runs) + len(rest), iter(rest)
    for share in range(workers):
        size = left // (workers - share)
        own = long_runs[share::workers]
        if len(own) > size:  # fewer tests than long runs to spread: nothing to balance
            return long_runs + rest
        ordered += own + [item for _, item in zip(range(size - len(own)), others)]
        left -= size
    return ordered + list(others)


class ProcessInFastTest(AssertionError):
    """A test that starts a process or the XLA runtime must be marked slow, so `pytest -m "not slow"` stays fast."""


def _xla_runtime_started() -> bool:
    """Whether this process has started torch_xla's runtime (a PJRT client); never imports torch_xla itself."""
    torch_xla = sys.modules.get("torch_xla")
    return torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized()


@pytest.fixture(autouse=True)
def _processes_only_in_slow_tests(request, monkeypatch):
    """Enforce the marker instead of trusting it: an unmarked test that starts a process, or that starts
    torch_xla's runtime in this process (seconds, and a PJRT client for the rest of the worker's life), fails."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    warm_children.stop()  # fast tests come last; some measure this process's tree, which holds the server
    import multiprocessing.process

    def refuse(*_args, **_kwargs):
        raise ProcessInFastTest(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    runtime_before = _xla_runtime_started()
    yield
    if not runtime_before and _xla_runtime_started():
        raise ProcessInFastTest(f"{request.node.nodeid} starts torch_xla's runtime: mark it @pytest.mark.slow")


# ------------------------------------------------------------------------ the watchdog's log events

class WatchdogEvents(logging.Handler):
    """The structured events every `watchdog.*` logger emits, as dicts, for tests to read."""

    def __init__(self):
        super().__init__()
        self.events: list[dict] = []

    def emit(self, record):
        if isinstance(record.msg, dict):
            self.events.append(record.msg)

    def named(self, name: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == name]


@pytest.fixture
def events():
    """Every event the watchdog logs during the test, at INFO and above."""
    handler, logger = WatchdogEvents(), logging.getLogger("watchdog")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


# ------------------------------------------------------------------------ one real run, many checks

def once_per_suite(tmp_path_factory, name: str, run: Callable[[Path], dict]) -> tuple[Path, dict]:
    """`run(folder)` once for the whole suite, whichever xdist worker asks first; every later caller,
    on any worker, gets the same folder and the JSON-able dict `run` returned.

    An end-to-end run costs a minute; several test files assert on its outputs (its screen, its
    log, its trace, its checkpoints). The first caller runs it under a file lock; the others wait
    on the lock, then read its outcome. A run that raises leaves nothing behind, so the next caller
    runs it again (and fails the same way, in its own test)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common root
    folder, outcome = shared / name, shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not outcome.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            result = run(folder)
            outcome.write_text(json.dumps(result))
    return folder, json.loads(outcome.read_text())


def run_on_a_pty(args: list[str], timeout: float = 600, columns: int = 160, rows: int = 400) -> tuple[int, bytes]:
    """Run a command with a pseudo-terminal of `columns` x `rows` as its stdin/stdout/stderr (so it
    takes the console path: progress bar, console logs, blocks); return its status and output."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))  # a real terminal has a size
    os.set_blocking(controller, False)
    env = hbm_watchdog_env(COLUMNS=str(columns), LINES=str(rows), TERM="xterm")
    child = subprocess.Popen(args, stdin=terminal, stdout=terminal, stderr=terminal, cwd=REPO, env=env,
                             start_new_session=True)
    os.close(terminal)
    output, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk and child.poll() is not None:
                break
            output += chunk
        elif child.poll() is not None:
            break
    else:
        child.kill()
    os.close(controller)
    return child.wait(timeout=30), bytes(output)


LEAK_CAUGHT_LIMIT = 2304 << 20  # 2.25 GiB: about 0.5 GiB of torch_xla's job memory plus ~440 steps of 4 MiB/step


@pytest.fixture(scope="session")
def leak_caught_on_a_terminal(tmp_path_factory) -> tuple[Path, dict]:
    """The quick start's run, as a person watches it: `train` with a 4 MiB/step `tensors` leak under
    a 2.25 GiB budget, 600 steps, on a pseudo-terminal, with its JSON log, trace, checkpoints and a
    metrics endpoint. Its folder holds `log.jsonl`, `trace.csv`, `ckpt/`; the dict, its exit status
    and its terminal output (`screen`, decoded bytes). Read by test_terminal.py (the screen) and
    test_trainer_e2e.py (the log and the trace).

    The run must outlast its OOM, or the watchdog rightly only warns (the run ends first): from
    about 0.5 GiB of job memory (each page once; its resident set near 1 GB counts torch_xla's
    libraries too), 4 MiB a step fills the budget near step 440 (the quick start's two blocks: 423),
    and at 420 steps one loaded run was warned and never checkpointed. At 600 steps the OOM falls
    inside the run for any start above 0.2 GiB, and the next one, after the reinit, past its end."""

    def run(folder: Path) -> dict:
        code, output = run_on_a_pty([
            sys.executable, "-m", "watchdog", "--log-file", str(folder / "log.jsonl"), "train", *ONE_BLOCK,
            "--steps", "600", "--inject-leak", "tensors:4MiB/step", "--memory-limit", str(LEAK_CAUGHT_LIMIT),
            "--sample-every", "5", "--log-every", "10", "--metrics-port", "0",
            "--checkpoint-dir", str(folder / "ckpt"), "--trace-file", str(folder / "trace.csv")])
        return {"exit_status": code, "output": output.decode("utf-8", "replace")}

    return once_per_suite(tmp_path_factory, "leak_caught_on_a_terminal", run)


# ------------------------------------------------------------------------ set-up paid once per worker

@pytest.fixture(scope="session")
def synthetic_corpus_0():
    """The bench's synthetic corpus, seed 0 (seconds to build): built once per worker, shared read-only."""
    from watchdog.bench.corpus import synthetic_corpus

    return tuple(synthetic_corpus(0))


@pytest.fixture(scope="session")
def real_corpus_shipped():
    """The real corpus from the copy shipped in the package: built once per worker, shared read-only."""
    from watchdog.bench.realtraces import real_corpus

    return tuple(real_corpus())


@pytest.fixture
def corpora_built_once(monkeypatch, synthetic_corpus_0, real_corpus_shipped):
    """`hbm-watchdog bench`, run in process, gets this worker's corpora for the default seed and
    data instead of drawing them again (about 12 s of the fast lane); other arguments draw as usual.
    What the command does with a corpus is unchanged; test_corpus.py checks the drawing itself."""
    from watchdog.bench import corpus, realtraces

    draw_synthetic, draw_real = corpus.synthetic_corpus, realtraces.real_corpus
    monkeypatch.setattr(corpus, "synthetic_corpus",
                        lambda seed: list(synthetic_corpus_0) if seed == 0 else draw_synthetic(seed))
    monkeypatch.setattr(realtraces, "real_corpus",
                        lambda path=None, seed=0: (list(real_corpus_shipped) if path is None and seed == 0
                                                   else draw_real(path, seed)))


# ------------------------------------------------------------------ the watch daemon, in process

class ThisProcess:
    """A finder that hands the daemon this test's own process (watched, never signalled)."""

    description = "this test process"
    comes_back = False

    def find(self):
        import psutil

        return psutil.Process()

    def why_not_found(self):
        return "never"

    def handover(self, watched):
        return None


def tick_per_read_daemon():
    """The daemon with one tick per reading and no waiting: what it judges is then exactly the
    script, step for step, however loaded the machine (a 1 ms axis skips ticks under load and
    stretches a scripted leak's rate per step). Tests of the time axis itself use `Daemon`."""
    from watchdog.daemon.loop import Daemon

    class TickPerRead(Daemon):
        def _sleep_until_next_tick(self, start: float, tick: int) -> int:
            return tick + 1

    return TickPerRead
