"""What each command's --help says agrees with what it does (issue 53): every option with a default
names it, a size is written SIZE everywhere, `postmortem` says it reads PyTorch CUDA's message as
well as XLA's, and `watch --help` keeps the budgets apart from the time axis."""

import argparse

import pytest

from watchdog.commands.cli import COMMANDS, build_parser


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_with_a_default_names_it_in_its_help(name):
    command = _subparsers()[name]
    text = command.format_help()
    for action in command._actions:
        default = action.default
        if (not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0
                or default is None or default is False or default in ([], ()) or default is argparse.SUPPRESS):
            continue
        shown = command._get_formatter()._get_help_string(action) or ""
        assert "default" in shown, (name, action.option_strings, action.help)
    assert "%(default)" not in text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_size_is_written_size_in_every_command(name):
    command = _subparsers()[name]
    for action in command._actions:
        if any(option.endswith("memory-limit") for option in action.option_strings):
            assert action.metavar == "SIZE", (name, action.option_strings)


def test_postmortem_says_it_reads_cudas_message_too():
    parser = build_parser()
    assert "PyTorch CUDA" in _subparsers()["postmortem"].format_help()
    assert "PyTorch CUDA" in parser.format_help()


def test_watch_keeps_the_budgets_out_of_the_time_axis():
    text = _subparsers()["watch"].format_help()
    options = text[text.index("options:"):]  # past the usage line, which lists every option
    time_axis, budgets = options.index("time axis:"), options.index("budgets:")
    assert options.index("--memory-limit SIZE") > budgets > time_axis
