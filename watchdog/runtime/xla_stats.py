"""XLA counters and torch_xla's own compile analysis, read from the sidecar: compilations for the
recompilation finding, syncs and traced IR for forensics. Never read by a scrape or a training
step, and reading them is no sync.

Never from a scrape or a training step: the counters are C++ atomics torch_xla keeps anyway
(reading one costs about 0.3 us and adds no compilation and no transfer).

What torch_xla 2.9 can tell about a compilation, and when (read from torch_xla/csrc/debug_util.cpp
and docs/source/learn/troubleshoot.md, checked on PJRT CPU):

- Counters and metrics, always on, readable at any time: `UncachedCompile` (graphs compiled),
  `CompileTime` (their total time), the number of executables in the compile cache.
- The compile analysis (`PT_XLA_DEBUG_LEVEL=1`): for each compilation, its cause ("user code
  trying to access tensor value before torch_xla.sync", "user torch_xla.sync", the parallel
  loader, dynamo), the graph's hash, its number of inputs and outputs, their total sizes, and the
  Python frames that triggered it (`PT_XLA_DEBUG_MAX_FRAME` of them). It runs only when a graph
  is compiled: level 1 skips the per-execution analysis, so a loop that replays cached graphs
  pays nothing. It cannot be switched on later: torch_xla reads `PT_XLA_DEBUG_LEVEL`,
  `PT_XLA_DEBUG_FILE` and `PT_XLA_DEBUG_MAX_FRAME` into function-local statics at its first graph,
  once per process. It is written only by local process 0 (`PJRT_LOCAL_PROCESS_RANK`), and not
  in eager mode.
- Not the graph itself: dumping it (`XLA_SAVE_TENSORS_FILE`) is also fixed at start and runs at
  every sync, not only at compilations, so it is not used.

So `prepare_compile_analysis()` sets level 1 before the first graph, writing to a path that is a
symbolic link to /dev/null. torch_xla opens that path in append mode for each report, so the
watchdog switches the capture on by putting a regular file in its place (`AnalysisReader`) and
off by putting the link back: the reports cost a Python stack walk per compilation, and are read
only for a bounded window once a recompilation is found.
"""

from __future__ import annotations

import atexit
import importlib.util
import linecache
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

from watchdog.core.compile_causes import SourceView
from watchdog.core.inputs import NotARegularFile, kind_of, open_regular
from watchdog.fileio import link_atomically, write_atomically

LEVEL_ENV = "PT_XLA_DEBUG_LEVEL"
FILE_ENV = "PT_XLA_DEBUG_FILE"
MAX_FRAME_ENV = "PT_XLA_DEBUG_MAX_FRAME"
OWNER_ENV = "HBMWATCH_COMPILE_ANALYSIS_PID"  # which process set the three above (children inherit them)
MAX_FRAMES = "32"  # torch_xla's default of 8 ends inside Lightning, before the user's own frame
_READ_LIMIT = 1 << 20  # bytes read per capture window; a few reports are enough to name the cause


def _metrics():
    """torch_xla's metrics module, only if the program already imported torch_xla."""
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.debug.metrics as met

    return met


def compilations() -> int | None:
    """Graphs compiled so far in this process (`UncachedCompile`), or None without torch_xla."""
    met = _metrics()
    return None if met is None else int(met.counter_value("UncachedCompile") or 0)


def compile_seconds() -> float | None:
    """Time spent compiling so far in this process (`CompileTime`), or None."""
    met = _metrics()
    if met is None or "CompileTime" not in met.metric_names():
        return None
    return float(met.metric_data("CompileTime")[1]) / 1e9


def cached_graphs() -> int | None:
    """Executables held in torch_xla's compile cache (each one holds device memory)."""
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla

    try:
        return int(torch_xla._XLAC._xla_get_num_cached_compilation_graph())
    except (AttributeError, RuntimeError):
        return None


def _graphs_already_run() -> bool:
    met = _metrics()
    if met is None:
        return False
    return any(met.counter_value(name) for name in ("UncachedCompile", "CachedCompile", "ExecuteComputation"))


