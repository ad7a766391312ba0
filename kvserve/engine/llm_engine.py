"""LLMEngine: add_request / step / abort over one model, one cache and one scheduler.

A step is: schedule -> run the model -> update requests -> detokenize and build outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from kvserve.config import (DEFAULT_MODEL, EngineConfig, FieldError, ModelConfig, resolve_dtype,
                            resolve_kv_cache_dtype, resolve_packed_activations)
from kvserve.core.cache_group import layer_maps
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.observers import Observers
from kvserve.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput, SchedulerStats
from kvserve.core.scheduler import Scheduler, group_width
from kvserve.engine.args import engine_config
from kvserve.engine.beam_search import BeamSearch
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.trace import StepTrace
from kvserve.engine.watchdog import Watchdog
from kvserve.engine.calibrate import calibrate_fp8
from kvserve.engine.handover import KVHandover, KVIdentity
from kvserve.engine.kv_events import KVEventLog, ZmqPublisher, watch_pool
from kvserve.engine.lora import EngineLoRA
from kvserve.engine.offload import TierSummary, build_tiers
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.parallel import CommStats, TensorParallel, tensor_parallel
from kvserve import kernels
from kvserve.kv.calibrate import read_fp8_scales
from kvserve.kv.latent import make_latent_storage
from kvserve.kv.storage import Fp8KVStorage, KVStorage, make_storage
from kvserve.kv.sizing import CachePlan, cache_groups, is_bounded, plan_cache
from kvserve.models.loaders.base import LoadedModel
from kvserve.models.lora import LoRAAdapter, LoRASet
from kvserve.models.products import missing_int8_kernels, packed_formats
from kvserve.models.registry import build_model, checkpoint_dtype, load_weights
from kvserve.core.request import Request, RequestStatus
from kvserve.runner import host_memory
from kvserve.runner.model_runner import CacheLayout, ModelRunner
from kvserve.runner.layer_recompute import cache_view, cached_layers_key, check_model, select_cache_layers
from kvserve.spec.base import Proposer
from kvserve.spec.draft import DraftProposer, check_same_vocabulary
from kvserve.spec.ngram import NgramProposer
from kvserve.core.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")
UNBOUNDED_LEN = 1 << 62  # the length limit of a sequence whose cache is bounded in every layer

Prompt = Union[str, Sequence[int]]


SPEC_JUDGE_AFTER, SPEC_MIN_ACCEPTANCE, SPEC_PAUSE_STEPS = 8, 0.25, 16


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting requests already."""


@dataclass
class EngineStats:
    """The scheduler's figures and what only the engine knows (steps, tokens, block sizes)."""

    scheduler: SchedulerStats
    block_size: int
    block_bytes: int
    kv_cache_dtype: str
    kv_bytes_per_token: float  # kvserve.kv.formats: values and scales, the one formula sizing uses
    kv_cache_bytes: int  # everything the cache holds: blocks, the null block, residual slots, scales
    num_spec_proposed: int  # speculative tokens verified since start
    num_spec_accepted: int  # of which accepted
    num_steps: int
    num_batched_tokens_last_step: int
    num_generated_tokens: int
    num_prompt_tokens_computed: int
    sequence_bytes_max: int = 0  # the most one sequence of max_model_len holds (windowed layers: their window)
    groups: tuple[tuple[str, Optional[int], int, int], ...] = ()  # per cache group: kind, window, sinks, blocks held
    num_swaps_out: int = 0  # requests moved to the CPU pool since start
    num_swaps_in: int = 0
    num_evictions: int = 0  # cached blocks whose hash was dropped to reuse them
    preemption_choices: tuple[tuple[str, str, int], ...] = ()  # (swap | recompute, reason, count) since start
    prefill_tokens_per_s: float = 0.0  # the measured speeds preemption weighs (kvserve.core.preemption)
    copy_bytes_per_s: float = 0.0
    tiers: tuple[TierSummary, ...] = ()  # the tiers below the pool (kvserve.engine.offload)


