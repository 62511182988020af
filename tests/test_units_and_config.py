import pytest

from watchdog.core.config import WatchdogConfig
from watchdog.core.errors import ConfigError, InputError
from watchdog.core.units import format_bytes, memory_limit_option, parse_size


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
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        WatchdogConfig(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field)


def test_default_config_is_valid():
    config = WatchdogConfig()
    assert config.sample_every >= 1 and config.source == "auto"


@pytest.mark.parametrize("text, expected", [(None, None), ("2.75GiB", 2816 << 20), ("1048576", 1 << 20)])
def test_memory_limit_option_accepts_sizes_and_absence(text, expected):
    assert memory_limit_option(text) == expected


@pytest.mark.parametrize("text, message", [("0", "must be a positive"), ("3 parsecs", "unknown size unit"),
                                           ("-1GiB", "not a size")])
def test_memory_limit_option_names_the_flag_on_bad_input(text, message):
    with pytest.raises(InputError, match=rf"^--budget: .*{message}"):
        memory_limit_option(text, flag="--budget")
