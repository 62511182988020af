"""The two lanes stay honest: a test that starts a process or torch_xla's runtime must carry `slow`.

`tests/conftest.py` enforces the marker at run time rather than trusting it. These tests run a small
suite under that same conftest and check that the enforcement catches an unmarked test, names it,
and lets a marked one through.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
WARM_CHILDREN = (Path(__file__).parent / "warm_children.py").read_text()  # the conftest imports it

STARTS_A_PROCESS = """
import subprocess, sys

def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""

STARTS_A_MULTIPROCESSING_CHILD = """
import multiprocessing

def test_starts_a_child():
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()
"""

STARTS_THE_XLA_RUNTIME = """
import torch, torch_xla

def test_starts_the_runtime():
    torch.ones(2, device=torch_xla.device())
"""


def run_suite(pytester, body: str, *, marked: bool, in_subprocess: bool = False):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(warm_children=WARM_CHILDREN)
    pytester.makeini("[pytest]\nmarkers =\n    slow: marked slow\n")
    if marked:
        body = "import pytest\npytestmark = pytest.mark.slow\n" + body
    pytester.makepyfile(test_inner=body)
    run = pytester.runpytest_subprocess if in_subprocess else pytester.runpytest_inprocess
    return run("-p", "no:cacheprovider", "-p", "no:xdist", "-q")


@pytest.mark.parametrize("body", [STARTS_A_PROCESS, STARTS_A_MULTIPROCESSING_CHILD], ids=["subprocess", "multiprocessing"])
def test_an_unmarked_test_that_starts_a_process_fails_and_is_named(pytester, body):
    result = run_suite(pytester, body, marked=False)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_inner.py::test_* starts a process: mark it @pytest.mark.slow*"])


@pytest.mark.slow
@pytest.mark.parametrize("body", [STARTS_A_PROCESS, STARTS_A_MULTIPROCESSING_CHILD], ids=["subprocess", "multiprocessing"])
def test_a_marked_test_may_start_a_process(pytester, body):
    run_suite(pytester, body, marked=True).assert_outcomes(passed=1)


@pytest.mark.slow  # the inner suite gets a process of its own, so the runtime it starts is not this worker's
@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "marked"])
def test_the_xla_runtime_is_allowed_only_in_a_marked_test(pytester, marked):
    result = run_suite(pytester, STARTS_THE_XLA_RUNTIME, marked=marked, in_subprocess=True)
    if marked:
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(passed=1, errors=1)  # the test ran; its teardown found the runtime started
        result.stdout.fnmatch_lines(["*test_inner.py::test_starts_the_runtime starts torch_xla's runtime*"])


# ------------------------------------------------------------------------ the long runs, spread

def _shares(order: list, workers: int) -> list[list]:
    """The consecutive shares pytest-xdist's work stealing hands out first: what is left, divided
    by the workers left (xdist.scheduler.worksteal, `check_schedule`)."""
    shares, left = [], list(order)
    for share in range(workers):
        size = len(left) // (workers - share)
        shares.append(left[:size])
        left = left[size:]
    return shares


@pytest.mark.parametrize("long_runs, others, workers", [(19, 900, 2), (19, 900, 3), (5, 6, 4), (3, 0, 2), (1, 50, 8), (9, 1, 4)])
def test_every_workers_first_share_starts_with_its_turn_of_the_long_runs(long_runs, others, workers):
    from tests.conftest import _long_runs_at_each_share_start

    longs = [f"long{i}" for i in range(long_runs)]
    rest = [f"other{i}" for i in range(others)]
    order = _long_runs_at_each_share_start(longs, rest, workers)
    assert sorted(order) == sorted(longs + rest), "every test once, none lost"
    shares = _shares(order, workers)
    if any(len(longs[worker::workers]) > len(share) for worker, share in enumerate(shares)):
        assert order == longs + rest  # too few tests to spread them over: the plain order
        return
    for worker, share in enumerate(shares):
        turn = longs[worker::workers]
        assert share[:len(turn)] == turn, f"share {worker} starts with {share[:len(turn)]}, not {turn}"
    assert [t for t in order if t.startswith("other")] == rest, "the others keep their order"