def allocate_cache(config: EngineConfig, model: ModelConfig, plan: CachePlan, layer_tensor: Sequence[int],
                   device: str) -> tuple[KVStorage, Optional[KVStorage]]:
    """The cache (the pool's blocks and the null block) of the KV heads `model` holds and, for
    swap preemption, its CPU pool."""
    fmt = plan.kv_format
    args = (fmt.kind, fmt.name, layer_tensor)
    shape = (plan.block_size, model.num_key_value_heads, model.head_dim, getattr(torch, config.dtype))

    def make(num_blocks: int, where: str) -> KVStorage:
        if model.mla is not None and model.mla.caches_latent:  # the latent cache (kvserve.kv.latent)
            return make_latent_storage(*args, num_blocks, plan.block_size, model.mla.kv_lora_rank,
                                       model.mla.qk_rope_head_dim, where)
        return make_storage(*args, num_blocks, *shape, where, plan.num_residual_slots)
    cache = make(plan.num_blocks + 1, device)
    if config.cache.populate:
        t = time.perf_counter()
        cache.populate()
        logger.info("KV cache populated: %.0f MiB written in %.2f s", cache.nbytes / 2**20,
                    time.perf_counter() - t)
    swap = None
    if host_pool_blocks(config, plan) > 0:
        swap = make(host_pool_blocks(config, plan), "cpu")
    return cache, swap


def host_pool_blocks(config: EngineConfig, plan: CachePlan) -> int:
    """Blocks of the host pool that swap preemption moves blocks to: --swap-space's under swap;
    under auto at most as many as the device pool (a victim swapped there must fit back), so an
    engine that never preempts does not hold a large host pool it was not asked for."""
    mode = config.scheduler.preemption_mode
    if mode == "recompute":
        return 0
    return plan.num_cpu_blocks if mode == "swap" else min(plan.num_cpu_blocks, plan.num_blocks)


_logged_choices: set[str] = set()  # what resolve_defaults said, so each choice is logged once a process


def resolve_defaults(config: EngineConfig, loaded: LoadedModel) -> EngineConfig:
    """`config` with its "auto" model dtype, KV cache format and packed activations resolved for
    this checkpoint, device and CPU (kvserve.config.resolve_dtype, resolve_kv_cache_dtype,
    resolve_packed_activations): done once the
    checkpoint is loaded, so everything after (the cache's "auto" format, sizing, logs, the
    server's state) sees what runs, never "auto". A resolved config comes back as it is."""
    if config.is_resolved:
        return config
    dtype, acts, cache = config.dtype, config.packed_activations, config.cache
    if dtype == "auto":
        checkpoint = checkpoint_dtype(loaded)
        dtype = resolve_dtype(config.device, kernels.cpu_flags(), checkpoint, config.weight_dtype)
        if cache.kv_cache_dtype == "auto":
            cache = dataclasses.replace(cache, kv_cache_dtype=resolve_kv_cache_dtype(
                config.device, kernels.cpu_flags(), checkpoint, dtype, config.weight_dtype))
    if acts == "auto":
        formats = packed_formats(loaded, config.weight_dtype)
        missing = missing_int8_kernels(formats) if config.device == "cpu" else []
        acts, why = resolve_packed_activations(config.device, not missing)
        if formats:
            _log_once(f"packed weights ({', '.join(sorted(formats))}) multiply {acts} activations: {why}"
                      + (f" (missing: {', '.join(missing)})" if missing else ""))
    # dense copies are the auto policy's (kvserve.models.products); a named path takes every row count
    copies = config.dense_copy_memory if config.packed_activations == "auto" and acts == "int8" else 0.0
    resolved = dataclasses.replace(config, dtype=dtype, packed_activations=acts, dense_copy_memory=copies,
                                   cache=cache)
    _log_once(f"model dtype {resolved.dtype}, KV cache {resolved.kv_cache_dtype}"
              + ("" if config.dtype != "auto" else " (--dtype auto: docs/defaults.md)"))
    return resolved


def _log_once(message: str) -> None:
    if message not in _logged_choices:
        _logged_choices.add(message)
        logger.info("%s", message)


