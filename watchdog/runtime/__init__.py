"""Inside a training process: memory sources, the sidecar thread, the telemetry cache, the
Prometheus exporter, XLA counters and the live-tensor census. Feeds the core, never decides."""
