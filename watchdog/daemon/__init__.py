"""`hbm-watchdog watch`: a daemon outside the training process that predicts its OOM and sends the
preemption signal early enough for the job's own checkpoint (commands/watch.py is its command
line).

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
