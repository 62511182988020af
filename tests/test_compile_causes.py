"""torch_xla's compile analysis, parsed, and a recompilation's cause in words. Pure, fast.

The real-runtime side (the text torch_xla 2.9 writes on PJRT CPU) is covered by
tests/test_xla_recompilation.py; REAL below is one such report, verbatim but for the paths.
"""

from __future__ import annotations

from watchdog.core.compile_causes import (
    Frame,
    SourceView,
    explain,
    parse_compile_analysis,
)
from watchdog.core.recompilation import Recompilation

REAL = """
Compilation Analysis: ================================================================================
Compilation Analysis: Compilation Cause
Compilation Analysis:   most likely user code trying to access tensor value before torch_xla.sync
Compilation Analysis: Graph Info: 
Compilation Analysis:   Graph Hash: d28b0993a55ac1167693c51c9266ae99
Compilation Analysis:   Number of Graph Inputs: 3
Compilation Analysis:   Number of Graph Outputs: 1
Compilation Analysis: Python Frame Triggered Execution: 
Compilation Analysis:   training_step (/home/me/model.py:88)
Compilation Analysis:   _call_lightning_module_hook (/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/call.py:177)
Compilation Analysis:   ..........
Compilation Analysis: --------------------------------------------------------------------------------
Compilation Analysis: ================================================================================

Computation hash: 7dca0451225e8b8382152a176f3c1d49

Post Compilation Analysis: ================================================================================
Post Compilation Analysis: Graph input size: 0.000001 GB
Post Compilation Analysis: Graph output size: 0.000000 GB
Post Compilation Analysis: Aliased Input size: 0.000000 GB
Post Compilation Analysis: Intermediate tensor size: 0.000000 GB
Post Compilation Analysis: Compiled program size: 0.000002 GB
Post Compilation Analysis: --------------------------------------------------------------------------------
Post Compilation Analysis: ================================================================================
"""

SYNC_FRAMES = ["sync (/venv/lib/python3.11/site-packages/torch_xla/torch_xla.py:87)",
               "_one_step (/home/me/loop.py:407)", "run (/home/me/loop.py:330)"]


def report(cause: str, frames: list[str], *, graph_hash: str = "h", inputs: int = 12, input_gb: str = "0.001000") -> str:
    """One compilation in torch_xla 2.9's layout (torch_xla/csrc/debug_util.cpp)."""
    lines = ["Compilation Cause", f"  {cause}", "Graph Info: ", f"  Graph Hash: {graph_hash}",
             f"  Number of Graph Inputs: {inputs}", "  Number of Graph Outputs: 3",
             "Python Frame Triggered Execution: ", *[f"  {f}" for f in frames], "-" * 80, "=" * 80]
    post = [f"Graph input size: {input_gb} GB", "Graph output size: 0.000000 GB", "Compiled program size: 0.000010 GB"]
    return ("\n".join(f"Compilation Analysis: {line}" for line in lines) + "\n\n"
            + "\n".join(f"Post Compilation Analysis: {line}" for line in post) + "\n\n")


FOUND = Recompilation(step=150, trigger="rate", warmup_compiles=4, compiles_after_warmup=30,
                      steps_after_warmup=30, steps_per_compile=1.0)
SLOW = Recompilation(step=400, trigger="count", warmup_compiles=5, compiles_after_warmup=6,
                     steps_after_warmup=300, steps_per_compile=50.0)
SOURCE = SourceView(is_library=lambda path: "site-packages" in path,
                    code_at=lambda path, line: {("/home/me/model.py", 88): 'self.log("loss", loss.item())',
                                                ("/home/me/loop.py", 407): "torch_xla.sync()"}.get((path, line)),
                    shorten=lambda path: path.replace("/home/me/", ""))


def test_a_real_report_parses_into_cause_graph_frames_and_sizes():
    [record] = parse_compile_analysis(REAL)
    assert record.kind == "value_read"
    assert record.graph_hash == "d28b0993a55ac1167693c51c9266ae99"
    assert (record.inputs, record.outputs) == (3, 1)
    assert record.frames[0] == Frame("training_step", "/home/me/model.py", 88)
    assert record.frames_truncated
    assert record.input_bytes == round(0.000001 * (1 << 30))
    assert record.program_bytes == round(0.000002 * (1 << 30))


def test_several_reports_and_a_torn_last_one():
    text = report("user torch_xla.sync", SYNC_FRAMES, graph_hash="a") * 2 + REAL
    torn = text + "Compilation Analysis: Compilation Cause\nCompilation Analysis:   user torch"
    assert [r.kind for r in parse_compile_analysis(text)] == ["step_boundary", "step_boundary", "value_read"]
    assert len(parse_compile_analysis(torn)) == 3, "a report still being written is not a record yet"
    assert parse_compile_analysis("noise\nExecution Analysis: Execution Cause\n") == []


