"""Memory as each kind of device and the host tell it: in process (the sources a `Watchdog` samples:
xla, tpu, cuda, rss, replay), and from outside a process (the readers the `watch` daemon samples a
target with, by PID). Reads, never judges: what a reading means is the station's.

Its modules are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
