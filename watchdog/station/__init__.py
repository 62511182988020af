"""The station: one memory series' path, from a sample to an action a loop carries out, and its
sinks (trace, telemetry, the Prometheus exporter and its endpoint).

Shared by every loop, in the training process (the sidecar's `Watchdog`, and through it the
trainer, Lightning and Hugging Face) and outside it (the `watch` daemon). It imports only the core:
a loop plugs in below it (how memory is read) and above it (what an action does), never inside
it.

Its modules, one job each, are mapped in watchdog/ARCHITECTURE.md (Layers).
"""