def test_a_value_read_names_the_users_line_and_code():
    text = "".join(report("most likely user code trying to access tensor value before torch_xla.sync",
                          ["training_step (/home/me/model.py:88)",
                           "_call (/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/call.py:177)"],
                          graph_hash=f"g{i}", inputs=5 + i) for i in range(3))
    cause = explain(FOUND, parse_compile_analysis(text), compiles_in_window=3, window_steps=3, source=SOURCE)
    assert cause.kind == "value_read"
    assert (cause.file, cause.line, cause.code) == ("/home/me/model.py", 88, 'self.log("loss", loss.item())')
    assert cause.message.startswith(
        'graph recompiled every step: `self.log("loss", loss.item())` at model.py:88 reads a tensor before '
        "torch_xla.sync()")
    assert "5 -> 6 -> 7" in cause.message
    assert cause.graphs == 3
    assert "in Lightning, that is a value read from a device tensor inside a step hook and handed to " \
           "self.log(): pass the tensor itself, detached" in cause.message


def test_a_value_read_outside_a_lightning_step_hook_gets_the_general_advice():
    frames = ["running_mean (/home/me/model.py:88)"]
    text = "".join(report("most likely user code trying to access tensor value before torch_xla.sync", frames,
                          graph_hash=f"g{i}") for i in range(3))
    cause = explain(FOUND, parse_compile_analysis(text), compiles_in_window=3, window_steps=3, source=SOURCE)
    assert cause.kind == "value_read" and "Lightning" not in cause.message
    assert "read it after the sync, or log the detached tensor" in cause.message


def test_a_read_inside_a_library_names_the_users_frame_and_the_library_line():
    frames = ["convert (/venv/lib/python3.11/site-packages/lightning/pytorch/utilities/metrics.py:40)",
              "training_step (/home/me/model.py:88)"]
    text = report("most likely user code trying to access tensor value before torch_xla.sync", frames)
    cause = explain(FOUND, parse_compile_analysis(text), compiles_in_window=1, window_steps=1, source=SOURCE)
    assert cause.line == 88
    assert "(through convert in /venv/lib/python3.11/site-packages/lightning/pytorch/utilities/metrics.py:40)" \
        in cause.message


def test_a_graph_changing_at_the_sync_names_the_sync_and_says_what_the_runtime_cannot():
    text = "".join(report("user torch_xla.sync", SYNC_FRAMES, graph_hash=f"g{i}") for i in range(3))
    cause = explain(SLOW, parse_compile_analysis(text), compiles_in_window=3, window_steps=150, source=SOURCE)
    assert cause.kind == "graph_changes"
    assert (cause.file, cause.line, cause.code) == ("/home/me/loop.py", 407, "torch_xla.sync()")
    assert cause.message.startswith("the step's graph changes every ~50 steps: each new graph is compiled at "
                                    "`torch_xla.sync()` at loop.py:407")
    assert "same 12 inputs" in cause.message
    assert "not the op or shape that changed" in cause.message


def test_inputs_that_change_size_are_named_as_an_input_shape_change():
    text = "".join(report("user torch_xla.sync", SYNC_FRAMES, graph_hash=f"g{i}", input_gb=gb)
                   for i, gb in enumerate(["0.000004", "0.000008", "0.000012"]))
    cause = explain(SLOW, parse_compile_analysis(text), compiles_in_window=3, window_steps=150, source=SOURCE)
    assert "an input's shape changes: 4.2 KiB -> 8.4 KiB -> 12.6 KiB" in cause.message


def test_the_dominant_cause_wins_and_the_others_are_counted():
    read = report("most likely user code trying to access tensor value before torch_xla.sync",
                  ["training_step (/home/me/model.py:88)"])
    text = read * 3 + report("user torch_xla.sync", SYNC_FRAMES)
    cause = explain(FOUND, parse_compile_analysis(text), compiles_in_window=4, window_steps=4, source=SOURCE)
    assert cause.kind == "value_read" and cause.line == 88
    assert "(1 other compilation elsewhere)" in cause.message


def test_without_reports_the_finding_says_what_it_knows_and_why_not_more():
    cause = explain(FOUND, [], compiles_in_window=5, window_steps=5,
                    unavailable="torch_xla writes its compile analysis only in local process 0")
    assert cause.kind == "unknown" and cause.file is None
    assert cause.message == ("XLA compiles a new graph every step after warm-up (30 since, 4 during warm-up); "
                             "cause unknown: torch_xla writes its compile analysis only in local process 0")
    silent = explain(FOUND, [], compiles_in_window=5, window_steps=5)
    assert "reported none of the 5 compilations" in silent.message
    stopped = explain(FOUND, [], compiles_in_window=0, window_steps=1000)
    assert stopped.kind == "stopped" and "the recompilation stopped" in stopped.message


def test_a_sync_inside_a_library_names_the_library_line_between_it_and_the_user():
    frames = ["sync (/venv/lib/python3.11/site-packages/torch_xla/torch_xla.py:87)",
              "mark_step (/venv/lib/python3.11/site-packages/torch_xla/core/xla_model.py:1032)",
              "wrapper (/venv/lib/python3.11/site-packages/typing_extensions.py:3140)",
              "optimizer_step (/venv/lib/python3.11/site-packages/lightning/pytorch/plugins/precision/xla.py:75)",
              "fit (/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/trainer.py:584)",
              "main (/home/me/train.py:20)"]
    cause = explain(SLOW, parse_compile_analysis(report("user torch_xla.sync", frames)), compiles_in_window=1,
                    window_steps=50, source=SOURCE)
    assert (cause.file, cause.line) == ("/home/me/train.py", 20)
    assert "main() at train.py:20 (through optimizer_step in " \
           "/venv/lib/python3.11/site-packages/lightning/pytorch/plugins/precision/xla.py:75)" in cause.message