def check_tensor_parallel(config: EngineConfig, model: ModelConfig, tp: Optional[TensorParallel]) -> None:
    """What tensor parallelism does not serve yet, refused by name."""
    if tp is None:  # one rank
        return
    if model.mla is not None:
        raise ValueError(f"{model.name}'s latent attention (MLA) is not served with tensor parallelism yet")
    tp.check_shardable(model, config.parallel.tensor_parallel_size)
    if config.kv_cache_dtype.startswith("fp8"):
        raise ValueError("fp8 KV caches are not served with tensor parallelism yet (their per-head scales "
                         "are calibrated on the whole model): use int8, int4 or a float kv cache dtype")
    if not config.use_cache:
        raise ValueError("tensor parallelism needs the KV cache (--no-cache is the single-process reference)")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: Optional[LoadedModel] = None) -> None:
        """`loaded` lets several engines share weights already read from disk."""
        t0 = time.perf_counter()
        kernels_before = kernels.import_seconds()
        loaded = loaded or load_weights(config.model, config.tokenizer)
        self.config = config = resolve_defaults(config, loaded)
        t_read = time.perf_counter()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        trained = loaded.config.max_position_embeddings
        self.max_model_len = config.max_model_len or trained
        if self.max_model_len > trained:
            logger.warning("max_model_len %d is longer than the %d tokens %s was trained on: positions past "
                           "them were never seen, expect quality to fall there", self.max_model_len, trained,
                           loaded.config.name)
        dtype = getattr(torch, config.dtype)
        if config.device == "cpu":
            host_memory.keep_freed_memory()
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} requested but CUDA is not available")
        world = config.parallel.tensor_parallel_size
        tp = tensor_parallel(world)  # None for one rank; else kvserve.distributed's (engine/parallel.py)
        check_tensor_parallel(config, loaded.config, tp)
        shard = tp.shard_weights(loaded, 0, world) if tp is not None else loaded  # rank 0's share
        self.shard_config = shard.config  # what this rank's layers and cache hold
        self.model = build_model(shard, dtype, config.device, self.max_model_len, config.weight_dtype,
                                 config.packed_activations, config.dense_copy_memory)
        self.lora = self._make_lora()  # wraps the adapted products before the runner binds its fast path
        t_model = time.perf_counter()
        self.comm = CommStats()
        if tp is not None:
            tp.install_row_parallel(self.model, self.comm)
        self.model_id = loaded.model_id
        groups = cache_groups(loaded.config, config.cache, self.max_model_len)
        # windows the user asked for on every layer: a constant cache, so no limit on length
        # (the model's own windows keep its context limit, as its authors set it)
        self.unbounded = config.cache.sliding_window is not None and is_bounded(groups)
        self.max_seq_len = UNBOUNDED_LEN if self.unbounded else self.max_model_len
        layer_group, layer_tensor = layer_maps(groups, loaded.config.num_hidden_layers)
        self.cache_layers = select_cache_layers(config, loaded.config, groups)  # None: every layer keeps K/V
        cache_model, layer_tensor = cache_view(self.cache_layers, shard.config, layer_tensor)
        sc = config.scheduler
        step_tokens = min(sc.max_num_batched_tokens, sc.max_prefill_chunk or sc.max_num_batched_tokens)
        self.plan = plan_cache(config.cache, cache_model, config.kv_cache_dtype, self.max_model_len,
                               config.scheduler.max_num_seqs, config.device, groups, config.dtype, step_tokens)
        self.storage, swap_storage = (allocate_cache(config, cache_model, self.plan, layer_tensor, config.device)
                                      if config.use_cache else (None, None))
        self._set_fp8_scales(self.storage, swap_storage)
        t_cache = time.perf_counter()
        caching = config.cache.enable_prefix_caching and config.cache.layout == "paged"
        self.kv = KVCacheManager(self.plan.num_blocks, self.plan.block_size, caching,
                                 host_pool_blocks(config, self.plan) if swap_storage is not None else 0,
                                 namespace=(self.model_id, config.dtype, config.kv_cache_dtype, None,
                                            *cached_layers_key(self.cache_layers)),
                                 groups=groups, step_tokens=step_tokens, eviction_policy=config.cache.eviction_policy)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_seq_len)
        self.scheduler.preemption.costs.block_bytes = self.plan.block_bytes
        self.kv_events = KVEventLog()  # what the prefix cache holds, as it changes (GET /v1/kv/events)
        watch_pool(self.kv.pool, self.kv_events, self.plan.block_size)
        if config.cache.kv_events is not None:
            self.kv_events.publishers.append(ZmqPublisher(config.cache.kv_events))
        self.tiers = build_tiers(config, self.kv, self.storage, self.model_id, self.kv_events)
        self.beams = BeamSearch(self.scheduler)
        self.watchdog = Watchdog()  # ends a request that runs without progress, saying why
        layout = CacheLayout(layer_group, len(groups), tuple(g.window for g in groups), self.plan.block_size,
                             self.plan.num_blocks, self.max_model_len, tuple(g.sinks for g in groups),
                             tuple(g.kind for g in groups))
        self.runner = ModelRunner(self.model, self.storage, swap_storage, layout, config.seed,
                                  config.attention_backend, config.linear_backend)
        self.runner.lora = self.lora.adapters if self.lora is not None else None
        if self.cache_layers is not None:
            check_model(self.model)
            self.runner.cache_layers = self.cache_layers
        # ranks 1..N-1 hear every block move and forward pass before rank 0 runs it
        self.workers = tp.start_ranks(config, loaded, self.plan, layout, layer_tensor) if tp else None
        if self.workers is not None:
            self.runner.mirrors.append(self.workers)
        self.proposer = self._make_proposer(loaded)
        self.num_spec_proposed = self.num_spec_accepted = 0
        self._spec_window: dict[str, list[int]] = {}  # request -> [guessed, accepted] since last judged
        self._spec_paused: dict[str, int] = {}  # request -> the step its guessing resumes
        self.outputs = OutputProcessor(self.tokenizer)
        # told (request id, first position, logits [rows, vocab]) of the prompt rows asked for
        self.on_prompt_logits: Observers[[str, int, torch.Tensor]] = Observers()
        self._ids = itertools.count()
        self._ended_outside_step: list[Request] = []  # handed over finished: reported by the next step
        self.num_steps = self.num_generated_tokens = self.num_prompt_tokens_computed = 0
        self._last_step_tokens = 0
        self._last_log = time.monotonic()
        self.trace: Optional[StepTrace] = None  # what each step did to the cache (--trace FILE)
        if config.trace_path is not None:
            self.trace = StepTrace(self, config.trace_path)
        self.load_time_s = time.perf_counter() - t0
        logger.info("engine built in %.2f s: weights read %.2f s, model built %.2f s (kernels imported %.2f s; "
                    "%s), cache of %d blocks allocated %.2f s, runner and scheduler %.2f s", self.load_time_s,
                    t_read - t0, t_model - t_read, kernels.import_seconds() - kernels_before,
                    kernels.summary(loaded_only=True), self.plan.num_blocks, t_cache - t_model,
                    time.perf_counter() - t_cache)

    @classmethod
    def from_options(cls, model: str = DEFAULT_MODEL, loaded: Optional[LoadedModel] = None,
                     **options: Any) -> "LLMEngine":
        """The one way to build an engine from options: flat, as `LLM(...)` and the command line
        (`kvserve.engine.args.engine_options`) give them; an unknown one is a TypeError naming it."""
        return cls(engine_config(model, **options), loaded)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step after this), write
        the pool's cached blocks down to the disk tier and stop the KV event publishers."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        self.kv_events.close()
        if self.workers is not None:
            self.workers.close()
            self.runner.mirrors.remove(self.workers)
            self.workers = None

    def flush_kv_tiers(self) -> None:
        """Write the pool's cached blocks down to the tiers and wait for every write (at a
        server's shutdown; the engine goes on working)."""
        if self.tiers is not None:
            self.tiers.flush()

    def _make_lora(self) -> Optional[EngineLoRA]:
        """The LoRA adapters (kvserve.engine.lora), where enabled."""
        c = self.config
        if not c.lora.enabled:
            return None
        if c.parallel.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served with tensor parallelism yet")
        if c.cache.disk_dir is not None:  # an adapter's load id does not name the same adapter after a restart
            raise ValueError("LoRA adapters are not served with a disk KV cache tier (--kv-cache-dir) yet: "
                             "their block names hold a load id that a restart does not keep")
        return EngineLoRA(LoRASet(self.model, c.lora.max_loras, c.lora.max_lora_rank), c.lora)

    def _make_proposer(self, loaded: LoadedModel) -> Optional[Proposer]:
        spec = self.config.speculative
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.method == "draft":
            assert spec.speculative_model is not None
            c = self.config
            draft = LLMEngine.from_options(
                spec.speculative_model, device=c.device, dtype=c.dtype, max_model_len=self.max_model_len,
                block_size=c.cache.block_size, num_blocks=self.plan.num_blocks, max_num_seqs=c.scheduler.max_num_seqs,
                max_num_batched_tokens=c.scheduler.max_num_batched_tokens, seed=c.seed,
                attention_backend=c.attention_backend, linear_backend=c.linear_backend,
                sliding_window=c.cache.sliding_window, attention_sinks=c.cache.attention_sinks,
                kv_cache_populate=c.cache.populate)
            check_same_vocabulary(self, draft)
            draft.outputs.tokenizer = None  # its copies' tokens are never read as text
            return DraftProposer(draft, self.runner.sampler.key)
        return None

    def _propose(self) -> None:
        """Guesses for the next step's decodes, unless the batch is past the point where guessing
        costs more than it saves, or a request's guesses keep failing: one whose last
        SPEC_JUDGE_AFTER guesses were accepted less than SPEC_MIN_ACCEPTANCE of the time is not
        guessed for during the next SPEC_PAUSE_STEPS steps (free text gives n-gram lookup little
        to find, and a verification that accepts nothing only costs)."""
        if self.proposer is None:
            return
        spec, running = self.config.speculative, self.scheduler.running
        if len(running) > spec.disable_batch_size:
            return
        for rid, (guessed, accepted) in list(self._spec_window.items()):
            if guessed >= SPEC_JUDGE_AFTER:
                if accepted < SPEC_MIN_ACCEPTANCE * guessed:
                    self._spec_paused[rid] = self.num_steps + SPEC_PAUSE_STEPS
                del self._spec_window[rid]
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1
                    and not r.sampling_params.use_beam_search and r.sampling_params.structured is None
                    and r.num_output_tokens > 0
                    and self._spec_paused.get(r.request_id, 0) <= self.num_steps]
        if decoding:
            self.proposer.propose(decoding, spec.num_speculative_tokens)

    def _set_fp8_scales(self, *storages: Optional[KVStorage]) -> None:
        """fp8 scales: from the given file, or calibrated now (kvserve.engine.calibrate)."""
        fp8 = [s for s in storages if isinstance(s, Fp8KVStorage)]
        if not fp8:
            return
        c = self.model_config
        path = self.config.cache.kv_cache_scales
        scales = (read_fp8_scales(path, c.num_hidden_layers, c.num_key_value_heads) if path else
                  calibrate_fp8(self.model, self.tokenizer, self.plan.kv_format.name))
        for storage in fp8:
            storage.set_scales(scales)

    # ---- requests ----
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids, or --tokenizer")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}")
        return ids

    def add_request(self, request_id: Optional[str], prompt: Prompt,
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None, cache_salt: Optional[str] = None) -> str:
        """Validate and queue a request; returns its id. Raises ValueError naming the problem."""
        params = self._with_lora(params or SamplingParams())
        ids = self.encode(prompt)
        self._validate(ids, params)
        max_waiting = self.config.scheduler.max_waiting
        if max_waiting is not None and len(self.scheduler.waiting) >= max_waiting:
            raise QueueFullError(f"the waiting queue is full ({max_waiting} requests)")
        rid = request_id if request_id is not None else str(next(self._ids))
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        req = Request(rid, ids, params, tuple(eos), priority,
                      arrival_time if arrival_time is not None else time.monotonic(), cache_salt)
        self.scheduler.add_request(req)
        self.outputs.add(req, prompt if isinstance(prompt, str) else None)
        if params.use_beam_search:
            self.beams.add(req, params.max_tokens)
        return rid

    def add_prefilled(self, handover: KVHandover, params: SamplingParams, arrival_time: Optional[float] = None) -> str:
        """A request whose prompt another engine computed (disaggregated prefill): its K/V is
        written into this engine's blocks on admission and decoding goes on from the first
        token that engine sampled, without computing the prompt again. A handover from another
        model, KV format or layout is refused (ValueError naming what differs)."""
        self.kv_identity().check(handover.identity)
        ids = list(handover.prompt_token_ids)
        self._validate(ids, params)
        if params.lora_request is not None:
            raise ValueError("a handed-over request runs the base model: its K/V was computed without an adapter")
        if params.n > 1 or params.use_beam_search:
            raise ValueError("a handed-over request continues one sequence: n > 1 and beam search are not served")
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        req = Request(handover.request_id, ids, params, tuple(eos), 0,
                      arrival_time if arrival_time is not None else time.monotonic(),
                      output_token_ids=list(handover.output_token_ids),
                      output_logprobs=list(handover.output_logprobs), num_external_tokens=handover.num_tokens)
        self.scheduler.add_request(req)
        self.outputs.add(req, handover.prompt)
        if handover.sampling_key is not None:
            self.runner.sampler.adopt(req.request_id, handover.sampling_key)
        status = req.check_stop(self.max_seq_len)
        if status is not None or not handover.num_tokens:  # its first token ended it
            self.scheduler.finish_request(req.request_id, status or RequestStatus.FINISHED_STOPPED)
            self._ended_outside_step.append(req)
        else:
            self.runner.kv_sources[req.request_id] = handover.source(self.config.dtype)
        return req.request_id

    # ---- LoRA adapters ----
    def _with_lora(self, params: SamplingParams) -> SamplingParams:
        """params naming its adapter's current load (kvserve.engine.lora), or as given without one."""
        if params.lora_request is None:
            return params
        if self.lora is None:
            raise ValueError(f"LoRA adapter {params.lora_request.lora_name!r} asked for, but LoRA is not enabled "
                             "(--lora-modules or --enable-lora)")
        return self.lora.resolve(params)

    def lora_adapters(self) -> list[LoRAAdapter]:
        """The adapters loaded, in load order (none without LoRA)."""
        return [] if self.lora is None else list(self.lora.adapters.adapters.values())  # one read (another thread loads)

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load a PEFT adapter at run time; ValueError naming the problem."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora or --lora-modules")
        return self.lora.load(name, path)

    def unload_lora(self, name: str) -> LoRAAdapter:
        """Unload an adapter; refused (ValueError) while unfinished requests run it."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled: no adapter is loaded")
        return self.lora.unload(name, self.scheduler.requests.values())

    def kv_identity(self) -> KVIdentity:
        """What a K/V handover must match to be loaded here."""
        c = self.model_config
        num_layers = c.num_hidden_layers if self.cache_layers is None else len(self.cache_layers.cached)
        return KVIdentity(self.model_id, self.config.kv_cache_dtype, num_layers, c.num_key_value_heads,
                          c.head_dim, self.plan.block_size)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if params.structured is not None:
            self._structured().grammar(params.structured)  # a ValueError naming the problem
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise FieldError("logit_bias", f"token ids must be below the vocabulary size {vocab}, got "
                             f"{max(t for t, _ in params.logit_bias)}")
        width = group_width(params)
        if width > self.config.scheduler.max_num_seqs:
            raise FieldError("n", f"this request runs {width} sequences at once, more than the "
                             f"{self.config.scheduler.max_num_seqs} the engine runs (--max-num-seqs)")
        budget = self.config.scheduler.max_num_batched_tokens
        if params.use_beam_search and width > budget:  # every beam computes a token in the same step
            raise FieldError("beam_width", f"{width} beams step together, more than the {budget} tokens a step "
                             f"computes (--max-num-batched-tokens)")
        room = self.max_seq_len - (params.max_tokens > 0)  # room for one generated token, if any
        if len(ids) > room:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds "
                             f"{self.max_model_len}, so at most {room} fit")
        self._check_fits(ids, params, width)

    def _check_fits(self, ids: list[int], params: SamplingParams, width: int) -> None:
        """The request's group at its worst (every sequence grown to its longest, a decode step
        each with its proposals: the scheduler cuts a windowed prompt into chunks that fit)
        must fit the pool, or it could never run whole."""
        longest = min(len(ids) + params.max_tokens, self.max_seq_len)
        lookahead = self.config.speculative.num_speculative_tokens if self._speculates(params) else 0
        needed = self.kv.group_blocks_needed(len(ids), longest, width, 1 + lookahead)
        if needed <= self.plan.num_blocks:
            return
        group = f"its {width} sequences" if width > 1 else "it"
        lower = "max_tokens, n or best_of" if width > 1 else "max_tokens"
        raise ValueError(f"this request can grow to {longest} tokens: {group} may hold {needed} blocks "
                         f"at once but the KV cache has {self.plan.num_blocks} blocks of "
                         f"{self.plan.block_size}; lower {lower} or raise --kv-cache-memory")

    def _speculates(self, params: SamplingParams) -> bool:
        """Whether the request's decodes may verify proposals (the proposer guesses for plain
        sampling only)."""
        return self.proposer is not None and not params.use_beam_search and params.structured is None

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now (every member of its group: n > 1 samples)."""
        aborted = self.scheduler.finish_group(request_id, RequestStatus.FINISHED_ABORTED)
        self.runner.kv_sources.pop(request_id, None)
        self.beams.forget(request_id)
        for req in aborted:
            self.outputs.finish_sample(req, "abort")
        self.outputs.states.pop(request_id, None)
        return bool(aborted)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ended_outside_step)

    def has_runnable(self) -> bool:
        """Whether a step would do anything: a request that is not paused, or outputs to report."""
        return self.scheduler.has_runnable() or bool(self._ended_outside_step)

    def pause(self, request_id: str) -> bool:
        """Hold a request (its whole group) out of the steps until resume: nothing is computed
        for it, its blocks go first when another request needs them (Scheduler.pause)."""
        return self.scheduler.pause(request_id)

    def resume(self, request_id: str) -> None:
        self.scheduler.resume(request_id)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        if self.tiers is not None:  # prefixes only a tier holds go back into the pool first
            self.tiers.load_waiting(self.scheduler.waiting[:self.config.scheduler.max_num_seqs])
        sched = self.scheduler.schedule()
        self.watchdog.watch(sched, self.scheduler)
        if self.proposer is not None:
            self.proposer.forget(sched.finished_request_ids)
            for rid in sched.finished_request_ids:
                self._spec_window.pop(rid, None)
                self._spec_paused.pop(rid, None)
        t_run = time.perf_counter()
        result, failed = self.runner.execute_isolated(sched)
        self._measure_costs(sched, time.perf_counter() - t_run)
        failed_groups = [g for rid, message in failed.items() if (g := self._fail(rid, message)) is not None]
        failed_groups += [self._end_group(r, r.error or "failed") for r in
                          {r.group_id: r for r in self.scheduler.take_failed()}.values()]
        for s in sched.scheduled:
            if s.spec_token_ids and s.request_id in result.sampled_token_ids:
                accepted = len(result.sampled_token_ids[s.request_id]) - 1
                self.num_spec_proposed += len(s.spec_token_ids)
                self.num_spec_accepted += accepted
                window = self._spec_window.setdefault(s.request_id, [0, 0])
                window[0] += len(s.spec_token_ids)
                window[1] += accepted
        self._prompt_rows(sched.scheduled, result)
        touched = self.scheduler.update(sched, result)
        touched += self._ended_outside_step
        self._ended_outside_step = []
        for state in self.beams.step(result.logits):
            self.outputs.finish_beams(state.group.group_id, self.beams.outputs(state))
            touched.append(state.group.first)
        failed_groups += [g for rid, why in self.watchdog.stalled(self.scheduler)
                          if (g := self._fail(rid, why)) is not None]
        self.num_steps += 1
        self._last_step_tokens = sched.num_batched_tokens
        if self.trace is not None:
            self.trace.record(self, sched)
        self.num_generated_tokens += sum(len(t) for t in result.sampled_token_ids.values())
        self.num_prompt_tokens_computed += sum(
            s.num_tokens for s in sched.scheduled if s.start_position < len(s.prompt_token_ids))
        finished_ids = set(sched.finished_request_ids)
        touched_ids = list(failed_groups)
        for req in touched:
            self._record_footprint(req)
            if self.outputs.process(req) is not None and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            touched_ids.append(req.group_id)
        for rid in finished_ids:  # errors raised inside the scheduler
            failed = self.outputs.states.get(rid)
            if failed is not None and rid not in touched_ids:
                touched_ids.append(rid)
        self._maybe_log()
        self._propose()
        self.kv_events.publish()
        return [o for rid in dict.fromkeys(touched_ids) if (o := self.outputs.output(rid)) is not None]

    def _measure_costs(self, sched: SchedulerOutput, seconds: float) -> None:
        """What preemption weighs (kvserve.core.preemption): the block copies' bandwidth and,
        from steps that prefilled, tokens a second."""
        costs = self.scheduler.preemption.costs
        num_bytes, copy_s = self.runner.take_copy_timing()
        costs.observe_copy(num_bytes, copy_s)
        if any(s.start_position < len(s.prompt_token_ids) for s in sched.scheduled):
            costs.observe_prefill(sched.num_batched_tokens, seconds - copy_s)

    def _structured(self) -> Any:
        """The structured-output matchers, made on first use (they need llguidance and a
        Hugging Face tokenizer; a ValueError says which is missing)."""
        if self.runner.sampler.structured is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model has none")
            try:
                from kvserve.runner.structured import StructuredOutputs
                self.runner.sampler.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
            except ImportError as e:
                raise ValueError(f"structured outputs need llguidance (pip install llguidance): {e}") from e
        return self.runner.sampler.structured

    def _fail(self, request_id: str, message: str) -> Optional[str]:
        """A request whose step failed: its whole group ends with the error and frees its
        blocks; the others go on. Returns the group's id."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None else self._end_group(req, message)

    def _end_group(self, req: Request, message: str) -> str:
        """req's whole group ends with the error (req itself may have ended already, inside the
        scheduler) and frees its blocks. Returns the group's id."""
        logger.warning("request %s failed: %s", req.group_id, message)
        for member in self.scheduler.finish_group(req.group_id, RequestStatus.FINISHED_ERROR):
            member.error = message
        assert req.group is not None
        for member in req.group.members:
            if member.status == RequestStatus.FINISHED_ERROR:
                self.outputs.finish_sample(member, "error")
        self.beams.forget(req.group_id)
        state = self.outputs.states.get(req.group_id)
        if state is not None:
            state.error = state.error or message
        return req.group_id

    def _prompt_rows(self, seqs: Sequence[ScheduledSequence], result: ModelRunnerOutput) -> None:
        """Prompt chunks that asked for their rows: each row at position p scores prompt token
        p + 1 (logprob, and the k most likely), and goes to the `on_prompt_logits` observers."""
        for s in seqs:
            rows = result.logits.get(s.request_id)
            if rows is None or s.sampling_params.prompt_logprobs is None:
                continue
            self.on_prompt_logits(s.request_id, s.start_position, rows)
            targets = s.prompt_token_ids[s.start_position + 1:s.start_position + 1 + len(rows)]
            if not targets:
                continue
            lp = rows[:len(targets)].log_softmax(-1)
            chosen = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1))[:, 0].tolist()
            k = s.sampling_params.prompt_logprobs or 0
            top = lp.topk(min(k, lp.shape[-1])) if k else None
            scored = []
            for i, (t, c) in enumerate(zip(targets, chosen)):
                d = {t: c}
                if top is not None:
                    d.update(zip(top.indices[i].tolist(), top.values[i].tolist()))
                scored.append(d)
            state = self.scheduler.requests.get(s.request_id)
            if state is not None:
                self.outputs.add_prompt_logprobs(state.group_id, s.start_position, scored)

    def _record_footprint(self, req: Request) -> None:
        state = self.outputs.states.get(req.group_id)
        if state is None or req.sample_index:
            return
        blocks = self.kv.num_held_blocks(req.request_id) or req.num_kv_blocks
        state.metrics.num_kv_blocks = blocks
        state.metrics.kv_cache_bytes = blocks * self.plan.block_bytes if self.storage is not None else 0

    # ---- stats ----
    def stats(self) -> EngineStats:
        plan = self.plan
        return EngineStats(self.scheduler.stats(), plan.block_size, plan.block_bytes, plan.kv_format.name,
                           plan.kv_format.bytes_per_token(self.shard_config, plan.block_size),
                           plan.total_bytes if self.storage is not None else 0,
                           self.num_spec_proposed, self.num_spec_accepted, self.num_steps, self._last_step_tokens, self.num_generated_tokens,
                           self.num_prompt_tokens_computed, self.kv.blocks_needed(self.max_model_len, 1) * plan.block_bytes,
                           tuple((g.spec.kind, g.spec.window, g.spec.sinks, n)
                                 for g, n in zip(self.kv.groups, self.kv.group_held_blocks())),
                           self.kv.num_swaps_out, self.kv.num_swaps_in, self.kv.pool.num_evictions,
                           *self._preemption_stats(), tiers=self.tiers.summary() if self.tiers is not None else ())

    def _preemption_stats(self) -> tuple[tuple[tuple[str, str, int], ...], float, float]:
        costs = self.scheduler.preemption.costs
        choices = tuple((mode, why, n) for (mode, why), n in sorted(self.scheduler.preemption_choices.items()))
        return choices, costs.prefill_tokens_per_s, costs.copy_bytes_per_s

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval_s
        now = time.monotonic()
        if interval is None or now - self._last_log < interval:
            return
        self._last_log = now
        s = self.scheduler.stats()
        logger.info("running %d | waiting %d | preempted %d | kv usage %.1f%% | prefix hit %.1f%% | "
                    "tokens/step %d", s.num_running, s.num_waiting, s.num_preemptions,
                    100 * s.kv_usage, 100 * s.prefix_hit_rate, self._last_step_tokens)

    def check_integrity(self) -> None:
        """Between steps: the scheduler's invariants (each request in the one queue its status
        names, running tables covering exactly the computed tokens) and through them the cache
        manager's and the pool's; and every unfinished request has its output state."""
        self.scheduler.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        missing = [gid for gid in self.scheduler.groups if gid not in self.outputs.states]
        assert not missing, f"unfinished requests without an output state: {missing}"

