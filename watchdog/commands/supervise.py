"""`hbm-watchdog supervise [--max-restarts N] [--backoff S] [--grace-seconds S] [--postmortem-dir DIR] -- CMD ...`:
restart CMD on exit 42, 43 or 44, an out-of-memory crash or a death by a signal (never on 45: the
watchdog saved and said restarting would be in vain), and say why it crashed.
`--on-restart-args ARGS` adds ARGS (the script's resume flag) to CMD on a restart once a checkpoint
exists (`--checkpoint-path`, else a run that exited 42).

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

Nothing is written before every input is known good (`_check_inputs`): the options, the command,
the job file and the post-mortem folder. A job file or a file in that folder that supervise (or
the watchdog) did not make, a link or anything but a regular file, is refused in one line with
exit status 2 and left as it is; an empty job file is adopted. `output.log` is known as ours only
by the `exits.jsonl` of ours beside it (the two are written together).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

from watchdog.actions.supervisor import DEFAULT_GRACE_SECONDS, ChildOutcome, check_options, describe, supervise
from watchdog.commands import postmortem
from watchdog.core.errors import EXIT_PEER_LOST, EXIT_RESTART_REQUESTED, EXIT_UNSAVED, InputError
from watchdog.core.inputs import open_regular
from watchdog.core.numbers import option, parse_count
from watchdog.fileio import write_atomically
from watchdog.logs import get_logger
from watchdog.core import goodput, strict_json
from watchdog.core.printable import printable_lines
from watchdog.records import flight_record
from watchdog.records.job_ledger import JOB_FILE_ENV, existing_records, start_job

log = get_logger(__name__)
MAX_EXITS_BYTES = 16 << 20  # a few lines a run


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-restarts", type=option(parse_count), default=3, metavar="N",
                        help="restarts allowed before giving up with status 1 (default 3)")
    parser.add_argument("--backoff", type=float, default=1.0, metavar="SECONDS",
                        help="wait before the first restart; doubles each time (default 1)")
    parser.add_argument("--max-backoff", type=float, default=60.0, metavar="SECONDS",
                        help="cap on the wait between restarts (default 60)")
    parser.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_SECONDS, metavar="SECONDS",
                        help="after SIGTERM or SIGINT is forwarded to the job's process group (or what is "
                             "left of it once the command exits), SIGKILL it this much later "
                             f"(default {DEFAULT_GRACE_SECONDS:g}: time to save a checkpoint; as watch's)")
    parser.add_argument("--postmortem-dir", metavar="DIR", type=Path,
                        help="keep the job's flight record, every exit and the end of its output here, for "
                             "`hbm-watchdog postmortem DIR` (and the post-mortem printed on a crash)")
    parser.add_argument("--job-file", metavar="FILE", type=Path,
                        help="keep the job's time accounting here (every process appends to it), for `hbm-watchdog "
                             f"goodput FILE`; default: ${JOB_FILE_ENV} if set, else a temporary file, printed and removed")
    parser.add_argument("--on-restart-args", metavar="ARGS", type=_arguments,
                        help="added to CMD on a restart once a checkpoint exists (a script's resume flag: "
                             "--on-restart-args=--resume, with '=' as its value starts with '-'); split as a "
                             "shell does")
    parser.add_argument("--checkpoint-path", metavar="PATH", type=Path,
                        help="with --on-restart-args: the checkpoint whose existence (a file, or a folder with "
                             "something in it) says a restart can resume; default: once a run exited 42")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")


def _arguments(text: str) -> list[str]:
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if not words:
        raise argparse.ArgumentTypeError("no arguments in it")
    return words


def run(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    folder = args.postmortem_dir
    named = args.job_file or (Path(os.environ[JOB_FILE_ENV]) if os.environ.get(JOB_FILE_ENV) else None)
    _check_inputs(args, command, named)
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--postmortem-dir {folder}: {exc.strerror or exc}") from None
        os.environ[flight_record.FLIGHT_RECORD_ENV] = str(folder / postmortem.FLIGHT_RECORD_NAME)  # the child's
    with _temporary_folder() if named is None else nullcontext() as folder_:
        job_file = _start_job_file(named or Path(folder_) / f"job{goodput.SUFFIX}")
        status = supervise(command, max_restarts=args.max_restarts, backoff=args.backoff,
                           max_backoff=args.max_backoff, grace_seconds=args.grace_seconds,
                           on_exit=lambda outcome, run: _after_exit(outcome, run, folder),
                           restart_args=args.on_restart_args or (), checkpoint=args.checkpoint_path)
        _print_goodput(job_file)
        return status


@contextmanager
def _temporary_folder() -> Iterator[str]:
    """The folder of a job file no one named, removed at the end. A writer late to it (a `watch`
    daemon recording the exit it saw) can put the file back while it is being removed: the removal
    is tried again, and a folder that still cannot go is left in the temporary directory, never a
    traceback after a job that finished (seen once in CI: exit 1 from rmdir's "Directory not empty")."""
    folder = tempfile.mkdtemp(prefix="hbm-watchdog-job-")
    try:
        yield folder
    finally:
        for _ in range(_REMOVAL_TRIES):
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.lexists(folder):
                break
            time.sleep(0.05)


_REMOVAL_TRIES = 5


def _check_inputs(args: argparse.Namespace, command: list[str], job_file: Path | None) -> None:
    """Every input, checked before anything is written (reads only): a refusal leaves no debris."""
    if not command:
        raise InputError("no command to supervise: hbm-watchdog supervise [options] -- CMD ...")
    check_options(args.max_restarts, args.backoff, args.max_backoff, args.grace_seconds)
    if args.checkpoint_path is not None and not args.on_restart_args:
        raise InputError("--checkpoint-path says when --on-restart-args apply: give them too")
    if job_file is not None:
        try:
            existing_records(job_file)
        except InputError as exc:
            raise InputError(f"--job-file: {exc}") from None
        _creatable(f"--job-file {job_file}", job_file.parent)
    folder = args.postmortem_dir
    if folder is not None:
        _creatable(f"--postmortem-dir {folder}", folder)
    if folder is None or not (folder.exists() or folder.is_symlink()):
        return
    if not folder.is_dir():
        raise InputError(f"--postmortem-dir {folder}: not a directory")
    try:
        flight_record.claim(folder / postmortem.FLIGHT_RECORD_NAME)
    except InputError as exc:
        raise InputError(f"--postmortem-dir: {exc}") from None
    exits = _earlier_exits(folder / postmortem.EXITS_NAME)
    output = folder / postmortem.OUTPUT_NAME
    if exits is None and (output.exists() or output.is_symlink()):
        raise InputError(f"--postmortem-dir: {output}: not written by supervise (no {postmortem.EXITS_NAME} "
                         "of its beside it); left as it is")
    if output.is_symlink() or (output.exists() and not output.is_file()):
        raise InputError(f"--postmortem-dir: {output}: not a regular file; left as it is")


def _creatable(what: str, folder: Path) -> None:
    """A folder that is there or can be made: its nearest existing ancestor is a directory."""
    ancestor = folder
    while not (ancestor.exists() or ancestor.is_symlink()) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{what}: {ancestor} is not a directory")


def _earlier_exits(path: Path) -> str | None:
    """What `exits.jsonl` holds (None: no such file); an InputError naming the path and the line for
    a file that is not one supervise wrote: a link, not a regular file, or a line that is no exit."""
    try:
        with open_regular(path, "r", encoding="utf-8", errors="replace", follow_symlinks=False,
                          what="--postmortem-dir: ") as handle:
            text = handle.read(MAX_EXITS_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"--postmortem-dir: {path}: {exc.strerror or exc}") from None
    if len(text) > MAX_EXITS_BYTES:
        raise InputError(f"--postmortem-dir: {path}: larger than any {postmortem.EXITS_NAME} of supervise; "
                         "left as it is")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = strict_json.loads(line, max_depth=2)  # bounded like every reader: `[` * 100,000 is an error
        except strict_json.JsonProblem:
            entry = None
        if not (isinstance(entry, dict) and {"run", "exit"} <= entry.keys()):
            raise InputError(f"--postmortem-dir: {path}:{number}: not an exit recorded by supervise; "
                             "left as it is")
    return text


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
        print(printable_lines(account.block()), file=sys.stderr, flush=True)  # a job file's text never acts


def _after_exit(outcome: ChildOutcome, run: int, folder: Path | None) -> None:
    """Record the exit where `postmortem` finds it; on a crash, print the post-mortem."""
    output = outcome.output_tail.decode("utf-8", errors="replace")
    status = describe(outcome.returncode)
    if folder is not None:
        record = flight_record.read(folder / postmortem.FLIGHT_RECORD_NAME) or {}
        line = {"time": time.time(), "run": run, "exit": status, "returncode": outcome.returncode,
                "last_step": record.get("last_step")}
        exits = folder / postmortem.EXITS_NAME
        try:  # what the earlier runs recorded: checked at the start, and again (something may have replaced it)
            earlier = _earlier_exits(exits) or ""
        except InputError as exc:
            log.warning("postmortem_exit_not_recorded", run=run, error=str(exc))
        else:
            write_atomically(exits, earlier + json.dumps(line) + "\n")  # a few lines a run: rewritten whole
            write_atomically(folder / postmortem.OUTPUT_NAME, outcome.output_tail)
    if outcome.returncode in (0, EXIT_RESTART_REQUESTED, EXIT_PEER_LOST, EXIT_UNSAVED):  # no crash to explain
        return
    text = postmortem.after_a_crash(folder, output, status)
    log.error("postmortem", child_status=status, run=run, block=text)
