"""A watched target's share of the job file: what `watch` knows of the processes it watched.

A job whose code cannot change keeps no account of its time: under `supervise --job-file` its
processes write nothing, and `goodput` found no process in the file. The daemon reads the job file
supervise named from the target's own environment (`HBMWATCH_JOB_FILE` in /proc/PID/environ,
relative to the target's working directory) when it attaches, and once the target is gone (or the
daemon stops) appends what it knows of it (`records/job_ledger.py`'s records): the process, `by`
"watch" (its start, no steps: progress is not visible from outside), and how it ended ("signalled":
it exited after the daemon's signal; "exit" otherwise). A target that keeps its own account (a
loop with a `Watchdog`) wrote its `process` record already: nothing is added for it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from watchdog.core.errors import InputError
from watchdog.logs import get_logger
from watchdog.records.job_ledger import JOB_FILE_ENV, append_records, existing_records, process_started

log = get_logger(__name__)

_ENVIRON_MAX_BYTES = 1 << 20  # an environment is a few KiB; a larger one is not read whole
_SAME_START_SECONDS = 1.0  # psutil's start and the kernel's, to the boot time's whole second


@dataclass(frozen=True)
class TargetAccount:
    path: Path
    pid: int
    started: float

    @classmethod
    def of(cls, process: psutil.Process) -> "TargetAccount | None":
        """The job file the target's environment names (None: none, or not readable)."""
        try:
            with open(f"/proc/{process.pid}/environ", "rb") as handle:
                environ = handle.read(_ENVIRON_MAX_BYTES)
            cwd = process.cwd()
        except (OSError, psutil.Error):
            return None
        prefix = JOB_FILE_ENV.encode() + b"="
        named = next((entry[len(prefix):] for entry in environ.split(b"\0") if entry.startswith(prefix)), b"")
        if not named:
            return None
        return cls(Path(cwd, os.fsdecode(named)), process.pid, process_started(process.pid))

    def record(self, signalled: bool, exited: bool) -> None:
        """The target's process and, when it exited, how: once, unless it recorded itself. A write
        that fails is said and never stops the watch."""
        try:
            earlier = existing_records(self.path)
            if any(r.get("event") == "process" and r.get("pid") == self.pid
                   and abs(float(r.get("started") or 0.0) - self.started) <= _SAME_START_SECONDS for r in earlier):
                return  # its own Watchdog keeps its account
            now = time.time()
            records = [{"event": "process", "t": now, "pid": self.pid, "started": self.started, "step": 0,
                        "checkpoint_every": 0, "by": "watch"}]
            if exited:
                records.append({"event": "end", "t": now, "how": "signalled" if signalled else "exit", "step": 0})
            append_records(self.path, records)
        except (OSError, InputError) as exc:
            if isinstance(exc, FileNotFoundError) and not self.path.parent.exists():
                log.info("job_file_gone", path=str(self.path), pid=self.pid,
                         note="its folder went with the job (supervise removes a temporary one at the end)")
                return
            log.warning("job_file_not_written", path=str(self.path), pid=self.pid, error=str(exc),
                        note="the watch goes on; goodput will lack this process")
