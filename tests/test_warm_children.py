"""The suite's warm children hold memory as a fresh interpreter does (tests/warm_children.py).

The budgets of the leak scenarios are built on the memory the watchdog judges, each page counted
once (Pss). A child forked with torch's heap still shared with the forkserver read 284 MiB where a
fresh interpreter read 432, and its count rose as it wrote to those pages: under CI's load a
scenario of growth that stops crept into its budget and was acted on. These hold both halves.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_python

MiB = 1 << 20

# A torch_xla program (the suite's children are; the server imports what torch_xla does) counts the
# job's memory, then touches every object the interpreter holds (a full collection writes to each
# tracked object's header, as a training loop's first steps do to what it imports).
COUNT = """
import gc, json, torch_xla
from watchdog.readers.host_memory import job_memory
first = job_memory()
gc.collect()
print(json.dumps({"first": first, "after_touching": job_memory()}))
"""


def counts(fresh: bool) -> dict:
    return json.loads(run_python(COUNT, timeout=120, fresh=fresh).strip().splitlines()[-1])


@pytest.mark.slow
def test_a_warm_child_counts_its_memory_as_a_fresh_interpreter_and_does_not_creep():
    warm, fresh = counts(fresh=False), counts(fresh=True)
    assert 0.85 * fresh["first"] <= warm["first"] <= 1.25 * fresh["first"], (warm, fresh)
    assert warm["after_touching"] - warm["first"] < 16 * MiB, f"shared pages copied on write: {warm}"
