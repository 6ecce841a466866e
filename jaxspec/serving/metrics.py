"""Prometheus metrics of the gRPC server, in their own CollectorRegistry.

Every metric's help text is its definition. Three sources feed them:
  - the RPC handlers: status codes, latency, streamed tokens, per-request timings (`record_*`);
  - the scheduler's per-step statistics (`observe_step`, a step listener called in the engine
    thread): chosen k, acceptance, predicted and realised goodput, step time;
  - scrape-time reads of the scheduler (queue depth, running slots) and of the compile counter.
"""

from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxspec.engine import compile_counter
from jaxspec.scheduling.requests import FinishReason, RequestResult
from jaxspec.scheduling.scheduler import Scheduler, StepStats
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb

PREFIX = "jaxspec"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GOODPUT_BUCKETS = tuple(10.0 ** (e / 2) for e in range(0, 13))  # 1 .. 1e6 tokens/s, ×√10 apart
NORMAL_FINISH = (FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP)
_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
METHOD_LABELS = {f"/{_SERVICE.full_name}/{m.name}": m.name for m in _SERVICE.methods}  # full path -> label
UNKNOWN_METHOD = "unknown"
HTTP_ENDPOINTS = ("models", "chat_completions", "completions", "health", UNKNOWN_METHOD)  # jaxspec.serving.openai_api
HTTP_STATUSES = (200, 400, 401, 404, 405, 408, 413, 429, 499, 500, 503)  # what the HTTP API answers


def method_label(method: str) -> str:
    """The `method` label of a call: 'Generate' for '/jaxspec.v1.Generation/Generate' (or 'Generate'),
    'unknown' for any other name, so callers cannot grow the label set."""
    if method in METHOD_LABELS:
        return METHOD_LABELS[method]
    return method if method in METHOD_LABELS.values() else UNKNOWN_METHOD


