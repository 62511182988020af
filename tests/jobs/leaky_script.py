"""A plain training script that leaks and knows nothing of hbm-watchdog: torch_xla, or CUDA.

Like most trainers it checkpoints when preempted: on SIGTERM it saves its step (atomically) at the
next step boundary and exits 42; started again, it resumes from that step. Every step it keeps
`--leak-mib` MiB of device tensors alive; on PJRT CPU device buffers live in host memory, so its
resident memory grows. `--leak-mib 0` is the clean script of the same shape. `--device cuda` runs
it on a GPU (issue 41's device check), within the budget `--memory-fraction` gives its allocator.

Lines on stdout: `started step=K pid=P`, `preempted step=K`, `finished step=N`.
"""

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--state", required=True, help="file holding the step to resume from")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--leak-mib", type=float, default=0.0)
parser.add_argument("--step-seconds", type=float, default=0.02, help="a step's pause besides its compute")
parser.add_argument("--device", choices=("xla", "cuda"), default="xla")
parser.add_argument("--memory-fraction", type=float, help="cuda: the allocator's share of the GPU, its budget")
args = parser.parse_args()

preempted = False


def on_sigterm(_signum, _frame):
    global preempted
    preempted = True  # acted on at the step boundary, never mid-step


signal.signal(signal.SIGTERM, on_sigterm)

import torch  # noqa: E402  (after the handler: a SIGTERM during the import is not lost)

if args.device == "xla":
    import torch_xla

    device, sync = torch_xla.device(), torch_xla.sync
else:  # a CUDA loop queues its steps and never waits on them
    device, sync = torch.device("cuda", 0), (lambda: None)
    if args.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
step = int(open(args.state).read()) if os.path.exists(args.state) else 0
print(f"started step={step} pid={os.getpid()}", flush=True)
weights = torch.randn(128, 128, device=device)
kept = []
leak_elements = int(args.leak_mib * (1 << 20)) // 4


def save(step: int) -> None:
    with open(args.state + ".tmp", "w") as handle:
        handle.write(str(step))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(args.state + ".tmp", args.state)


while step < args.steps:
    batch = torch.randn(32, 128, device=device)
    loss = torch.relu(batch @ weights).mean()
    if leak_elements:
        kept.append(torch.full((leak_elements,), float(step), device=device))  # held forever: the leak
    sync()
    step += 1
    time.sleep(args.step_seconds)
    if preempted:
        save(step)
        print(f"preempted step={step}", flush=True)
        sys.exit(42)
save(step)
if preempted:  # signalled after its last step: saved all the same, and says so, as a preempted job does
    print(f"preempted step={step}", flush=True)
    sys.exit(42)
print(f"finished step={step}", flush=True)
