"""`hbm-watchdog supervise [--max-restarts N] [--backoff S] [--kill-grace S] [--postmortem-dir DIR] -- CMD ...`:
restart CMD on exit 42 or an OOM crash, and say why it crashed.

The loop itself, its decisions and its exit statuses are in `watchdog.actions.supervisor`; the
job's process group (signalled whole, ended whatever happens to the supervisor) in
`watchdog.actions.job_group`. This module adds the post-mortem: when the child exits with
anything but 0 or 42, what XLA's out-of-memory message in its output says, and with
`--postmortem-dir` everything `hbm-watchdog postmortem DIR` says, printed at once. In that folder
the child's watchdog keeps its flight record (`flight.json`), and supervise records every exit
(`exits.jsonl`: time, run, status or signal, last step) and the end of the child's output
(`output.log`).

Every process of the job appends where its time went to one job file (`HBMWATCH_JOB_FILE`, set
here for the children: `--job-file`, else a temporary one removed at the end); when the job ends,
supervise prints its goodput (`core/goodput.py`), and `hbm-watchdog goodput FILE` reads a kept one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from watchdog.actions.supervisor import DEFAULT_KILL_GRACE, ChildOutcome, describe, supervise
from watchdog.commands import postmortem
from watchdog.core.errors import EXIT_RESTART_REQUESTED, InputError
from watchdog.core.inputs import open_regular
from watchdog.core.numbers import option, parse_count
from watchdog.fileio import write_atomically
from watchdog.logs import get_logger
from watchdog.core import goodput
from watchdog.runtime import flight_record
from watchdog.runtime.job_ledger import JOB_FILE_ENV, start_job

log = get_logger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-restarts", type=option(parse_count), default=3, metavar="N",
                        help="restarts allowed before giving up with status 1 (default 3)")
    parser.add_argument("--backoff", type=float, default=1.0, metavar="SECONDS",
                        help="wait before the first restart; doubles each time (default 1)")
    parser.add_argument("--max-backoff", type=float, default=60.0, metavar="SECONDS",
                        help="cap on the wait between restarts (default 60)")
    parser.add_argument("--kill-grace", type=float, default=DEFAULT_KILL_GRACE, metavar="SECONDS",
                        help="after SIGTERM or SIGINT is forwarded to the job's process group (or what is "
                             "left of it once the command exits), SIGKILL it this much later "
                             f"(default {DEFAULT_KILL_GRACE:g}: time to save a checkpoint)")
    parser.add_argument("--postmortem-dir", metavar="DIR", type=Path,
                        help="keep the job's flight record, every exit and the end of its output here, for "
                             "`hbm-watchdog postmortem DIR` (and the post-mortem printed on a crash)")
    parser.add_argument("--job-file", metavar="FILE", type=Path,
                        help="keep the job's time accounting here (every process appends to it), for `hbm-watchdog "
                             f"goodput FILE`; default: ${JOB_FILE_ENV} if set, else a temporary file, printed and removed")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")


def run(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    folder = args.postmortem_dir
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--postmortem-dir {folder}: {exc.strerror or exc}") from None
        os.environ[flight_record.FLIGHT_RECORD_ENV] = str(folder / postmortem.FLIGHT_RECORD_NAME)  # the child's
    named = args.job_file or (Path(os.environ[JOB_FILE_ENV]) if os.environ.get(JOB_FILE_ENV) else None)
    with tempfile.TemporaryDirectory(prefix="hbm-watchdog-job-") if named is None else nullcontext() as folder_:
        job_file = _start_job_file(named or Path(folder_) / f"job{goodput.SUFFIX}")
        status = supervise(command, max_restarts=args.max_restarts, backoff=args.backoff,
                           max_backoff=args.max_backoff, kill_grace=args.kill_grace,
                           on_exit=lambda outcome, run: _after_exit(outcome, run, folder))
        _print_goodput(job_file)
        return status


def _start_job_file(path: Path) -> Path:
    """The job file the children append to (`--job-file`, `HBMWATCH_JOB_FILE`, else a temporary one
    removed at the end), a job line starting it."""
    try:
        start_job(path)
    except OSError as exc:
        raise InputError(f"--job-file {path}: {exc.strerror or exc}") from None
    except InputError as exc:
        raise InputError(f"--job-file: {exc}") from None
    os.environ[JOB_FILE_ENV] = str(path)  # the children's
    return path


def _print_goodput(job_file: Path) -> None:
    """The job's goodput, when its processes recorded any (a command that is not our trainer does not)."""
    try:
        records = goodput.read(job_file)
    except InputError as exc:
        log.warning("job_goodput_unreadable", error=str(exc))
        return
    account = goodput.account(records)
    if account.processes:  # a summary, printed as the trainer's is, --quiet or not
        print(account.block(), file=sys.stderr, flush=True)


def _after_exit(outcome: ChildOutcome, run: int, folder: Path | None) -> None:
    """Record the exit where `postmortem` finds it; on a crash, print the post-mortem."""
    output = outcome.output_tail.decode("utf-8", errors="replace")
    status = describe(outcome.returncode)
    if folder is not None:
        record = flight_record.read(folder / postmortem.FLIGHT_RECORD_NAME) or {}
        line = {"time": time.time(), "run": run, "exit": status, "returncode": outcome.returncode,
                "last_step": record.get("last_step")}
        exits = folder / postmortem.EXITS_NAME
        try:  # what the earlier runs recorded; a file that is not ours (a link, a FIFO) starts afresh
            with open_regular(exits, "r", encoding="utf-8", follow_symlinks=False) as handle:
                earlier = handle.read()
        except (OSError, InputError):
            earlier = ""
        write_atomically(exits, earlier + json.dumps(line) + "\n")  # a few lines a run: rewritten whole
        write_atomically(folder / postmortem.OUTPUT_NAME, outcome.output_tail)
    if outcome.returncode in (0, EXIT_RESTART_REQUESTED):
        return
    text = postmortem.after_a_crash(folder, output, status)
    log.error("postmortem", child_status=status, run=run, block=text)
