"""Prometheus metrics: requests by status, latency histograms, and the cache's state on scrape."""

from __future__ import annotations

from typing import Callable, Iterator, Union

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.engine.llm_engine import EngineStats
from kvserve.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Union[GaugeMetricFamily, CounterMetricFamily]]:
        e = self.stats()
        s = e.scheduler
        yield _gauge("kvserve_kv_cache_bytes_per_token", f"KV bytes per token ({e.kv_cache_dtype}: values and "
                     "scales, the formula cache sizing uses)", e.kv_bytes_per_token)
        yield _gauge("kvserve_kv_cache_bytes", "Bytes the KV cache holds (blocks, null block, residual slots, scales)",
                     e.kv_cache_bytes)
        yield _gauge("kvserve_kv_cache_block_bytes", "Bytes of one KV block", e.block_bytes)
        yield _gauge("kvserve_kv_cache_sequence_bytes_max", "The most KV bytes one sequence of max_model_len "
                     "holds (a sliding-window layer holds its window)", e.sequence_bytes_max)
        groups = GaugeMetricFamily("kvserve_kv_cache_group_blocks", "KV blocks held by requests, per cache group",
                                   labels=["group", "kind", "window", "sinks"])
        for i, (kind, window, sinks, held) in enumerate(e.groups):
            groups.add_metric([str(i), kind, str(window or 0), str(sinks)], held)
        yield groups
        yield _gauge("kvserve_spec_proposed_tokens", "Speculative tokens verified since start", e.num_spec_proposed)
        yield _gauge("kvserve_spec_accepted_tokens", "Speculative tokens accepted since start", e.num_spec_accepted)
        yield _gauge("kvserve_spec_acceptance_rate", "Accepted / verified speculative tokens",
                     e.num_spec_accepted / e.num_spec_proposed if e.num_spec_proposed else 0.0)
        yield _gauge("kvserve_num_requests_running", "Requests in the running batch", s.num_running)
        yield _gauge("kvserve_num_requests_waiting", "Requests waiting (preempted ones included)", s.num_waiting)
        yield _gauge("kvserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", s.kv_usage)
        yield _gauge("kvserve_kv_cache_blocks_total", "KV blocks in the pool", s.num_blocks)
        yield _gauge("kvserve_kv_cache_blocks_free", "KV blocks free or cached-evictable", s.num_free_blocks)
        yield _gauge("kvserve_kv_cache_blocks_cached", "KV blocks holding a prefix-cache hash", s.num_cached_blocks)
        yield _gauge("kvserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / queried",
                     s.prefix_hit_rate)
        yield _gauge("kvserve_num_preemptions", "Preemptions since start", s.num_preemptions)
        yield _gauge("kvserve_num_swaps_out", "Requests swapped out to the CPU pool since start", e.num_swaps_out)
        yield _gauge("kvserve_num_swaps_in", "Requests swapped back in since start", e.num_swaps_in)
        yield _gauge("kvserve_kv_cache_evictions", "Cached blocks evicted for reuse since start", e.num_evictions)
        choices = CounterMetricFamily("kvserve_preemption_choices", "Preempted requests by how they give their "
                                      "blocks back (swap or recompute) and why", labels=["mode", "reason"])
        for mode, reason, n in e.preemption_choices:
            choices.add_metric([mode, reason], n)
        yield choices
        yield _gauge("kvserve_preemption_prefill_tokens_per_second", "Measured prefill speed a recompute is "
                     "costed at", e.prefill_tokens_per_s)
        yield _gauge("kvserve_preemption_copy_bytes_per_second", "Measured cache-to-host copy bandwidth a swap is "
                     "costed at", e.copy_bytes_per_s)
        yield _gauge("kvserve_kv_cache_fragmentation_slots", "Allocated slots holding no token", s.fragmentation_slots)
        yield from _tier_metrics(e)


def _tier_metrics(e: EngineStats) -> Iterator[Union[GaugeMetricFamily, CounterMetricFamily]]:
    """The tiers below the pool (host RAM, disk), labelled by medium."""
    families = (
        (GaugeMetricFamily, "kvserve_kv_tier_blocks", "Prefix blocks a tier below the pool holds", "num_blocks"),
        (GaugeMetricFamily, "kvserve_kv_tier_bytes", "Bytes a tier below the pool holds", "num_bytes"),
        (GaugeMetricFamily, "kvserve_kv_tier_max_bytes", "Bytes a tier below the pool may hold", "max_bytes"),
        (CounterMetricFamily, "kvserve_kv_tier_hit_blocks", "Blocks loaded back into the pool from a tier",
         "num_hit_blocks"),
        (CounterMetricFamily, "kvserve_kv_tier_stored_blocks", "Blocks written into a tier", "num_stored_blocks"),
        (CounterMetricFamily, "kvserve_kv_tier_load_seconds", "Time spent loading blocks back from a tier",
         "load_seconds"))
    for kind, name, doc, attr in families:
        family = kind(name, doc, labels=["medium"])
        for t in e.tiers:
            family.add_metric([t.medium], getattr(t, attr))
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvserve_requests", "Requests by final status", ["status"], registry=r)
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvserve_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("kvserve_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("kvserve_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds", "Arrival to finish", registry=r,
                             buckets=LATENCY_BUCKETS)
        r.register(_EngineCollector(stats))

    def reject(self, status: str) -> None:
        """A request refused before the engine saw it (400, 401, 404, 503, ...)."""
        self.requests.labels(status=status).inc()

    def finished(self, out: RequestOutput) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "error"
        if out.error:
            reason = "error"
        self.requests.labels(status=reason or "error").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        n = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.inc(n)
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        tpot = m.tpot(len(out.outputs[0].token_ids)) if out.outputs else None
        if tpot is not None:
            self.tpot.observe(tpot)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
