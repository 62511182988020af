"""What torch_xla's compile analysis costs, off, on (to /dev/null) and captured to a file, in one run.

    python -m watchdog.bench.compile_analysis [--graphs 24] [--tiny 200] [--steps 300] [--rounds 2]

Each measurement is a fresh process (torch_xla fixes the analysis setting at its first graph, and
the compile cache must start empty), modes in ABBA order so that load from elsewhere on the
machine hits them alike. A process trains a small MLP on PJRT CPU:

- `graphs` steps, each with a new batch size: a new graph every step, the recompilation case.
  Per new graph: torch_xla's own `CompileTime`, and the whole step's wall time (where the
  analysis' Python stack walk, report and HLO serialisation land, outside `CompileTime` too).
- `tiny` graphs of a single reduction over a new length each: compiling them takes a few
  milliseconds, so a fixed cost per compilation (the report) stands out most there.
- `steps` steps on one cached shape: the healthy case, where level 1 must cost nothing.
- in `on` mode, the capture switched on and off every 10 tiny graphs in the same process: what
  writing the reports to a file (the capture window) adds, paired, so machine load cancels out.
- in `capture` mode, the sidecar's side: parsing the captured reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from watchdog.commands.cli import OneLineParser
from watchdog.core.numbers import option, parse_positive

MODES = ("off", "on", "capture")


def child(mode: str, graphs: int, tiny: int, steps: int) -> dict:
    from watchdog.runtime import xla_stats

    reader = None
    if mode in ("on", "capture"):
        xla_stats.prepare_compile_analysis()
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    if mode == "capture":
        reader = xla_stats.current_compile_analysis().open()
    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(rows: int) -> None:
        x, y = torch.randn(rows, 64).to(device), torch.randn(rows, 1).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        torch_xla.sync(wait=True)

    step(1)
    step(1)  # the optimizer's first update is a graph of its own
    compiled_before = met.counter_value("UncachedCompile") or 0
    compile_ns_before = met.metric_data("CompileTime")[1]
    walls = []
    for i in range(graphs):
        start = time.perf_counter()
        step(2 + i)
        walls.append(time.perf_counter() - start)
    compiles = (met.counter_value("UncachedCompile") or 0) - compiled_before
    compile_ms = (met.metric_data("CompileTime")[1] - compile_ns_before) / 1e6 / max(compiles, 1)

    tiny_walls = []
    for n in range(tiny):
        start = time.perf_counter()
        kept = torch.ones(n + 1, device=device).sum()  # noqa: F841 - a live result, or nothing runs
        torch_xla.sync(wait=True)
        tiny_walls.append(time.perf_counter() - start)

    paired = {"capture": [], "link": []}
    if mode == "on":
        length = tiny + 1
        for block in range(2 * max(tiny // 10, 1)):
            window = xla_stats.current_compile_analysis().open() if block % 2 == 0 else None
            for _ in range(10):
                length += 1
                start = time.perf_counter()
                kept = torch.ones(length, device=device).sum()  # noqa: F841
                torch_xla.sync(wait=True)
                paired["capture" if window is not None else "link"].append(time.perf_counter() - start)
            if window is not None:
                window.close()

    for _ in range(10):
        step(1)
    start = time.perf_counter()
    for _ in range(steps):
        step(1)
    steady_us = (time.perf_counter() - start) / steps * 1e6

    reports, parse_us = 0, None
    if reader is not None:
        from watchdog.core.compile_causes import parse_compile_analysis

        text = reader.close()
        start = time.perf_counter()
        reports = len(parse_compile_analysis(text))
        parse_us = (time.perf_counter() - start) / max(reports, 1) * 1e6
    return {"mode": mode, "new_graphs": compiles, "compile_ms": compile_ms,
            "step_with_new_graph_ms": statistics.median(walls) * 1e3,
            "tiny_graph_ms": statistics.median(tiny_walls) * 1e3, "steady_step_us": steady_us,
            "paired_ms": {k: statistics.median(v) * 1e3 for k, v in paired.items() if v},
            "reports": reports, "parse_us_per_report": parse_us}


def run_child(mode: str, graphs: int, tiny: int, steps: int) -> dict:
    command = [sys.executable, "-m", "watchdog.bench.compile_analysis", "--child", mode,
               "--graphs", str(graphs), "--tiny", str(tiny), "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.compile_analysis", description=__doc__.splitlines()[0])
    made.add_argument("--graphs", type=option(parse_positive), default=24, help="new MLP graphs (default 24)")
    made.add_argument("--tiny", type=option(parse_positive), default=200, help="tiny graphs (default 200)")
    made.add_argument("--steps", type=option(parse_positive), default=300, help="cached steps (default 300)")
    made.add_argument("--rounds", type=option(parse_positive), default=2, help="fresh processes per mode (default 2)")
    made.add_argument("--json", action="store_true")
    made.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.graphs, args.tiny, args.steps)))
        return 0

    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            runs[mode].append(run_child(mode, args.graphs, args.tiny, args.steps))
            print(f"round {round_ + 1}/{args.rounds}: {mode} done", file=sys.stderr, flush=True)
    keys = ("compile_ms", "step_with_new_graph_ms", "tiny_graph_ms", "steady_step_us")
    rows = []
    for mode in MODES:
        row = {"mode": mode, "new_graphs": runs[mode][0]["new_graphs"], "reports": runs[mode][0]["reports"],
               "parse_us_per_report": runs[mode][0]["parse_us_per_report"]}
        for key in keys:
            values = [r[key] for r in runs[mode]]
            row[key], row[key + "_range"] = statistics.median(values), (min(values), max(values))
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return 0
    off = rows[0]
    print(f"torch_xla compile analysis cost, PJRT CPU, median (min-max) of {args.rounds} fresh processes per "
          f"mode: {off['new_graphs']} new MLP graphs, {args.tiny} tiny graphs, {args.steps} cached steps each")
    labels = {"compile_ms": ("CompileTime per MLP graph", "ms"), "step_with_new_graph_ms": ("MLP step with a new graph", "ms"),
              "tiny_graph_ms": ("tiny graph, compile and run", "ms"), "steady_step_us": ("cached MLP step", "us")}
    for key, (label, unit) in labels.items():
        cells = []
        for row in rows:
            low, high = row[key + "_range"]
            cells.append(f"{row['mode']} {row[key]:.2f} ({low:.2f}-{high:.2f}) {unit}, "
                         f"{row[key] / off[key]:.3f}x")
        print(f"{label:>28}: " + "; ".join(cells))
    paired = [r["paired_ms"] for r in runs["on"] if r["paired_ms"]]
    if paired:
        link = statistics.median(p["link"] for p in paired)
        file = statistics.median(p["capture"] for p in paired)
        print(f"capture window, paired in one process (tiny graphs): to /dev/null {link:.2f} ms, "
              f"to a file {file:.2f} ms per new graph, {file - link:+.2f} ms")
    capture = rows[-1]
    print(f"captured {capture['reports']} reports; parsing them on the sidecar: "
          f"{capture['parse_us_per_report']:.1f} us per report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
