"""Prometheus metrics of the gateway, in a registry of their own (one per app).

Several gateways sharing the port (``distributed.gateways``) run in prometheus_client's multiprocess mode
(``tiller up`` sets ``PROMETHEUS_MULTIPROC_DIR``): each process writes its samples to files there, and
``/metrics``, whichever process answers, sums the counters and histograms of all of them, the processes that
died included (their totals happened), and the live ones' ``active_streams``; an engine gauge is the latest
value any process saw (a worker that left keeps its last ``tiller:worker_*`` values there until ``tiller up``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from common import wire

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """Labelled by ``surface`` (websocket | rest | openai | aici | salience | evergreen) and, for requests,
    ``outcome`` (a finish reason or an error code); never by request id."""

    def __init__(self) -> None:
        self._shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")  # set: several gateways, one exposition
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tiller:requests",
            "Generation requests by surface and outcome",
            ["surface", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tiller:prompt_tokens", "Prompt tokens submitted", ["surface"], registry=self.registry
        )
        self.generation_tokens = Counter(
            "tiller:generation_tokens", "Tokens generated and delivered", ["surface"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "tiller:time_to_first_token_seconds",
            "From request to first generated token",
            ["surface"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "tiller:e2e_request_latency_seconds",
            "From request to its completion or error",
            ["surface"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.active_streams = Gauge(
            "tiller:active_streams", "Generations in progress", ["surface"], registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.scheduler_up = Gauge(
            "tiller:scheduler_up",
            "1 while the scheduler answers (the engine gauges are then current), 0 when it has not answered "
            "lately (they hold its last answer)",
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        # the engine's state, as the scheduler's health reports it when /metrics is scraped
        self.engine_state = {
            key: Gauge(f"tiller:{key}", doc, registry=self.registry, multiprocess_mode="mostrecent")
            for key, doc in (
                ("kv_capacity_tokens", "Tokens the workers' KV pools hold"),
                ("kv_free_tokens", "Tokens of the workers' empty KV blocks"),
                ("kv_cached_tokens", "Tokens of KV blocks that only hold reusable prefixes (taken when free ones run out)"),
                ("kv_used_tokens", "Tokens of KV blocks held by live sequences and parked sessions"),
                ("kv_reserved_tokens", "KV tokens promised to admitted requests and parked sessions"),
                ("queued", "Requests waiting for admission"),
                ("running", "Sequences admitted to a worker"),
            )
        }
        # per worker, labelled by its id (a worker that left loses its series)
        self.worker_state = {
            key: Gauge(f"tiller:worker_{key}", doc, ["worker"], registry=self.registry,
                       multiprocess_mode="mostrecent")
            for key, doc in (
                ("running", "Sequences admitted to the worker"),
                ("kv_capacity_tokens", "Tokens the worker's KV pool holds"),
                ("kv_used_tokens", "Tokens of the worker's KV blocks held by live sequences and parked sessions"),
                ("kv_cached_tokens", "Tokens of the worker's KV blocks that only hold reusable prefixes"),
                ("kv_free_tokens", "Tokens of the worker's empty KV blocks"),
                ("prefix_hit_rate", "Share of the prompt tokens sent to the worker whose KV its prefix cache gave"),
            )
        }

    def refused(self, surface: str, code: str) -> None:
        """A request refused before a generation started (a generation counts its own outcome)."""
        self.requests.labels(surface, code).inc()

    def observe_engine(self, facts: wire.ModelFacts) -> None:
        """Set the engine gauges from the scheduler's model facts."""
        for key, gauge in self.engine_state.items():
            gauge.set(getattr(facts, key))
        for key, gauge in self.worker_state.items():
            if not self._shared_dir:  # (prometheus_client cannot drop series of several processes' files)
                gauge.clear()
            for worker in facts.workers:
                gauge.labels(worker.worker).set(getattr(worker, key))

    def render(self) -> bytes:
        """The exposition of this process, or of every gateway process in multiprocess mode."""
        if not self._shared_dir:
            return generate_latest(self.registry)
        forget_dead_processes(Path(self._shared_dir))
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self._shared_dir)
        return generate_latest(registry)


_LIVE_FILE = re.compile(r"gauge_live\w+_(\d+)\.db")  # the per-pid files of the live-only gauges


def forget_dead_processes(directory: Path) -> None:
    """Drop the live-only gauges (``active_streams``) of gateway processes gone without saying so (killed):
    their streams ended with them."""
    for pid in {int(m.group(1)) for f in directory.iterdir() if (m := _LIVE_FILE.fullmatch(f.name))}:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, str(directory))
        except PermissionError:  # alive, someone else's (a reused pid)
            pass
