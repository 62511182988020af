"""The job file: this process's share of the job's time, appended as it goes, for goodput.

Every process of a job (each one a supervisor starts, and the reinits inside them) appends to one
file: `HBMWATCH_JOB_FILE` (supervise sets it), else `<trace>.job.jsonl` beside the trace. The
records and their accounting are `core/goodput.py`'s; this module only measures and writes. The
instrumented trainer keeps its own `JobLedger` (training steps, restores, periodic saves); any
other loop gets one from its `Watchdog` (`LoopAccount`, below). One process writes one account
to a file: the first ledger to `begin` there claims it for the process (`claimed_here`).

- `begin`: the process's start (its creation time, so imports and the runtime's start count),
  the step it starts from, the checkpoint restore it did, and its start-up;
- `step_done`: training steps, written as one stretch every `flush_seconds` (and before any span)
  with the compile time XLA spent inside it, so a crash loses at most that stretch's record;
- `span`: a checkpoint save, a reinit, an evaluation: timed, written when it ends;
- `action`, `end`: what the watchdog did, with the OOM it projected, and how the process ended.

Times partition the process: each stretch of steps runs from the end of the previous record to
the step boundary, so steps and spans never overlap (spans do not nest). A write error is
telemetry's, never training's: the file is dropped for the rest of the process and said once.
The newest account is the ledger's own figures (`GoodputFigures`, one per series), for `/metrics`:
`hbmwatch_elapsed_seconds_total`, `hbmwatch_goodput_seconds_total`, `hbmwatch_badput_seconds_total{cause}`.

Only a job file is ever written, cut or read for the account (`_claimed`): a file created new, an
empty one, or one whose every line is a job record (what this project always wrote), opened
without following a link (O_NOFOLLOW) and checked on the descriptor that is then written. A link,
a FIFO, a device, or a file holding anything else is an InputError naming the path and the line
(never its text), and is left exactly as it was: nothing is cut before the whole file is known
to be ours.
"""

from __future__ import annotations

import io
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from watchdog.core import goodput, strict_json
from watchdog.core.errors import InputError
from watchdog.core.inputs import open_regular
from watchdog.logs import get_logger
from watchdog.station.exporter import BASE_LABELS, PREFIX, counter_family
from watchdog.station.telemetry import Telemetry

log = get_logger(__name__)

JOB_FILE_ENV = "HBMWATCH_JOB_FILE"
FLUSH_SECONDS = 30.0
_BEGUN: set[tuple[int, str]] = set()  # (pid, job file) where a ledger of this process began: one account each


def claimed_here(path: Path) -> bool:
    """Whether a ledger of this process already keeps its account in `path` (the trainer's, when its
    `Watchdog` comes to open one): a process is one `process` record, never two."""
    return (os.getpid(), os.path.abspath(path)) in _BEGUN


def path_for(trace_file: str | os.PathLike | None) -> Path | None:
    """`HBMWATCH_JOB_FILE`, else beside the trace, else none (no trace: no job file)."""
    override = os.environ.get(JOB_FILE_ENV)
    if override:
        return Path(override)
    return Path(goodput.path_beside(trace_file)) if trace_file is not None else None


