"""The layers in watchdog/ARCHITECTURE.md, kept true: every module's imports of our own code are
read (with `ast`, nothing is imported) and checked against what its layer may use.

Pure code stays pure (core imports nothing of ours outside core); the in-process runtime never
reaches up into what drives it; the station (one series' path and its sinks, shared by every loop)
uses only the core; the `watch` daemon, which runs outside the job, uses the station and the host's
/proc reader, never the in-process runtime (the sidecar, its sources) or the forensics that walk a
training process's objects; the forensics, which only read a process's objects, use nothing
above the core; the records (the files a process leaves for readers outside it) use the core
and the station's figures, never the runtime that writes them; and an action's life (actions/:
its path, record, agreement, checkpoints, restarts) uses the core, the records it writes to and
the station's words for its block, never the runtime that carries it out.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "watchdog"

SHARED = {"watchdog.logs", "watchdog.fileio", "watchdog.moved"}  # any layer outside core
MAY_IMPORT = {  # layer -> prefixes of our modules it may import (its own always)
    "core": set(),
    "logs": {"watchdog.core"},
    "fileio": {"watchdog.core"},
    "moved": set(),
    "station": {"watchdog.core", *SHARED},
    "forensics": {"watchdog.core", *SHARED},
    "readers": {"watchdog.core", *SHARED},  # memory as each kind of device and host tells it, in or out of process
    "records": {"watchdog.core", *SHARED, "watchdog.station"},  # files read from outside the process
    "runtime": {"watchdog.core", *SHARED, "watchdog.station", "watchdog.forensics", "watchdog.readers",
                "watchdog.records", "watchdog.actions"},
    # an action's life: its path, record, agreement, checkpoints and restarts; what it writes to
    # (the records) and the words of its block (the station's), never the runtime that carries it
    "actions": {"watchdog.core", *SHARED, "watchdog.station", "watchdog.records"},
    "daemon": {"watchdog.core", *SHARED, "watchdog.station",
               "watchdog.readers.outside", "watchdog.readers.host_memory",  # a target's memory, by PID
               "watchdog.records"},  # the job file, for a target that keeps none
}
TOP = {"commands", "trainer", "bench", "integrations", "__init__", "__main__"}  # may use any layer


def layer_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def our_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "watchdog" or node.module.startswith("watchdog."):
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("watchdog."))
    return found


def allowed(layer: str, module: str) -> bool:
    if module == "watchdog.__version__":  # the package's version: metadata, no code
        return True
    if module.startswith(f"watchdog.{layer}.") or module == f"watchdog.{layer}":
        return True
    return any(module == prefix or module.startswith(prefix + ".") for prefix in MAY_IMPORT[layer])


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_known_layer():
    unknown = {layer_of(p) for p in MODULES} - set(MAY_IMPORT) - TOP
    assert not unknown, f"a new layer needs its place in MAY_IMPORT and ARCHITECTURE.md: {unknown}"


@pytest.mark.parametrize("path", [p for p in MODULES if layer_of(p) not in TOP],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_layer_imports_only_what_it_may(path):
    layer = layer_of(path)
    wrong = sorted(m for m in our_imports(path) if not allowed(layer, m))
    assert not wrong, f"{path.relative_to(PACKAGE)} ({layer}) imports {wrong}"


def test_the_check_catches_a_wrong_import(tmp_path):
    """The test itself can fail: core reaching into runtime, the daemon into the sidecar."""
    assert not allowed("core", "watchdog.runtime.sidecar.Watchdog")
    assert not allowed("daemon", "watchdog.runtime.sidecar.Watchdog")
    assert not allowed("daemon", "watchdog.actions.agreement.Agreement")  # nothing of the in-process runtime
    assert not allowed("actions", "watchdog.runtime.stall.StallWatch")  # an action's life, not what carries it
    assert not allowed("readers", "watchdog.station.station.Station")
    assert not allowed("daemon", "watchdog.forensics.census.census")
    assert not allowed("forensics", "watchdog.runtime.sidecar.Watchdog")
    assert not allowed("records", "watchdog.runtime.sidecar.Watchdog")
    assert allowed("daemon", "watchdog.records.job_ledger.append_records")
    assert not allowed("runtime", "watchdog.trainer.loop.Trainer")
    assert allowed("daemon", "watchdog.station.telemetry.Telemetry")
    assert not allowed("station", "watchdog.readers.sources.MemorySource")
    assert not allowed("daemon", "watchdog.readers.sources.RssSource")
    module = tmp_path / "bad.py"
    module.write_text("from watchdog.runtime import sidecar\nimport watchdog.trainer.loop\n")
    assert our_imports(module) == {"watchdog.runtime.sidecar", "watchdog.trainer.loop"}


@pytest.mark.parametrize("old_name, new_name", [
    ("watchdog.runtime.flight_record", "watchdog.records.flight_record"),
    ("watchdog.runtime.job_ledger", "watchdog.records.job_ledger"),
    ("watchdog.runtime.sources", "watchdog.readers.sources"),
    ("watchdog.runtime.host_memory", "watchdog.readers.host_memory"),
    ("watchdog.runtime.breakdown_plan", "watchdog.readers.breakdown_plan"),
    ("watchdog.daemon.readers", "watchdog.readers.outside"),
])
def test_a_moved_modules_old_name_is_the_same_module_for_one_release_with_a_deprecation_line(old_name, new_name):
    """The records and the readers have rooms of their own (issue 59): a program importing a module
    by its old name gets the very module (its state, its patches), and is told where it went."""
    import importlib
    import sys
    import warnings

    moved = importlib.import_module(new_name)
    sys.modules.pop(old_name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module(old_name)
    assert old is moved
    assert any(issubclass(w.category, DeprecationWarning) and new_name in str(w.message) for w in caught)