class CompileAnalysis:
    """torch_xla's compile analysis in this process: where it goes, and whether it can be read."""

    def __init__(self, path: Path | None, *, owned: bool, unavailable: str | None):
        self.path = path
        self.owned = owned  # the watchdog set it up, and switches the capture on and off
        self.unavailable = unavailable
        self._lock = threading.Lock()
        self._readers = 0

    def why_not(self) -> str | None:
        """Why no report can be read now, or None when they can."""
        if self.unavailable:
            return self.unavailable
        rank = os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0")
        if rank != "0":
            return (f"torch_xla writes its compile analysis only in local process 0, and this is local "
                    f"process {rank}: local process 0 on this host names it")
        if "torch_xla" in sys.modules:
            import torch_xla

            try:
                eager = bool(torch_xla._XLAC._get_use_eager_mode())
            except AttributeError:
                eager = False
            if eager:
                return "torch_xla skips its compile analysis in eager mode"
        return None

    def open(self) -> "AnalysisReader | None":
        """Start capturing: reports from now on can be read from the returned reader."""
        if self.why_not() is not None or self.path is None:
            return None
        with self._lock:
            if self.owned and self._readers == 0:
                write_atomically(self.path, b"")  # torch_xla may open the path at any moment
            self._readers += 1
        return AnalysisReader(self)

    def _release(self) -> None:
        with self._lock:
            self._readers -= 1
            if self.owned and self._readers == 0:
                link_atomically(self.path, os.devnull)


class AnalysisReader:
    """Reads what torch_xla appends to the analysis file while the capture is on."""

    def __init__(self, analysis: CompileAnalysis):
        self._analysis = analysis
        self._path = analysis.path
        self._handle = None
        self._budget = _READ_LIMIT
        self._closed = False
        if analysis.owned:
            self._handle = open(self._path, "rb")  # kept open: the file leaves the path when the capture ends
        else:  # the user's own file: read from its current end on
            self._handle = _open_users_file(self._path)
            if self._handle is not None:
                self._handle.seek(0, os.SEEK_END)

    def read(self) -> str:
        if self._handle is None:
            if self._closed:
                return ""
            self._handle = _open_users_file(self._path)  # created by torch_xla meanwhile, or still not there
            if self._handle is None:
                return ""
        data = self._handle.read(max(self._budget, 0))
        self._budget -= len(data)
        return data.decode("utf-8", errors="replace")

    def close(self) -> str:
        """Stop capturing; returns what was written since the last read."""
        if self._closed:
            return ""
        self._analysis._release()  # the link is back; what was written is still behind our handle
        text = self.read()
        self._closed = True
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        return text


def _open_users_file(path: Path):
    """The user's PT_XLA_DEBUG_FILE for reading, or None while it is not there or not a regular file
    (a FIFO's open would wait for a writer; `_users_own_setting` says why nothing is read from one)."""
    try:
        return open_regular(path, "rb")
    except (OSError, NotARegularFile):
        return None


_ANALYSIS: CompileAnalysis | None = None
_ANALYSIS_LOCK = threading.Lock()


def prepare_compile_analysis() -> CompileAnalysis:
    """Turn torch_xla's compile analysis on for this process, if it is not too late. Idempotent.

    Call before the first XLA graph runs (the `Watchdog` and the Lightning callback do when they
    are created): after that torch_xla no longer reads the setting. A user's own
    `PT_XLA_DEBUG_LEVEL` is respected; its reports are read from `PT_XLA_DEBUG_FILE` if set.
    """
    global _ANALYSIS
    with _ANALYSIS_LOCK:
        if _ANALYSIS is None:
            _ANALYSIS = _prepare()
        return _ANALYSIS


def current_compile_analysis() -> CompileAnalysis:
    """What `prepare_compile_analysis` set up, or why nothing was."""
    with _ANALYSIS_LOCK:
        if _ANALYSIS is not None:
            return _ANALYSIS
    return CompileAnalysis(None, owned=False, unavailable=(
        "torch_xla's compile analysis was not turned on (recompilation.explain is off, or no Watchdog "
        "was created before the first graph)"))


