"""`hbm-watchdog watch`: a daemon outside the training process that predicts its OOM and sends the
preemption signal early enough for the job's own checkpoint (see watch.py in commands/ for the CLI).

    timeaxis   seconds -> the detector's and policy's sample counts (pure)
    targets    which process to watch: --pid, --cmd-pattern, --pidfile; identity against PID reuse
    readers    the reading seam: a reader gives per-device memory (a process tree's RSS; libtpu's chips)
    signalling signal names, the escalation ladder (pure), sending only to an identified process
    metrics    the daemon's own gauges beside the sidecar's telemetry, one registry for every device
    loop       the daemon: attach, sample on a time axis, judge, act, re-attach after a restart
"""
