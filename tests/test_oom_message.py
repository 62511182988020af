"""XLA's and PyTorch CUDA's out-of-memory messages, parsed. Pure, fast.

Each message below follows the layout of a public report, cited above it: the wording, the order
of the lines and the fields are the report's; the figures, op names and paths are made up here
(so each expected number is known exactly), and the log prefixes are the kinds those reports show.
"""

from __future__ import annotations

import pytest

from watchdog.core.oom_message import parse, size_bytes

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10

# Layout: erfanzar/EasyDeL#166 (a JAX train step on TPU v4, "XLA:TPU compile permanent error"), and
# OpenXLA's docs/errors/error_1000.md.
COMPILE_HBM = """\
jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 40.50G of 15.48G hbm. Exceeded hbm capacity by 25.02G.

Total hbm usage >= 41.75G:
    reserved          1.25G
    program          40.50G
    arguments            0B

Output size 0B; shares 0B with arguments.

Program hbm requirement 40.50G:
    global            1.14M
    scoped            4.56M
    HLO temp         40.49G (100.0% utilization: Unpadded (40.30G) Padded (40.30G), 0.3% fragmentation (120.00M))

  Largest program allocations in hbm:

  1. Size: 4.00G
     Operator: op_name="jit(train_step)/jit(main)/transformer/h/0/attention/dot_general[dimension_numbers=(((3,), (3,)), ((0, 2), (0, 2)))]" source_file="/home/me/model/attention.py" source_line=212
     Shape: f32[64,4096,4096]{1,2,0:T(8,128)}
     Unpadded size: 4.00G
     XLA label: fusion.1265.remat3 = fusion(custom-call.224, custom-call.241), kind=kOutput, calls=fused_computation.957
     Allocation type: HLO temp
     ==========================

  2. Size: 4.00G
     Operator: op_name="jit(train_step)/jit(main)/transformer/h/1/attention/dot_general" source_file="/home/me/model/attention.py" source_line=212
     Shape: f32[64,4096,4096]{1,2,0:T(8,128)}
     Unpadded size: 4.00G
     Allocation type: HLO temp
     ==========================

  3. Size: 512.00M
     Operator: op_name="jit(train_step)/jit(main)/transformer/h/0/mlp/dot_general" source_file="/home/me/model/mlp.py" source_line=40
     Shape: bf16[64,4096,1024]{2,1,0:T(8,128)(2,1)}
     Unpadded size: 512.00M
     Allocation type: HLO temp
     ==========================

  4. Size: 256.00M
     Shape: f32[65536,1024]{1,0:T(8,128)}
     Unpadded size: 256.00M
     Allocation type: parameter
     ==========================
"""

# Layout: pytorch/xla#9524 (PyTorch/XLA on TPU, "Ran out of memory in memory space vmem").
COMPILE_VMEM = """\
RuntimeError: Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem. Used 24.50M of 16.00M vmem. Exceeded vmem capacity by 8.50M.
"""

# Layout: pytorch/xla#1735 (Colab TPU, "Attempting to reserve ... at the bottom of memory", the HBM
# capacity table with byte counts in parentheses), and OpenXLA's docs/errors/error_0101.md.
RUNTIME_RESERVE = """\
RuntimeError: Resource exhausted: From /job:tpu_worker/replica:0/task:0:
Attempting to reserve 3.95G at the bottom of memory. That was not possible. There are 1.92G free, 0B reserved, and 1.92G reservable.;
HBM capacity 8.00G:
       Top-of-Memory reserved:  529.00M (     554,696,704 bytes)
          Currently allocated:    6.08G (   6,532,939,776 bytes)
          Program requirement:    3.95G (   4,237,689,856 bytes)
                               ------------
      Available after request:   -2.55G (  -2,735,391,744 bytes)
; attempting reservation for program memory
"""

# Layout: AI-Hypercomputer/tpu-recipes#151 (the newer one-line "Error loading program" wording).
RUNTIME_LOAD = "RESOURCE_EXHAUSTED: Error loading program 'jit__multi_slice': Attempting to reserve 6.14G at the bottom of memory. That was not possible. There are 5.00G free, 0B reserved, and 5.00G reservable.\n"

