"""Inside a training process: memory sources, the sidecar thread, the telemetry cache, the
Prometheus exporter, XLA counters and the flight record (the census is forensics/). Feeds the core, never decides."""
