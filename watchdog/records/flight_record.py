"""The flight record: what the watchdog knew, on disk, whole, for when the process dies anyway.

A job killed by the kernel's OOM killer (SIGKILL) or an XLA abort leaves no Python traceback and
no log line of ours. What it leaves is this small JSON file next to the trace, rewritten
atomically (`fileio.write_atomically`: a temporary, fsync, rename) by the sidecar thread, never
the training thread:

- the process: PID, start time, command line, rank;
- the newest verdict and both signals, with the step each first went up;
- the newest `leak_suspects` (and whether creation sites were known), and those at the newest
  checkpoint action (`action_suspects`: after a reinit the newest census counts only what grew since);
- XLA's compile counter and the newest recompilation finding;
- `ended`: null while running (and after a SIGKILL), "clean" once the watchdog stopped in order
  (`sys.exit(42)` included), "unclean" once it saw a way out that was not (an exception, a signal);
- `stall`: null; while a stall watch with an exit bound runs, its deadline in C, "armed" (`armed`,
  `step` at start, `seconds`, `exit_code`, `training_thread`: the thread id faulthandler's dump on
  stderr names, `stacks`), since a loop that holds the GIL is ended from C, writing nothing of ours;
  or where every thread was when the watch itself ended a loop that stopped stepping (exit 43), and
  `waiting`: what its training thread waited for in the agreement, if it did (`step`, `ranks`).

A SIGKILL between two writes leaves the older record, never a torn one. It is rewritten when a
signal, an action or the suspects change, and otherwise at most every `min_interval_seconds`:
the cost is one small file write per few seconds, on the sidecar thread. `hbm-watchdog
postmortem` reads it with the trace. It is strict JSON (`core/strict_json.py`: a non-finite number is
null), read back bounded (nesting, integers, finite numbers); `postmortem` checks each field it
reads (`core/postmortem.py`'s `RECORD_FIELDS`: the one list of its fields, which the record is
also written from) before using any.

Only a flight record is ever replaced (`claim`, when the recorder is made): the path holds
nothing yet, an empty file, or a record of ours (`is_record`: what every version of this module
wrote). A link, a FIFO, a directory, or a file holding anything else is an InputError naming the
path (never its text), left as it was. A write the disk refuses is telemetry's: counted, tried
again at the next write, said once (`flight_record_write_failed`), never the run's exit status.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from watchdog.core.errors import InputError
from watchdog.core import strict_json
from watchdog.core.inputs import open_regular
from watchdog.core.postmortem import RECORD_FIELDS, record_problem
from watchdog.core.verdict import Verdict
from watchdog.fileio import write_atomically
from watchdog.logs import OncePerKind, get_logger

log = get_logger(__name__)

FLIGHT_RECORD_ENV = "HBMWATCH_FLIGHT_RECORD"  # a path that overrides the one beside the trace
SUFFIX = ".flight.json"
VERSION = 1
MAX_RECORD_BYTES = 64 << 20  # a record is a few KiB (the program's ops: tens); anything larger is not one
_KEYS = frozenset({"version", "process", "ended", "last_step"})  # in every record this module ever wrote


def path_for(trace_file: str | os.PathLike | None) -> Path | None:
    """Where the flight record goes: `HBMWATCH_FLIGHT_RECORD`, else beside the trace, else nowhere."""
    override = os.environ.get(FLIGHT_RECORD_ENV)
    if override:
        return Path(override)
    return Path(f"{trace_file}{SUFFIX}") if trace_file is not None else None


def is_record(record: Any) -> bool:
    """Whether parsed JSON is a flight record of ours."""
    return isinstance(record, dict) and record.get("version") == VERSION and _KEYS <= record.keys()


def _load(path: str | os.PathLike, *, follow_symlinks: bool = True, reading: bool = False) -> dict[str, Any] | None:
    """The record at `path`; None for an empty file; InputError (path and line only) for anything
    that is not a record of ours; OSError as it comes (no such file). `reading`: the error says what
    is wrong for a reader (`load`), not what the recorder leaves alone (`claim`)."""
    with open_regular(path, "rb", follow_symlinks=follow_symlinks, what="flight record ") as handle:
        data = handle.read(MAX_RECORD_BYTES + 1)
    if not data:
        return None
    where, problem = os.fspath(path), "not a flight record of this tool (version 1, with process, ended, last_step)"
    record = None
    if len(data) > MAX_RECORD_BYTES:
        problem = f"larger than {MAX_RECORD_BYTES:,} bytes: not a flight record"
    else:
        try:
            record = strict_json.loads(data)
        except strict_json.JsonProblem as exc:  # not JSON, nested too deep, a number out of range
            where, problem = f"{where}:{exc.line}" if exc.line else where, exc.problem
    if not is_record(record):
        if reading:
            raise InputError(f"flight record {where}: {problem}")
        raise InputError(f"flight record {os.fspath(path)}: exists and is not a flight record of this tool; "
                         f"left as it is (remove it, or name another path with {FLIGHT_RECORD_ENV})")
    return record


def load(path: str | os.PathLike) -> dict[str, Any] | None:
    """A flight record for a post-mortem: None where there is none (no file, an empty one); an
    InputError naming the path (and the line, where the text says) for a file that is not a record
    of ours, and naming the field for a record whose fields `postmortem` cannot use
    (`core.postmortem.RECORD_FIELDS`). Never quotes the file."""
    try:
        record = _load(path, reading=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise InputError(f"flight record {os.fspath(path)}: {exc.strerror or exc}") from None
    problem = record_problem(record) if record is not None else None
    if problem is not None:
        raise InputError(f"flight record {os.fspath(path)}: {problem}")
    return record


def claim(path: str | os.PathLike) -> None:
    """Check that the recorder may replace `path`: nothing there, an empty file or a flight record.
    InputError otherwise, with nothing touched; never follows a link."""
    try:
        _load(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there yet (or its folder is a file: every write fails, and says so once)
    except OSError as exc:
        raise InputError(f"flight record {os.fspath(path)}: {exc.strerror or exc}") from None


def _process_identity(rank: int) -> dict[str, Any]:
    started = None
    try:
        import psutil

        started = psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - the identity is best effort
        pass
    return {"pid": os.getpid(), "start_time": started, "command": list(sys.argv), "rank": rank}


def _verdict_fields(verdict: Verdict | None) -> dict[str, Any] | None:
    if verdict is None:
        return None
    return {"step": verdict.step, "status": verdict.status.value, "explanation": verdict.explanation,
            "floor_bytes": verdict.floor_bytes, "excursion_bytes": verdict.excursion_bytes,
            "limit_bytes": verdict.limit_bytes, "slope_bytes_per_step": verdict.slope_bytes_per_step,
            "projected_oom_step": verdict.projected_oom_step, "leak_reported": verdict.leak_detected,
            "oom_projected": verdict.oom_projected}


class FlightRecorder:
    """Keeps the record's state and writes it when it changed enough to matter (sidecar thread)."""

    def __init__(self, path: Path, *, rank: int = 0, trace_file: str | os.PathLike | None = None,
                 min_interval_seconds: float = 5.0):
        """InputError when `path` holds something other than a flight record (`claim`)."""
        claim(path)
        self.path = path
        self.min_interval_seconds = min_interval_seconds
        self._error_log = OncePerKind(log, "flight_record_write_failed", level="error")
        # Every field `RECORD_FIELDS` names, and no other: null until known, but for these.
        self._state: dict[str, Any] = dict.fromkeys(RECORD_FIELDS) | {
            "version": VERSION, "process": _process_identity(rank),
            "trace_file": os.path.abspath(trace_file) if trace_file is not None else None,  # read from anywhere
            "actions": {}, "suspects": [], "creation_sites": False, "program_sites": [],
        }
        self._written_at = 0.0
        self._key: tuple = ()
        self._host_key: tuple = ()

    def observe(self, step: int, verdict: Verdict, *, actions: dict[str, int], suspects=None,
                compilations: int | None = None, recompilation: dict | None = None) -> None:
        """Fold in what the sidecar knows after a sample; write if it changed what matters or the
        interval has passed."""
        state = self._state
        state["last_step"], state["verdict"] = step, _verdict_fields(verdict)
        if verdict.leak_detected and state["leak_reported_at"] is None:
            state["leak_reported_at"] = step
        if verdict.oom_projected and state["oom_projected_at"] is None:
            state["oom_projected_at"] = step
        state["actions"] = actions
        if suspects is not None:
            state["suspects"], state["suspects_step"] = list(suspects.lines), suspects.step
            state["creation_sites"] = suspects.creation_sites
        state["compilations"], state["recompilation"] = compilations, recompilation
        key = (verdict.status, verdict.leak_detected, tuple(sorted(actions.items())), state["suspects_step"],
               recompilation is not None, self._host_key)
        self._write_if_due(key)

    def observe_host(self, reading: Any, verdict: Verdict) -> None:
        """Fold in the host's newest reading (`HostReading`) and its verdict, with the first steps its
        two signals came up: what a post-mortem needs to tell a host OOM from a device one."""
        host = self._state["host"] or {"leak_reported_at": None, "oom_projected_at": None}
        host.update(reading.fields())
        host["verdict"] = _verdict_fields(verdict)
        if verdict.leak_detected and host["leak_reported_at"] is None:
            host["leak_reported_at"] = verdict.step
        if verdict.oom_projected and host["oom_projected_at"] is None:
            host["oom_projected_at"] = verdict.step
        self._state["host"] = host
        self._host_key = (verdict.status, verdict.leak_detected)

    def observe_program(self, ops: list[dict]) -> None:
        """The traced step's largest ops with their Python lines (`forensics.program_sites`): what lets
        a post-mortem name the user's line behind an allocation XLA's message names. Any thread: it
        replaces one key, and the sidecar's next write carries it."""
        self._state["program_sites"] = ops

    def observe_device_oom(self, device: int, requested: int, limit: int, free: int) -> None:
        """PyTorch's CUDA allocator is about to raise OutOfMemoryError (its OOM observer, on the thread
        that asked): what it was asked for, its limit (its share under
        `set_per_process_memory_fraction`, else the device's total: the observer's third argument)
        and what the device had free, written at once, as the process may be gone next."""
        self._state["device_oom"] = {"device": f"cuda:{device}", "requested_bytes": int(requested),
                                     "limit_bytes": int(limit), "free_bytes": int(free),
                                     "step": self._state["last_step"]}
        self._write(time.monotonic())

    def observe_action(self, step: int, suspects: list[str]) -> None:
        """What was leaking when a checkpoint action was handed over (training thread): after a
        reinit the newest census counts only what grew since, so a post-mortem keeps this one too.
        The sidecar's next write carries it."""
        self._state["action_suspects"] = {"step": step, "lines": list(suspects)}

    def stall_armed(self, record: dict | None) -> None:
        """The stall watch's deadline in C (`runtime/hard_exit.py`), which writes nothing of ours when
        it ends the process: said before, written at once (`stall` with `armed`), or taken back (None)
        when the watch stops or the process leaves in order, written at once too (a stall the watch
        recorded itself stays). So an armed record beside an exit 43 is the exit from C."""
        if record is not None:
            self._state["stall"] = record
            self._write(time.monotonic())
        elif (self._state.get("stall") or {}).get("armed"):
            self._state["stall"] = None
            self._write(time.monotonic())

    def stalled(self, record: dict) -> None:
        """The loop stopped stepping and the process is about to exit 43 (`runtime/stall.py`): where
        every thread was, written at once (from the stall watch's thread: the training thread is stuck)."""
        self._state["stall"] = record
        self._write(time.monotonic())

    def _write_if_due(self, key: tuple) -> None:
        now = time.monotonic()
        if key != self._key or now - self._written_at >= self.min_interval_seconds:
            self._key = key
            self._write(now)

    def ended(self, clean: bool = True) -> None:
        """The watchdog stopped, or its process is leaving (`runtime/exit_watch.py`): the last state
        written at once, marked "clean" for an end in order (the loop's end, `stop()`, any
        `sys.exit`, a KeyboardInterrupt), "unclean" for one that was not (an exception on its way out
        of the loop, a signal's default death). A record still null was left by a process that
        could not say: killed (SIGKILL, an abort), or still running."""
        self._state["ended"] = "clean" if clean else "unclean"
        self._write(time.monotonic())

    @property
    def state(self) -> dict[str, Any]:
        return self._state

    def _write(self, now: float) -> None:
        self._written_at = now
        self._state["written_at"] = time.time()
        try:
            write_atomically(self.path, strict_json.dumps(self._state, default=str) + "\n")
        except OSError as exc:  # telemetry: a full disk never reaches training, and is said once per cause
            reason = exc.strerror or str(exc)
            self._error_log("write", reason, path=str(self.path), error=reason,
                            note="training goes on; a post-mortem will lack this process's flight record "
                                 f"until a write succeeds, and {OncePerKind.NOTE}")

    @property
    def errors(self) -> int:
        """Failed writes so far."""
        return self._error_log.count


def read(path: str | os.PathLike) -> dict[str, Any] | None:
    """A flight record, or None if there is none (or it is not one of ours)."""
    try:
        return _load(path)
    except (OSError, InputError):
        return None
