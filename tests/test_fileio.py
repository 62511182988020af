"""Every file the project writes whole goes through watchdog/fileio.py, and no planted link can
redirect a write.

The attack: anyone who may create files in the target's folder (a shared /tmp, a shared
checkpoint mount) plants a symbolic link, at a temporary name the writer is known to use, to a
file of the user's; the writer opens the name for writing and overwrites that file. The class
test runs each writer twice in the same process (same PID, same step, same target name): every
name it used beside the target the first time is planted as a link the second time, and so is
the target itself. The victim must be unchanged, the names not used again, and the target a
plain file (or directory), never a link.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from watchdog import fileio

REPO = Path(__file__).resolve().parents[1]
VICTIM_BYTES = b"the user's own file"


# ---- the writers, each as `write(folder) -> the path it wrote` ----------------------------------------

def write_report(folder: Path) -> Path:
    from watchdog.commands.report import draw_trace
    from watchdog.core.sample import Sample

    samples = [Sample(step, 1000.0 + step, (100 + step) << 20, 1 << 30) for step in range(0, 400, 4)]
    return draw_trace(samples, folder / "report.png")


def write_checkpoint(folder: Path) -> Path:
    import torch

    from watchdog.actions.checkpoint import CheckpointManager

    return CheckpointManager(folder).save({"w": torch.ones(3)}, 7)


def write_sharded_step(folder: Path) -> Path:
    """A sharded step's own file work (DCP's shards need SPMD, test_spmd.py): rank 0's temporary
    directory, its host file, the commit, then the same step again (a reinit at the same step)."""
    from watchdog.actions.sharded_checkpoint import HOST_FILE, ShardedCheckpointManager, step_dir_name

    manager = ShardedCheckpointManager(folder)
    for _ in range(2):
        temp = manager._fresh_temporary(7)
        (temp / "__0_0.distcp").write_bytes(b"shard")  # what DCP writes into it
        with fileio.replacing(temp / HOST_FILE) as handle:
            handle.write(b"host")
        manager._commit(temp, folder / step_dir_name(7))
    return folder / step_dir_name(7)


class LightningTrainer:
    """What `_save_atomically` uses of a Lightning trainer; it writes the way Lightning does, by path."""

    is_global_zero = True

    class strategy:
        @staticmethod
        def broadcast(obj, src: int = 0):
            return obj

    @staticmethod
    def save_checkpoint(path) -> None:
        with open(path, "wb") as handle:  # follows a link, as Lightning's own writer would
            handle.write(b"lightning checkpoint")


def write_lightning_checkpoint(folder: Path) -> Path:
    from watchdog.integrations.lightning import HbmWatchdogCallback

    callback = HbmWatchdogCallback(checkpoint_dir=folder)
    callback._save_atomically(LightningTrainer())
    return callback.checkpoint_path


def switch_compile_analysis_on(folder: Path) -> Path:
    """The capture switch: a regular file in place of the link torch_xla appends to."""
    from watchdog.runtime.xla_stats import CompileAnalysis

    path = folder / "compile-analysis.txt"
    fileio.link_atomically(path, os.devnull)
    reader = CompileAnalysis(path, owned=True, unavailable=None).open()
    assert reader is not None
    reader._handle.close()  # keep it on: the file stays, the test looks at it
    return path


def save_a_figure(folder: Path) -> Path:
    """bench/sensitivity.py and deploy/grafana/snapshot.py."""
    from matplotlib.figure import Figure

    figure = Figure()
    figure.add_subplot().plot([0, 1], [1, 0])
    return fileio.save_figure(figure, folder / "figure.png")


def write_json(folder: Path) -> Path:
    """bench/agreement_cost.py, trainer/multi.py, the deploy generators."""
    return fileio.write_atomically(folder / "rank-00000.json", '{"rank": 0}')


WRITERS = {
    "report": write_report,
    "checkpoint": write_checkpoint,
    "sharded checkpoint": write_sharded_step,
    "lightning checkpoint": write_lightning_checkpoint,
    "compile analysis switch": switch_compile_analysis_on,
    "figure": save_a_figure,
    "json": write_json,
}


@pytest.fixture
def names_used(monkeypatch) -> dict[str, list[str]]:
    """Names a writer renamed from or made a link at (`written`: its temporaries), and names it
    removed (`removed`: probes, and stale temporaries it cleared)."""
    used: dict[str, list[str]] = {"written": [], "removed": []}

    def spy(real, kind, position):
        def call(*args, **kwargs):
            used[kind].append(os.fspath(args[position]))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(os, "replace", spy(os.replace, "written", 0))
    monkeypatch.setattr(os, "rename", spy(os.rename, "written", 0))
    monkeypatch.setattr(os, "symlink", spy(os.symlink, "written", 1))
    monkeypatch.setattr(os, "unlink", spy(os.unlink, "removed", 0))
    return used


def beside(names: list[str], folder: Path, target: Path) -> set[str]:
    return {Path(n).name for n in names if Path(n).parent == folder} - {target.name}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_link_planted_at_any_name_a_writer_uses_is_never_followed(writer, tmp_path, names_used):
    write = WRITERS[writer]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    target = write(first)
    temporaries = beside(names_used["written"], first, target)
    assert temporaries, "the writer used no temporary: it wrote the target in place"

    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    for name in sorted(temporaries | beside(names_used["removed"], first, target)) + [target.name]:
        (second / name).symlink_to(victim)
    names_used["written"].clear()
    written = write(second)

    assert victim.read_bytes() == VICTIM_BYTES
    assert not written.is_symlink() and (written.is_file() or written.is_dir())
    again = beside(names_used["written"], second, written) & temporaries
    assert not again, f"predictable temporary names: {sorted(again)}"


def test_a_link_planted_at_a_checkpoint_directorys_probe_name_is_never_written_through(tmp_path):
    """The directory is proved writable at start with a throwaway file: under a random name too."""
    from watchdog.actions.checkpoint import ensure_writable_directory

    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for guess in (f".ckpt-probe.{os.getpid()}.tmp", ".ckpt-probe.tmp", ".probe.tmp"):
        (folder / guess).symlink_to(victim)
    ensure_writable_directory(folder)
    assert victim.read_bytes() == VICTIM_BYTES


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with fileio.replacing(target) as handle:
            handle.write(b"half of the new")
            raise RuntimeError("disk gone")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_file_written_whole_gets_the_mode_a_plain_write_would_give(tmp_path):
    """mkstemp and mkdtemp make them private (0600, 0700); a report or a checkpoint is not."""
    umask = os.umask(0o077)
    os.umask(umask)
    assert fileio._umask() == umask
    written = fileio.write_atomically(tmp_path / "report.html", "<html>")
    directory = fileio.temporary_directory(tmp_path, ".tmp-step-")
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask
    assert written.read_text() == "<html>"


def test_stale_temporaries_of_the_new_names_are_still_recognised_and_cleared(tmp_path):
    """A save killed mid-write leaves its temporary; the next save removes it (checkpoint.py's glob)."""
    import torch

    from watchdog.actions.checkpoint import CheckpointManager
    from watchdog.actions.sharded_checkpoint import ShardedCheckpointManager

    manager = CheckpointManager(tmp_path / "files")
    with pytest.raises(KeyboardInterrupt), fileio.replacing(tmp_path / "files" / "ckpt-00000001.pt") as handle:
        handle.write(b"x")
        raise KeyboardInterrupt
    killed = (tmp_path / "files" / ".ckpt-00000002.abcd1234.tmp")
    killed.write_bytes(b"torn")  # what SIGKILL leaves: the helper never got to remove it
    manager.save({"w": torch.ones(1)}, 3)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["ckpt-00000003.pt"]

    sharded = ShardedCheckpointManager(tmp_path / "steps")
    torn = sharded._fresh_temporary(1)
    sharded._fresh_temporary(2)
    assert not torn.exists() and len(list((tmp_path / "steps").iterdir())) == 1


# ---- nothing writes a file any other way -------------------------------------------------------------

WRITING_CALLS = re.compile(r"\.write_text\(|\.write_bytes\(|\bopen\([^)]*['\"][wxa]b?\+?['\"]|\.savefig\(|"
                           r"torch\.save\(|os\.replace\(|os\.rename\(|shutil\.move\(|\.touch\(|symlink_to\(|"
                           r"os\.symlink\(|mkstemp\(|NamedTemporaryFile\(")
ALLOWED = {  # (file, what the line says): why it is not a whole file written around the helper
    ("watchdog/commands/report.py", "figure.savefig(buffer"): "into memory; the bytes go through the helper",
    ("watchdog/actions/checkpoint.py", "torch.save(cpu_state, handle)"): "into the helper's handle",
    ("watchdog/actions/checkpoint.py", "os.replace(path, target)"): "sets a checkpoint aside: a rename, no write",
    ("watchdog/actions/sharded_checkpoint.py", "torch.save(host_tree, handle)"): "into the helper's handle",
    ("watchdog/actions/sharded_checkpoint.py", "os.replace(final, stale)"): "onto the helper's fresh directory",
    ("watchdog/actions/sharded_checkpoint.py", "os.replace(temp, final)"): "the step's commit; temp is the helper's",
    ("watchdog/core/sample.py", 'open(self.path, "a"'): "the trace CSV: appended in place, at the user's path",
    ("deploy/prometheus/local_stack.py", 'open(self.workdir / "prometheus.log", "wb")'):
        "the child Prometheus's log stream, in the run's own work folder",
    ("watchdog/bench/endurance.py", 'open(folder / "job.log", "wb")'):
        "the supervised job's output stream, in the endurance run's own folder",
    ("watchdog/readers/host_memory.py", 'clear_refs", "wb"'):
        "a kernel control file, no file: writing 5 resets the process's high-water mark (VmHWM)",
}


def test_every_whole_file_is_written_through_the_helper():
    found = []
    for path in sorted([*(REPO / "watchdog").rglob("*.py"), *(REPO / "deploy").rglob("*.py")]):
        relative = str(path.relative_to(REPO))
        if relative == "watchdog/fileio.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if WRITING_CALLS.search(line) and not any(relative == file and snippet in line
                                                      for file, snippet in ALLOWED):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == [], "write through watchdog/fileio.py (or allow here, saying why):\n" + "\n".join(found)