class ServingMetrics:
    """The server's metrics. `positions`: draft positions with their own acceptance series."""

    def __init__(self, k_menu: tuple[int, ...], registry: CollectorRegistry | None = None,
                 positions: int | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.positions = positions if positions is not None else max(k_menu)
        self.requests = Counter(
            f"{PREFIX}_requests", "Finished Generate and ListModels calls that reached the handlers, the auth "
            "check or the request-message checks, by method and gRPC status code name (a call the client "
            "cancelled or abandoned, or that sent no request message within request_timeout_s, counts as "
            "CANCELLED, one that ended at or within 50 ms of its deadline as DEADLINE_EXCEEDED). Calls to any "
            "other method (reflection, names no service has) that were refused count as method=\"unknown\"; "
            "calls gRPC itself refused, e.g. over its transport message limit, are not counted.",
            ["method", "code"], registry=r)
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "Finished calls to the OpenAI-compatible HTTP API, by endpoint (models, "
            "chat_completions, completions, health; any other path counts as \"unknown\") and HTTP status (499: "
            "the client disconnected first; any status outside the API's own set counts as \"other\").",
            ["endpoint", "status"], registry=r)
        self.request_timeouts = Counter(
            f"{PREFIX}_request_timeouts", "Calls (health checks included) cancelled because their request "
            "message did not arrive within request_timeout_s of the server awaiting it (half-open calls).",
            registry=r)
        self.queue_depth = Gauge(
            f"{PREFIX}_queue_depth", "Requests accepted by the scheduler that wait for a free slot (not yet "
            "admitted), read at scrape time.", registry=r)
        self.running_slots = Gauge(
            f"{PREFIX}_running_slots", "Engine slots holding a request (prefilling or decoding), read at "
            "scrape time.", registry=r)
        self.kv_pages = Gauge(
            f"{PREFIX}_kv_pages", "Pages of the target's paged KV cache by state: in_use (held by a request), "
            "cached (a prompt prefix no request holds, kept for reuse), free; read at scrape time.", ["state"],
            registry=r)
        self.preemptions = Gauge(
            f"{PREFIX}_preemptions", "Requests preempted so far to free KV pages (recomputed later), read at "
            "scrape time.", registry=r)
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens", "Prompt tokens served from the prefix cache (not computed) of "
            "requests that finished.", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Per request that finished normally (eos, length or "
            "stop): seconds from entering the scheduler to its first generated token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Per request that finished normally with at least two "
            "tokens: (finish - first token) / (tokens - 1) seconds.", buckets=TPOT_BUCKETS, registry=r)
        self.latency = Histogram(
            f"{PREFIX}_request_latency_seconds", "Per Generate call that ended OK: seconds from the server "
            "receiving the call to its last response message (end-to-end on the server).",
            buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens", "Tokens generated for Generate calls and put into their response "
            "streams (an eos or stop token id that ended a request included).", registry=r)
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens (after the chat template) of requests the scheduler "
            "accepted.", registry=r)
        self.steps = Counter(
            f"{PREFIX}_engine_steps", "Engine decode steps (one padded batch step each).", registry=r)
        self.step_seconds = Histogram(
            f"{PREFIX}_engine_step_seconds", "Measured seconds of each engine decode step's executable (the "
            "time the policy observes: lazy draft catch-up excluded).", buckets=STEP_BUCKETS, registry=r)
        self.chosen_k = Histogram(
            f"{PREFIX}_chosen_k", "The speculation length k the policy chose, one observation per engine step "
            "(the padded k when rows have their own caps).", buckets=tuple(float(k) for k in k_menu), registry=r)
        self.proposed = Counter(
            f"{PREFIX}_proposed_tokens", "Speculative proposals verified, summed over the rows of every engine "
            "step.", registry=r)
        self.accepted = Counter(
            f"{PREFIX}_accepted_tokens", "Speculative proposals accepted, summed over the rows of every engine "
            "step (bonus tokens not included).", registry=r)
        self.position_trials = Counter(
            f"{PREFIX}_position_trials", "Per draft position j (1-based): rows of a step that verified a "
            "proposal at position j after accepting every earlier one (the trials of alpha_j).",
            ["position"], registry=r)
        self.position_accepted = Counter(
            f"{PREFIX}_position_accepted", "Per draft position j (1-based): rows of a step that accepted the "
            "proposal at position j (and so every earlier one).", ["position"], registry=r)
        self.predicted_goodput = Histogram(
            f"{PREFIX}_predicted_goodput_tokens_per_second", "Per engine step whose policy predicted it: the "
            "chosen option's predicted tokens per second, sum_i E_i(k_i) / T(B, k) (SmartSpec).",
            buckets=GOODPUT_BUCKETS, registry=r)
        self.realised_goodput = Histogram(
            f"{PREFIX}_realised_goodput_tokens_per_second", "Per engine step whose policy predicted a goodput: "
            "tokens committed (accepted proposals + one bonus token per row) / measured step seconds.",
            buckets=GOODPUT_BUCKETS, registry=r)
        self.ready = Gauge(f"{PREFIX}_ready", "1 once warm-up finished and the server accepts Generate calls, "
                           "0 before and while shutting down.", registry=r)
        self._lock = threading.Lock()
        self._totals = {"proposed": 0, "accepted": 0}
        self._positions_seen = [[0, 0] for _ in range(self.positions)]  # [trials, accepted] per position
        self._compiles_at_warm: int | None = None
        r.register(_DerivedCollector(self))
        compile_counter.install()
        for j in range(1, self.positions + 1):  # every position series exists from the start
            self.position_trials.labels(str(j))
            self.position_accepted.labels(str(j))

    # --- wiring ------------------------------------------------------------------------

    def bind(self, scheduler: Scheduler) -> None:
        """Read queue depth and running slots from `scheduler` at scrape time."""
        self.queue_depth.set_function(lambda: scheduler.num_waiting)
        self.running_slots.set_function(lambda: scheduler.num_running)
        self.preemptions.set_function(lambda: scheduler.preemptions)
        for state in ("in_use", "cached", "free"):
            self.kv_pages.labels(state).set_function(lambda state=state: getattr(scheduler.engine.page_stats(), state))

    def mark_warm(self) -> None:
        """Warm-up is over: from now on the compile count must stay flat."""
        self._compiles_at_warm = compile_counter.count()
        self.ready.set(1)

    def serve_http(self, host: str, port: int) -> tuple[object, int]:
        """Start the /metrics HTTP endpoint; returns (server, bound port). Stop it with server.shutdown()."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port

    def render(self) -> str:
        """The exposition text (what a scrape returns)."""
        return generate_latest(self.registry).decode()

    # --- handlers ----------------------------------------------------------------------

    def record_rpc(self, method: str, code: str) -> None:
        """One finished call; `method` is a label or a full method path (others count as 'unknown')."""
        self.requests.labels(method_label(method), code).inc()

    def record_http(self, endpoint: str, status: int) -> None:
        """One finished HTTP API call; labels outside the bounded sets count as 'unknown' / 'other'."""
        self.http_requests.labels(endpoint if endpoint in HTTP_ENDPOINTS else UNKNOWN_METHOD,
                                  str(status) if status in HTTP_STATUSES else "other").inc()

    def record_request_timeout(self) -> None:
        self.request_timeouts.inc()

    def record_tokens(self, n: int) -> None:
        if n:
            self.generated_tokens.inc(n)

    def record_prompt(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def record_result(self, result: RequestResult) -> None:
        t = result.timings
        self.cached_prompt_tokens.inc(result.cached_prompt_tokens)
        if result.finish_reason in NORMAL_FINISH:
            if t.ttft_s is not None:
                self.ttft.observe(t.ttft_s)
            if t.tpot_s is not None:
                self.tpot.observe(t.tpot_s)

    def record_latency(self, seconds: float) -> None:
        self.latency.observe(seconds)

    # --- engine steps (engine thread) ----------------------------------------------------

    def observe_step(self, stats: StepStats) -> None:
        """One decode step the scheduler published (a step listener)."""
        view, decision, result, elapsed_s = stats.view, stats.decision, stats.result, stats.executable_s
        n = view.batch_size
        proposed = [int(p) for p in result.proposed[:n]]
        accepted = [int(a) for a in result.accepted[:n]]
        self.steps.inc()
        self.step_seconds.observe(elapsed_s)
        self.chosen_k.observe(decision.k)
        self.proposed.inc(sum(proposed))
        self.accepted.inc(sum(accepted))
        trials = [0] * self.positions
        hits = [0] * self.positions
        for p, a in zip(proposed, accepted):
            for j in range(min(p, a + 1, self.positions)):  # position j+1 verified after j accepted
                trials[j] += 1
                hits[j] += j < a
        with self._lock:
            self._totals["proposed"] += sum(proposed)
            self._totals["accepted"] += sum(accepted)
            for j in range(self.positions):
                self._positions_seen[j][0] += trials[j]
                self._positions_seen[j][1] += hits[j]
        for j in range(self.positions):
            if trials[j]:
                self.position_trials.labels(str(j + 1)).inc(trials[j])
            if hits[j]:
                self.position_accepted.labels(str(j + 1)).inc(hits[j])
        predicted = (decision.predicted_goodput or {}).get(decision.k)
        if predicted is not None:
            self.predicted_goodput.observe(predicted)
            if elapsed_s > 0:
                self.realised_goodput.observe(int(sum(result.counts[:n])) / elapsed_s)

    # --- derived values (scrape time) ----------------------------------------------------

    def acceptance(self) -> tuple[float, list[float]]:
        """(accepted / proposed overall, [accepted_j / trials_j per position]); NaN without data."""
        with self._lock:
            p, a = self._totals["proposed"], self._totals["accepted"]
            per = [h / t if t else math.nan for t, h in self._positions_seen]
        return (a / p if p else math.nan), per

    def compiles_after_warmup(self) -> int | None:
        return None if self._compiles_at_warm is None else compile_counter.count() - self._compiles_at_warm


class _DerivedCollector(Collector):
    """Ratios and the compile counter, computed at scrape time."""

    def __init__(self, metrics: ServingMetrics):
        self._m = metrics

    def collect(self):
        overall, per = self._m.acceptance()
        rate = GaugeMetricFamily(
            f"{PREFIX}_acceptance_rate", "Accepted / verified speculative proposals since start: position=\"all\" "
            "over every proposal; position=\"j\" is alpha_j = position_accepted / position_trials (the chance "
            "the j-th proposal is accepted given every earlier one was). NaN before any data.",
            labels=["position"])
        rate.add_metric(["all"], overall)
        for j, value in enumerate(per, start=1):
            rate.add_metric([str(j)], value)
        yield rate
        yield CounterMetricFamily(
            f"{PREFIX}_compilations", "XLA backend compilations in this process since the metrics were created "
            "(warm-up included).", value=compile_counter.count())
        after = self._m.compiles_after_warmup()
        yield GaugeMetricFamily(
            f"{PREFIX}_compilations_after_warmup", "XLA backend compilations since warm-up finished; must stay 0 "
            "(anything else means a request shape missed the precompiled menu). NaN before warm-up ends.",
            value=math.nan if after is None else after)


__all__ = ["ServingMetrics", "method_label"]
