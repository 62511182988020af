"""`hbm-watchdog train`: the instrumented trainer with the watchdog attached.

Flags are validated here, before torch is imported, so a typo costs a second and exit 2, not a
minute of start-up. torch is imported inside `run` only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from watchdog.core.config import SOURCES
from watchdog.core.errors import InputError
from watchdog.core.numbers import option, parse_count, parse_positive, parse_seed, parse_step
from watchdog.core.units import positive_size
from watchdog.logs import console_wanted, get_logger
from watchdog.station.endpoint import add_metrics_options
from watchdog.trainer.leaks import FORMS, parse_leak_spec

DEFAULT_STEPS = 600
COUNT, POSITIVE = option(parse_count), option(parse_positive)  # ASCII digits, bounded (watchdog.core.numbers)


HLO_SOURCE_LINES_ENV = ("XLA_IR_DEBUG", "XLA_HLO_DEBUG")


def configure(parser: argparse.ArgumentParser) -> None:
    run_group = parser.add_argument_group("run")
    run_group.add_argument("--steps", type=COUNT, default=DEFAULT_STEPS, help="training steps in all (default: %(default)s)")
    run_group.add_argument("--device", choices=("auto", "xla", "cuda", "cpu"), default="auto",
                           help="auto: XLA on a TPU, else CUDA, else XLA on PJRT CPU, else CPU")
    run_group.add_argument("--num-devices", type=POSITIVE, default=1,
                           help="data-parallel replicas through torch_xla.launch (XLA only; default 1)")
    run_group.add_argument("--spmd", action="store_true",
                           help="shard the model, optimizer state and batch over every device of this "
                                "process (XLA SPMD, FSDPv2-style; one process per host); on PJRT CPU set "
                                "CPU_NUM_DEVICES")
    run_group.add_argument("--seed", type=option(parse_seed), default=0, metavar="N",
                           help="seeds the model's weights and the data")
    run_group.add_argument("--batch-size", type=POSITIVE, default=8, metavar="N", help="sequences a step")
    run_group.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW")
    run_group.add_argument("--text-file", type=Path, help="train on this file, byte level (default: synthetic data)")
    run_group.add_argument("--log-every", type=POSITIVE, default=50, help="a progress line (and a loss read) every N steps")
    run_group.add_argument("--eval-every", type=COUNT, default=0,
                           help="a small evaluation after every N training steps, under the watchdog's eval phase "
                                "(default: none)")
    run_group.add_argument("--eval-steps", type=POSITIVE, default=20, help="batches per evaluation (default: %(default)s)")
    run_group.add_argument("--eval-keep-outputs", action="store_true",
                           help="keep each evaluation batch's logits on the device until the evaluation ends "
                                "(the 'eval predictions accumulated on the device' pattern)")
    run_group.add_argument("--hlo-source-lines", action="store_true",
                           help="record each op's Python file and line in the compiled program (XLA_IR_DEBUG=1 "
                                "XLA_HLO_DEBUG=1), so an out-of-memory message names them; costs about a "
                                "quarter more time per step on PJRT CPU, compile time unchanged")
    run_group.add_argument("--probe-activations", action="store_true",
                           help="print saved-activation bytes per step with and without checkpointing, then exit")

    model = parser.add_argument_group("model")
    model.add_argument("--depth", type=POSITIVE, default=2, metavar="N", help="transformer blocks")
    model.add_argument("--width", type=POSITIVE, default=64, metavar="N", help="embedding width")
    model.add_argument("--heads", type=POSITIVE, default=4, metavar="N", help="attention heads")
    model.add_argument("--seq-len", type=POSITIVE, default=64, metavar="N", help="tokens a sequence")
    model.add_argument("--activation-checkpointing", choices=("none", "full"), default="full",
                       help="recompute each block's activations in backward (default: %(default)s)")

    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", type=Path,
                      help="where checkpoints go (default: a temporary directory, so no resume)")
    ckpt.add_argument("--checkpoint-every", type=COUNT, default=0,
                      help="also checkpoint every N steps (default: only on actions, SIGTERM and at the end)")
    ckpt.add_argument("--resume", choices=("auto", "never"), default="auto",
                      help="auto: continue from the newest checkpoint in --checkpoint-dir if there is one")
    ckpt.add_argument("--overwrite-checkpoints", action="store_true",
                      help="start over a --checkpoint-dir holding another run's checkpoints (with --resume never, "
                           "or when none of them loads); they are deleted after this run's first checkpoint")

    wd = parser.add_argument_group("watchdog")
    wd.add_argument("--inject-leak", action="append", default=[], metavar="SPEC",
                    help=f"{FORMS}, optionally @START (repeatable)")
    wd.add_argument("--memory-limit", type=option(positive_size), metavar="SIZE",
                    help="memory budget (e.g. 2GiB); needed on PJRT CPU and CPU")
    wd.add_argument("--host-memory-limit", type=option(positive_size), metavar="SIZE",
                    help="the host RAM's budget (default: the job's memory cgroup limit, else the machine's memory)")
    wd.add_argument("--no-host-watch", action="store_true", help="watch the device's memory only, not the host's")
    wd.add_argument("--memory-source", choices=SOURCES, default="auto",
                    help="where device memory numbers come from (default %(default)s: the first that reads; "
                         "replay serves --replay-trace, for demos and dashboards without the hardware)")
    wd.add_argument("--replay-trace", type=Path, help="the trace --memory-source replay serves")
    wd.add_argument("--sample-every", type=POSITIVE, default=5,
                    help="sample memory every N steps (default %(default)s: this trainer's steps are short and its "
                         "runs a few hundred steps; the library's WatchdogConfig default is 10)")
    add_metrics_options(wd)
    wd.add_argument("--trace-file", type=Path, help="append every sample to this trace CSV")
    wd.add_argument("--checkpoint-margin-steps", type=COUNT, default=50,
                    help="steps a checkpoint needs before the OOM (the policy's margin)")
    wd.add_argument("--action-cooldown-steps", type=COUNT, default=150,
                    help="after a checkpoint action whose rebuild is never measured, no other for this many steps "
                         "(PolicyConfig.cooldown_steps; default %(default)s, sized for demo runs of a few hundred "
                         "steps, the library's is 500); a measured reinit ends the quiet period at once")
    wd.add_argument("--no-watchdog", action="store_true", help="train unwatched (for comparisons)")
    wd.add_argument("--force-action", action="append", default=[], metavar="ACTION@STEP",
                    help="drill: reinit@STEP or restart@STEP acts after STEP as if the watchdog asked")


def build_config(args: argparse.Namespace):
    """Flags -> TrainConfig; every bad value is an InputError naming the flag."""
    from watchdog.core.config import WatchdogConfig
    from watchdog.core.detector import DetectorConfig
    from watchdog.core.policy import PolicyConfig
    from watchdog.trainer.loop import TrainConfig
    from watchdog.trainer.model import ModelConfig

    if args.spmd and args.num_devices > 1:
        raise InputError("--spmd drives every device from one process; it does not combine with --num-devices")
    if args.spmd and args.device not in ("auto", "xla"):
        raise InputError(f"--spmd needs XLA (--device xla or auto), got --device {args.device}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise InputError(f"--lr must be a positive finite number, got {args.lr}")
    if args.text_file is not None and not os.access(args.text_file, os.R_OK):
        raise InputError(f"--text-file {args.text_file}: not a readable file")
    if args.checkpoint_dir is not None:
        _check_path("--checkpoint-dir", args.checkpoint_dir, _check_checkpoint_dir)
    forced = tuple(_parse_forced(s) for s in args.force_action)
    restart = next((text for text in args.force_action if text.startswith("restart@")), None)
    if restart is not None and args.checkpoint_dir is None:
        raise InputError(f"--force-action {restart}: a restart resumes from --checkpoint-dir, and without one the "
                         "checkpoints are in a temporary directory: give --checkpoint-dir")
    if args.trace_file is not None and not args.no_watchdog:
        _check_path("--trace-file", args.trace_file, _check_trace_file)
    watchdog = None
    if not args.no_watchdog:
        watchdog = WatchdogConfig(
            sample_every=args.sample_every, memory_limit_bytes=args.memory_limit, trace_file=args.trace_file,
            source=args.memory_source, replay_trace=args.replay_trace,
            host_memory=not args.no_host_watch, host_memory_limit_bytes=args.host_memory_limit,
            detector=DetectorConfig(),
            policy=PolicyConfig(checkpoint_margin_steps=args.checkpoint_margin_steps,
                                cooldown_steps=args.action_cooldown_steps))
    return TrainConfig(
        steps=args.steps,
        model=ModelConfig(depth=args.depth, width=args.width, heads=args.heads, seq_len=args.seq_len,
                          activation_checkpointing=args.activation_checkpointing),
        batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed, device=args.device,
        text_file=args.text_file, leaks=tuple(parse_leak_spec(s) for s in args.inject_leak),
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
        overwrite_checkpoints=args.overwrite_checkpoints,
        log_every=args.log_every, forced_actions=forced,
        progress_bar=False if getattr(args, "quiet", False) else None,
        eval_every=args.eval_every, eval_steps=args.eval_steps, eval_keep_outputs=args.eval_keep_outputs,
        watchdog=watchdog,
    )


def _check_path(flag: str, path: Path, check) -> None:
    """`check(path)`, with a path the system will not even look up (a name too long, say) refused
    in one line like any other bad path, not as an OSError's traceback."""
    try:
        check(path)
    except OSError as exc:
        raise InputError(f"{flag} {path}: {exc.strerror or exc}") from None


