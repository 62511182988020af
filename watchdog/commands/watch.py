"""`hbm-watchdog watch`: protect a job whose code cannot change, from outside its process.

    hbm-watchdog watch --cmd-pattern 'train\\.py' --memory-limit 30GiB --checkpoint-seconds 90

predicts the target's OOM and sends it the preemption signal (SIGTERM) early enough for its own
checkpoint-on-SIGTERM to finish; its supervisor (`hbm-watchdog supervise`, JobSet) restarts it
with its memory fresh, and the daemon re-attaches. The daemon is `watchdog.daemon`; this module
only turns flags into its configuration. Bad input is one line and exit status 2; SIGTERM or
SIGINT to the daemon ends it cleanly with status 0.
"""

from __future__ import annotations

import argparse
import signal

from watchdog.core.errors import InputError
from watchdog.core.numbers import option, parse_interval, parse_pid, parse_seconds
from watchdog.core.units import positive_size
from watchdog.daemon.timeaxis import DEFAULT_INTERVAL_SECONDS, DEFAULT_WARMUP_SECONDS
from watchdog.station.endpoint import add_metrics_options

TPU_CHIPS = ("V2", "V3", "V4", "V5E", "V5P", "V6E", "V7X")  # tpu_info.device.TpuChip, listed without importing it



