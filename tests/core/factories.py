"""Pure-Python factories for core tests."""

from __future__ import annotations

import itertools
from typing import Optional

from kvserve.config import SchedulerConfig
from kvserve.core.cache_group import CacheGroupSpec
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(tokens, max_tokens: int = 8, salt: Optional[str] = None, priority: int = 0,
                 arrival: Optional[float] = None, rid: Optional[str] = None, output=(), **params) -> Request:
    return Request(rid or f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(), priority=priority,
                   arrival_time=arrival if arrival is not None else float(next(_ids)), cache_salt=salt,
                   output_token_ids=list(output))


# a window group, a full one, and a window with attention sinks
HYBRID = (CacheGroupSpec("sliding", (0,), window=6), CacheGroupSpec("full", (1,)),
          CacheGroupSpec("sliding", (2,), window=10, sinks=3))


def make_manager(num_blocks: int = 16, block_size: int = 4, caching: bool = True,
                 cpu_blocks: int = 0, namespace=("m", "float32", "float32", None), groups=None,
                 eviction_policy: str = "lru") -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, caching, cpu_blocks, namespace,
                          **({} if groups is None else {"groups": groups}), eviction_policy=eviction_policy)


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_model_len: int = 64,
                   caching: bool = True, cpu_blocks: int = 0, groups=None, eviction_policy: str = "lru",
                   **cfg) -> Scheduler:
    kv = make_manager(num_blocks, block_size, caching, cpu_blocks, groups=groups, eviction_policy=eviction_policy)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len)


def fake_step(sched: Scheduler, next_token=lambda rid, n: 7) -> SchedulerOutput:
    """Schedule, 'run' (each sampled request gets next_token; at an n > 1 fork point each
    further sample gets one too), update, check integrity."""
    out = sched.schedule()
    sampled = {s.request_id: [next_token(s.request_id, 0)] for s in out.scheduled if s.num_samples}
    forked = {s.request_id: [next_token(s.request_id, i) for i in range(1, s.num_samples)]
              for s in out.scheduled if s.num_samples > 1}
    sched.update(out, ModelRunnerOutput(sampled, forked_token_ids=forked))
    sched.check_integrity()
    return out
