import pytest

from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import ConfigError, InputError
from hypothesis import given, settings
from hypothesis import strategies as st

from watchdog.core.numbers import (
    MAX_SIZE,
    MAX_STEP,
    PID_MAX,
    SEED_MAX,
    parse_count,
    parse_pid,
    parse_port,
    parse_positive,
    parse_seed,
    parse_step,
)
from watchdog.core.units import format_bytes, parse_size, positive_size


@pytest.mark.parametrize("text, expected", [
    ("1048576", 1 << 20), ("512MiB", 512 << 20), ("3GiB", 3 << 30), ("1.5GiB", 3 << 29),
    ("64 KiB", 64 << 10), ("2gib", 2 << 30), ("1GB", 10**9), (4096, 4096),
])
def test_parse_size_accepts_bytes_and_binary_suffixes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "3 parsecs", "-1", "GiB"])
def test_parse_size_rejects_nonsense_with_the_text_in_the_message(text):
    with pytest.raises(ValueError) as err:
        parse_size(text)
    assert repr(text) in str(err.value) or "size" in str(err.value)


def test_format_bytes_is_signed_and_binary():
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(-3 << 30) == "-3.0 GiB"
    assert format_bytes(None) == "n/a"


@pytest.mark.parametrize("kwargs, field", [
    ({"sample_every": 0}, "sample_every"),
    ({"sample_every": True}, "sample_every"),
    ({"source": "magic"}, "source"),
    ({"memory_limit_bytes": -1}, "memory_limit_bytes"),
    ({"stall_after_seconds": 0}, "stall_after_seconds"),
    ({"history_size": 0}, "history_size"),
    ({"rank": -1}, "rank"),
    ({"source": "replay"}, "replay_trace"),
    ({"memory_limit_bytes": 2**70}, "memory_limit_bytes"),  # bounded like every size: below 2**63
    ({"host_memory_limit_bytes": 2**63}, "host_memory_limit_bytes"),
    ({"sample_every": 2**60}, "sample_every"),  # bounded like every step count: below 2**52
    ({"history_size": 2**40}, "history_size"),
    ({"host_sample_every": 2**52}, "host_sample_every"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        WatchdogConfig(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field)


def test_the_restart_budget_counts_the_watchdogs_own_restarts_where_the_host_knows_them():
    from watchdog.core.errors import ConfigError
    from watchdog.core.restarts import RunState

    run = RunState(4)
    assert run.budget_spent == 4  # a host that cannot tell
    run.load_state_dict({"watchdog_restarts": 1})
    assert run.budget_spent == 1 and run.restarts_so_far == 4  # 3 preemptions
    for bad in ({"restarts_so_far": -1}, {"watchdog_restarts": -2}, {"watchdog_restarts": True},
                {"watchdog_restart_step": "7"}, ["not", "a", "dict"]):
        with pytest.raises(ConfigError):
            RunState().load_state_dict(bad)


def test_default_config_is_valid():
    config = WatchdogConfig()
    assert config.sample_every >= 1 and config.source == "auto"


@pytest.mark.parametrize("text, expected", [("2.75GiB", 2816 << 20), ("1048576", 1 << 20), (" 1 KiB ", 1024)])
def test_a_memory_budget_is_a_positive_size(text, expected):
    assert positive_size(text) == expected


@pytest.mark.parametrize("configure", ["watchdog.trainer.cli", "watchdog.commands.analyze"])
def test_no_memory_budget_given_is_none_and_one_given_is_parsed(configure):
    """Absence of `--memory-limit` is no budget (the device's own limit rules), not an error."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(configure).configure(parser)
    extra = ["trace.csv"] if configure.endswith("analyze") else []
    assert parser.parse_args(extra).memory_limit is None
    assert parser.parse_args([*extra, "--memory-limit", "2.75GiB"]).memory_limit == 2816 << 20


@pytest.mark.parametrize("text, message", [("0", "must be a positive"), ("3 parsecs", "unknown size unit"),
                                           ("-1GiB", "not a size")])
def test_a_bad_memory_budget_says_why(text, message):
    with pytest.raises(InputError, match=message):
        positive_size(text)


# -- numbers from people and files: ASCII digits, bounded (watchdog.core.numbers) ------------------

PARSERS = {  # parser -> (lowest, highest) it may return
    parse_step: (0, MAX_STEP - 1), parse_count: (0, MAX_STEP - 1), parse_positive: (1, MAX_STEP - 1),
    parse_seed: (0, SEED_MAX), parse_pid: (2, PID_MAX - 1), parse_port: (0, 65535), parse_size: (0, MAX_SIZE - 1),
}
NOT_ASCII_DIGITS = ["²", "١", "５", "٣٢", "1²", "१०", "⑤", "𝟗"]  # int() reads some, isdigit() passes all
texts = st.one_of(st.text(max_size=30), st.text(alphabet="0123456789 .kKmMgGiIbB+-_eE" + "".join(NOT_ASCII_DIGITS),
                                                max_size=30), st.sampled_from(NOT_ASCII_DIGITS),
                  st.integers(0, 10**30).map(str), st.integers(1, 5000).map(lambda n: "9" * n))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(PARSERS)), texts)
def test_any_text_is_a_number_within_bounds_or_one_input_error(parse, text):
    try:
        value = parse(text)
    except InputError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 300  # one line, a long value cut short
        return
    low, high = PARSERS[parse]
    assert type(value) is int and low <= value <= high
    assert text.strip()[:1].isascii() and all(c.isascii() for c in text.strip())


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(PARSERS)), st.integers(0, 2**70))
def test_valid_numbers_round_trip_and_the_bounds_are_exact(parse, value):
    low, high = PARSERS[parse]
    if low <= value <= high:
        assert parse(str(value)) == value and parse(f" {value:0>25}") == value  # spaces and leading zeros
    else:
        with pytest.raises(InputError):
            parse(str(value))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, MAX_SIZE - 1), st.sampled_from([("", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30),
                                                      ("TiB", 1 << 40), ("GB", 10**9)]), st.integers(0, 3))
def test_sizes_round_trip_through_their_units_and_the_log_format(size, unit, digits):
    suffix, factor = unit
    whole = size // factor
    assert parse_size(f"{whole}{suffix}") == whole * factor
    assert parse_size(f"{whole} {suffix.lower()}") == whole * factor
    if size < MAX_SIZE // 2:  # nearer the bound, "8388608.0 TiB" rounds up past it
        printed = format_bytes(size, digits)  # "1.5 GiB": what the logs say parses back, to its rounding and a byte
        unit_bytes = parse_size("1" + printed.split()[1])
        assert abs(parse_size(printed) - size) <= 0.5 * 10**-digits * unit_bytes + 1


@pytest.mark.parametrize("text", ["9" * 400, "1" + "0" * 19 + "GiB", "8EiB", "8388608TiB", "9223372036854775808"])
def test_a_size_too_large_is_an_input_error_not_an_overflow(text):
    with pytest.raises(InputError, match="too large|unknown size unit"):
        parse_size(text)
    assert parse_size("8388607.999TiB") < MAX_SIZE


@pytest.mark.parametrize("text, pid", [("²", None), ("١", None), ("５", None), ("9" * 5000, None), ("1", None),
                                       ("0", None), ("-5", None), ("4194304", None), ("2", 2), (" 4242\n", 4242)])
def test_pids_are_ascii_digits_between_init_and_pid_max(text, pid):
    if pid is None:
        with pytest.raises(InputError):
            parse_pid(text)
    else:
        assert parse_pid(text) == pid


def _numeric_fields(cls):
    """Every int or float field of a config dataclass (by annotation), with no bool in it."""
    import dataclasses

    return [f.name for f in dataclasses.fields(cls)
            if ("int" in str(f.type) or "float" in str(f.type)) and "bool" not in str(f.type)]


def _configs():
    from watchdog.core.detector import DetectorConfig
    from watchdog.core.policy import PolicyConfig
    from watchdog.core.recompilation import RecompilationConfig

    return [WatchdogConfig, PolicyConfig, DetectorConfig, RecompilationConfig]


@pytest.mark.parametrize("cls", _configs(), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("value", [True, float("inf"), float("nan")])
def test_every_numeric_setting_refuses_a_bool_and_a_non_finite_number_when_made(cls, value):
    """Issue 52's class: a setting checked for its type and range before anything starts.
    `memory_limit_bytes=True` was a 1-byte budget (an action at step 1); inf waits overflowed a timer."""
    accepted = []
    for name in _numeric_fields(cls):
        try:
            cls(**{name: value})
        except (ConfigError, TypeError, ValueError):
            continue
        accepted.append(name)
    assert accepted == [], f"{cls.__name__} accepted {value!r} for {accepted}"