def _prepare() -> CompileAnalysis:
    env = os.environ
    if importlib.util.find_spec("torch_xla") is None:
        return CompileAnalysis(None, owned=False, unavailable="torch_xla is not installed")
    owner = env.get(OWNER_ENV)
    set_by_user = env.get(LEVEL_ENV) is not None and owner in (None, str(os.getpid()))
    if set_by_user:
        return _users_own_setting(env.get(LEVEL_ENV, ""), env.get(FILE_ENV))
    if _graphs_already_run():
        return CompileAnalysis(None, owned=False, unavailable=(
            "torch_xla ran a graph before the watchdog was created, and it reads PT_XLA_DEBUG_LEVEL only at "
            "its first graph: create the Watchdog (or HbmWatchdogCallback) before the first step, or start "
            f"the job with {LEVEL_ENV}=1 {FILE_ENV}=<file>"))
    try:
        directory = Path(tempfile.mkdtemp(prefix="hbm-watchdog-xla-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        path = directory / "compile-analysis.txt"
        link_atomically(path, os.devnull)  # off until a recompilation is found
    except OSError as exc:
        return CompileAnalysis(None, owned=False, unavailable=f"no place for torch_xla's compile analysis: {exc}")
    env[LEVEL_ENV] = "1"
    env[FILE_ENV] = str(path)
    if env.get(MAX_FRAME_ENV) is None or owner is not None:
        env[MAX_FRAME_ENV] = MAX_FRAMES
    env[OWNER_ENV] = str(os.getpid())
    return CompileAnalysis(path, owned=True, unavailable=None)


def _users_own_setting(level: str, file: str | None) -> CompileAnalysis:
    try:
        on = int(level) >= 1
    except ValueError:
        on = False
    if not on:
        return CompileAnalysis(None, owned=False, unavailable=(
            f"{LEVEL_ENV}={level!r} is set in the environment and keeps torch_xla's compile analysis off"))
    if not file:
        return CompileAnalysis(None, owned=False, unavailable=(
            f"{LEVEL_ENV} is set without {FILE_ENV}: torch_xla writes its compile analysis to stderr, "
            "where the watchdog cannot read it (look for 'Compilation Analysis' there)"))
    try:
        kind = kind_of(os.stat(file).st_mode)
    except OSError:
        kind = None  # not there yet: torch_xla creates it at its first report
    if kind is not None:
        return CompileAnalysis(None, owned=False, unavailable=(
            f"{FILE_ENV}={file} is {kind}, not a regular file: the watchdog cannot read the compile analysis back"))
    return CompileAnalysis(Path(file), owned=False, unavailable=None)


def source_view() -> SourceView:
    """Library files (the interpreter's and site-packages), source lines, paths relative to the cwd."""
    paths = sysconfig.get_paths()
    roots = tuple(sorted({os.path.realpath(paths[key]) + os.sep
                          for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}))

    def is_library(path: str) -> bool:
        real = os.path.realpath(path)
        return real.startswith(roots) or f"{os.sep}site-packages{os.sep}" in real \
            or f"{os.sep}dist-packages{os.sep}" in real

    def code_at(path: str, line: int) -> str | None:
        return _without_comment(linecache.getline(path, line)) or None

    def shorten(path: str) -> str:
        try:
            relative = os.path.relpath(path)
        except ValueError:
            return path
        return path if relative.startswith("..") else relative

    return SourceView(is_library=is_library, code_at=code_at, shorten=shorten)


def _without_comment(line: str) -> str:
    """A source line without its trailing `# comment` (a `#` inside a string literal stays)."""
    quote = None
    for i, char in enumerate(line):
        if quote is None and char == "#":
            return line[:i].strip()
        if char in "'\"" and (i == 0 or line[i - 1] != "\\"):
            quote = None if quote == char else (char if quote is None else quote)
    return line.strip()
