"""`hbm-watchdog bench [--json]`: detector quality and speed against the baselines, on the labelled corpus.

Two tables, never mixed: the synthetic TPU-like corpus and the real-trace corpus (unmodified
machines as negatives, the same machines' neighbours with injected leaks). numpy is imported only
when the bench runs, so the rest of the CLI does not need it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from watchdog.core import strict_json
from watchdog.core.errors import InputError
from watchdog.core.numbers import option, parse_count, parse_positive, parse_seed

ANCHORS = (
    "PrecogMF: F1 0.857 with 0 false positives (Jindal et al. 2021, offline, labelled cloud VMs)",
    "RESIN: precision 0.85 / recall 0.91 in Azure production (OSDI 2022)",
)
DEFINITIONS = (
    "acts = first checkpoint action (a baseline acts when its alert fires); TP = a leak acted on after onset",
    "false alarms = negatives acted on; alarms on clean = negatives with nothing growing that ever raised the alarm",
    "delay = steps from leak onset to the OOM-projected alarm; prevented = acted >= checkpoint margin before the true OOM step",
    "leak report (the warning, second table): owed where the floor rises to the end (OOM-bound or not), false where "
    "nothing leaks or before onset; growth that stops may be reported either way",
    "report delay = steps from onset to the first report, and as a share of the leak's life (onset to OOM, or to the end)",
    "proj. error = |projected - true OOM step| / steps left, at the first action (median)",
    "samples/s = samples over replay time, each trace's fastest of --repeat timed replays",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--corpus", choices=("all", "synthetic", "real"), default="all",
                        help="which corpus to score (default: both, as separate tables)")
    parser.add_argument("--seed", type=option(parse_seed), default=0, help="corpus seed (default 0)")
    parser.add_argument("--data", metavar="PATH", default=None,
                        help="alibaba_mem_util.csv.gz or its folder (default: $HBMWATCH_DATA, "
                             "else the copy shipped with hbm-watchdog)")
    parser.add_argument("--detectors", metavar="NAMES", default=None,
                        help="comma-separated subset, e.g. hbm-watchdog,lbr_r2_0.8 (default: all)")
    parser.add_argument("--repeat", type=option(parse_positive), default=3, metavar="N",
                        help="time each replay N times and count the fastest, as timeit does (default 3)")
    parser.add_argument("--traces", action="store_true",
                        help="also list per-trace outcomes (JSON) or the traces the first detector got wrong (tables)")
    parser.add_argument("--step-cost", action="store_true",
                        help="instead: measure what Watchdog.step() costs the training thread")
    parser.add_argument("--endurance", action="store_true",
                        help="instead: a whole supervised job with leaks that force actions and seeded SIGTERM "
                             "preemptions; steps, actions, goodput, memory against the budget (minutes)")
    parser.add_argument("--endurance-steps", type=option(parse_positive), default=80_000, metavar="N",
                        help="the endurance job's steps (default 80000)")
    parser.add_argument("--endurance-dir", type=Path, metavar="DIR",
                        help="keep the endurance job's files here: its job file, trace, log and checkpoints "
                             "(default: a temporary folder, removed)")
    parser.add_argument("--preemptions", type=option(parse_count), default=3, metavar="N",
                        help="SIGTERM preemptions in the endurance job, at --seed's random steps (default 3, at most 8)")


def _selected(spec: str | None) -> list[str] | None:
    if spec is None:
        return None
    from watchdog.bench.evaluate import detectors

    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = list(detectors())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        bad = ", ".join(unknown) or repr(spec)
        raise InputError(f"unknown detector {bad}; choose from {', '.join(known)}")
    return names


def _progress_bar(total: int, label: str):
    """tqdm on stderr when a person is watching; silent otherwise (CI logs, --json pipes)."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="replay", file=sys.stderr, leave=False)


def _load_corpora(args: argparse.Namespace) -> dict[str, list]:
    from watchdog.bench.corpus import synthetic_corpus
    from watchdog.bench.realtraces import real_corpus, resolve_data_path

    corpora: dict[str, list] = {}
    if args.corpus in ("all", "real"):
        resolve_data_path(args.data)  # fail before minutes of synthetic work if the real data is missing
    if args.corpus in ("all", "synthetic"):
        corpora["synthetic"] = synthetic_corpus(args.seed)
    if args.corpus in ("all", "real"):
        corpora["real"] = real_corpus(args.data, args.seed)
    return corpora


