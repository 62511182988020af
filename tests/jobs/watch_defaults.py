"""Which `watch --interval` and `--warmup-seconds` protect a script leaking 2 MiB every 12 ms into
500 MiB of headroom (issue 63; the defaults in watchdog/daemon/timeaxis.py come from it). Not a
test: a measurement, run by hand (about 15 s a run on 2 cores).

The script (tests/jobs/gpt_script.py --sigterm=save, plus any EXTRA flags: `--load-seconds=6`,
`--leak=0`) runs under `supervise --max-restarts 0`, `watch --cmd-pattern` beside it with
`--memory-limit` its floor (a first run's) + 500 MiB and `--checkpoint-seconds 2`. Per setting and
repeat: the reading at the signal against the budget B, and the job's kernel high-water mark.

    .venv/bin/python tests/jobs/watch_defaults.py . '2:30 0.5:30 0.25:30 0.1:30 0.1:5' 1 [EXTRA...]
"""
import json, os, re, signal, subprocess, sys, tempfile, time
from pathlib import Path

repo, settings, repeats = Path(sys.argv[1]).resolve(), sys.argv[2].split(), int(sys.argv[3])
py = str(repo / ".venv/bin/python")
script = str(repo / "tests/jobs/gpt_script.py")
env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
MiB = 1 << 20
PEAK_BELOW = ("import resource, subprocess, sys\n"
              "status = subprocess.call(sys.argv[2:])\n"
              "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))\n"
              "sys.exit(status)")
with tempfile.TemporaryDirectory() as folder:
    probe = subprocess.run([py, script, "--max-iters=1", f"--out-dir={folder}/probe"], capture_output=True, text=True,
                           env=env, timeout=120)
    floor = int(re.search(r"rss=(\d+)", probe.stdout).group(1))
print(f"floor {floor / MiB:.0f} MiB, budget {floor / MiB + 500:.0f} MiB")
budget = floor + 500 * MiB
for setting in settings:
    interval, warmup = setting.split(":")
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            tag = Path(folder).name
            peak = Path(folder) / "peak"
            job = [py, script, "--sigterm=save", "--max-iters=1500", f"--out-dir={folder}/out", *sys.argv[4:]]
            sup = subprocess.Popen([py, "-c", PEAK_BELOW, str(peak), py, "-m", "watchdog", "--log-format", "json",
                                    "supervise", "--max-restarts", "0", "--", *job],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            watch_args = [] if interval == "default" else ["--interval", interval, "--warmup-seconds", warmup]
            daemon = subprocess.Popen([py, "-m", "watchdog", "--log-format", "json", "watch", "--cmd-pattern",
                                       re.escape(f"{folder}/out"), "--memory-limit", str(budget), "--checkpoint-seconds",
                                       "2", "--wait-seconds", "30", *watch_args],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
            out, _ = sup.communicate(timeout=300)
            daemon.send_signal(signal.SIGTERM)
            _, err = daemon.communicate(timeout=60)
            events = [json.loads(l) for l in err.splitlines() if l.startswith("{")]
            signalled = [e for e in events if e["event"] == "target_signalled"]
            attached = [e for e in events if e["event"] == "target_attached"]
            job_peak = int(peak.read_text())
            first = signalled[0] if signalled else None
            print(f"interval {interval} warmup {warmup} #{repeat}: "
                  + (f"signal at {first['bytes_used'] / MiB:.0f} MiB ({(budget - first['bytes_used']) / MiB:+.0f} MiB "
                     f"below B), step {first['step']}, {first['explanation'][:70]}" if first else "no signal")
                  + f"; job peak {job_peak / MiB:.0f} MiB ({(budget - job_peak) / MiB:+.0f} below B); "
                  + f"attached to pid {[e['pid'] for e in attached]}; {out.strip().splitlines()[-1] if out.strip() else ''}",
                  flush=True)