# Layout: pytorch/xla#8020 (PyTorch/XLA on a TPU pod, "Error allocating device buffer"), with the
# profiler's lines around it, and OpenXLA's docs/errors/error_0100.md.
ALLOCATION_TPU = """\
  0%|          | 1/300 [12:22<61:42:17, 742.93s/it]
RuntimeError: Bad StatusOr access: RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 196.00M. That was not possible. There are 134.44M free.; (1x0x0_HBM0): while running replica 0 and partition 0 of a replicated computation (other replicas may have failed as well).
WARNING:pt-xla-profiler:================================================================================
WARNING:pt-xla-profiler:Unlowered Op usage summary (more of these ops, lower performance)
"""

# Layout: jax-ml/jax#13428 (GPU, "Out of memory while trying to allocate N bytes", "Peak buffers"),
# theislab/moscot#51 (tab-indented, an "Entry Parameter Subshape" buffer), with an absl prefix.
ALLOCATION_GPU = """\
E1103 18:23:55.102059 3413776 pjrt_stream_executor_client.cc:2086] Execution of replica 0 failed: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6291456 bytes.
BufferAssignment OOM Debugging.
BufferAssignment stats:
             parameter allocation:    6.00MiB
              constant allocation:         0B
        maybe_live_out allocation:    6.00MiB
     preallocated temp allocation:         0B
                 total allocation:   12.00MiB
              total fragmentation:         0B (0.00%)
Peak buffers:
\tBuffer 1:
\t\tSize: 6.00MiB
\t\tOperator: op_type="concatenate" op_name="jit(concatenate)/jit(main)/concatenate[dimension=0]" source_file="/home/me/nerf/models.py" source_line=689
\t\tXLA Label: concatenate
\t\tShape: f32[4096,128,3]
\t\t==========================

\tBuffer 2:
\t\tSize: 384.0KiB
\t\tEntry Parameter Subshape: f32[256,128,3]
\t\t==========================
"""

# Layout: google-deepmind/jax_privacy#10 (the allocator's "Failed to allocate request for").
ALLOCATION_GPU_REQUEST = "Original error: RESOURCE_EXHAUSTED: Failed to allocate request for 176.00MiB (184549376B) on device ordinal 0\n"

# Layout: google-research/t5x#870 and AlphaFold's ColabFold#62: an Operator whose op_name runs
# over two lines.
WRAPPED_OPERATOR = """\
Ran out of memory in memory space hbm. Used 20.00G of 16.00G hbm. Exceeded hbm capacity by 4.00G.
  Largest program allocations in hbm:

  1. Size: 64.00M
     Operator: op_type="broadcast_in_dim" op_name="jit(apply_fn)/scan/while/body/broadcast_in_dim[ broadcast_dimensions=(  )
                                                shape=(1024, 245, 64) ]" source_file="/home/me/fold/mapping.py" source_line=177
     Shape: f32[1024,245,64]{1,2,0:T(8,128)}
     Allocation type: HLO temp
     ==========================
"""


def within_one_percent(parsed: int, printed: float) -> bool:
    return abs(parsed - printed) <= 0.01 * abs(printed)


def test_a_compile_time_hbm_oom_names_its_sizes_allocations_and_python_lines():
    message = parse(COMPILE_HBM)
    assert (message.kind, message.memory_space) == ("compile", "hbm")
    assert within_one_percent(message.used_bytes, 40.50 * GiB)
    assert within_one_percent(message.capacity_bytes, 15.48 * GiB)
    assert within_one_percent(message.exceeded_bytes, 25.02 * GiB)
    assert message.requested_bytes is None
    first, second, third, argument = message.allocations
    assert first.size_bytes == 4 * GiB and first.shape == "f32[64,4096,4096]"
    assert first.op_name.startswith("jit(train_step)/jit(main)/transformer/h/0/attention/dot_general[")
    assert (first.source_file, first.source_line, first.allocation_type) == ("/home/me/model/attention.py", 212,
                                                                             "HLO temp")
    assert third.shape == "bf16[64,4096,1024]" and third.source_line == 40
    assert (argument.op_name, argument.source_file, argument.allocation_type) == (None, None, "parameter")
    sites = [(s.file, s.line, s.bytes, s.allocations) for s in message.python_sites]
    assert sites == [("/home/me/model/attention.py", 212, 8 * GiB, 2), ("/home/me/model/mlp.py", 40, 512 * MiB, 1)]


