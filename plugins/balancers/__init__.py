"""Host balancers (``rrtod.hookspecs.HostBalancer``): which GPU daemon a new app session goes to
(``choose``), and which host each replayed inference is placed on (``place``, then ``observe``
of its latency).

The robot daemon passes hosts as ``HostView``s (``name``, ``up``, ``rtt_ms``, ``sessions``,
``inflight``). ``choose`` gets every host and returns one that is up, or None when none is;
``place`` gets the up hosts holding the inference's sequence, primary first, and returns one of
them. Each balancer is built as ``factory(options, state_dir)`` with its ``balancers.<name>``
block; ``first-up``, ``least-loaded``, ``least-connections`` and ``round-robin`` take no options.
"""

from __future__ import annotations

from rrto_plugins.balancers.model_time import LeastModelTime
from rrto_plugins.balancers.q_learning import QLearning
from rrto_plugins.balancers.simple import FirstUp, LeastConnections, LeastLoaded, RoundRobin
from rrtod.hookspecs import BalancerFactory, PluginRecord, hookimpl

__all__ = ["FirstUp", "LeastLoaded", "LeastConnections", "RoundRobin", "LeastModelTime",
           "QLearning", "rrto_host_balancers"]


@hookimpl
def rrto_host_balancers() -> list[PluginRecord[BalancerFactory]]:
    return [
        PluginRecord("first-up", FirstUp, "first reachable host in configuration order"),
        PluginRecord("least-loaded", LeastLoaded, "fewest sessions/inferences in flight, then "
                                                  "lowest RTT"),
        PluginRecord("least-connections", LeastConnections,
                     "fewest sessions/inferences in flight, then lowest RTT (RILaaS baseline)"),
        PluginRecord("round-robin", RoundRobin, "rotate over the hosts (inferences: per sequence)"),
        PluginRecord("least-model-time", LeastModelTime,
                     "lowest running latency estimate per sequence, with exploration"),
        PluginRecord("q-learning", QLearning,
                     "RILaaS's adaptive policy: tabular Q-learning of -latency, trained online"),
    ]