@pytest.mark.parametrize("dangling", [False, True])
def test_a_trace_name_the_tool_chose_is_never_written_through_a_link(tmp_path, dangling):
    """Issue 52: the host's trace beside `--trace-file` (`TRACE.host.csv`, a name the user never gave)
    followed planted links: it appended 2,751 bytes to a file outside the run folder, and created
    one at a dangling link's target. Such a name is refused like the flight record's and the job
    file's; a trace the user named keeps the path they gave."""
    from watchdog.core.errors import InputError
    from watchdog.station.telemetry import Telemetry
    from watchdog.station.trace_sink import TraceSink

    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "precious.csv"
    if not dangling:
        target.write_bytes(b"step,timestamp,bytes_used,bytes_limit,peak_bytes_used\n1,2,3,,\n")
    before = target.read_bytes() if not dangling else None
    run = tmp_path / "run"
    run.mkdir()
    (run / "trace.host.csv").symlink_to(target)
    with pytest.raises(InputError, match="symbolic link"):
        TraceSink(run / "trace.host.csv", Telemetry(device="host"), lambda: 30.0, named_by_user=False)
    assert (target.read_bytes() == before) if not dangling else not target.exists()


def test_every_trace_at_a_name_the_tool_derives_is_opened_without_following_links():
    """The class held by the code's shape: a TraceSink at a derived name (`labelled_trace_path`, a
    device's name in `watch`) says so, and only the path a user gave is followed."""
    def calls_in(text):
        start = text.find("TraceSink(")
        while start != -1:
            depth, end = 0, start + len("TraceSink")
            while True:  # to the parenthesis that closes the call
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
                if depth == 0:
                    break
            yield text[start:end]
            start = text.find("TraceSink(", end)

    calls = [(path.name, call) for path in (REPO / "watchdog").rglob("*.py") if path.name != "trace_sink.py"
             for call in calls_in(path.read_text())]
    assert len(calls) == 3, calls  # the sidecar's, the host watch's, the daemon's
    for name, call in calls:
        given = call.startswith(("TraceSink(self.config.trace_file,", "TraceSink(config.trace_file,"))  # the user's, as given
        assert given or "named_by_user=" in call, (name, call)