def test_another_memory_space_is_named_as_printed():
    message = parse(COMPILE_VMEM)
    assert (message.kind, message.memory_space) == ("compile", "vmem")
    assert (message.used_bytes, message.capacity_bytes) == (round(24.5 * MiB), 16 * MiB)
    assert message.exceeded_bytes == round(8.5 * MiB) and message.allocations == []


def test_a_program_that_cannot_be_loaded_is_a_runtime_oom_and_the_byte_counts_win():
    message = parse(RUNTIME_RESERVE)
    assert (message.kind, message.memory_space) == ("runtime", "hbm")
    assert within_one_percent(message.requested_bytes, 3.95 * GiB)
    assert message.capacity_bytes == 8 * GiB
    assert message.used_bytes == 6_532_939_776, "the exact count in parentheses, not 6.08G"
    assert within_one_percent(message.exceeded_bytes, (3.95 - 1.92) * GiB)
    newer = parse(RUNTIME_LOAD)
    assert newer.kind == "runtime" and within_one_percent(newer.requested_bytes, 6.14 * GiB)
    assert within_one_percent(newer.exceeded_bytes, 1.14 * GiB)


def test_a_buffer_that_cannot_be_allocated_is_an_allocation_oom_among_other_log_lines():
    message = parse(ALLOCATION_TPU)
    assert (message.kind, message.memory_space) == ("allocation", "hbm")
    assert message.requested_bytes == 196 * MiB
    assert within_one_percent(message.exceeded_bytes, (196 - 134.44) * MiB)


def test_a_gpu_allocators_message_lists_its_peak_buffers():
    message = parse(ALLOCATION_GPU)
    assert (message.kind, message.memory_space, message.requested_bytes) == ("allocation", "device", 6291456)
    concat, parameter = message.allocations
    assert (concat.size_bytes, concat.shape, concat.source_line) == (6 * MiB, "f32[4096,128,3]", 689)
    assert concat.op_name == "jit(concatenate)/jit(main)/concatenate[dimension=0]"
    assert (parameter.size_bytes, parameter.shape, parameter.allocation_type) == (384 * KiB, "f32[256,128,3]",
                                                                                 "parameter")
    assert [(s.file, s.line) for s in message.python_sites] == [("/home/me/nerf/models.py", 689)]
    request = parse(ALLOCATION_GPU_REQUEST)
    assert (request.kind, request.memory_space, request.requested_bytes) == ("allocation", "device", 184549376)


def test_an_operator_over_two_lines_keeps_its_source_line():
    (allocation,) = parse(WRAPPED_OPERATOR).allocations
    assert allocation.op_name.startswith("jit(apply_fn)/scan/while/body/broadcast_in_dim[")
    assert (allocation.source_file, allocation.source_line) == ("/home/me/fold/mapping.py", 177)


def test_with_two_messages_the_last_is_reported():
    message = parse(ALLOCATION_TPU + "\nsome training lines\n" + COMPILE_VMEM)
    assert message.kind == "compile" and message.memory_space == "vmem"
    assert parse(COMPILE_VMEM + ALLOCATION_TPU).kind == "allocation"


def test_a_repeated_one_line_headline_keeps_the_list_printed_before_it():
    headline = COMPILE_HBM.splitlines()[0]
    message = parse(COMPILE_HBM + "Traceback (most recent call last):\n  ...\n" + headline + "\n")
    assert len(message.allocations) == 4 and message.python_sites[0].line == 212


def test_a_message_cut_off_mid_list_keeps_what_was_printed():
    cut = COMPILE_HBM[:COMPILE_HBM.index("  2. Size:") + 30]
    message = parse(cut)
    assert message.kind == "compile" and [a.size_bytes for a in message.allocations] == [4 * GiB, 4 * GiB]
    assert message.allocations[1].op_name is None, "its Operator line was never printed"


@pytest.mark.parametrize("text", [
    "RESOURCE_EXHAUSTED: Quota exceeded for quota metric 'Requests' of service 'storage.googleapis.com'",
    "OSError: [Errno 28] No space left on device; RESOURCE_EXHAUSTED: file system full",
    "RuntimeError: RESOURCE_EXHAUSTED: Too many open files",
    "",
    "Attempting to allocate a new tensor",  # no size, no "That was not possible": not XLA's message
])
def test_what_is_not_an_out_of_memory_message_parses_to_none(text):
    assert parse(text) is None


