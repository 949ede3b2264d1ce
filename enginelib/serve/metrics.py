"""The server's Prometheus metrics (chapter 11): the engine loop's counters and gauges, read when
``/metrics`` is scraped, and latency histograms of the requests that finished. Names follow vLLM's
(``vllm:num_requests_running`` is ``enginelib_num_requests_running`` here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from enginelib.core.outputs import StreamDelta
from enginelib.serve.engine_client import EngineClient


class _EngineCollector:
    """Gauges and counters read from the engine loop's latest snapshot when /metrics is scraped."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        for name, doc, value in [("num_requests_running", "Requests in the running batch.", s.running),
                                 ("num_requests_waiting", "Requests queued, not yet admitted.", s.waiting),
                                 ("kv_blocks_used", "KV-cache blocks held by requests.", s.pool.used),
                                 ("kv_blocks_free", "KV-cache blocks free (cached ones included).", s.pool.free),
                                 ("kv_blocks_total", "KV-cache blocks in the pool.", s.pool.total),
                                 ("kv_cache_usage_ratio", "Fraction of KV blocks in use.", s.pool.used / s.pool.total)]:
            yield GaugeMetricFamily(f"enginelib_{name}", doc, value=value)
        for name, doc, value in [("generation_tokens", "Tokens generated.", s.generated_tokens),
                                 ("num_preemptions", "Requests preempted to free blocks.", s.preemptions),
                                 ("engine_steps", "Engine steps run.", s.steps),
                                 ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache.queried_tokens),
                                 ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  s.prefix_cache.hit_tokens),
                                 ("spec_decode_num_draft_tokens", "Speculative guesses verified.",
                                  s.spec_decode.proposed),
                                 ("spec_decode_num_accepted_tokens", "Speculative guesses the model agreed with.",
                                  s.spec_decode.accepted)]:
            yield CounterMetricFamily(f"enginelib_{name}", doc, value=value)


@dataclass
class ServerMetrics:
    """The server's Prometheus registry: the engine's state, plus latency histograms of finished requests."""

    engine: EngineClient
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.registry.register(_EngineCollector(self.engine))
        seconds = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40)
        self.ttft = Histogram("enginelib_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=seconds, registry=self.registry)
        self.tpot = Histogram("enginelib_time_per_output_token_seconds", "Mean gap between output tokens.",
                              buckets=seconds, registry=self.registry)
        self.e2e = Histogram("enginelib_e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=seconds, registry=self.registry)
        self.finished = Counter("enginelib_request_success", "Requests finished, by reason.",
                                ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("enginelib_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)

    def observe(self, last: StreamDelta) -> None:
        m = last.metrics
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        if m.last_token_time is not None:
            self.e2e.observe(m.last_token_time - m.arrival_time)
        self.finished.labels(last.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(last.num_prompt_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)
