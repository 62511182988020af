"""`hbm-watchdog supervise` with real processes: the CLI supervising small `python -c` children.

The children read HBMWATCH_RESTART_COUNT to behave differently on each run, which also proves
the count reaches them and goes up by one per restart.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, watchdog_cli

from watchdog.actions.supervisor import (
    EXIT_BUDGET_EXHAUSTED,
    ChildOutcome,
    OomScanner,
    backoff_seconds,
    decide,
    exit_status_of,
)

PRELUDE = "import os, signal, sys, time\nrun = int(os.environ['HBMWATCH_RESTART_COUNT'])\nprint(f'run {run}', flush=True)\n"


def supervisor_argv(script, *options):
    return [sys.executable, "-m", "watchdog", "--log-format", "json", "supervise", "--backoff", "0", *options,
            "--", sys.executable, "-c", PRELUDE + script]


def supervise(script, *options):
    return subprocess.run(supervisor_argv(script, *options), cwd=REPO, capture_output=True, text=True, timeout=60)


def runs(out):
    return [line for line in out.stdout.splitlines() if line.startswith("run ")]


def log_events(out):
    events = []
    for line in out.stderr.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


# --- the pure decision ----------------------------------------------------------------------------

@pytest.mark.parametrize("outcome, restarts, expected", [
    (ChildOutcome(0), 0, (False, "finished", 0)),
    (ChildOutcome(0, saw_oom=True), 0, (False, "finished", 0)),  # it printed an OOM, recovered, finished
    (ChildOutcome(42), 0, (True, "restart_requested", None)),
    (ChildOutcome(43), 1, (True, "peer_lost", None)),  # another rank died or stalled in an agreement
    (ChildOutcome(44), 1, (True, "restart_unsaved", None)),  # a restart was due, its checkpoint refused
    (ChildOutcome(43), 3, (False, "budget_exhausted", EXIT_BUDGET_EXHAUSTED)),
    (ChildOutcome(1, saw_oom=True), 0, (True, "out_of_memory", None)),
    (ChildOutcome(-9), 2, (True, "killed_by_signal", None)),
    (ChildOutcome(1), 0, (False, "failed", 1)),
    (ChildOutcome(7), 0, (False, "failed", 7)),
    (ChildOutcome(42), 3, (False, "budget_exhausted", EXIT_BUDGET_EXHAUSTED)),
    (ChildOutcome(-9, saw_oom=True), 3, (False, "budget_exhausted", EXIT_BUDGET_EXHAUSTED)),
])
def test_decide(outcome, restarts, expected):
    decision = decide(outcome, restarts_so_far=restarts, max_restarts=3)
    assert (decision.restart, decision.reason, decision.exit_status) == expected


def test_a_stopping_supervisor_never_restarts_and_reports_the_childs_status():
    assert decide(ChildOutcome(42), 0, 3, stopping=True).exit_status == 42
    assert decide(ChildOutcome(-15), 0, 3, stopping=True).exit_status == 143
    assert not decide(ChildOutcome(-9), 0, 3, stopping=True).restart


def test_backoff_doubles_and_is_capped():
    assert [backoff_seconds(n, 0.5, 3.0) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff_seconds(10, 0.0, 60.0) == 0.0
    assert exit_status_of(-9) == 137 and exit_status_of(3) == 3


def test_oom_scanner_finds_a_marker_split_across_chunks():
    scanner = OomScanner()
    assert not scanner.feed(b"step 10 ok\nRuntimeError: RESOURCE_EXH")
    assert scanner.feed(b"AUSTED: Out of memory while trying to allocate")
    assert scanner.found == b"RESOURCE_EXHAUSTED"
    assert not OomScanner().feed(b"memory is fine, loss 1.2\n")
    assert OomScanner().feed(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")


# --- real processes -------------------------------------------------------------------------------

@pytest.mark.slow
def test_restarts_on_42_until_the_child_succeeds_with_the_count_going_up():
    out = supervise("sys.exit(42 if run < 2 else 0)", "--max-restarts", "3")
    assert out.returncode == 0, out.stderr
    assert runs(out) == ["run 0", "run 1", "run 2"]
    restarts = [e for e in log_events(out) if e["event"] == "child_restarting"]
    assert [(e["restart"], e["reason"]) for e in restarts] == [(1, "restart_requested"), (2, "restart_requested")]


@pytest.mark.slow
def test_gives_up_with_status_1_when_the_budget_is_spent():
    out = supervise("sys.exit(42)", "--max-restarts", "2")
    assert out.returncode == EXIT_BUDGET_EXHAUSTED
    assert runs(out) == ["run 0", "run 1", "run 2"]
    assert "restart budget of 2 spent" in out.stderr


@pytest.mark.slow
def test_restarts_after_an_out_of_memory_crash_seen_in_the_output():
    out = supervise("if run == 0:\n"
                    "    print('RuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 1GiB', file=sys.stderr)\n"
                    "    sys.exit(1)\n")
    assert out.returncode == 0
    assert runs(out) == ["run 0", "run 1"]
    assert "RuntimeError: RESOURCE_EXHAUSTED" in out.stderr  # streamed through
    assert any(e["event"] == "child_restarting" and e["reason"] == "out_of_memory" for e in log_events(out))


@pytest.mark.slow
def test_an_ordinary_failure_is_not_restarted_and_its_status_is_passed_on():
    out = supervise("print('bad config', file=sys.stderr); sys.exit(3)")
    assert out.returncode == 3
    assert runs(out) == ["run 0"]


@pytest.mark.slow
def test_restarts_after_death_by_sigkill():
    out = supervise("if run == 0: os.kill(os.getpid(), signal.SIGKILL)")
    assert out.returncode == 0
    assert runs(out) == ["run 0", "run 1"]
    assert any(e["event"] == "child_restarting" and e["child_status"] == "SIGKILL" for e in log_events(out))


@pytest.mark.slow
def test_a_restart_adds_the_scripts_resume_flag_once_a_checkpoint_exists(tmp_path):
    """Issue 63, item 6: a restarter reruns one command, and a script that starts from scratch
    unless given its resume flag lost every step. `--on-restart-args` adds it on a restart, only
    once the checkpoint named is there: run 0 is killed before any save (no flag on run 1), run 1
    saves and exits 42 (the flag on run 2)."""
    ckpt = tmp_path / "ckpt.pt"
    out = supervise(f"print('args', sys.argv[1:], flush=True)\n"
                    f"if run == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
                    f"if run == 1: open({str(ckpt)!r}, 'w').write('saved'); sys.exit(42)\n",
                    "--max-restarts", "3", "--on-restart-args", "--init-from=resume --x 'a b'",
                    "--checkpoint-path", str(ckpt))
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stdout.splitlines() if line.startswith("args")] == [
        "args []", "args []", "args ['--init-from=resume', '--x', 'a b']"]
    added = [e["added_args"] for e in log_events(out) if e["event"] == "child_restarting"]
    assert added == [[], ["--init-from=resume", "--x", "a b"]]
    unnamed = supervise("print('args', sys.argv[1:], flush=True)\nsys.exit(42 if run == 0 else 0)\n",
                        "--on-restart-args=--resume")  # a value that starts with '-' takes the '='
    assert [line for line in unnamed.stdout.splitlines() if line.startswith("args")] == [
        "args []", "args ['--resume']"], "without --checkpoint-path: once a run exited 42 (it saved)"


def test_a_checkpoint_path_without_restart_args_is_refused_in_one_line(capsys):
    from watchdog.commands.cli import main

    assert main(["supervise", "--checkpoint-path", "ckpt.pt", "--", "true"]) == 2
    assert "--checkpoint-path says when --on-restart-args apply" in capsys.readouterr().err


def start_supervisor(script, *options):
    return subprocess.Popen(supervisor_argv(script, *options), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def sigterm_once_ready(script, *options) -> tuple[subprocess.Popen, str, str]:
    """Supervise `script` (which prints 'ready'), SIGTERM the supervisor once the child is ready,
    and return the supervisor with what it printed."""
    sup = start_supervisor(script, *options)
    try:
        assert sup.stdout.readline().strip() == "run 0"
        assert sup.stdout.readline().strip() == "ready"
        sup.send_signal(signal.SIGTERM)
        stdout, stderr = sup.communicate(timeout=30)
    finally:
        sup.kill()
    return sup, stdout, stderr


SAVES_ON_SIGTERM = ("def on_term(signum, frame):\n"
                    "    print('child got SIGTERM, saving', flush=True)\n"
                    "    sys.exit(42)\n"
                    "signal.signal(signal.SIGTERM, on_term)\n"
                    "print('ready', flush=True)\n"
                    "time.sleep(60)\n")


@pytest.mark.slow
def test_sigterm_is_forwarded_to_the_child_and_supervision_stops():
    sup, stdout, _ = sigterm_once_ready(SAVES_ON_SIGTERM)
    assert "child got SIGTERM, saving" in stdout
    assert "run 1" not in stdout  # a 42 caused by our own SIGTERM is not restarted...
    assert sup.returncode == 42  # ...but passed on, so a cluster reschedules the job


@pytest.mark.slow
def test_a_child_without_a_handler_dies_of_the_forwarded_sigterm():
    sup, _, _ = sigterm_once_ready("print('ready', flush=True); time.sleep(60)")
    assert sup.returncode == 128 + signal.SIGTERM


@pytest.mark.slow
def test_sigterm_during_backoff_stops_without_another_run():
    sup = start_supervisor("sys.exit(42)", "--backoff", "30")
    try:
        for line in sup.stderr:  # wait until it is backing off
            if '"child_restarting"' in line:
                break
        sup.send_signal(signal.SIGTERM)
        stdout, _ = sup.communicate(timeout=10)
    finally:
        sup.kill()
    assert sup.returncode == 42
    assert "run 1" not in stdout


# --- the job's process group: nothing of it outlives supervise -----------------------------------

def shell_supervisor(script, *options):
    """`supervise --grace-seconds 1 -- sh -c SCRIPT`: a shell child, whose commands are its own children."""
    return subprocess.Popen([sys.executable, "-m", "watchdog", "--log-format", "json", "supervise", "--backoff", "0",
                             "--grace-seconds", "1", *options, "--", "sh", "-c", script],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, its parent not yet told
    except psutil.NoSuchProcess:
        return True


def wait_until_gone(pids, seconds=20.0):
    """The pids still running after a bounded wait (a hang guard: the test fails, it never hangs)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if not gone(pid)]


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_and_supervise_exits():
    ignores_sigterm = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"
    sup, _, stderr = sigterm_once_ready(ignores_sigterm, "--grace-seconds", "1")
    assert sup.returncode == 128 + signal.SIGKILL
    (killed,) = [e for e in log_events(subprocess.CompletedProcess([], 0, "", stderr))
                 if e["event"] == "child_killed_after_grace"]
    assert killed["signal"] == "SIGTERM" and killed["grace_seconds"] == 1.0