@pytest.mark.parametrize("text, expected", [
    ("63.80G", round(63.80 * GiB)), ("6.00MiB", 6 * MiB), ("384.0KiB", 384 * KiB), ("0B", 0), ("4.0K", 4 * KiB),
    ("176.00MiB (184549376B)", 184549376), ("529.00M (     554,696,704 bytes)", 554_696_704), ("1T", 1 << 40),
])
def test_sizes_are_binary_and_an_exact_count_wins(text, expected):
    assert size_bytes(text) == expected


def test_the_json_has_exactly_the_documented_keys():
    row = parse(COMPILE_HBM).to_json()
    assert list(row) == ["oom", "kind", "memory_space", "used_bytes", "capacity_bytes", "exceeded_bytes",
                         "requested_bytes", "free_bytes", "allocated_bytes", "reserved_unallocated_bytes",
                         "process_bytes", "processes", "limit_bytes", "allocations", "python_sites"]
    assert list(row["allocations"][0]) == ["size_bytes", "op_name", "source_file", "source_line", "shape",
                                           "allocation_type"]
    assert list(row["python_sites"][0]) == ["file", "line", "bytes", "allocations"]


# ---- PyTorch's CUDA caching allocator --------------------------------------------------------------
# Wordings as PyTorch printed them (pytorch/pytorch#13751 for 1.0, #37250 for 1.4-2.0, #99699 for
# 2.1, a torch.OutOfMemoryError of 2.5+ in chatdoc-com/OCRFlux#64); the figures are made up here.

CUDA_1_0 = ("RuntimeError: CUDA out of memory. Tried to allocate 24.00 MiB (GPU 0; 11.17 GiB total capacity; "
            "10.50 GiB already allocated; 6.81 MiB free; 320.00 MiB cached)")
CUDA_1_4 = ("RuntimeError: CUDA out of memory. Tried to allocate 512 bytes (GPU 1; 15.78 GiB total capacity; "
            "14.00 GiB already allocated; 0 bytes free; 14.25 GiB reserved in total by PyTorch) If reserved "
            "memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.")
CUDA_2_1 = """torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB.
GPU 0 has a total capacty of 23.69 GiB of which 100.00 MiB is free.
Process 4242 has 1.50 GiB memory in use. Including non-PyTorch memory,
this process has 22.00 GiB memory in use. Of the allocated memory
20.00 GiB is allocated by PyTorch, and 1.25 GiB is reserved
by PyTorch but unallocated. If reserved but unallocated memory is large
try setting max_split_size_mb to avoid fragmentation.
"""
CUDA_2_5 = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.19 GiB of which 1.00 GiB is free. Process 101 has 4.00 GiB memory in use. Process 202 "
            "has 512.00 MiB memory in use. Including non-PyTorch memory, this process has 73.50 GiB memory in use. "
            "Of the allocated memory 70.00 GiB is allocated by PyTorch, and 768.00 MiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
CUDA_NO_NVML = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
                "capacity of 7.63 GiB of which 12.00 MiB is free. Of the allocated memory 7.00 GiB is allocated "
                "by PyTorch, and 40.00 MiB is reserved by PyTorch but unallocated.")


def test_pytorch_1_0s_cuda_message_reads_cached_as_reserved_but_unallocated():
    message = parse(CUDA_1_0)
    assert (message.kind, message.memory_space, message.requested_bytes) == ("allocation", "device", 24 * MiB)
    assert message.capacity_bytes == round(11.17 * GiB) and message.allocated_bytes == round(10.5 * GiB)
    assert message.free_bytes == round(6.81 * MiB) and message.reserved_unallocated_bytes == 320 * MiB
    assert (message.process_bytes, message.processes, message.allocations) == (None, [], [])
    assert message.fragmented, "320 MiB held unused, 24 MiB asked for: no block fitted"


def test_pytorch_1_4s_cuda_message_subtracts_allocated_from_reserved_and_reads_bytes():
    message = parse(CUDA_1_4)
    assert (message.requested_bytes, message.free_bytes) == (512, 0)
    assert message.capacity_bytes == round(15.78 * GiB) and message.allocated_bytes == 14 * GiB
    assert message.reserved_unallocated_bytes == round(0.25 * GiB)


