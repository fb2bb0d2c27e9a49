"""Prometheus metrics of the daemon (`GET /metrics` on the HTTP gateway).

Two kinds of numbers. Per-request timings (TTFT, inter-token latency, duration, tokens) are
observed as they happen by `daemon.service`, for requests from every front (ZeroMQ and HTTP,
told apart by the `api` label). Everything else (queue depths, memory ledger vs budget,
admission state, fine-tuning progress, adapter versions) is read at scrape time from the same
`Service.status()` that `macectl status` shows, so the two never disagree.

Uses its own registry, not prometheus_client's global one: several services may live in one
process (tests), and the process-wide default collectors are not this daemon's business.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from daemon.principals import split_stored

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds. TTFT spans a warm decode on a GPU (ms) to a long cold prefill on a busy CPU (s).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ADMISSION_STATES = ("normal", "shed_finetune", "queue", "reject", "off")
_FINETUNE_STATES = ("idle", "profiling", "training", "publishing", "paused")
_MODEL_STATES = ("loaded", "unloading", "unloaded", "loading")  # daemon/keep_alive.py
TOKENS_WINDOW_S = 10.0


class DaemonMetrics:
    """The daemon's metric registry; `observe_*` on the event loop, `render()` on scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "mace_time_to_first_token_seconds",
            "From a generate's arrival at the daemon (admission wait included) to its first token "
            "reaching the event loop", ["api"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "mace_inter_token_latency_seconds",
            "Gap between successive tokens of one candidate as the event loop receives them (a "
            "delivery of k tokens after a gap g counts k gaps of g/k)", ["api"],
            buckets=_ITL_BUCKETS, registry=r)
        self.duration = Histogram(
            "mace_request_duration_seconds", "Generate requests from arrival to their final reply",
            ["api"], buckets=_DURATION_BUCKETS, registry=r)
        self.requests = Counter(
            "mace_requests", "Generate requests by front and outcome (ok or the error code)",
            ["api", "outcome"], registry=r)
        self.completion_tokens = Counter(
            "mace_completion_tokens", "Tokens generated for requests that completed", ["api"], registry=r)
        self.prompt_tokens = Counter(
            "mace_prompt_tokens", "Prompt tokens of requests that completed", ["api"], registry=r)
        self._status = _StatusCollector(self)
        r.register(self._status)
        self._token_times: deque[tuple[float, int]] = deque()
        self._tokens_in_window = 0

    # -- per-request observations (event loop) --------------------------------------------------

    def tokens_arrived(self, now: float, count: int) -> None:
        """`count` new tokens reached the loop at `now` (monotonic): the tokens/s window."""
        self._token_times.append((now, count))
        self._tokens_in_window += count
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._token_times and now - self._token_times[0][0] > TOKENS_WINDOW_S:
            self._tokens_in_window -= self._token_times.popleft()[1]

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        return self._tokens_in_window / TOKENS_WINDOW_S

    def finished(self, api: str, outcome: str, duration_s: float, prompt_tokens: int = 0,
                 completion_tokens: int = 0) -> None:
        self.requests.labels(api, outcome).inc()
        self.duration.labels(api).observe(duration_s)
        if outcome == "ok":
            self.prompt_tokens.labels(api).inc(prompt_tokens)
            self.completion_tokens.labels(api).inc(completion_tokens)

    # -- scrape ---------------------------------------------------------------------------------

    def render(self, status: dict[str, Any], adapters: list[dict[str, Any]] | None) -> bytes:
        """The exposition text; `status` is `Service.status()`, `adapters` `adapters.list`."""
        self._status.status = status
        self._status.adapters = adapters or []
        try:
            return generate_latest(self.registry)
        finally:
            self._status.status, self._status.adapters = {}, []


