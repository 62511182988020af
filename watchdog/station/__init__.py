"""The station: one memory series' path, from a sample to an action a host carries out, and its sinks.

Shared by every host, in the training process (the sidecar's `Watchdog`, and through it the
trainer, Lightning and Hugging Face) and outside it (the `watch` daemon):

    station.py      sample -> trace -> telemetry -> Judge -> verdict, action, and the lines they log
    telemetry.py    what a station last saw, for scrapes (one per series)
    exporter.py     telemetry as Prometheus metric families (a collector), read at scrape time
    endpoint.py     /metrics: the HTTP server, bounded whatever its clients do; knows no station
    trace_sink.py   the trace CSV, best-effort: a failing disk never reaches training
    leak_report.py  the leak report's lines, up and cleared
    reports.py      an action's block for the terminal

It imports only the core: a host plugs in below it (how memory is read) and above it (what an
action does), never inside it.
"""