def test_pytorch_2_1s_wrapped_cuda_message_names_every_process_and_this_ones_whole_use():
    message = parse("epoch 3 step 800 loss 1.9\n" + CUDA_2_1)
    assert (message.kind, message.memory_space, message.requested_bytes) == ("allocation", "device", 256 * MiB)
    assert message.capacity_bytes == round(23.69 * GiB) and message.free_bytes == 100 * MiB
    assert message.processes == [{"pid": 4242, "bytes": round(1.5 * GiB)}]
    assert message.process_bytes == 22 * GiB and message.allocated_bytes == 20 * GiB
    assert message.reserved_unallocated_bytes == round(1.25 * GiB) and message.fragmented


def test_the_newest_cuda_message_under_torchrun_lists_each_other_process():
    message = parse(CUDA_2_5)
    assert message.requested_bytes == 2 * GiB and message.free_bytes == 1 * GiB
    assert message.processes == [{"pid": 101, "bytes": 4 * GiB}, {"pid": 202, "bytes": 512 * MiB}]
    assert message.process_bytes == round(73.5 * GiB) and message.allocated_bytes == 70 * GiB
    assert message.reserved_unallocated_bytes == 768 * MiB and not message.fragmented
    no_nvml = parse(CUDA_NO_NVML)
    assert (no_nvml.process_bytes, no_nvml.processes) == (None, [])
    assert no_nvml.allocated_bytes == 7 * GiB and no_nvml.reserved_unallocated_bytes == 40 * MiB


def test_the_oldest_cuda_message_has_no_figures_and_the_last_cuda_message_is_the_one_read():
    bare = parse("RuntimeError: CUDA error: out of memory\n")
    assert (bare.kind, bare.memory_space, bare.requested_bytes, bare.capacity_bytes) == ("allocation", "device",
                                                                                         None, None)
    both = parse(CUDA_1_0 + "\nretrying with a smaller batch\n" + CUDA_2_5)
    assert both.requested_bytes == 2 * GiB and len(both.processes) == 2
    first = parse(CUDA_2_5 + "\n" + CUDA_NO_NVML)
    assert first.requested_bytes == 64 * MiB and first.processes == [], "the next message's figures are not its own"


# ---- `hbm-watchdog postmortem --oom-log` --------------------------------------------------------