def _check_checkpoint_dir(directory: Path) -> None:
    """Fail now, not at the first checkpoint an hour in: the directory must be creatable and writable."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--checkpoint-dir {directory}: {existing} is not a directory")
    if not os.access(existing, os.R_OK | os.W_OK | os.X_OK):
        raise InputError(f"--checkpoint-dir {directory}: {existing} is not readable and writable by this user")


def _check_trace_file(path: Path) -> None:
    """A trace that cannot be appended to is the user's mistake, said now; a disk filling up later is not."""
    if path.is_dir():
        raise InputError(f"--trace-file {path}: is a directory")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise InputError(f"--trace-file {path}: not writable (read-only file system or no permission)")
        return
    existing = path.absolute().parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--trace-file {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--trace-file {path}: cannot create it in {existing} (read-only file system or no permission)")


def _parse_forced(text: str):
    from watchdog.core.verdict import Action

    kinds = {"reinit": Action.CHECKPOINT_REINIT, "restart": Action.CHECKPOINT_RESTART}
    kind, _, step = text.partition("@")
    if kind not in kinds:
        raise InputError(f"--force-action {text!r}: expected reinit@STEP or restart@STEP")
    try:
        return parse_step(step), kinds[kind]
    except InputError as exc:
        raise InputError(f"--force-action {text!r}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    if args.hlo_source_lines:  # read by torch_xla once, so before it is imported
        for name in HLO_SOURCE_LINES_ENV:
            os.environ[name] = "1"
    config = build_config(args)
    if args.probe_activations:
        return _print_probe(config)
    if args.num_devices > 1:
        from watchdog.trainer.multi import train_replicated

        return train_replicated(config, args.num_devices, metrics_port=args.metrics_port,
                                metrics_address=args.metrics_address)
    from watchdog.station.telemetry import Telemetry
    from watchdog.trainer.loop import Replica, train

    strategy, replica = None, Replica()
    if args.spmd:
        from watchdog.trainer.spmd import Spmd

        strategy = Spmd()
        replica = strategy.replica  # this host among the job's hosts
    telemetry = Telemetry(rank=replica.rank)
    server = None
    if args.metrics_port is not None and config.watchdog is not None:
        from watchdog.station.exporter import serve_metrics

        server = serve_metrics(telemetry, args.metrics_port, addr=args.metrics_address)
        print(f"metrics: {server.url}", flush=True)
    try:
        result = train(config, telemetry=telemetry, replica=replica, strategy=strategy)
    finally:
        if server is not None:
            server.close()
    get_logger(__name__).info(  # the summary, for a log pipeline (or --log-file) whatever the terminal shows
        "train_finished", exit_code=result.exit_code, step=result.step, steps_total=result.steps_total,
        first_step=result.first_step, reinits=result.reinits, restarts=result.restarts,
        final_loss=result.final_loss, steps_per_second=round(result.steps_per_second, 2), verdict=result.verdict)
    if console_wanted(getattr(args, "log_format", "auto")):
        print(result.table, file=sys.stderr, flush=True)  # a table for a person at a terminal
    else:
        print(result.summary(), flush=True)  # one line for scripts and logs
    return result.exit_code


def _print_probe(config) -> int:
    from watchdog.core.units import format_bytes
    from watchdog.trainer.probe import probe

    found = probe(config.model, config.batch_size, config.seed)
    print(f"saved activations per step (batch {config.batch_size}, depth {config.model.depth}, "
          f"width {config.model.width}, seq {config.model.seq_len}): "
          f"without checkpointing {found.without_checkpointing} B ({format_bytes(found.without_checkpointing)}), "
          f"with checkpointing {found.with_checkpointing} B ({format_bytes(found.with_checkpointing)}), "
          f"{found.ratio:.1%} of it", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    from watchdog.commands.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