def configure(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target (exactly one)")
    target.add_argument("--pid", type=option(parse_pid), help="a process and its children (resident memory)")
    target.add_argument("--cmd-pattern", metavar="REGEX",
                        help="the process whose command line matches (the largest, when several do); "
                             "followed across restarts")
    target.add_argument("--pidfile", metavar="FILE", help="the process whose PID the job writes to FILE; "
                                                           "followed across restarts")
    target.add_argument("--wait-seconds", type=option(parse_seconds), default=300.0, metavar="S",
                        help="wait this long for the target to appear, at start and after it exits (default 300)")

    memory = parser.add_argument_group("memory read (default: the target's resident memory)")
    memory.add_argument("--tpu", action="store_true",
                        help="judge every TPU chip of this host, through libtpu's runtime metrics; the target "
                             "is the process signalled")
    memory.add_argument("--gpu", action="store_true",
                        help="judge every GPU of this host through NVML (nvidia-ml-py): the memory the target's "
                             "processes hold on each, against what the other processes leave; no CUDA context")
    memory.add_argument("--tpu-address", default="localhost:8431", metavar="HOST:PORT",
                        help="libtpu's runtime-metrics endpoint (default %(default)s)")
    memory.add_argument("--tpu-chip", choices=TPU_CHIPS, type=str.upper, metavar="TYPE",
                        help=f"chip type ({', '.join(TPU_CHIPS)}) when it cannot be read from the PCI bus "
                             "(a container without /sys/bus/pci)")

    timing = parser.add_argument_group("time axis")
    timing.add_argument("--interval", type=option(parse_interval), default=DEFAULT_INTERVAL_SECONDS, metavar="S",
                        help=f"seconds between samples (default {DEFAULT_INTERVAL_SECONDS:g}: a leak that fills the "
                             "headroom in 2 s or more is signalled before the limit)")
    timing.add_argument("--checkpoint-seconds", type=option(parse_seconds), default=60.0, metavar="S",
                        help="how long the job takes to save and exit on the signal (default 60)")
    timing.add_argument("--safety-seconds", type=option(parse_seconds), metavar="S",
                        help="added to the checkpoint time (default: two intervals)")
    timing.add_argument("--warmup-seconds", type=option(parse_seconds), default=DEFAULT_WARMUP_SECONDS, metavar="S",
                        help=f"a new process's start-up, not judged for a trend (default {DEFAULT_WARMUP_SECONDS:g}; "
                             "memory at the limit, or whose pace would take it there, is acted on even then)")
    budgets = parser.add_argument_group("budgets")
    budgets.add_argument("--memory-limit", type=option(positive_size), metavar="SIZE",
                        help="memory budget, e.g. 30GiB (default: the host's memory)")
    budgets.add_argument("--host-memory-limit", type=option(positive_size), metavar="SIZE",
                        help="the target's host RAM budget (default: its memory cgroup's limit, else the machine's "
                             "memory); with --tpu or --gpu the host is judged beside the devices, else it is the one series")

    act = parser.add_argument_group("action")
    act.add_argument("--signal", default="TERM", help="sent before the projected OOM (default TERM)")
    act.add_argument("--signal-group", action="store_true",
                     help="signal the target's process group (never one holding the daemon or the target's supervisor)")
    act.add_argument("--grace-seconds", type=option(parse_seconds), metavar="S",
                     help="after the signal, wait this long before escalating (default: twice --checkpoint-seconds)")
    act.add_argument("--escalate", default="KILL", metavar="SIGNAL|none",
                     help="sent once if the target still runs and still grows after the grace period (default KILL)")
    act.add_argument("--no-act", action="store_true", help="warn only; never signal")

    out = parser.add_argument_group("outputs")
    add_metrics_options(out)
    out.add_argument("--trace-file", help="append every sample to this trace CSV (one per device when several)")


def build(args: argparse.Namespace):
    """Flags -> (WatchConfig, Finder, reader factory); every bad value is an InputError naming the flag.

    The reader factory is the seam for `--tpu` and `--gpu`: given the process found, it returns the
    memory source (`MemorySource`; watchdog/readers/outside.py) whose devices the daemon judges.
    """
    from pathlib import Path

    from watchdog.daemon.loop import WatchConfig
    from watchdog.readers.host_memory import RssSource
    from watchdog.daemon.signalling import parse_escalation, parse_signal
    from watchdog.daemon.targets import PatternFinder, PidfileFinder, PidFinder
    from watchdog.daemon.timeaxis import TimeAxis

    given = [flag for flag, value in (("--pid", args.pid), ("--cmd-pattern", args.cmd_pattern),
                                      ("--pidfile", args.pidfile)) if value is not None]
    if len(given) != 1:
        raise InputError("give exactly one target: --pid, --cmd-pattern or --pidfile"
                         + (f" (got {', '.join(given)})" if given else ""))
    if not args.wait_seconds >= 0:
        raise InputError(f"--wait-seconds must not be negative, got {args.wait_seconds}")
    axis = TimeAxis(interval_seconds=args.interval, checkpoint_seconds=args.checkpoint_seconds,
                    safety_seconds=args.safety_seconds, warmup_seconds=args.warmup_seconds,
                    grace_seconds=args.grace_seconds)
    config = WatchConfig(axis=axis, memory_limit_bytes=args.memory_limit,
                         signal=parse_signal(args.signal), signal_group=args.signal_group,
                         escalate_to=parse_escalation(args.escalate), act=not args.no_act,
                         wait_seconds=args.wait_seconds,
                         trace_file=Path(args.trace_file) if args.trace_file else None)
    if args.pid is not None:
        finder = PidFinder(args.pid)
    elif args.cmd_pattern is not None:
        finder = PatternFinder(args.cmd_pattern)
    else:
        finder = PidfileFinder(args.pidfile)
    host_limit = args.host_memory_limit
    if args.tpu and args.gpu:
        raise InputError("--tpu and --gpu: one accelerator per watch")
    if args.tpu:
        return config, finder, _tpu_reader_factory(args, host_limit)
    if args.gpu:
        return config, finder, _gpu_reader_factory(host_limit)
    return config, finder, lambda process: RssSource(host_limit, pid=process.pid, kernel_limits=True)


def _tpu_reader_factory(args: argparse.Namespace, host_limit: int | None):
    """One connection to libtpu's metrics for the daemon's life, checked now: a host with no chips
    or no tpu-info is exit 2 at start, not a failed read every interval."""
    from watchdog.readers.outside import TpuChipsReader, WithHost
    from watchdog.readers.sources import SourceUnavailable, TpuRuntimeSource

    chip_type = None
    if args.tpu_chip:
        from tpu_info.device import TpuChip

        chip_type = TpuChip[args.tpu_chip]
    try:
        chips = TpuRuntimeSource(grpc_addr=args.tpu_address, chip_type=chip_type)
    except SourceUnavailable as exc:
        raise InputError(f"--tpu: {exc} (install hbm-watchdog[tpu] on a TPU host, or give --tpu-chip)") from None
    return lambda process: WithHost(TpuChipsReader(process, chips), process, host_limit)


def _gpu_reader_factory(host_limit: int | None):
    """NVML started now: a host without it is exit 2 at start, not a failed read every interval."""
    from watchdog.readers.outside import GpuProcessesReader, NvmlGpus, ReaderUnavailable, WithHost

    try:
        gpus = NvmlGpus()
    except ReaderUnavailable as exc:
        raise InputError(f"--gpu: {exc}") from None
    return lambda process: WithHost(GpuProcessesReader(process, gpus), process, host_limit)


def run(args: argparse.Namespace) -> int:
    from watchdog.daemon.loop import Daemon
    from watchdog.daemon.metrics import build_watch_registry
    from watchdog.daemon.stopping import StopFlag
    from watchdog.logs import get_logger
    from watchdog.station.endpoint import serve_registry

    log = get_logger("watchdog.daemon")
    config, finder, make_reader = build(args)
    daemon = Daemon(config, finder, make_reader, stop=StopFlag())
    stopped_by: list[int] = []

    def stop(signum, _frame):
        stopped_by.append(signum)  # a handler only sets flags (StopFlag takes no lock): logging could deadlock
        daemon.stop.set()

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    server = None
    try:
        if args.metrics_port is not None:
            server = serve_registry(build_watch_registry(daemon.state, daemon.telemetry), args.metrics_port,
                                    addr=args.metrics_address)
            print(f"metrics: {server.url}", flush=True)
        log.info("watch_started", target=finder.description, interval_seconds=config.axis.interval_seconds,
                 checkpoint_margin_seconds=config.axis.margin_seconds, memory_limit_bytes=config.memory_limit_bytes,
                 signal=config.signal.name, signal_group=config.signal_group,
                 escalate=config.escalate_to.name if config.escalate_to else None, act=config.act,
                 trace_file=str(config.trace_file) if config.trace_file else None)
        reach = config.axis.reach
        log.info("watch_reach", only_at_limit_below_seconds=reach.only_at_limit_below,
                 before_limit_from_seconds=reach.before_limit_from, trend_after_seconds=reach.trend_after,
                 note=reach.words())
        status = daemon.run()
    finally:
        if server is not None:
            server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        daemon.stop.close()
    if stopped_by:
        log.info("watch_stopped", signal=signal.Signals(stopped_by[0]).name)
    return status
