"""`python ARGS...` children forked from an interpreter that has already imported torch.

A torch_xla child spends 6 to 9 CPU-seconds importing torch, torch._dynamo and torch._inductor
(torch_xla imports both) before its first line runs, and the suite starts dozens of them. Here,
multiprocessing's forkserver imports those modules once per xdist worker, and each child is forked
from it. The child then does what `python ARGS...` would do:
- the same argv, environment, working directory, sys.path[0] and `__main__`;
- its stdout and stderr go to its own files;
- it waits for its threads, then runs its atexit handlers;
- it returns its exit status, with a signal given as a negative number, as subprocess does.

What differs from a fresh interpreter is that torch and those modules are already imported.
torch_xla itself never is, because whether a program imported torch_xla decides which device the
watchdog watches. A test of what a fresh process imports asks for a fresh one.

Resident memory is the same as a fresh interpreter's, because the suite's budgets are built on it.
A fork leaves out the pages of shared libraries the parent had read: the kernel faults them in
again only when they are touched. A child showed 481 MB where a fresh interpreter showed 723, and
it then grew as it ran, which looks like a leak. So the server notes which of those pages it holds,
and each child maps them in again (MADV_POPULATE_READ) before it runs.

The memory the watchdog judges is also the same: each page counted once (Pss), so a page a child
still shares with the server and its siblings counts in part. A child forked with torch's heap
shared read 284 MiB where a fresh interpreter read 432, and its count then rose as it wrote to
those pages (each write copies one: +77 MiB in its first ten steps) and as siblings sharing them
exited: under CI's load, a scenario of growth that stops rose into its budget and was acted on. So
each child makes the pages it inherited its own (MADV_POPULATE_WRITE on the present pages it does
not hold alone) before it runs, as a fresh interpreter holds the heap its imports built.
"""

from __future__ import annotations

import array
import atexit
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path

# What `import torch_xla` spends its time on, apart from torch_xla's own modules (python -X importtime).
PRELOAD = ["torch", "torch._dynamo", "functorch.compile", "torch._functorch.aot_autograd",
           "torch._inductor.fx_passes.post_grad", "torch._inductor.lowering", "torch._inductor.kernel.mm",
           "torch._inductor.codegen.cpp_wrapper_cpu", "torch.utils.hipify.hipify_python", "torch._decomp"]

# A child whose environment differs from the server's in these needs a fresh interpreter: torch
# and the libraries it loads read them once, at import (OpenMP's thread count among them).
READ_AT_IMPORT = ("OMP_", "KMP_", "MKL_", "TORCH", "PYTORCH", "LD_", "CUDA", "PYTHON")

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)
_server_env: dict[str, str] | None = None  # the environment the server imported torch in


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k != "PYTHONPATH"}


def can_fork(env: dict[str, str]) -> bool:
    """Whether a child with this environment would import torch as the server did (starts the server)."""
    global _server_env
    if _server_env is None:
        _server_env = dict(os.environ)
        multiprocessing.forkserver.ensure_running()
    return _read_at_import(env) == _read_at_import(_server_env)


def stop() -> None:
    """End this worker's server: it is a child of this process holding torch (800 MB), so a test
    that measures its own process tree would count it. The next warm child starts a new one."""
    global _server_env
    if _server_env is not None:
        multiprocessing.forkserver._forkserver._stop()
        _server_env = None


def _present_runs(pid: int, wanted, keep) -> list[tuple[int, int]]:
    """The (start, length) runs of pages of process `pid` whose pagemap entry `keep(entry)` accepts,
    in the mappings `wanted(fields)` accepts (fields: a /proc/PID/maps line split in six). The
    pagemap's present and exclusively-mapped bits are readable by the same user without privileges."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs: list[tuple[int, int]] = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            if not wanted(fields):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // page * 8)
            entries = array.array("Q")
            size = (end - start) // page * 8
            while len(entries) * 8 < size and (chunk := pagemap.read(size - len(entries) * 8)):
                entries.frombytes(chunk)  # the kernel answers a large read in parts
            run_start = None
            for index, entry in enumerate(entries):
                if keep(entry):
                    run_start = index if run_start is None else run_start
                elif run_start is not None:
                    runs.append((start + run_start * page, (index - run_start) * page))
                    run_start = None
            if run_start is not None:
                runs.append((start + run_start * page, (len(entries) - run_start) * page))
    return runs


def _is_library(fields: list[str]) -> bool:
    return len(fields) == 6 and fields[5].startswith("/")


def _is_private_writable(fields: list[str]) -> bool:
    return fields[1][1] == "w" and fields[1][3] == "p" and not (len(fields) == 6 and fields[5].startswith("[v"))


def _present(entry: int) -> bool:
    return bool(entry >> 63)


def _present_and_shared(entry: int) -> bool:
    return bool(entry >> 63) and not (entry >> 56) & 1


_MADV_POPULATE_READ = 22  # Linux 5.14
_MADV_POPULATE_WRITE = 23


def _as_a_fresh_interpreter_holds_it() -> None:
    """Read in the library pages the server (this child's parent) holds, and make the heap pages
    this child shares with it its own, as a fresh interpreter would hold both after the same imports."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for pid, wanted, keep, advice in ((os.getppid(), _is_library, _present, _MADV_POPULATE_READ),
                                      (os.getpid(), _is_private_writable, _present_and_shared, _MADV_POPULATE_WRITE)):
        try:
            runs = _present_runs(pid, wanted, keep)
        except OSError:
            continue
        for start, length in runs:
            madvise(start, length, advice)  # an error (an older kernel) leaves the pages as they were


def run(args: list[str], *, env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """`python ARGS...` forked from the warm server (`can_fork(env)` first); raises
    subprocess.TimeoutExpired as subprocess.run does."""
    with tempfile.TemporaryDirectory(prefix="hbm-watchdog-child-") as folder:
        paths = [os.path.join(folder, name) for name in ("stdout", "stderr")]
        for path in paths:
            open(path, "w").close()
        child = _context.Process(target=_main, args=(args, env, cwd, *paths), name="python")
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
        stdout, stderr = (Path(path).read_text(errors="replace") for path in paths)
    return subprocess.CompletedProcess([sys.executable, *args], child.exitcode, stdout, stderr)


def _main(args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """The child: becomes `python ARGS...` and never returns."""
    _as_a_fresh_interpreter_holds_it()
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    status = 0
    try:
        _run_as_python(args, env)
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        status = 1
    threading._shutdown()  # the interpreter's own order: join non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _run_as_python(args: list[str], env: dict[str, str]) -> None:
    if args[0] == "-c":
        first, argv = "", ["-c", *args[2:]]
    elif args[0] == "-m":
        first, argv = os.getcwd(), [args[1], *args[2:]]
    else:
        first, argv = os.path.dirname(os.path.realpath(args[0])), list(args)
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path if p and p not in python_path and not p.endswith(os.sep + "tests")]
    sys.path[:] = [first, *python_path, *rest]
    sys.argv = argv
    sys.stdin = open(os.devnull)
    if args[0] == "-c":
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args[0] == "-m":
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(args[0], run_name="__main__")


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