def test_postmortem_reads_the_message_among_a_jobs_other_output(tmp_path, capsys):
    import json

    from watchdog.commands.cli import main

    log = tmp_path / "job.log"
    log.write_text("step 100 loss 2.3\n" * 50 + COMPILE_HBM + "Traceback (most recent call last):\n")
    assert main(["postmortem", "--oom-log", str(log), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["oom"] is True and row["kind"] == "compile" and row["memory_space"] == "hbm"
    assert row["python_sites"][0] == {"file": "/home/me/model/attention.py", "line": 212, "bytes": 8 * GiB,
                                      "allocations": 2}
    assert main(["postmortem", "--oom-log", str(log)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("out of memory: the program does not fit in hbm (found while compiling)")
    assert "8.0 GiB  /home/me/model/attention.py:212  (2 allocations)" in text


def test_postmortem_says_how_to_get_python_lines_when_the_message_has_none(tmp_path, capsys):
    from watchdog.commands.cli import main

    log = tmp_path / "job.log"
    log.write_text(COMPILE_HBM.replace('source_file="/home/me/model/attention.py" source_line=212', "")
                   .replace('source_file="/home/me/model/mlp.py" source_line=40', ""))
    assert main(["postmortem", "--oom-log", str(log)]) == 0
    assert "XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1" in capsys.readouterr().out


def test_postmortem_on_a_log_with_no_oom_is_one_line_and_exit_2(tmp_path, capsys):
    from watchdog.commands.cli import main

    log = tmp_path / "quota.log"
    log.write_text("RESOURCE_EXHAUSTED: Quota exceeded for quota metric 'Requests'\n")
    assert main(["postmortem", "--oom-log", str(log)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no out-of-memory message" in err and str(log) in err
    assert main(["postmortem", "--oom-log", str(tmp_path / "missing.log")]) == 2
    assert "missing.log" in capsys.readouterr().err
    assert main(["postmortem", "--oom-log", str(tmp_path)]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_postmortem_explains_a_cuda_oom_and_names_fragmentation(tmp_path, capsys):
    import json

    from watchdog.commands.cli import main

    log = tmp_path / "job.log"
    log.write_text("step 10\n" * 20 + CUDA_2_1)
    assert main(["postmortem", "--oom-log", str(log), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["kind"], row["memory_space"], row["requested_bytes"]) == ("allocation", "device", 256 * MiB)
    assert row["processes"] == [{"pid": 4242, "bytes": round(1.5 * GiB)}] and row["process_bytes"] == 22 * GiB
    assert main(["postmortem", "--oom-log", str(log)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("out of memory: a buffer could not be allocated in device")
    assert "reserved but unallocated 1.2 GiB" in text and "other processes on the device: pid 4242 1.5 GiB" in text
    assert "fragmentation:" in text


# ---- linear by construction (issue 52) -------------------------------------------------------------

def _unbounded_greedy_repeats(pattern) -> int:
    """How many `*`, `+` or `{n,}` in a compiled pattern may backtrack: greedy and unbounded. A
    possessive repeat (`*+`, `++`) never gives back what it took; a lazy one (`+?`) here always
    meets a literal at once."""
    import re._parser as parser

    count = 0

    def walk(items):
        nonlocal count
        for op, arg in items:
            if op is parser.MAX_REPEAT:
                low, high, sub = arg
                count += high == parser.MAXREPEAT
                walk(sub)
            elif op in (parser.MIN_REPEAT, parser.POSSESSIVE_REPEAT):
                walk(arg[2])
            elif op is parser.SUBPATTERN:
                walk(arg[-1])
            elif op is parser.BRANCH:
                for branch in arg[1]:
                    walk(branch)
            elif op in (parser.ASSERT, parser.ASSERT_NOT):
                walk(arg[1])
            elif op is parser.ATOMIC_GROUP:
                walk(arg)

    walk(parser.parse(pattern.pattern, pattern.flags))
    return count


def test_every_pattern_of_the_message_parser_is_possessive_so_no_line_can_make_it_backtrack():
    """Issue 52's class, held structurally rather than by a timed test: `Shape:` followed by n `{`
    took 21 s at 100,000 through `\\{[^}]*\\}\\s*$`. No pattern of the parser may hold a greedy
    unbounded repeat; the layout suffix is cut without a regex."""
    import re

    import watchdog.core.oom_message as module

    patterns = {name: value for name, value in vars(module).items() if isinstance(value, re.Pattern)}
    assert len(patterns) >= 30, sorted(patterns)
    import ast
    import inspect

    inline = [node.lineno for node in ast.walk(ast.parse(inspect.getsource(module)))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.func.attr != "compile"]
    assert inline == [], f"patterns compiled where they are used, out of this check's sight: lines {inline}"
    offenders = {name: n for name, pattern in patterns.items() if (n := _unbounded_greedy_repeats(pattern))}
    assert offenders == {}, offenders


def test_a_shape_of_many_braces_and_an_unfinished_escape_leave_the_message_whole():
    """Issue 52: an allocation's `Shape:` of 100,000 `{` (it was quadratic), and two stray bytes (ESC ])
    100 lines before PyTorch's message, which hid it ("no out-of-memory message")."""
    shape = "Shape: f32[8]" + "{" * 100_000
    message = parse(f"{COMPILE_HBM}\n  1. Size: 4.00M\n     {shape}\n")
    assert message is not None and message.kind == "compile"
    hidden = "start\n\x1b]\n" + "a line\n" * 100 + CUDA_2_5
    found = parse(hidden)
    assert found is not None and found.requested_bytes == parse(CUDA_2_5).requested_bytes


def test_a_malformed_size_is_unknown_not_a_wrong_number():
    """Issue 53: "Tried to allocate 1.5.5 GiB" was read as 2 bytes (the "1.5" before the second dot)."""
    message = parse("CUDA out of memory. Tried to allocate 1.5.5 GiB. GPU 0 has a total capacity of "
                    "79.18 GiB of which 70.46 GiB is free.")
    assert message is not None and message.kind == "allocation"
    assert message.requested_bytes is None and message.capacity_bytes is not None
