"""What torch_xla's compile analysis costs, off, on (to /dev/null) and captured to a file, in one run.

    python -m watchdog.bench.compile_analysis [--graphs 24] [--steps 300] [--rounds 2]

Each measurement is a fresh process (torch_xla fixes the analysis setting at its first graph, and
the compile cache must start empty), modes in ABBA order so that load from elsewhere on the
machine hits them alike. A process trains a small MLP on PJRT CPU:

- `graphs` steps, each with a new batch size: a new graph every step, the recompilation case.
  Per new graph: torch_xla's own `CompileTime`, and the whole step's wall time (where the
  analysis' Python stack walk, report and HLO serialisation land, outside `CompileTime` too).
- `steps` steps on one cached shape: the healthy case, where level 1 must cost nothing.
- in `capture` mode, the sidecar's side: parsing the captured reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODES = ("off", "on", "capture")


def child(mode: str, graphs: int, steps: int) -> dict:
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
            "step_with_new_graph_ms": statistics.median(walls) * 1e3, "steady_step_us": steady_us,
            "reports": reports, "parse_us_per_report": parse_us}


def run_child(mode: str, graphs: int, steps: int) -> dict:
    command = [sys.executable, "-m", "watchdog.bench.compile_analysis", "--child", mode,
               "--graphs", str(graphs), "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=24)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.graphs, args.steps)))
        return 0

    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            runs[mode].append(run_child(mode, args.graphs, args.steps))
            print(f"round {round_ + 1}/{args.rounds}: {mode} done", file=sys.stderr, flush=True)
    rows = []
    for mode in MODES:
        median = lambda key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
        rows.append({"mode": mode, "compile_ms": median("compile_ms"),
                     "step_with_new_graph_ms": median("step_with_new_graph_ms"),
                     "steady_step_us": median("steady_step_us"), "new_graphs": runs[mode][0]["new_graphs"],
                     "reports": runs[mode][0]["reports"],
                     "parse_us_per_report": runs[mode][0]["parse_us_per_report"]})
    if args.json:
        print(json.dumps(rows))
        return 0
    off = rows[0]
    print(f"torch_xla compile analysis cost, PJRT CPU, median of {args.rounds} fresh processes per mode "
          f"({off['new_graphs']} new graphs, {args.steps} cached steps each)")
    print(f"{'mode':>8} {'CompileTime/graph':>18} {'step with new graph':>20} {'cached step':>12} {'vs off':>8}")
    for row in rows:
        print(f"{row['mode']:>8} {row['compile_ms']:>15.2f} ms {row['step_with_new_graph_ms']:>17.2f} ms "
              f"{row['steady_step_us']:>9.0f} us {row['steady_step_us'] / off['steady_step_us']:>7.3f}x")
    capture = rows[-1]
    print(f"captured {capture['reports']} reports; parsing them on the sidecar: "
          f"{capture['parse_us_per_report']:.1f} us per report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