class _StatusCollector(Collector):
    """Gauges read from one `Service.status()` snapshot, taken by the scrape that renders them."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics
        self.status: dict[str, Any] = {}
        self.adapters: list[dict[str, Any]] = []

    def describe(self) -> Iterable[Metric]:
        return []  # values exist only during a scrape; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        s = self.status
        if not s:
            return
        yield _gauge("mace_tokens_per_second",
                     f"Tokens delivered to clients per second over the last {TOKENS_WINDOW_S:g} s",
                     self.metrics.tokens_per_second())
        daemon = s.get("daemon", {})
        up = GaugeMetricFamily("mace_daemon_state", "1 for the daemon's current state", labels=["state"])
        for state in ("starting", "loading", "serving", "draining", "stopped", "failed"):
            up.add_metric([state], 1.0 if daemon.get("state") == state else 0.0)
        yield up
        yield _gauge("mace_uptime_seconds", "Seconds since the daemon started", daemon.get("uptime_s"))
        model = s.get("model", {})
        if model.get("backend"):
            backend = GaugeMetricFamily(
                "mace_backend_info", "1 for the backend serving the model: the setting (requested), "
                "what runs, its weight format, and why (auto's choice or its fallback)",
                labels=["requested", "backend", "quantization", "reason"])
            backend.add_metric([str(model.get("backend_requested", "")), str(model["backend"]),
                                str(model.get("quantization", "")), str(model.get("backend_reason", ""))], 1.0)
            yield backend

        yield from _keep_alive(s.get("keep_alive") or {})
        queues = GaugeMetricFamily("mace_queue_depth", "Requests waiting or running, by queue",
                                   labels=["queue"])
        for name, value in s.get("queues", {}).items():
            queues.add_metric([name], float(value or 0))
        engine = s.get("engine", {})
        queues.add_metric(["finetune_queued"], float(engine.get("finetune_queued") or 0))
        yield queues
        if engine.get("tokens_generated") is not None:
            yield _counter("mace_engine_tokens_generated", "Tokens the engine generated since start",
                           engine["tokens_generated"])
        if engine.get("iterations") is not None:
            yield _counter("mace_engine_iterations", "Engine iterations since start", engine["iterations"])

        memory = s.get("memory", {})
        ledger = (engine.get("memory") or {})
        by_kind = GaugeMetricFamily("mace_memory_ledger_bytes", "Bytes the engine's memory ledger "
                                    "holds, by kind", labels=["kind"])
        for key, value in ledger.items():
            if key.endswith("_bytes") and key not in ("budget_bytes", "held_bytes", "free_bytes",
                                                      "peak_used_bytes"):
                by_kind.add_metric([key.removesuffix("_bytes")], float(value))
        yield by_kind
        yield _gauge("mace_memory_ledger_held_bytes", "Bytes held in the engine's memory ledger",
                     ledger.get("held_bytes", memory.get("ledger_bytes")))
        yield _gauge("mace_memory_ledger_budget_bytes", "The engine's memory ledger budget",
                     ledger.get("budget_bytes"))
        yield _gauge("mace_memory_ledger_free_bytes", "Ledger budget minus held bytes",
                     ledger.get("free_bytes"))
        yield _gauge("mace_memory_ledger_peak_bytes", "Most bytes the ledger ever held",
                     ledger.get("peak_used_bytes"))
        yield _gauge("mace_process_resident_bytes", "Resident memory of the daemon process",
                     memory.get("process_rss_bytes"))
        budget = memory.get("budget") or {}
        if budget:
            yield _gauge("mace_memory_headroom_bytes", "Device memory headroom above the reserve, "
                         "from telemetry", budget["headroom_mb"] * (1 << 20))
            yield _gauge("mace_memory_available_bytes", "Device memory available, from telemetry",
                         budget["available_mb"] * (1 << 20))

        admission = s.get("admission", {})
        current = admission.get("state", "off")
        state = GaugeMetricFamily("mace_admission_state", "1 for the admission controller's current "
                                  "state", labels=["state"])
        for name in _ADMISSION_STATES:
            state.add_metric([name], 1.0 if current == name else 0.0)
        yield state
        yield _gauge("mace_admission_level", "Admission severity: 0 normal, 1 shed_finetune, 2 queue, "
                     "3 reject", float(_ADMISSION_STATES.index(current)) if current != "off" else 0.0)

        ft = s.get("finetune", {})
        ft_state = GaugeMetricFamily("mace_finetune_state", "1 for the fine-tuner's current state",
                                     labels=["state"])
        for name in _FINETUNE_STATES:
            ft_state.add_metric([name], 1.0 if ft.get("state") == name else 0.0)
        yield ft_state
        yield _gauge("mace_finetune_enabled", "1 when continual fine-tuning is enabled",
                     1.0 if ft.get("enabled") else 0.0)
        for key, help_text in (("pairs_trained", "Preference pairs trained since start"),
                               ("versions_published", "Adapter versions published since start"),
                               ("versions_rejected", "Candidate versions the guard rejected since start"),
                               ("errors", "Fine-tuning rounds that failed since start")):
            if ft.get(key) is not None:
                yield _counter(f"mace_finetune_{key}", help_text, ft[key])
        if ft.get("restarts") is not None:
            yield _counter("mace_finetune_restarts", "Fine-tune passes begun again after their activations "
                           "were shed, since start", ft["restarts"])
            yield _counter("mace_finetune_stalled", "Fine-tune jobs failed for restarting max_restarts times",
                           ft.get("stalled_jobs", 0))
            yield _gauge("mace_finetune_stalling_jobs", "Queued fine-tune jobs restarted at least half of "
                         "max_restarts times", ft.get("stalling_jobs", 0))
        if ft.get("since_progress_s") is not None:
            yield _gauge("mace_finetune_since_progress_seconds", "Seconds since a fine-tune item was trained or a "
                         "candidate decided, while work is under way (0 otherwise)", ft["since_progress_s"])
        yield _gauge("mace_finetune_last_loss", "DPO loss of the last trained pair", ft.get("last_loss"))
        yield _gauge("mace_finetune_pairs_per_version", "Pairs trained per published version",
                     ft.get("pairs_per_version"))
        feedback = s.get("feedback", {})
        pairs = GaugeMetricFamily("mace_feedback_pairs", "Preference pairs in the store, by state",
                                  labels=["state"])
        for key in ("pairs_pending", "pairs_heldout", "pairs_trained", "pairs_skipped"):
            if feedback.get(key) is not None:
                pairs.add_metric([key.removeprefix("pairs_")], float(feedback[key]))
        yield pairs
        for key in ("users", "consented_users", "interactions", "feedback", "db_bytes"):
            if feedback.get(key) is not None:
                yield _gauge(f"mace_feedback_store_{key}", f"Feedback store: {key.replace('_', ' ')}",
                             feedback[key])
        counters = daemon.get("counters", {})
        for key in ("interactions_recorded", "feedback"):
            if key in counters:
                yield _counter(f"mace_{key}", f"{key.replace('_', ' ').capitalize()} since start",
                               counters[key])

        adapters = s.get("adapters", {})
        yield _gauge("mace_adapter_users", "Users with at least one adapter version",
                     adapters.get("users"))
        yield _gauge("mace_adapter_versions", "Adapter versions the engine serves (all users)",
                     adapters.get("versions_served"))
        yield _gauge("mace_adapters_cached", "Adapter versions in the engine's adapter cache",
                     adapters.get("cached"))
        # A count per app, never a user id: a scrape must not list who uses the device
        # (docs/security.md); the caller's listing holds only what its principal may see.
        active = GaugeMetricFamily("mace_adapter_active_users", "Users served an adapter version "
                                   "(of the scraping app, or per app for the operator)", labels=["app"])
        per_app: dict[str, int] = {}
        viewer = (s.get("principal") or {}).get("app")  # an app's listing holds plain ids
        for entry in self.adapters:
            if entry.get("active"):
                app = viewer or split_stored(str(entry["user"]))[0]
                per_app[app] = per_app.get(app, 0) + 1
        for app, count in sorted(per_app.items()):
            active.add_metric([app], float(count))
        yield active


def _keep_alive(keep: dict[str, Any]) -> Iterable[Metric]:
    """The model's residency (engine.keep_alive): loaded or given back, unloads, reload time."""
    if not keep:
        return
    state = GaugeMetricFamily("mace_model_state", "1 for the model's current residency (engine.keep_alive)",
                              labels=["state"])
    for name in _MODEL_STATES:
        state.add_metric([name], 1.0 if keep.get("state") == name else 0.0)
    yield state
    yield _gauge("mace_keep_alive_seconds", "How long an idle model stays loaded (-1: always)",
                 keep.get("keep_alive_s"))
    yield _counter("mace_model_unloads", "Times the idle model was unloaded since start", keep.get("unloads", 0))
    yield _counter("mace_model_pressure_unloads", "Unloads caused by device memory pressure since start",
                   keep.get("pressure_unloads", 0))
    yield _counter("mace_model_reloads", "Times the model was loaded again since start", keep.get("reloads", 0))
    yield _gauge("mace_model_last_reload_seconds", "Seconds the last reload of the model took",
                 keep.get("last_reload_s"))


def _gauge(name: str, help_text: str, value: Any) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text)
    family.add_metric([], float("nan") if value is None else float(value))
    return family


def _counter(name: str, help_text: str, value: Any) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text)
    family.add_metric([], float(value))
    return family