def run(args: argparse.Namespace) -> int:
    if args.step_cost:
        from watchdog.bench.step_cost import main as step_cost_main

        return step_cost_main(["--json"] if args.json else [])
    if args.endurance:
        from watchdog.bench.endurance import run_from_cli

        if args.preemptions > 8:
            raise InputError(f"--preemptions {args.preemptions}: at most 8")
        return run_from_cli(args.endurance_steps, args.preemptions, args.seed, args.json, args.endurance_dir)
    names = _selected(args.detectors)
    from watchdog.bench.corpus import corpus_summary
    from watchdog.bench.evaluate import detectors, evaluate

    corpora = _load_corpora(args)
    runners = detectors(names)
    from watchdog.bench.baselines import BASELINE_NOTES

    report: dict = {"seed": args.seed, "repeat": args.repeat, "anchors": list(ANCHORS), "definitions": list(DEFINITIONS),
                    "baselines": {name: BASELINE_NOTES[name] for name in runners if name in BASELINE_NOTES}}
    for corpus_name, traces in corpora.items():
        bar = _progress_bar(len(traces) * len(runners) * args.repeat, corpus_name)
        scores, outcomes = evaluate(traces, runners, args.repeat, progress=bar.update if bar else None)
        if bar:
            bar.close()
        section = {"corpus": corpus_summary(traces), "scores": [s.to_json() for s in scores]}
        if args.traces:
            section["outcomes"] = {name: [vars(o) | {"kind": t.kind} for o, t in zip(results, traces)]
                                   for name, results in outcomes.items()}
        report[corpus_name] = section
        if not args.json:
            print(render_section(corpus_name, traces, scores))
            if args.traces:
                print(render_misses(traces, outcomes.get(next(iter(runners)), [])))
    if args.json:
        print(strict_json.dumps(report))
    else:
        print("Anchors from the literature (different data, for scale):")
        for line in ANCHORS:
            print(f"  - {line}")
        print("Baselines:")
        for name, note in report["baselines"].items():
            print(f"  - {name}: {note}")
        print("Definitions:")
        for line in DEFINITIONS:
            print(f"  - {line}")
    return 0


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _quality(precision: float, recall: float, f1: float) -> tuple[str, str, str]:
    return f"{precision:.3f}", f"{recall:.3f}", f"{f1:.3f}"


def _steps(value: float | None) -> str:
    return _fmt(value, ".0f") + (" steps" if value is not None else "")


COLUMNS = ("detector", "precision", "recall", "F1", "false alarms", "alarms on clean", "median delay",
           "OOMs prevented", "proj. error", "samples/s")


def render_section(corpus_name: str, traces: list, scores: list) -> str:
    """An aligned table: one row per detector."""
    leaks = sum(t.leak for t in traces)
    clean = sum(t.hard_negative for t in traces)
    samples = sum(len(t.samples) for t in traces)
    title = (f"{corpus_name.capitalize()} corpus: {len(traces)} traces ({leaks} OOM-bound leaks, "
             f"{len(traces) - leaks} negatives of which {clean} with nothing growing), {samples:,} samples")
    rows = [COLUMNS]
    for s in scores:
        rows.append((
            s.detector, *_quality(s.precision, s.recall, s.f1),
            f"{s.false_alarms}/{s.negatives}", f"{s.alarms_on_clean}/{clean}", _steps(s.median_delay_steps),
            f"{s.ooms_prevented}/{s.leaks}",
            _fmt(None if s.median_projection_error is None else 100 * s.median_projection_error, ".0f")
            + ("%" if s.median_projection_error is not None else ""),
            f"{s.samples_per_second:,.0f}",
        ))
    owed = sum(bool(t.floor_leak) for t in traces)
    nothing = sum(t.floor_leak is False for t in traces)
    report_rows = [REPORT_COLUMNS]
    for s in scores:
        report_rows.append((
            s.detector, *_quality(s.report_precision, s.report_recall, s.report_f1),
            f"{s.false_reports}/{s.report_positives + s.report_negatives}", f"{s.unbounded_reported}/{s.unbounded}",
            _steps(s.median_report_delay_steps), _fmt(s.median_report_delay_share, ".2f"),
        ))
    return (_table(title + "\nActions (OOM projected):", rows) + "\n"
            + _table(f"Leak report ({owed} traces owed one, {nothing} where nothing leaks):", report_rows))


REPORT_COLUMNS = ("detector", "precision", "recall", "F1", "false reports", "non-OOM leaks", "median delay",
                  "share of life")


def _table(title: str, rows: list) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title]
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def render_misses(traces: list, outcomes: list) -> str:
    """The traces the first detector got wrong: what a person tuning it reads next."""
    lines = []
    for trace, outcome in zip(traces, outcomes):
        if outcome.false_positive:
            problem = f"false action at step {outcome.first_action_step}"
        elif trace.leak and not outcome.prevented:
            problem = (f"acted at {outcome.first_action_step}, OOM at {trace.oom_step}, margin "
                       f"{trace.checkpoint_margin_steps}" if outcome.detected else "leak never acted on")
        elif outcome.false_report:
            problem = f"leak reported (no action) at step {outcome.first_report_step}"
        elif trace.floor_leak and not outcome.reported:
            problem = "leak never reported"
        else:
            continue
        lines.append(f"  {trace.name:<28} {problem}  [{trace.description}]")
    return ("Missed or wrong:\n" + "\n".join(lines) if lines else "No misses.") + "\n"
