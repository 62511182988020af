"""How early: for a leak that refills after every reinit, when the first action comes, and whether
every cycle's action comes before the limit, by `sample_every` and by how many samples the leak
takes to fill its headroom (docs/detection.md's table).

    python -m watchdog.bench.how_early [--cycles N] [--sawtooth-mib M] [--outside SHARE]

The loop is simulated through the one `Judge` every loop drives (the sidecar's, with the default
detector and policy): memory per step is a base, what the leak kept since the last rebuild, and
activations (a random share of the sawtooth); an action decided at a sample is carried out
`HANDOVER_STEPS` later (the sidecar judges while the loop trains on) and its effect told to the
judge, as `Watchdog.carry_out` does, with the time its save took (`SAVE_SECONDS`: from then on the
action comes at the latest safe moment, `core/action_time.py`). Each row prints, over the cycles: the
warning the first action gave (steps before the step the leak would have reached the limit, and in
samples), the least warning of any cycle, the highest memory any step reached as a share of the
limit, the rule that acted first (the detector's projection, or the limit rule's margin), and how
long each cycle lasted (from the start, or its rebuild, to its action). `--outside SHARE` keeps that
share of each step's leak outside the rebuilt state (a global list, a module's cache): a rebuild
leaves it, each cycle starts with less headroom, and a restart (what the judge asks for once the
rebuilds leave more behind each time) starts a new process with none of it.
"""

from __future__ import annotations

import argparse
import random
from typing import NamedTuple

from watchdog.commands.cli import OneLineParser
from watchdog.core.judge import Judge
from watchdog.core.numbers import decimal_in, option, whole_in
from watchdog.core.pace import HANDOVER_STEPS
from watchdog.core.sample import Sample
from watchdog.core.verdict import Action

GiB, MiB = 1 << 30, 1 << 20
BASE, LIMIT = 2 * GiB, 3 * GiB
HEADROOM_MIB = (LIMIT - BASE) // MiB  # what the leak fills; the activations' sawtooth takes its share
SAMPLE_EVERY = (1, 10, 50)
SAMPLES_TO_FILL = (10, 20, 40, 100, 400)
STEP_SECONDS = 0.5  # the simulated loop's pace
SAVE_SECONDS = 1.0  # what each action's save takes, timed as `carry_out` times it


class Row(NamedTuple):
    sample_every: int
    samples_to_fill: int
    actions: int
    first_warning_steps: int  # steps between the first action and the step the leak would have reached the limit
    least_warning_steps: int  # the same, the least of any cycle
    highest_share: float  # the highest memory any step reached, over the limit
    first_rule: str  # "projection" or "limit rule"
    cycle_steps: tuple[int, ...] = ()  # each cycle's length, from its start (the run's, or a rebuild) to its action


def run(sample_every: int, samples_to_fill: int, *, cycles: int = 3, sawtooth: float = 0.0, outside: float = 0.0,
        seed: int = 0) -> Row:
    if not (1 <= cycles and 0 <= sawtooth < LIMIT - BASE and 0 <= outside < 1):
        raise ValueError(f"cycles from 1, a sawtooth below the headroom ({LIMIT - BASE} bytes) and a share outside "
                         f"below 1, got {cycles}, {sawtooth}, {outside}")
    rng = random.Random(seed)
    judge = Judge(memory_limit_bytes=LIMIT)
    rate = (LIMIT - BASE - sawtooth) / (samples_to_fill * sample_every)
    fill_steps = (LIMIT - BASE - sawtooth) / rate
    kept = left = 0.0  # what the leak kept since the rebuild, and outside the rebuilt state
    born, rebuild_at, restart = 0, None, False
    warnings, highest, first_rule, lengths = [], 0.0, "", []
    step = 0
    while len(warnings) < cycles and step < 100 * fill_steps:
        if step == rebuild_at:
            born, rebuild_at = step, None
            if restart:  # a new process: nothing of the old one's memory is left
                kept = left = 0.0
                judge.restarted()
            else:
                kept = 0.0
                judge.reinit_finished(BASE + left + sawtooth * rng.random(), took_steps=HANDOVER_STEPS)
        kept += rate * (1 - outside)
        left += rate * outside
        highest = max(highest, BASE + kept + left + sawtooth)
        if step % sample_every == 0 and rebuild_at is None:
            used = BASE + kept + left + sawtooth * rng.random()
            verdict, action = judge.judge(Sample(step, 1.7e9 + STEP_SECONDS * step, int(used), None))
            if action.needs_checkpoint:
                judge.saved(SAVE_SECONDS)  # the action's save, timed
                warnings.append(int((LIMIT - BASE - kept - left - sawtooth) / rate))  # steps its peak had left
                lengths.append(step - born)
                first_rule = first_rule or ("limit rule" if verdict.explanation.startswith("memory ")
                                            else "projection")
                rebuild_at, restart = step + HANDOVER_STEPS, action is Action.CHECKPOINT_RESTART
        step += 1
    if not warnings:
        return Row(sample_every, samples_to_fill, 0, 0, 0, highest / LIMIT, "none")
    return Row(sample_every, samples_to_fill, len(warnings), warnings[0], min(warnings), highest / LIMIT, first_rule,
               tuple(lengths))


def table(cycles: int = 3, sawtooth: float = 0.0, outside: float = 0.0) -> list[Row]:
    return [run(every, fill, cycles=cycles, sawtooth=sawtooth, outside=outside)
            for every in SAMPLE_EVERY for fill in SAMPLES_TO_FILL]


MAX_CYCLES = 100  # a row's simulation ends after 100 fills of the headroom, so it has at most this many


def parser() -> argparse.ArgumentParser:
    made = OneLineParser(prog="python -m watchdog.bench.how_early", description=__doc__.split("\n\n")[0])
    made.add_argument("--cycles", type=option(whole_in(1, MAX_CYCLES, "a count of leak cycles")), default=3,
                      help=f"leak cycles (actions) per row, 1 to {MAX_CYCLES} (default 3)")
    made.add_argument("--sawtooth-mib", type=option(decimal_in(0, HEADROOM_MIB, "a height in MiB", below=True)),
                      default=0.0, help=f"activations' height in MiB, below the {HEADROOM_MIB} MiB of headroom "
                                        "the leak fills (default 0)")
    made.add_argument("--outside", type=option(decimal_in(0, 1, "a share of the leak", below=True)), default=0.0,
                      help="the share of each step's leak a rebuild leaves (outside the rebuilt state), 0 to below 1 "
                           "(default 0)")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(f"limit 3 GiB, 1 GiB of headroom; {args.cycles} cycles; sawtooth {args.sawtooth_mib:g} MiB; "
          f"{args.outside:g} of the leak outside the rebuilt state")
    print("| sample_every | samples to fill | actions | first warning (steps, samples) | least warning | "
          "highest / limit | first acted by | each cycle (steps) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table(args.cycles, args.sawtooth_mib * MiB, args.outside):
        print(f"| {row.sample_every} | {row.samples_to_fill} | {row.actions} | {row.first_warning_steps:,} "
              f"({row.first_warning_steps / row.sample_every:.1f}) | {row.least_warning_steps:,} | "
              f"{row.highest_share:.3f} | {row.first_rule} | {', '.join(f'{n:,}' for n in row.cycle_steps) or '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
