"""A libtpu runtime-metrics server for tests: tpu-info's own gRPC service, serving per-chip traces.

On a TPU VM, libtpu serves `tpu.monitoring.runtime.RuntimeMetricService` on localhost:8431 and
tpu-info reads it. This server implements that service with the stubs tpu-info ships
(`tpu_info/proto/tpu_metric_service_pb2_grpc.py`), over the same local-credentials channel its
client opens, and answers from one recorded trace per chip (the trace CSV format): each memory
usage request serves the next sample of every chip. So a test drives tpu-info's real client
functions, and our reader through them, over a real socket; only libtpu itself is missing.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Sequence

import grpc
from tpu_info.metrics import MetricName
from tpu_info.proto import tpu_metric_service_pb2 as pb
from tpu_info.proto import tpu_metric_service_pb2_grpc as pb_grpc

from watchdog.core.sample import Sample


class TraceMetricService(pb_grpc.RuntimeMetricServiceServicer):
    """Per-chip HBM usage and capacity from traces; the duty cycle is a constant."""

    def __init__(self, traces: dict[int, Sequence[Sample]], duty_cycle_pct: float = 87.5):
        if not traces or any(not samples for samples in traces.values()):
            raise ValueError("every chip needs at least one sample")
        self.traces = traces
        self.duty_cycle_pct = duty_cycle_pct
        self.usage_requests = 0
        self._lock = threading.Lock()

    def _row(self, chip: int, index: int) -> Sample:
        samples = self.traces[chip]
        return samples[min(index, len(samples) - 1)]  # the last sample holds once a trace ends

    def GetRuntimeMetric(self, request, context):
        name = request.metric_name
        with self._lock:
            index = max(0, self.usage_requests - 1)
            if name == MetricName.MEMORY_USAGE.value:
                index = self.usage_requests
                self.usage_requests += 1
        if name == MetricName.MEMORY_USAGE.value:
            values = {chip: pb.Gauge(as_int=self._row(chip, index).bytes_used) for chip in self.traces}
        elif name == MetricName.TOTAL_MEMORY.value:
            values = {chip: pb.Gauge(as_int=self._row(chip, index).bytes_limit or 0) for chip in self.traces}
        elif name == MetricName.DUTY_CYCLE_PCT.value:
            values = {chip: pb.Gauge(as_double=self.duty_cycle_pct) for chip in self.traces}
        else:
            context.abort(grpc.StatusCode.NOT_FOUND, f"metric {name!r} is not served by this test server")
        # Served in reverse chip order: the client must sort by device, as it does against libtpu.
        metrics = [pb.Metric(attribute=pb.Attribute(key="device-id", value=pb.AttrValue(int_attr=chip)), gauge=gauge)
                   for chip, gauge in sorted(values.items(), reverse=True)]
        return pb.MetricResponse(metric=pb.TPUMetric(name=name, metrics=metrics))


class LibtpuMetricsServer:
    """`with LibtpuMetricsServer(traces) as server:` then read `server.addr` with tpu-info's client."""

    def __init__(self, traces: dict[int, Sequence[Sample]], **service_options):
        self.service = TraceMetricService(traces, **service_options)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RuntimeMetricServiceServicer_to_server(self.service, self._server)
        # tpu-info's client opens grpc.secure_channel(addr, local_channel_credentials()): match it.
        port = self._server.add_secure_port("localhost:0", grpc.local_server_credentials())
        self.addr = f"localhost:{port}"

    def __enter__(self) -> "LibtpuMetricsServer":
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
