"""Prometheus metrics, read from the daemon's state at scrape time.

A collector, not counters bumped on the hot path: the per-operator relay does no extra work for
metrics, and a scrape sees exactly what ``rrtoctl status`` would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class DaemonCollector:
    def __init__(self, daemon: Any):
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        info = GaugeMetricFamily("rrto_info", "rrtod build and roles", labels=["version", "roles"])
        from rrtod import __version__

        info.add_metric([__version__, "+".join(d.config.roles)], 1)
        yield info
        uptime = GaugeMetricFamily("rrto_uptime_seconds", "seconds since rrtod started")
        uptime.add_metric([], d.status()["uptime_s"])
        yield uptime
        if d.robot is not None:
            up = GaugeMetricFamily("rrto_host_up", "GPU host reachable (1) or not (0)", labels=["host"])
            rtt = GaugeMetricFamily("rrto_host_rtt_seconds", "median measured RTT", labels=["host"])
            for h in d.robot.hosts.values():
                up.add_metric([h.name], 1.0 if h.up else 0.0)
                if h.rtt_ms is not None:
                    rtt.add_metric([h.name], h.rtt_ms / 1e3)
            yield up
            yield rtt
            sessions = GaugeMetricFamily("rrto_app_sessions", "app sessions on this robot daemon")
            sessions.add_metric([], len(d.robot.sessions))
            yield sessions
            ops = CounterMetricFamily("rrto_ops_forwarded", "op calls relayed", labels=["app"])
            sent = CounterMetricFamily("rrto_bytes_up", "bytes relayed app->host", labels=["app"])
            for s in d.robot.sessions.values():
                ops.add_metric([s.app], s.calls)
                sent.add_metric([s.app], s.bytes_up)
            yield ops
            yield sent
        if d.gpu is not None:
            hs = GaugeMetricFamily("rrto_host_sessions", "sessions executing on this gpu daemon, "
                                   "by peer identity (certificate, local or anonymous)",
                                   labels=["identity"])
            by_identity: dict[str, int] = {}
            for s in d.gpu.sessions.values():
                by_identity[s.identity] = by_identity.get(s.identity, 0) + 1
            for identity, count in sorted(by_identity.items()):
                hs.add_metric([identity], count)
            yield hs
            limit = d.gpu.config.executor.max_sessions
            if limit is not None:
                g = GaugeMetricFamily("rrto_host_session_limit",
                                      "sessions this gpu daemon serves at once "
                                      "(executor.max_sessions)")
                g.add_metric([], limit)
                yield g
            refused = CounterMetricFamily("rrto_host_sessions_refused",
                                          "sessions refused at open by a session limit, by "
                                          "the config key that set it", labels=["limit"])
            for key, count in d.gpu.refused.items():
                refused.add_metric([key], count)
            yield refused
        if d.energy is not None:  # an EnergyAccountant, on a robot daemon with a meter
            yield from d.energy.collect()


def serve(daemon: Any, host: str, port: int) -> Any:
    """Start the HTTP endpoint in a background thread; returns the server (``shutdown()``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
