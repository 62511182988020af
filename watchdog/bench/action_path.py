"""Where one checkpoint-and-reinit goes: the modules, the threads, and what the training thread waits for.

    python -m watchdog.bench.action_path [--tree PATH] [--json]

Issue 59's measure of an action's path. A loop of its own runs a `Watchdog` (forensics on, the
host's memory not watched apart) over a scripted device whose memory grows 8 MiB a reading toward a
4 GiB limit, sampled every 4 steps, and carries every action out with `carry_out(action, save=,
rebuild=)`, where the rebuild gives the leak back. A profiler on every thread (`sys.setprofile`,
`threading.setprofile`) records each call into the watchdog package from the moment the policy
decides the first checkpoint action (`ActionPolicy._checkpoint`) until the sidecar has measured the
rebuild (`Station.reinit_finished` returns). The loop waits for that end without calling the
watchdog, so every call counted is the action's own. It prints:

- the modules whose functions ran on the path, by thread;
- the calls from one module into another, and how many of them go back into a module the path had
  already entered;
- the thread crossings: the work one thread hands the other on the path (the action handed over to
  the training thread; each message the sidecar handles; each answer a wait on the training thread
  gets back), counted by message, since the threads run at once;
- the training thread's waits for the sidecar on the path (`drain`), in seconds.

`--tree PATH` measures another checkout's code too (e.g. a `git worktree` of an older commit), in a
child process with PATH first on its path, and prints the two side by side: the same loop, the same
profiler, one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

MiB = 1 << 20
LIMIT = 4 << 30
LEAK_PER_READING = 8 * MiB
START = 1 << 30
SAMPLE_EVERY = 4
MAX_STEPS = 4_000  # the first action comes near step 1,000
START_AT = ("watchdog.core.policy", "_checkpoint")  # the decision
END_AT = ("watchdog.station.station", "reinit_finished")  # the rebuild measured, on the sidecar
CARRY_OUT = "carry_out"  # and the training thread back from carrying the action out
WAITS = {"drain"}  # the training thread waiting for the sidecar
HANDLED = {("watchdog.runtime.sampler", "handle"),  # the sidecar taking the messages posted to it
           ("watchdog.runtime.sidecar", "_handle")}  # (where an older checkout has it, for --tree)
HANDED_OVER = {("watchdog.actions.action_path", "hand_over"),  # the training thread taking the action
               ("watchdog.runtime.action_path", "hand_over"),  # (where older checkouts have it, for --tree)
               ("watchdog.runtime.sidecar", "_hand_over")}


def measure() -> dict:
    """The path of the first checkpoint-and-reinit of a leaking loop, as the module docstring says.
    Imports the watchdog only here, so that `--tree` can run it against another checkout."""
    import logging

    from watchdog import Watchdog, WatchdogConfig
    from watchdog.core.readings import MemoryReading

    quiet = logging.root.manager.disable  # put back afterwards: a test runs this in its own process

    class Leaking:
        name = "scripted"

        def __init__(self) -> None:
            self.extra = 0

        def read(self) -> MemoryReading:
            self.extra += LEAK_PER_READING
            return MemoryReading(START + self.extra, LIMIT, None)

    source = Leaking()
    events: list[tuple[str, str, str, str | None]] = []  # (thread, module, function, caller's module)
    waits: list[float] = []
    crossings: list[str] = []  # the work handed from one thread to the other, in order
    state = {"on": False, "done": False, "measured": False, "carried": False, "started": None}
    training = threading.current_thread().name

    def profile(frame, event, arg):  # noqa: ANN001 - the profiler's signature
        if event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("watchdog.") or module == __name__:
            return
        name = frame.f_code.co_name
        if event == "call" and (module, name) == START_AT:
            state["on"] = True
        if not state["on"] or state["done"]:
            return
        thread = threading.current_thread().name
        if event == "call":
            caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
            events.append((thread, module, name, caller if caller.startswith("watchdog.") else None))
            if name in WAITS and thread == training:
                state["started"] = time.perf_counter()
            elif (module, name) in HANDLED:
                crossings.extend(f"to the sidecar: {kind}" for kind, _ in frame.f_locals.get("messages", ()))
            elif (module, name) in HANDED_OVER and thread == training:
                crossings.append("to the training thread: the action")
        elif name in WAITS and thread == training and state["started"] is not None:
            waits.append(time.perf_counter() - state["started"])
            crossings.append(f"to the training thread: {name}'s answer")
            state["started"] = None
        elif (module, name) == END_AT:
            state["measured"] = True
        elif name == CARRY_OUT and thread == training:
            state["carried"] = True
        if event == "return" and state["measured"] and state["carried"]:
            state["done"] = True

    def rebuild() -> None:
        source.extra = 0  # the rebuilt state holds none of the leak

    logging.disable(logging.CRITICAL)
    sys.setprofile(profile)
    threading.setprofile(profile)  # before start(): it reaches only threads started after it
    wd = Watchdog(WatchdogConfig(sample_every=SAMPLE_EVERY, host_memory=False, memory_limit_bytes=LIMIT),
                  source=source)
    try:
        wd.start()
        for step in range(MAX_STEPS):
            action = wd.step(step)
            if action is not None and action.needs_checkpoint:
                wd.carry_out(action, save=lambda: "checkpoint", rebuild=rebuild)
                deadline = time.monotonic() + 30
                while not state["done"] and time.monotonic() < deadline:  # no call into the watchdog
                    time.sleep(0.001)
                break
            if not state["on"]:
                wd.drain()  # before the decision: the loop runs in step with its sidecar
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        wd.stop()
        logging.disable(quiet)
    return _figures(events, waits, crossings, measured=state["done"], training=training)


def _figures(events: list[tuple], waits: list[float], crossings: list[str], *, measured: bool,
             training: str) -> dict:
    """What the recorded calls say. A call from one module into another counts once per edge (the
    caller's module, the function called), however often a loop makes it: the path's shape, not the
    census's size. An edge goes back when the path had entered its module before."""
    modules: dict[str, set[str]] = {}
    entered: set[str] = set()
    edges: set[tuple] = set()
    back: set[tuple] = set()
    for thread, module, name, caller in events:
        label = "training" if thread == training else ("sidecar" if thread == "hbm-watchdog" else thread)
        modules.setdefault(module, set()).add(label)
        if caller is not None and caller != module:
            edge = (caller, module, name)
            if edge not in edges and module in entered:
                back.add(edge)
            edges.add(edge)
        entered.add(module)
    return {"measured": measured, "modules": len(modules),
            "by_module": {name: sorted(threads) for name, threads in sorted(modules.items())},
            "calls_between_modules": len(edges), "calls_back_into_a_module": len(back),
            "thread_crossings": len(crossings), "crossings": crossings,
            "training_waits_seconds": [round(w, 4) for w in waits]}


def _measured_in(tree: Path) -> dict:
    """`measure()` in a child process whose path starts with `tree`."""
    code = (f"import json, runpy; m = runpy.run_path({str(Path(__file__).resolve())!r}, run_name='action_path'); "
            "print(json.dumps(m['measure']()))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tree, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"action_path: the code at {tree} did not run the loop: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parser() -> argparse.ArgumentParser:
    from watchdog.commands.cli import OneLineParser
    from watchdog.core.numbers import option

    made = OneLineParser(prog="python -m watchdog.bench.action_path", description=__doc__.splitlines()[0])
    made.add_argument("--tree", type=option(checkout), help="another checkout (a folder holding watchdog/) to measure beside this one")
    made.add_argument("--json", action="store_true", help="print the figures as JSON")
    return made


def checkout(text: str) -> Path:
    """A folder holding a `watchdog/` package (a checkout of this repository), else InputError."""
    from watchdog.core.errors import InputError

    path = Path(text)
    if not text or not (path / "watchdog" / "__init__.py").is_file():
        raise InputError(f"{text!r}: no watchdog/ package in it, not a checkout to measure")
    return path.resolve()


def _table(columns: dict[str, dict]) -> str:
    rows = [("modules on the path", "modules"), ("calls between modules", "calls_between_modules"),
            ("of which back into a module already entered", "calls_back_into_a_module"),
            ("thread crossings", "thread_crossings"), ("training thread waits on the sidecar (s)", "training_waits_seconds")]
    lines = ["| | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for words, key in rows:
        lines.append(f"| {words} | " + " | ".join(str(figures[key]) for figures in columns.values()) + " |")
    for name, figures in columns.items():
        lines.append(f"\n{name}: " + ", ".join(f"{module.removeprefix('watchdog.')} ({'/'.join(threads)})"
                                               for module, threads in figures["by_module"].items()))
        lines.append("  crossings: " + "; ".join(figures["crossings"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    columns = {"this checkout": measure()}
    if args.tree is not None:
        columns[str(args.tree)] = _measured_in(args.tree)
    if not all(figures["measured"] for figures in columns.values()):
        print("action_path: a loop's first action was not measured within its steps", file=sys.stderr)
        return 1
    print(json.dumps(columns, indent=2) if args.json else _table(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
