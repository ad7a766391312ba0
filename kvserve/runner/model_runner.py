"""ModelRunner: SchedulerOutput -> input tensors -> logits -> sampled ids (ModelRunnerOutput).

The flat batch puts single-token decodes first, then prefill chunks:

    input_ids  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     positions  [37 12 80 | 0 1 2 3 | 16 17]
    slot_mapping: block_table[pos // block_size] * block_size + pos % block_size for each token

Every token's position is its sequence's num_computed_tokens plus its offset in the step, so
RoPE positions always equal the cache length, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from kvserve.attention.backend import AttentionMetadata, PrefillSpan
from kvserve.core.block_math import num_blocks_for, slots_for
from kvserve.core.kv_cache_manager import BlockCopies
from kvserve.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from kvserve.kv.cache import KVCache
from kvserve.models import linear
from kvserve.models.llama import LlamaForCausalLM
from kvserve.runner.sampler import Sampler


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] rows whose hidden state is sampled
    sample_seqs: list[ScheduledSequence]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: Optional[KVCache],
                 swap_cache: Optional[KVCache], block_size: int, seed: int = 0,
                 attention_backend: str = "auto", linear_backend: str = "auto") -> None:
        self.model = model
        self.kv_cache = kv_cache  # None: recompute every sequence from scratch (the reference)
        self.swap_cache = swap_cache
        self.block_size = block_size
        self.device = model.model.embed_tokens.weight.device
        self.sampler = Sampler(seed)
        self.decode_kernel = self._pick_decode_kernel(attention_backend)
        self._pick_linear_kernel(linear_backend)
        # called with (request ids, logits [N, vocab]) each step: tests and logprob tooling
        self.logits_hook: Optional[Callable[[list[str], torch.Tensor], None]] = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.apply_copies(out.copies)
        self.sampler.forget(out.finished_request_ids)
        if out.is_empty:
            return ModelRunnerOutput({})
        inp = self.prepare(out.scheduled)
        hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_cache)
        if not inp.sample_seqs:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        ids = [s.request_id for s in inp.sample_seqs]
        if self.logits_hook is not None:
            self.logits_hook(ids, logits)
        tokens, logprobs = self.sampler(logits, inp.sample_seqs)
        return ModelRunnerOutput(dict(zip(ids, tokens)),
                                 {i: lp for i, lp in zip(ids, logprobs) if lp is not None})

    def _pick_decode_kernel(self, backend: str) -> Optional[Callable[..., torch.Tensor]]:
        if backend == "torch" or self.device.type != "cpu" or self.kv_cache is None:
            return None
        from kvserve.attention import cpu_kernel
        fn = cpu_kernel.decode_fn()
        if fn is None and backend == "cpu-kernel":
            raise ValueError(f"attention backend 'cpu-kernel' could not be built: {cpu_kernel.failure()}")
        return fn

    def _pick_linear_kernel(self, backend: str) -> None:
        fn = None
        if self.device.type == "cpu" and self.model.lm_head.weight.dtype == torch.bfloat16:
            fn = linear.kernel_for(backend)
        linear.use_few_row_kernel(self.model, fn)

    def apply_copies(self, copies: BlockCopies) -> None:
        if not copies:
            return
        assert self.kv_cache is not None
        if copies.swap_out or copies.swap_in:
            assert self.swap_cache is not None
            self.kv_cache.copy_to(self.swap_cache, copies.swap_out)
            self.swap_cache.copy_to(self.kv_cache, copies.swap_in)
        self.kv_cache.copy_blocks(copies.copy_on_write)

    def prepare(self, seqs: Sequence[ScheduledSequence]) -> ModelInput:
        if self.kv_cache is None:
            return self._prepare_recompute(seqs)
        decodes = [s for s in seqs if s.num_tokens == 1 and s.start_position > 0]
        prefills = [s for s in seqs if not (s.num_tokens == 1 and s.start_position > 0)]
        ordered = decodes + prefills
        ids, positions, slots = [], [], []
        for s in ordered:
            ids.extend(s.input_token_ids)
            positions.extend(range(s.start_position, s.context_len))
            slots.extend(slots_for(s.block_table, s.start_position, s.context_len, self.block_size))
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), num_decode_tokens=len(decodes))
        if decodes:
            self._decode_metadata(meta, decodes)
        row = len(decodes)
        for s in prefills:
            meta.prefills.append(self._prefill_span(s, row))
            row += s.num_tokens
        return self._model_input(ids, positions, meta, ordered)

    def _prepare_recompute(self, seqs: Sequence[ScheduledSequence]) -> ModelInput:
        """No cache: each sequence's whole context is fed again from position 0."""
        ids: list[int] = []
        meta = AttentionMetadata()
        full = []
        for s in seqs:
            tokens = (list(s.prompt_token_ids) + list(s.output_token_ids))[:s.context_len]
            meta.prefills.append(PrefillSpan(len(ids), len(tokens), len(tokens)))
            ids.extend(tokens)
            full.append(ScheduledSequence(s.request_id, tokens, 0, [], s.sampling_params,
                                          s.num_samples, s.prompt_token_ids, s.output_token_ids, s.seed))
        positions = [p for s in full for p in range(s.num_tokens)]
        return self._model_input(ids, positions, meta, full)

    def _model_input(self, ids: list[int], positions: list[int], meta: AttentionMetadata,
                     ordered: list[ScheduledSequence]) -> ModelInput:
        ends, row = [], 0
        sample_seqs = []
        for s in ordered:
            row += s.num_tokens
            if s.num_samples:
                ends.append(row - 1)
                sample_seqs.append(s)
        return ModelInput(self._tensor(ids), self._tensor(positions), meta, self._tensor(ends), sample_seqs)

    def _decode_metadata(self, meta: AttentionMetadata, decodes: list[ScheduledSequence]) -> None:
        ctx = [s.context_len for s in decodes]
        num_blocks = max(num_blocks_for(c, self.block_size) for c in ctx)
        tables = [s.block_table[:num_blocks] + [0] * (num_blocks - len(s.block_table[:num_blocks]))
                  for s in decodes]
        slots_per_block = min(self.block_size, max(ctx))
        length = num_blocks * slots_per_block
        meta.decode_block_tables = self._tensor(tables)
        meta.decode_slots_per_block = slots_per_block
        meta.decode_context_lens = lens = self._tensor(ctx)
        meta.decode_kernel = self.decode_kernel
        if self.decode_kernel is not None:
            return  # the kernel reads each context's exact length: no padding mask
        positions = torch.arange(length, device=self.device)
        past_end = positions.unsqueeze(0) >= lens.unsqueeze(1)
        mask = torch.zeros(len(ctx), 1, 1, length, dtype=self.model.model.embed_tokens.weight.dtype,
                           device=self.device)
        meta.decode_mask = mask.masked_fill_(past_end.view(len(ctx), 1, 1, length), float("-inf"))

    def _prefill_span(self, s: ScheduledSequence, row: int) -> PrefillSpan:
        if s.start_position == 0:  # the chunk is the whole context: no gather, plain causal
            return PrefillSpan(row, s.num_tokens, s.context_len)
        table = self._tensor(s.block_table[:num_blocks_for(s.context_len, self.block_size)])
        q_pos = torch.arange(s.start_position, s.context_len, device=self.device)
        mask = torch.arange(s.context_len, device=self.device).unsqueeze(0) <= q_pos.unsqueeze(1)
        return PrefillSpan(row, s.num_tokens, s.context_len, table, mask)

    def _tensor(self, data: Sequence) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)
