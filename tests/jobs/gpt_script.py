"""A public GPT training script's shape, tiny and on CPU (nanoGPT's train.py): settings as
`--key=value` flags over the globals, a `while True` loop at module level, its own checkpoint
format (`ckpt.pt` in `--out-dir`, a dict with `iter_num`) saved every `--eval-interval`
iterations, and its own resume flag (`--init-from=resume`). Its leak is one users report: every
batch's logits appended to a global list "for an accuracy metric", never detached (2 MiB of logits
a step, and the graph they hold). A step takes `--step-seconds` at least (12 ms, as the issue's);
`--leak=0` is its clean twin; `--load-seconds` holds memory flat before the first step, as a data
set's loading does.

`--sigterm=save` saves and exits 42 on SIGTERM, at the next step (a preemption-aware script);
`--sigterm=none`, the default, as the original: no handler, a SIGTERM ends it where it stands.
`--watchdog=1`: the README's lines for a loop of one's own, added to it as a user adds them to a
module-level loop: a Watchdog started without `with`, `carry_out(action, save=save)`, and
`sys.exit(wd.last_action.exit_code)`, never `stop()`; `--memory-limit`, or `--headroom-mib` over
the job's memory now (each page once, as the watchdog counts it), is its budget. `--rebuild=1`
passes a `rebuild()` that reloads the model and the optimizer from the checkpoint, as a user
writes one: the global list is outside what it rebuilds. `--forensics=1` names what leaks.
Prints `peak=B` at its end: the highest job memory read after any step.

Prints `started iter=K pid=P rss=B memory=M budget=L` (M: its anonymous and shared pages, each counted
once, as the kernel and the watchdog count the job's memory; L: the watchdog's budget, 0 for none), `saved iter=K`, `preempted iter=K`,
`finished iter=N`.
"""

import os
import signal
import sys
import time

out_dir = "out"
init_from = "scratch"
max_iters = 1000
eval_interval = 100
step_seconds = 0.012
sigterm = "none"
watchdog = 0
trace_file = ""
memory_limit = 0
headroom_mib = 0
sample_every = 1
block = 64
leak = 1
load_seconds = 0.0
rebuild = 0
forensics = 0
for flag in sys.argv[1:]:  # nanoGPT's configurator: --key=value over the globals
    key, value = flag[2:].split("=", 1)
    key = key.replace("-", "_")
    assert key in globals(), f"unknown setting {key}"
    globals()[key] = type(globals()[key])(value)

preempted = False
if sigterm == "save":
    def on_sigterm(_signum, _frame):
        global preempted
        preempted = True  # acted on at the next step

    signal.signal(signal.SIGTERM, on_sigterm)

import torch  # noqa: E402

torch.manual_seed(1337)
vocab, width, batch = 1024, 64, 8  # logits: 8 x block x 1024 float32, 2 MiB a step at block 64
model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
checkpoint = os.path.join(out_dir, "ckpt.pt")
iter_num = 0
if init_from == "resume":
    state = torch.load(checkpoint, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    iter_num = state["iter_num"]
train_logits = []  # "for an accuracy metric": every batch's logits, never detached


def save():
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num},
               checkpoint + ".tmp")
    os.replace(checkpoint + ".tmp", checkpoint)
    print(f"saved iter={iter_num}", flush=True)
    return checkpoint


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def counted_once() -> int:
    """This process's anonymous and shared pages, its share of each (smaps_rollup's Pss_Anon + Pss_Shmem)."""
    with open("/proc/self/smaps_rollup") as handle:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in handle.read().splitlines()[1:]}
    return (kib.get("Pss_Anon", 0) + kib.get("Pss_Shmem", 0)) * 1024


def reload():
    """The training state dropped and loaded back from the checkpoint (the global list is not in it)."""
    global model, optimizer
    state = torch.load(checkpoint, weights_only=True)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab))
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(state["optimizer"])


wd = None
if watchdog:
    from watchdog import Watchdog, WatchdogConfig

    from watchdog.readers.host_memory import job_memory

    if headroom_mib:  # an emulated budget: the job's memory now and this much headroom
        memory_limit = job_memory() + headroom_mib * (1 << 20)
    wd = Watchdog(WatchdogConfig(sample_every=sample_every, source="rss", trace_file=trace_file or None,
                                 memory_limit_bytes=memory_limit or None, forensics=bool(forensics))).start()
peak = 0

time.sleep(load_seconds)  # the data's loading: memory flat before the first step
print(f"started iter={iter_num} pid={os.getpid()} rss={rss()} memory={counted_once()} budget={memory_limit}", flush=True)
while True:
    started = time.perf_counter()
    x = torch.randint(0, vocab, (batch, block))
    y = torch.randint(0, vocab, (batch, block))
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), y.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if leak:
        train_logits.append(logits)  # the leak
    iter_num += 1
    if iter_num % eval_interval == 0:
        save()
    time.sleep(max(0.0, step_seconds - (time.perf_counter() - started)))
    if wd is not None:
        peak = max(peak, job_memory())
        action = wd.step(iter_num)
        if action is not None and not wd.carry_out(action, save=save, rebuild=reload if rebuild else None):
            print(f"peak={peak}", flush=True)
            sys.exit(wd.last_action.exit_code)  # 42: a restarter runs it again with its resume flag
    if preempted:
        save()
        print(f"preempted iter={iter_num}", flush=True)
        sys.exit(42)
    if iter_num >= max_iters:
        break
print(f"peak={peak}", flush=True)
print(f"finished iter={iter_num}", flush=True)
