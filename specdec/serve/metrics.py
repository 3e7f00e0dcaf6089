"""The server's Prometheus metrics, in a registry of its own (two servers in one process do not mix).

Requests are counted by endpoint and HTTP status as responses start. Everything about decoding is read
from the scheduler when /metrics is scraped: its SpecStats define tau and acceptance (vLLM's definitions:
tau = tokens emitted per row cycle, accepted + 1; acceptance at draft position i = drafts accepted at i /
row cycles that drafted at i). The spec_decode counters carry vLLM's names (`specdec:spec_decode_num_drafts`
for `vllm:spec_decode_num_drafts`, and so on).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.serve.scheduler import Scheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, scheduler: Scheduler, endpoints: tuple[str, ...]):
        self.registry = CollectorRegistry()
        self.endpoints = endpoints
        self.requests = Counter("specdec_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.registry.register(_SchedulerCollector(scheduler))

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in self.endpoints else "other", str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler
        stats = s.stats
        yield GaugeMetricFamily("specdec_num_requests_running", "requests decoding in a row of the batch",
                                value=s.running)
        yield GaugeMetricFamily("specdec_num_requests_waiting", "requests waiting for a free row", value=s.num_waiting)
        yield CounterMetricFamily("specdec_prompt_tokens", "prompt tokens prefilled", value=s.prompt_tokens)
        yield CounterMetricFamily("specdec_generation_tokens", "tokens generated and kept (stop conditions applied)",
                                  value=stats.kept)
        yield CounterMetricFamily("specdec_engine_steps", "verify forwards of the whole batch", value=s.steps)
        yield CounterMetricFamily("specdec_verify_cycles", "row cycles: one request verified in one step",
                                  value=stats.cycles)
        yield CounterMetricFamily("specdec_emitted_tokens", "tokens the row cycles emitted (accepted drafts + 1)",
                                  value=stats.emitted)
        yield GaugeMetricFamily("specdec_tau", "tokens emitted per row cycle since the start", value=stats.tau)
        # vLLM's spec_decode counters, under our prefix: a dashboard for one reads the other
        yield CounterMetricFamily("specdec:spec_decode_num_drafts", "row cycles that drafted", value=stats.num_drafts)
        yield CounterMetricFamily("specdec:spec_decode_num_draft_tokens", "draft tokens proposed", value=stats.drafted)
        yield CounterMetricFamily("specdec:spec_decode_num_accepted_tokens", "draft tokens accepted",
                                  value=stats.accepted)
        accepted = CounterMetricFamily("specdec:spec_decode_num_accepted_tokens_per_pos",
                                       "drafts accepted at a position", labels=["position"])
        drafted = CounterMetricFamily("specdec_drafted_tokens_per_pos", "row cycles that drafted at a position",
                                      labels=["position"])
        rate = GaugeMetricFamily("specdec_acceptance_per_pos", "accepted / drafted at a position since the start",
                                 labels=["position"])
        for i, (d, a, r) in enumerate(zip(stats.drafted_at, stats.accepted_at, stats.per_position_acceptance)):
            drafted.add_metric([str(i)], d)
            accepted.add_metric([str(i)], a)
            rate.add_metric([str(i)], r)
        yield from (drafted, accepted, rate)