def process_started(pid: int | str = "self") -> float:
    """A process's creation time (Unix seconds; this one's by default): start-up counts from there,
    imports included.

    Read as the kernel's seconds since boot at the process's start against the seconds since boot
    now, both to 10 ms. Not psutil's create_time: it adds the boot time, which the kernel gives in
    whole seconds, so a restarted process could seem to start up to a second before the one it
    replaced wrote its last line (seen here: 0.06 s before it), and the job's disruption read 0."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as handle:
            uptime = float(handle.read().split()[0])
        since_start = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks
        return time.time() - max(0.0, since_start)
    except (OSError, ValueError, IndexError):  # not Linux: the process's start is the ledger's creation
        return time.time()


def _claimed(handle: IO[bytes], path: Path) -> tuple[list[dict], int | None]:
    """The records of a job file of ours, and where its torn last line starts (None: none torn).

    Ours: empty, or every complete line a job record, or (killed while writing its first line)
    only the start of one. Anything else is an InputError naming the path and the line."""
    where = f"job file {path}"
    handle.seek(0)
    first = handle.readline(goodput.MAX_LINE_CHARS + 2)  # bounded: a foreign file is refused on its first line
    if not first:
        return [], None
    text = first.decode("utf-8", errors="replace")
    try:
        if not text.endswith(("\n", "\r")) and len(text) <= goodput.MAX_LINE_CHARS:
            if goodput.could_be_a_torn_record(text):
                return [], 0  # its only line, torn: ours
            raise InputError(f"{where}:1: not a job record")
        if not list(goodput.parse_lines([text], where)):  # we never write a blank line
            raise InputError(f"{where}:1: not a job record")
        handle.seek(0)
        data = handle.read()
        records = list(goodput.parse_lines(io.StringIO(data.decode("utf-8", errors="replace"), newline=""), where))
    except InputError as exc:
        raise InputError(f"{exc}: not a job file, left as it is") from None
    torn = None if data.endswith((b"\n", b"\r")) else max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    return records, torn


def existing_records(path: Path) -> list[dict]:
    """What earlier processes of the job wrote to `path` ([] where there is no file yet); an
    InputError for a file that is not a job file. Reads only: nothing is created or cut."""
    try:
        with open_regular(path, "rb", follow_symlinks=False, what="job file ") as handle:
            return _claimed(handle, path)[0]
    except (FileNotFoundError, NotADirectoryError):
        return []  # a folder that is a file: every write will fail, and say so
    except OSError as exc:
        raise InputError(f"job file {path}: {exc.strerror or exc}") from None


def _open_to_append(path: Path, *, make_folder: bool = True) -> IO[bytes]:
    """The job file opened to append (created if absent, in a folder made for it unless
    `make_folder` is off), never through a link, its torn last line cut: only once the descriptor is
    known to be a regular file and its contents a job file's."""
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    handle = open_regular(path, "a+b", follow_symlinks=False, what="job file ")
    try:
        _, torn = _claimed(handle, path)
        if torn is not None:
            handle.truncate(torn)
        return handle
    except BaseException:
        handle.close()
        raise


def append_records(path: Path, records: list[dict]) -> None:
    """Append whole records (`{"event": ..., "t": ..., ...}`) to a job file of ours, created if absent
    (`watch`, for a target that keeps no account of its own); OSError or InputError as they come.
    Never in a folder that is gone: the job file's folder is its owner's (supervise's temporary one
    is removed when the job ends), and made again by a late writer it was left behind, job after job
    (FileNotFoundError instead)."""
    lines = [strict_json.dumps({"v": goodput.VERSION, **record}) + "\n" for record in records]
    with _open_to_append(path, make_folder=False) as handle:
        handle.write("".join(lines).encode("utf-8"))


def start_job(path: Path) -> None:
    """Mark a new job in `path` (supervise, at its start): the account reads from the newest mark."""
    with _open_to_append(path) as handle:
        handle.write((strict_json.dumps({"v": goodput.VERSION, "event": "job", "t": time.time()}) + "\n").encode("utf-8"))


class GoodputFigures:
    """The job's time so far, across its processes and reinits (core/goodput.py); None: no job file.

    Job totals, not this process's: a new process starts from what the job file holds (a reset
    to Prometheus, as any restart). The share is goodput over elapsed; badput is by cause."""

    def __init__(self, labels: Callable[[], list[str]]):
        self._labels = labels
        self.account: goodput.Account | None = None  # replaced whole at every record the ledger writes

    def collect(self) -> Iterator[Metric]:
        account, labels = self.account, self._labels()
        if account is None:
            return
        yield from counter_family("elapsed_seconds", "Wall-clock seconds of the job so far, every process and the "
                                  "gaps between them.", labels, max(0.0, account.elapsed_seconds))
        yield from counter_family("goodput_seconds", "Seconds of training steps whose progress the job kept.",
                                  labels, max(0.0, account.productive_seconds))
        badput = CounterMetricFamily(PREFIX + "badput_seconds", "Seconds of the job not spent on kept training "
                                     "progress, by cause (start-up, recompilation, checkpoint save and restore, "
                                     "reinit, evaluation, steps redone, time between processes, other).",
                                     labels=(*BASE_LABELS, "cause"))
        for cause, seconds in account.badput_seconds.items():
            badput.add_metric([*labels, cause], max(0.0, seconds))
        yield badput


