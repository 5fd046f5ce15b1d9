"""Prometheus text exposition on ``/metrics`` (and a plain ``/healthz``).

A deliberately small registry: gauges and counters with labels, rendered in the text
format (version 0.0.4). Names carry the ``resihp_`` prefix and base units (seconds, bytes,
hertz, watts, celsius); job-level labels are ``job``, per-rank ``rank`` and ``node``.
GPU series use dcgm-exporter's label names (``gpu``, ``UUID``, ``modelName``,
``Hostname``) so existing dashboards join on them.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LabelKey = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        self._values: dict[str, dict[LabelKey, float]] = {}
        self.collectors: list[Callable[[], None]] = []  # refresh gauges just before a scrape

    def describe(self, name: str, kind: str, help_text: str) -> None:
        if kind not in ("gauge", "counter"):
            raise ValueError(f"metric kind must be gauge or counter, got {kind!r}")
        with self._lock:
            self._meta[name] = (kind, help_text)
            self._values.setdefault(name, {})

    def set(self, name: str, value: float, labels: Mapping[str, object] | None = None) -> None:
        key = tuple(sorted((k, str(v)) for k, v in (labels or {}).items()))
        with self._lock:
            self._values.setdefault(name, {})[key] = float(value)

    def inc(self, name: str, amount: float = 1.0, labels: Mapping[str, object] | None = None) -> None:
        key = tuple(sorted((k, str(v)) for k, v in (labels or {}).items()))
        with self._lock:
            series = self._values.setdefault(name, {})
            series[key] = series.get(key, 0.0) + amount

    def clear(self, name: str) -> None:
        with self._lock:
            self._values[name] = {}

    def get(self, name: str, labels: Mapping[str, object] | None = None) -> float | None:
        key = tuple(sorted((k, str(v)) for k, v in (labels or {}).items()))
        with self._lock:
            return self._values.get(name, {}).get(key)

    def render(self) -> str:
        for collect in self.collectors:
            collect()
        lines: list[str] = []
        with self._lock:
            for name in sorted(self._values):
                kind, help_text = self._meta.get(name, ("gauge", ""))
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                for key, value in sorted(self._values[name].items()):
                    label = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
                    lines.append(f"{name}{{{label}}} {_fmt(value)}" if label else f"{name} {_fmt(value)}")
        return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``registry.render()`` on ``http://host:port/metrics`` from a daemon thread."""

    def __init__(self, registry: Registry, host: str = "127.0.0.1", port: int = 0) -> None:
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                if self.path.split("?")[0] == "/metrics":
                    body = reg.render().encode()
                    ctype = "text/plain; version=0.0.4; charset=utf-8"
                elif self.path == "/healthz":
                    body, ctype = b"ok\n", "text/plain"
                else:
                    self.send_error(404, "try /metrics")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # silence per-scrape lines
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def describe_standard(reg: Registry) -> None:
    """The coordinator's metric families (see docs/control-plane.md)."""
    for name, kind, text in [
        ("resihp_state", "gauge", "1 for the coordinator's current lifecycle state"),
        ("resihp_epoch", "gauge", "current plan epoch"),
        ("resihp_iteration", "gauge", "last joined training iteration"),
        ("resihp_iteration_duration_seconds", "gauge", "observed time of the last joined iteration"),
        ("resihp_rank_step_duration_seconds", "gauge", "last reported step time of a rank"),
        ("resihp_rank_up", "gauge", "1 if the rank is alive, 0 if it exited or stopped heartbeating"),
        ("resihp_rank_speed_ratio", "gauge", "detector's speed estimate (1 = healthy, 0.5 = twice as slow)"),
        ("resihp_rank_cpu_seconds_total", "counter", "CPU time of a rank's process"),
        ("resihp_rank_resident_memory_bytes", "gauge", "resident memory of a rank's process"),
        ("resihp_agents_connected", "gauge", "agents with an open stream"),
        ("resihp_reports_total", "counter", "rank reports received"),
        ("resihp_reports_late_total", "counter", "reports that arrived after their iteration was joined"),
        ("resihp_requests_invalid_total", "counter", "requests or items refused as invalid"),
        ("resihp_records_unjudged_total", "counter", "joined iterations of a plan the detector does not run (traced only)"),
        ("resihp_internal_errors_total", "counter", "items a coordinator handler failed on (dropped; see its log)"),
        ("resihp_findings_total", "counter", "detector findings by kind"),
        ("resihp_commands_total", "counter", "commands issued by kind"),
        ("resihp_notices_total", "counter", "notices sent to the trainers by kind (finding / peer-failure)"),
        ("resihp_observe_only", "gauge", "1 while the job is observe-only (a rank cannot be reshaped)"),
        ("resihp_command_ack_duration_seconds", "gauge", "time from issuing the last command to its last ack"),
        ("resihp_gpu_sm_clock_hertz", "gauge", "GPU SM clock (DCGM_FI_DEV_SM_CLOCK)"),
        ("resihp_gpu_temperature_celsius", "gauge", "GPU temperature (DCGM_FI_DEV_GPU_TEMP)"),
        ("resihp_gpu_power_usage_watts", "gauge", "GPU power draw (DCGM_FI_DEV_POWER_USAGE)"),
        ("resihp_gpu_clock_event_reasons", "gauge", "NVML clocks-event reason bit mask (DCGM_FI_DEV_CLOCK_THROTTLE_REASONS)"),
        ("resihp_gpu_ecc_uncorrected_total", "counter", "uncorrected ECC errors (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL)"),
        ("resihp_gpu_xid_last", "gauge", "last XID error code seen (DCGM_FI_DEV_XID_ERRORS)"),
        ("resihp_agent_sampler_degraded", "gauge", "1 if the agent's GPU sampler is degraded (NVML missing or hung)"),
    ]:
        reg.describe(name, kind, text)
