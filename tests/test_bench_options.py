"""Every option of every `python -m watchdog...` program is checked as the commands' options are
(issue 64): a value it cannot use is one line and exit status 2 when the command line is read, never
a traceback minutes into the work (`how_early --sawtooth-mib 1024` divided by zero, `agreement_cost
--rounds 0` indexed an empty list, `how_early --cycles 0` printed a table of a simulation that never
ran).

Structural: the programs are found by their `__main__` guard, each exposes its `parser()`, and every
option that takes a value is either a choice or has a type made by `core/numbers.option` (a number
with its range kept on it, or a path checked for what it names). Each is then given values just
outside its range and values no number is written as."""

import argparse
import ast
import importlib
import inspect
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "watchdog"
ROUTED = {"watchdog.commands.cli", "watchdog.trainer.cli"}  # `hbm-watchdog` itself: the commands' own options
INTERNAL = {"watchdog.actions.job_group"}  # started by `supervise` with its own argument, never by a person
NOT_NUMBERS = ["", "x", "-1", "١", "²", "nan", "inf", "1e999", "9" * 5000, "0x10", "1_000", " "]


def programs() -> list[str]:
    """Every module with a `__main__` guard: what `python -m` runs."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        guarded = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if guarded and module not in ROUTED | INTERNAL:
            found.append(module)
    return found


def refusal(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    """The one line `parser` refuses `argv` with (exit status 2), or a failure naming what it did instead."""
    capsys.readouterr()
    try:
        parsed = parser.parse_args(argv)
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 2, (argv, exc.code, err)
        assert err.count("\n") == 1 and err.endswith("\n"), (argv, err)
        return err
    pytest.fail(f"{argv!r} was accepted: {parsed}")


def bad_values(kind) -> list[str]:
    """Values just outside a parser's range, and values no number is written as."""
    low, high, below = kind.low, kind.high, getattr(kind, "below", False)
    whole = isinstance(low, int) and isinstance(high, int)
    outside = [str(high) if below else str(high + 1) if whole else repr(high * 2 + 1)]
    if low > 0:
        outside.append(str(low - 1) if whole else repr(low / 2))
    if whole:
        outside.append("1.5")
    return outside + NOT_NUMBERS


def test_the_programs_are_found():
    found = programs()
    assert {"watchdog.bench.how_early", "watchdog.bench.agreement_cost", "watchdog.trainer.speed"} <= set(found)
    assert len(found) >= 10, found


@pytest.mark.parametrize("module", programs())
def test_every_option_of_every_program_refuses_what_it_cannot_use_in_one_line(module, tmp_path, capsys):
    program = importlib.import_module(module)
    assert hasattr(program, "parser"), f"{module}: expose parser(), the one its main() reads the command line with"
    assert "parser()" in inspect.getsource(program.main), f"{module}: main() reads its options through parser()"
    parser = program.parser()
    assert parser.parse_known_args.__func__ is argparse.ArgumentParser.parse_known_args
    assert type(parser).error is not argparse.ArgumentParser.error, f"{module}: refusals in one line (OneLineParser)"
    a_file, a_folder = tmp_path / "a-file", tmp_path / "a-folder"
    a_file.write_text("x")
    a_folder.mkdir()
    checked = 0
    for action in parser._actions:
        if action.nargs == 0 or action.nargs == argparse.REMAINDER or action.help == argparse.SUPPRESS:
            continue  # flags, `-- more flags`, and a program's own child's option
        flag = list(action.option_strings[:1])
        if action.choices is not None:
            refusal(parser, [*flag, "no-such-choice"], capsys)
        elif getattr(action.type, "checked", False) and hasattr(action.type, "low"):
            for value in bad_values(action.type):
                refusal(parser, [*flag, value], capsys)
        elif getattr(action.type, "checked", False) and action.type.__name__ == "folder_to_write":
            refusal(parser, [*flag, str(a_file)], capsys)
        elif getattr(action.type, "checked", False) and action.type.__name__ == "file_to_write":
            refusal(parser, [*flag, str(a_folder)], capsys)
        elif getattr(action.type, "checked", False) and action.type.__name__ == "checkout":
            refusal(parser, [*flag, str(a_folder)], capsys)  # a folder, but no checkout of this repository
        else:
            pytest.fail(f"{module} {flag or action.dest}: a value taken unchecked; give it a type made by "
                        "watchdog.core.numbers.option (a range) or choices")
        checked += 1
    assert checked or module.endswith("step_cost"), module


@pytest.mark.parametrize("module, argv, said", [
    ("watchdog.bench.how_early", ["--sawtooth-mib", "1024"], "from 0 to below 1,024"),
    ("watchdog.bench.how_early", ["--cycles", "0"], "from 1 to 100"),
    ("watchdog.bench.agreement_cost", ["--rounds", "0"], "--rounds"),
    ("watchdog.bench.agreement_cost", ["--worlds", "0", "--rounds", "1"], "--worlds"),
    ("watchdog.bench.agreement_cost", ["--every", "1"], "--every"),
    ("watchdog.bench.step_cost", ["--jsn"], "unrecognized arguments"),
    ("watchdog.trainer.speed", ["--steps", "100", "--log-every", "50"], "more than twice --log-every"),
])
def test_the_issue_s_cases_are_refused_before_any_work(module, argv, said, capsys):
    """The cases issue 64 found, through each program's main(): refused when the command line is read."""
    with pytest.raises(SystemExit) as refused:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and said in err, err


def test_the_least_and_most_a_simulation_accepts_run_to_a_row():
    """how_early at the edges of its range: one cycle, activations all but filling the headroom; the
    most cycles a row can hold."""
    from watchdog.bench.how_early import HEADROOM_MIB, MAX_CYCLES, MiB, run

    for cycles, sawtooth in ((1, (HEADROOM_MIB - 0.01) * MiB), (MAX_CYCLES, 0.0)):
        row = run(10, 10, cycles=cycles, sawtooth=sawtooth)
        assert 1 <= row.actions <= cycles and 0 < row.highest_share < 2, row