class JobLedger:
    def __init__(self, path: Path, *, checkpoint_every: int = 0, flush_seconds: float = FLUSH_SECONDS,
                 compile_seconds: Callable[[], float | None] = lambda: None, telemetry: Telemetry | None = None,
                 started: float | None = None):
        """`compile_seconds`: XLA's total compile time so far in this process (None off XLA).
        `telemetry`: given, the ledger's figures (`GoodputFigures`) are served with its series."""
        self.path = path
        self.checkpoint_every = checkpoint_every
        self.flush_seconds = flush_seconds
        self._compile_seconds = compile_seconds
        self._figures = telemetry.part(GoodputFigures) if telemetry is not None else None
        self._started = process_started() if started is None else started
        self._records = self._earlier_records()
        self._handle: IO[bytes] | None = None
        self._broken = False
        self._mark = self._mark_compile = 0.0
        self._first = self._last = 0  # the pending stretch of steps: [first, last)

    # -- what the trainer tells it --

    def begin(self, step: int, *, restore_seconds: float = 0.0) -> None:
        """The process is ready to train from `step` (after restoring a checkpoint in `restore_seconds`)."""
        now = time.time()
        _BEGUN.add((os.getpid(), os.path.abspath(self.path)))
        self._write("process", pid=os.getpid(), started=self._started, step=step,
                    checkpoint_every=self.checkpoint_every)
        if restore_seconds > 0:
            self._write("span", cause="checkpoint_restore", seconds=restore_seconds, step=step)
        self._write("span", cause="startup", seconds=max(0.0, now - self._started - restore_seconds), step=step)
        self._restart_clock(step)

    def step_done(self, steps_completed: int) -> None:
        self._last = steps_completed
        if time.perf_counter() - self._mark >= self.flush_seconds:
            self._flush_steps()

    @contextmanager
    def span(self, cause: str, step: int) -> Iterator[None]:
        """Time what runs inside as `cause` (checkpoint_save, reinit, eval); the steps before it are written first."""
        self._flush_steps()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._write("span", cause=cause, seconds=time.perf_counter() - started, step=step)
            self._restart_clock(self._last)

    def due(self) -> bool:
        """A stretch of steps is due to be written (any thread may ask: one float read)."""
        return time.perf_counter() - self._mark >= self.flush_seconds

    def pause(self, steps_completed: int) -> None:
        """Steps stop at `steps_completed` for a span its caller times (an evaluation): written now."""
        self._last = max(self._last, steps_completed)
        self._flush_steps()

    def spent(self, cause: str, seconds: float, resume_at: int) -> None:
        """A span its caller timed, ended now (after `pause`); steps go on from `resume_at`."""
        self._write("span", cause=cause, seconds=seconds, step=resume_at)
        self._restart_clock(resume_at)

    def action(self, kind: str, step: int, projected_oom_step: int | None) -> None:
        self._flush_steps()
        self._write("action", kind=kind, step=step, projected_oom_step=projected_oom_step)

    def end(self, how: str, step: int) -> None:
        self._flush_steps()
        self._write("end", how=how, step=step)
        self.close()

    def account(self) -> goodput.Account:
        return goodput.account(self._records)

    def close(self) -> None:
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError:
                pass
            self._handle = None

    # -- inside --

    def _restart_clock(self, step: int) -> None:
        self._mark, self._mark_compile = time.perf_counter(), self._compile_seconds() or 0.0
        self._first = self._last = step

    def _flush_steps(self) -> None:
        now, compiled = time.perf_counter(), self._compile_seconds() or 0.0
        if self._last > self._first:
            self._write("steps", first=self._first, last=self._last, seconds=now - self._mark,
                        compile_seconds=max(0.0, compiled - self._mark_compile))
            self._mark, self._mark_compile, self._first = now, compiled, self._last

    def _earlier_records(self) -> list[dict]:
        """What earlier processes of the job wrote (for a live account); a file that is not a job
        file is the user's error, and is left as it is."""
        return existing_records(self.path)

    def _write(self, event: str, **fields: Any) -> None:
        record = {"v": goodput.VERSION, "event": event, "t": time.time(), **fields}
        self._records.append(record)
        if self._figures is not None:
            self._figures.account = self.account()
        if self._broken:
            return
        try:
            if self._handle is None:
                self._handle = _open_to_append(self.path)
            self._handle.write((strict_json.dumps(record) + "\n").encode("utf-8"))
            self._handle.flush()
        except (OSError, InputError) as exc:
            self._broken = True
            log.error("job_file_write_failed", path=str(self.path), error=str(exc),
                      note="training goes on; goodput for this process stays in memory and on /metrics")