def children_of(pid, seconds=20.0):
    """The children `pid` has started, once it has some (bounded wait)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        children = psutil.Process(pid).children()
        if children:
            return [child.pid for child in children]
        time.sleep(0.02)
    raise AssertionError(f"process {pid} started no child")


@pytest.mark.slow
def test_sigterm_reaches_a_shell_childs_commands_and_none_is_left():
    sup = shell_supervisor("echo $$; sleep 60; echo done")  # the case: the shell waits on its command
    job = []
    try:
        shell = int(sup.stdout.readline())
        job = [shell, *children_of(shell)]
        sup.send_signal(signal.SIGTERM)
        stdout, _ = sup.communicate(timeout=30)
        assert wait_until_gone(job) == []
    finally:
        sup.kill()
        kill_all(job)
    assert sup.returncode == 128 + signal.SIGTERM and "done" not in stdout


@pytest.mark.slow
def test_what_a_child_leaves_running_is_ended_before_the_restart_and_the_exit():
    # run 0 leaves a command running (holding the output pipe) and asks for a restart; run 1 does it again and ends
    sup = shell_supervisor('sleep 60 & echo $!; exit $(( HBMWATCH_RESTART_COUNT == 0 ? 42 : 0 ))')
    orphans = []
    try:
        stdout, stderr = sup.communicate(timeout=60)
        orphans = [int(line) for line in stdout.split()]
        assert wait_until_gone(orphans) == []
    finally:
        sup.kill()
        kill_all(orphans)
    assert sup.returncode == 0 and len(orphans) == 2
    events = log_events(subprocess.CompletedProcess([], 0, "", stderr))
    assert [e["signal"] for e in events if e["event"] == "job_leftovers_ended"] == ["SIGTERM", "SIGTERM"]


@pytest.mark.slow
def test_after_sigkill_of_supervise_the_whole_job_is_gone_even_ignoring_sigterm():
    sup = shell_supervisor('trap "" TERM; sleep 60 & echo $$ $!; wait')  # the shell and its command ignore SIGTERM
    job = []
    try:
        job = [int(pid) for pid in sup.stdout.readline().split()]
        sup.send_signal(signal.SIGKILL)
        _, stderr = sup.communicate(timeout=30)  # the guard, holding our stderr, is done too
        assert wait_until_gone(job) == []
    finally:
        sup.kill()
        kill_all(job)
    assert len(job) == 2
    assert "the supervisor is gone; ended its job's process group" in stderr


@pytest.mark.parametrize("argv, message", [
    ([], "no command to supervise"),
    (["--"], "no command to supervise"),
    (["--max-restarts", "-1", "--", "true"], "--max-restarts"),
    (["--grace-seconds", "-1", "--", "true"], "--grace-seconds"),
    (["--grace-seconds", "nan", "--", "true"], "--grace-seconds"),
    (["--", "/nonexistent/hbm-watchdog-child"], "cannot run"),
])
@pytest.mark.slow
def test_bad_usage_is_one_line_and_status_2(argv, message):
    out = watchdog_cli("supervise", *argv, json_logs=False, timeout=60, env={**os.environ, "NO_COLOR": "1"})
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_the_grace_flag_has_one_name(capsys):
    """`--kill-grace` (its old name) is gone with the other renames of the unreleased 0.1.0."""
    from watchdog.commands.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["supervise", "--grace-seconds", "7", "--", "true"]).grace_seconds == 7.0
    assert parser.parse_args(["supervise", "--", "true"]).grace_seconds == 30.0
    with pytest.raises(SystemExit):
        parser.parse_args(["supervise", "--kill-grace", "7", "--", "true"])
    capsys.readouterr()

def test_an_exits_file_nested_beyond_any_bound_is_one_line_not_a_recursion_error(tmp_path):
    """Issue 52: `supervise --postmortem-dir D -- true` with `D/exits.jsonl` holding a line of 100,000
    `[`: RecursionError. It is read like every other file, bounded: an InputError naming the line."""
    from watchdog.commands.supervise import _earlier_exits
    from watchdog.core.errors import InputError

    exits = tmp_path / "exits.jsonl"
    exits.write_text('{"time": 1.0, "run": 0, "exit": "1", "returncode": 1}\n' + "[" * 100_000 + "\n")
    with pytest.raises(InputError, match=r"exits.jsonl:2: not an exit recorded by supervise"):
        _earlier_exits(exits)



def test_a_writer_late_to_the_temporary_job_file_never_turns_a_finished_job_into_a_traceback(monkeypatch):
    """Seen once in CI: the job finished, `watch` appended its record (creating the file again) while
    supervise removed its temporary job folder, between the file's unlink and the folder's rmdir,
    and supervise ended in "Directory not empty" (exit 1). That moment, made to happen here."""
    from watchdog.commands import supervise as command

    real_rmdir, arrived = os.rmdir, []

    def rmdir_after_a_late_write(path, *args, **kwargs):
        if str(path).startswith(tempfile.gettempdir()) and "hbm-watchdog-job-" in str(path) and not arrived:
            arrived.append(path)
            (Path(path) / "job.jsonl").write_text("{}\n")  # the daemon's append, just in time
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir_after_a_late_write)
    with command._temporary_folder() as folder:
        (Path(folder) / "job.jsonl").write_text("{}\n")
    assert arrived and not os.path.lexists(folder)