class LoopAccount:
    """A loop's share of the job file, kept by its `Watchdog` for any loop that drives one (a loop of
    one's own, Lightning, Hugging Face), on the training thread.

    The process begins at the loop's first `step()`: what came before (imports, the runtime, the
    loop's own restore) is its start-up. Its steps are the watchdog's counter, `step(n)` meaning n + 1
    steps done; a bounded phase (an evaluation) is an `eval` span, whose batches are no training
    steps; a checkpoint action is recorded when handed over, with the OOM it was decided against,
    and its save and rebuild (`carry_out`) are spans; `end` says how the process left (`stop()`, or
    any way out the `ExitWatch` sees). A stretch of steps is written when the sidecar finds one due
    (`due`, every 30 s) and before every other record. A loop that saves or rebuilds without
    `carry_out` has that time counted with its steps.
    """

    def __init__(self, ledger: JobLedger):
        self.ledger = ledger
        self._begun = False
        self._phase_started: float | None = None  # a bounded phase's start (perf_counter), while one runs
        self._phase_cause = "eval"  # what that phase's span is counted as
        self._ended = False  # ended, or the job file is kept by another ledger of this process (the trainer's)

    @classmethod
    def open(cls, path: Path | None, **ledger_options: Any) -> "LoopAccount | None":
        """The account for `path` (None: no job file named); a file that is not a job file is an
        InputError now, before anything is written."""
        return None if path is None else cls(JobLedger(path, **ledger_options))

    def between_steps(self, step: int) -> None:
        """`step(step)` was the newest: the process begins at the first (unless a ledger of this
        process keeps the file already: then this account writes nothing), and a stretch of steps
        up to it is written when one is due."""
        if not self._begun:
            self._begun = True
            if claimed_here(self.ledger.path):
                self._ended = True
            else:
                self.ledger.begin(step)
        elif self._phase_started is None and not self._ended:
            self.ledger.step_done(step + 1)

    def due(self) -> bool:
        return self._begun and self._phase_started is None and not self._ended and self.ledger.due()

    def phase(self, bounded: bool, step: int, cause: str = "eval") -> None:
        """The loop's phase changed after `step(step)`: a bounded one starts a span of `cause` (an
        `eval`; a save's phase, `checkpoint_save`), its end closes it (the next training step is
        `step + 1`)."""
        if self._ended or not self._begun:
            return
        if bounded and self._phase_started is None:
            self.ledger.pause(step + 1)
            self._phase_started, self._phase_cause = time.perf_counter(), cause
        elif not bounded and self._phase_started is not None:
            self.ledger.spent(self._phase_cause, time.perf_counter() - self._phase_started, step + 1)
            self._phase_started = None

    def timed(self, cause: str, step: int):
        """A span the action path times (`checkpoint_save`, `reinit`) after `step(step)`."""
        if self._ended or not self._begun:
            return nullcontext()
        self.between_steps(step)
        return self.ledger.span(cause, step + 1)

    def action(self, kind: str, step: int, projected_oom_step: int | None) -> None:
        if self._begun and not self._ended:
            self.between_steps(step)
            self.ledger.action(kind, step + 1, projected_oom_step)

    def end(self, how: str, step: int) -> None:
        """How the process left, after `step(step)`: written once (nothing before its first step)."""
        if self._ended or not self._begun:
            self._ended = True
            return
        self.phase(False, step)
        self.between_steps(step)
        self._ended = True
        self.ledger.end(how, step + 1)
