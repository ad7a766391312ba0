"""ModelRunner: SchedulerOutput -> input tensors -> logits -> sampled ids (ModelRunnerOutput).

The flat batch puts single-token decodes first, then multi-token chunks (prompt chunks, and
decodes that verify proposed tokens after their last token):

    input_ids  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     positions  [37 12 80 | 0 1 2 3 | 16 17]
    slot_mapping: table[pos // block_size] * block_size + pos % block_size, per cache group

Every token's position is its sequence's num_computed_tokens plus its offset in the step, so
RoPE positions always equal the cache length, whatever the batch. The runner keeps every
request's block tables (BlockTables) and applies the scheduler's changes to them, so preparing a
step costs the step's tokens and requests, not their contexts.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from kvserve import attention
from kvserve.attention.backend import AttentionMetadata, PrefillSpan
from kvserve.attention.layer import ForwardContext, install
from kvserve.core.block_math import cdiv
from kvserve.core.kv_cache_manager import BlockCopies
from kvserve.core.observers import Observers
from kvserve.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from kvserve import kernels
from kvserve.kv.storage import KVStorage
from kvserve.modules import FastPathEnv, bind_fast_path, unbind_fast_path
from kvserve.models import linear
from kvserve.models.llama import LlamaForCausalLM, RecomputedLayers
from kvserve.models.lora import LoRASet, lora_name
from kvserve.runner.block_table import BlockTables
from kvserve.runner.layer_recompute import LayerSelection, recomputed_layers
from kvserve.runner.sampler import Sampler


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    common: list[AttentionMetadata]  # per cache group, before the storage and backend add theirs
    seqs: list[ScheduledSequence]  # in batch order
    row_ends: list[int]  # one past each sequence's last row


class FatalStepError(RuntimeError):
    """A step failed where it cannot be retried per request (ranks out of step): the engine stops."""


class StepMirror(Protocol):
    """Whatever repeats rank 0's block moves and forward passes elsewhere (the other ranks)."""

    def copies(self, copies: BlockCopies) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, common: list[AttentionMetadata]) -> None: ...


@dataclass(frozen=True)
class CacheLayout:
    """How the runner maps layers to cache groups, and the pool it indexes."""

    layer_group: tuple[int, ...]  # the cache group of each layer
    num_groups: int
    group_windows: tuple[Optional[int], ...]  # each group's sliding window (None: full attention)
    block_size: int
    null_block_id: int
    max_model_len: int
    group_sinks: tuple[int, ...] = ()  # each group's attention sinks (empty: none anywhere)
    group_kinds: tuple[str, ...] = ()  # each group's kind ("full", "sliding"): which RoPE its layers use

    def sinks(self, group: int) -> int:
        return self.group_sinks[group] if self.group_sinks else 0


def release_fast_path(model: LlamaForCausalLM, runner_id: int) -> None:
    """The model's fast path unbound, where the runner that went (runner_id) bound it last."""
    if getattr(model, "fast_path_runner", None) == runner_id:
        unbind_fast_path(model)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, storage: Optional[KVStorage],
                 swap_storage: Optional[KVStorage], layout: CacheLayout, seed: int = 0,
                 attention_backend: str = "auto", linear_backend: str = "auto") -> None:
        self.model = model
        self.storage = storage  # None: recompute every sequence from scratch (the reference)
        self.swap_storage = swap_storage
        self._copy_timing = [0, 0.0]  # swapped bytes and their seconds since take_copy_timing()
        self.layout = layout
        self.device = model.device
        dtype = model.dtype
        if model.config.attn_logit_softcapping is not None:  # the kernel does not soft-cap scores
            if attention_backend == "cpu-kernel":
                raise ValueError("attention backend 'cpu-kernel' cannot soft-cap attention scores (this model's "
                                 "attn_logit_softcapping); use auto or torch")
            attention_backend = "torch"
        for g in range(layout.num_groups):
            if layout.sinks(g) and model.rope_for(layout.group_kinds[g]) is None:
                raise ValueError("attention sinks take positions within the cache, which needs RoPE "
                                 f"(keys turned by their rank); {model.config.name} has none")
        self.backend = attention.select(attention_backend, storage, self.device, layout.block_size, dtype)
        install(model, self.backend, layout.layer_group)
        self.tables = [BlockTables(layout.null_block_id, layout.block_size,
                                   cdiv(layout.max_model_len, layout.block_size) + 1, self.device)
                       for _ in range(layout.num_groups)]
        self.sampler = Sampler(seed)
        if self.device.type == "cpu" and linear_backend == "auto" and linear.onednn_available():
            linear.use_onednn(model)  # every product of a weight no other module shares
        if self.device.type == "cpu" and dtype == torch.bfloat16:
            linear.use_few_row_kernel(model, linear.kernel_for(linear_backend))
        self.fast_path: dict[str, list[str]] = {}
        self.fused_layers = True  # whether the fast path may run a decoder layer as one call (use_fast_path)
        self.use_fast_path(True)
        # The fast path's functions, bound into the model's modules, hold the model (and the cache
        # tensors its layers' compiled calls keep) in reference cycles: unbound when the runner
        # goes, so that a dropped engine's cache is freed then, not at some later collection (not
        # at the interpreter's exit, where nothing is left to free).
        weakref.finalize(self, release_fast_path, model, id(self)).atexit = False
        # told (request ids, logits [N, vocab]) of each sampled row: tests and tooling
        self.on_logits: Observers[[list[str], torch.Tensor]] = Observers()
        # called with (stage, the step's sequences) at "forward" and after plain rows are sampled
        # ("sample"): fault injection for tests
        self.fault_hook: Optional[Callable[[str, list[ScheduledSequence]], None]] = None
        # told every block move and forward before this rank runs it (the other tensor-parallel ranks)
        self.mirrors: list[StepMirror] = []
        # K/V handed over by a prefill engine, by request, until its admission loads it
        self.kv_sources: dict[str, KVStorage] = {}
        self.lora: Optional[LoRASet] = None  # the LoRA adapters the model serves (None: no LoRA)
        self.cache_layers: Optional[LayerSelection] = None  # the layers keeping K/V (None: all)

    def use_fast_path(self, enabled: bool, fused: bool = True, stacked: bool = True) -> dict[str, list[str]]:
        """Run the model's fast path (each module's kernel choices bound once, kvserve.modules)
        or its eager modules; the two give the same hidden states bit for bit. Returns what is
        bound, by module name. Bound again after anything that changes a module's weights or
        kernels (the linear backends above are chosen first). fused=False: no block runs its
        children's kernels as one compiled call (a decoder layer's decode step: FastPathEnv.fused),
        so that each kernel is called, and can be timed, on its own. stacked=False: a model whose
        layers all run as one call runs one call a layer, not all in one (FastPathEnv.stacked)."""
        unbind_fast_path(self.model)
        self.fast_path, self.fused_layers = {}, enabled and fused
        if enabled:
            env = FastPathEnv(self.device, self.model.dtype, kernels.load("layer_ops"), self.storage, fused,
                              stacked)
            self.fast_path = bind_fast_path(self.model, env)
            self.model.fast_path_runner = id(self)
        return self.fast_path

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.apply_copies(out.copies)
        self.apply_loads(out.kv_loads)
        inp = self.prepare_step(out)
        if inp is None:
            return ModelRunnerOutput({})
        if self.fault_hook is not None:
            self.fault_hook("forward", inp.seqs)
        for mirror in self.mirrors:
            mirror.forward(inp.input_ids, inp.positions, inp.common)
        try:
            hidden = self._run_model(inp)
        except Exception as e:
            if self.mirrors:  # the other ranks are inside the same forward: no retry can follow
                raise FatalStepError(f"a tensor-parallel forward failed on rank 0: {_failure(e)}") from e
            raise
        return self._sample(hidden, inp)

    def _run_model(self, inp: ModelInput) -> torch.Tensor:
        """The forward pass; with LoRA adapters served, each sequence's rows run its adapter
        (told to the model's adapter set for this pass only)."""
        if self.lora is not None:
            starts = [0, *inp.row_ends[:-1]]
            self.lora.begin_step([(lora_name(s.sampling_params), end - start)
                                  for s, start, end in zip(inp.seqs, starts, inp.row_ends)])
        try:
            return self.model(inp.input_ids, inp.positions, self.context(inp.common),  # type: ignore[no-any-return]
                              *self._recomputed(inp))
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _recomputed(self, inp: ModelInput) -> tuple[RecomputedLayers, ...]:
        """Under --cache-layers, the whole sequences the uncached leading layers run over (the
        model's extra argument); nothing otherwise (a family with its own forward takes none)."""
        if self.cache_layers is None:
            return ()
        return (recomputed_layers(inp.seqs, self.cache_layers.num_recomputed, self.backend, self.device),)

    def execute_isolated(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """execute, and where the step raises, run each sequence alone so that a failure costs
        only its own request: (what the others produced, the error of each one that failed). The
        retries redo exactly what the step did (table updates and K/V writes land in the same
        places with the same values; each request's random state goes back to where the step
        found it), so the others' outputs are what the whole step would have given. A failure
        that is no sequence's own (moving blocks) is raised."""
        saved = self.sampler.save([s.request_id for s in out.scheduled])
        self.apply_copies(out.copies)  # blocks move once; a failure here is the cache's, not a request's
        self.apply_loads(out.kv_loads)
        try:
            return self.execute(SchedulerOutput(out.scheduled, BlockCopies([], [], []), out.finished_request_ids)), {}
        except FatalStepError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure is bounded to the requests that cause it
            if len(out.scheduled) == 1:
                self.sampler.restore(saved)
                return ModelRunnerOutput({}), {out.scheduled[0].request_id: _failure(e)}
        self.sampler.restore(saved)
        merged, errors = ModelRunnerOutput({}), {}
        for s in out.scheduled:
            try:
                result = self.execute(SchedulerOutput([s], BlockCopies([], [], []), []))
            except FatalStepError:
                raise
            except Exception as e:  # noqa: BLE001
                errors[s.request_id] = _failure(e)
                continue
            for name in ("sampled_token_ids", "logprobs", "forked_token_ids", "forked_logprobs", "logits"):
                getattr(merged, name).update(getattr(result, name))
        return merged, errors

    def prepare_step(self, out: SchedulerOutput) -> Optional[ModelInput]:
        """The step's bookkeeping and inputs (no block copies, no model): forget finished
        requests, apply the table changes, build the tensors. None for an empty step."""
        self.forget(out.finished_request_ids)
        if out.is_empty:
            return None
        self._apply_table_updates(out.scheduled)
        return self.prepare(out.scheduled)

    def forget(self, request_ids: Sequence[str]) -> None:
        self.sampler.forget(request_ids)
        for t in self.tables:
            t.forget(request_ids)

    def apply_copies(self, copies: BlockCopies) -> None:
        """In BlockCopies' order: swap out, forget released blocks, swap in, copy on write."""
        if not copies or self.storage is None:
            return
        for mirror in self.mirrors:
            mirror.copies(copies)
        t0 = time.perf_counter()
        if copies.swap_out:
            assert self.swap_storage is not None
            self.storage.swap_out(self.swap_storage, copies.swap_out)
        self.storage.release(copies.released)
        if self.swap_storage is not None:
            self.swap_storage.release(copies.released_cpu)
        if copies.swap_in:
            assert self.swap_storage is not None
            self.storage.swap_in(self.swap_storage, copies.swap_in)
        num_swapped = len(copies.swap_out) + len(copies.swap_in)
        if num_swapped:
            self._copy_timing[0] += num_swapped * self.storage.bytes_per_block
            self._copy_timing[1] += time.perf_counter() - t0
        self.storage.copy_blocks(copies.copy_on_write)

    def take_copy_timing(self) -> tuple[int, float]:
        """Bytes swapped between the cache and the host pool, and the seconds it took, since the
        last call (what the engine measures the copy bandwidth by)."""
        (num_bytes, seconds), self._copy_timing = self._copy_timing, [0, 0.0]
        return int(num_bytes), float(seconds)

    def apply_loads(self, loads: Sequence[tuple[str, list[int]]]) -> None:
        """K/V another engine computed (kv_sources: a storage of the request's blocks in order)
        into the blocks the scheduler gave it, after this step's block moves."""
        for request_id, blocks in loads:
            source = self.kv_sources.pop(request_id)
            assert self.storage is not None and not self.mirrors, "handed-over K/V needs one rank's cache"
            self.storage.swap_in(source, list(enumerate(blocks)))

    def _apply_table_updates(self, seqs: Sequence[ScheduledSequence]) -> None:
        for s in seqs:
            for table, update in zip(self.tables, s.table_updates):
                if update is not None:
                    table.update(s.request_id, *update)

    # ---- inputs ----
    def prepare(self, seqs: Sequence[ScheduledSequence]) -> ModelInput:
        if self.storage is None:
            return self._prepare_recompute(seqs)
        if self._is_plain_decode_step(seqs):
            return self._prepare_decodes(seqs)
        return self._prepare_mixed(seqs)

    def _prepare_mixed(self, seqs: Sequence[ScheduledSequence]) -> ModelInput:
        """Any step over the cache: decodes first, then chunks, in tensor ops."""
        decodes = [s for s in seqs if self._as_decode(s)]
        chunks = [s for s in seqs if not self._as_decode(s)]
        ordered = decodes + chunks
        ids: list[int] = []
        positions: list[int] = []
        for s in ordered:
            ids += s.input_token_ids
            ids += s.spec_token_ids
            positions += range(s.start_position, s.context_len)
        pos = torch.tensor(positions, dtype=torch.long)
        counts = torch.tensor([s.num_tokens for s in ordered], dtype=torch.long)
        self.model.ensure_rope(max(s.context_len for s in ordered))
        common = [self._group_metadata(g, ordered, len(decodes), pos, counts) for g in range(self.layout.num_groups)]
        return self._model_input(ids, pos, common, ordered)

    def _is_plain_decode_step(self, seqs: Sequence[ScheduledSequence]) -> bool:
        """Every row a single-token decode (the steady state of generation), no attention sinks."""
        return not any(self.layout.group_sinks) and all(s.num_tokens == 1 and s.start_position > 0 for s in seqs)

    def _prepare_decodes(self, seqs: Sequence[ScheduledSequence]) -> ModelInput:
        """What `prepare` builds for a step of single-token decodes, made from Python lists in
        one tensor [3 + 2 groups, B] (ids, positions, context lengths, each group's slots and
        table rows; a row is sequence i's token), and one gather of each group's tables: a
        handful of tensor ops whatever the batch, where the general path takes a few per group."""
        positions = [s.start_position for s in seqs]
        slots = [[t.slot(s.request_id, s.start_position) for s in seqs] for t in self.tables]
        rows = [[t.rows[s.request_id] for s in seqs] for t in self.tables]
        flat = torch.tensor([[s.input_token_ids[0] for s in seqs], positions, [p + 1 for p in positions],
                             *slots, *rows], dtype=torch.long)  # [3 + 2 groups, B]
        on_device = flat if self.device.type == "cpu" else flat.to(self.device)
        ids, pos, context_lens, *group_slots = on_device[:3 + len(self.tables)].unbind(0)
        group_rows = flat[3 + len(self.tables):].unbind(0)
        max_context = max(positions) + 1
        self.model.ensure_rope(max_context)
        common = [AttentionMetadata(slot_mapping=group_slots[g], num_decode_tokens=len(seqs),
                                    sliding_window=self.layout.group_windows[g], decode_max_context=max_context,
                                    decode_block_tables=self.tables[g].tables(group_rows[g], max_context),
                                    decode_context_lens=context_lens) for g in range(self.layout.num_groups)]
        return ModelInput(ids, pos, common, list(seqs), list(range(1, len(seqs) + 1)))

    def context(self, common: list[AttentionMetadata]) -> ForwardContext:
        """The step's forward context from each group's common metadata: the storage plans its
        writes, the backend adds what it needs. Every tensor-parallel rank does this on its own
        storage from rank 0's common metadata (which stays as it was: the plan goes into the
        backend's copy, or a copy made here where the backend adds nothing)."""
        if self.storage is None:
            return ForwardContext(None, [self.backend.build_metadata(meta, None) for meta in common])
        self.storage.begin_step()
        metadata = []
        for meta in common:
            plan = self.storage.plan_writes(meta.slot_mapping)  # before the backend reads the storage
            built = self.backend.build_metadata(meta, self.storage)
            if built is meta:
                built = dataclasses.replace(meta, kv_write_plan=plan)
            else:
                built.kv_write_plan = plan
            metadata.append(built)
        return ForwardContext(self.storage, metadata)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                common: list[AttentionMetadata]) -> torch.Tensor:
        """The model over a prepared step -> hidden states [T, hidden] (tensor-parallel workers
        run this alone: no tables, no sampling)."""
        self.model.ensure_rope(int(positions.max()) + 1)
        return self.model(input_ids, positions, self.context(common))

    def _as_decode(self, s: ScheduledSequence) -> bool:
        """A token that attends to a cached context is a decode row; so is each row of a decode
        that verifies guesses (each row's context ends at its own position), read by the decode
        path, except with int4, whose rows must see their block as it was after their own write."""
        if s.start_position == 0:
            return False
        if s.num_tokens == 1:
            return True
        assert self.storage is not None
        return bool(s.spec_token_ids) and len(s.input_token_ids) == 1 and self.storage.kind != "int4"

    def _group_metadata(self, group: int, ordered: list[ScheduledSequence], num_decodes: int,
                        pos: torch.Tensor, counts: torch.Tensor) -> AttentionMetadata:
        assert self.storage is not None
        table = self.tables[group]
        rows = table.row_index([s.request_id for s in ordered])
        token_rows = torch.repeat_interleave(rows, counts)
        slots = table.slots(token_rows, pos)
        num_decode_rows = int(counts[:num_decodes].sum())
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=num_decode_rows, sliding_window=self.layout.group_windows[group])
        self._sink_metadata(meta, group, pos)
        if num_decodes:  # one query row per token: its context ends at its own position
            ctx = pos[:num_decode_rows] + 1
            meta.decode_max_context = int(ctx.max())
            meta.decode_block_tables = table.tables(token_rows[:num_decode_rows], meta.decode_max_context)
            meta.decode_context_lens = ctx.to(self.device)
        q_start = num_decode_rows
        for i, s in enumerate(ordered[num_decodes:], start=num_decodes):
            block_table = table.tables(rows[i:i + 1], s.context_len)[0]
            meta.prefills.append(PrefillSpan(q_start, s.num_tokens, s.context_len, block_table))
            q_start += s.num_tokens
        return meta

    def _sink_metadata(self, meta: AttentionMetadata, group: int, pos: torch.Tensor) -> None:
        """A sink is scored at its rank from the query's rank in the cache, min(p, W - 1): the
        query at position p is turned back by p - rank (where any is)."""
        meta.sinks = self.layout.sinks(group)
        if not meta.sinks:
            return
        assert meta.sliding_window is not None
        back = (pos - meta.sliding_window + 1).clamp(min=0)
        if bool(back.any()):
            rope = self.model.rope_for(self.layout.group_kinds[group])
            assert rope is not None
            meta.sink_rotation = rope.rotation(-back)

    def _prepare_recompute(self, seqs: Sequence[ScheduledSequence]) -> ModelInput:
        """No cache: each sequence's whole context is fed again from position 0."""
        ids: list[int] = []
        positions: list[int] = []
        meta = AttentionMetadata(sliding_window=self.layout.group_windows[0])
        for s in seqs:
            known = s.start_position + len(s.input_token_ids)
            tokens = (list(s.prompt_token_ids) + list(s.output_token_ids))[:known] + s.spec_token_ids
            meta.prefills.append(PrefillSpan(len(ids), len(tokens), len(tokens)))
            ids += tokens
            positions += range(len(tokens))
        pos = torch.tensor(positions, dtype=torch.long)
        self.model.ensure_rope(max(positions) + 1)
        common = []
        for g, w in enumerate(self.layout.group_windows):
            group_meta = AttentionMetadata(**{**vars(meta), "sliding_window": w})
            self._sink_metadata(group_meta, g, pos)
            common.append(group_meta)
        return self._model_input(ids, pos, common, list(seqs))

    def _model_input(self, ids: list[int], pos: torch.Tensor, common: list[AttentionMetadata],
                     ordered: list[ScheduledSequence]) -> ModelInput:
        ends, row = [], 0
        for s in ordered:
            row += s.num_tokens if self.storage is not None else s.context_len
            ends.append(row)
        return ModelInput(torch.tensor(ids, dtype=torch.long, device=self.device), pos.to(self.device),
                          common, ordered, ends)

    # ---- outputs ----
    def _sample(self, hidden: torch.Tensor, inp: ModelInput) -> ModelRunnerOutput:
        """Logits for the rows each sequence needs (its last row; with proposals, the last
        input and every proposal; more where it asked), then tokens."""
        if self._samples_every_row(hidden, inp):  # the decode steady state: no rows to pick
            result = ModelRunnerOutput({})
            self._sample_plain(inp.seqs, self.model.compute_logits(hidden), result)
            if self.fault_hook is not None:
                self.fault_hook("sample", inp.seqs)
            return result
        wanted = [(s, end, max(len(s.spec_token_ids) + 1 if s.num_samples else 0, s.num_logit_rows))
                  for s, end in zip(inp.seqs, inp.row_ends)]
        wanted = [w for w in wanted if w[2]]
        if not wanted:
            return ModelRunnerOutput({})
        index = torch.cat([torch.arange(end - n, end) for _, end, n in wanted]).to(self.device)
        logits = self.model.compute_logits(hidden[index])  # [rows, vocab] fp32
        per_seq = dict(zip((s.request_id for s, _, _ in wanted), logits.split([n for *_, n in wanted])))
        result = ModelRunnerOutput({})
        plain = [s for s, _, _ in wanted if s.num_samples and not s.spec_token_ids]
        if plain:
            self._sample_plain(plain, torch.stack([per_seq[s.request_id][-1] for s in plain]), result)
        if self.fault_hook is not None:
            self.fault_hook("sample", inp.seqs)
        for s, _, n in wanted:
            if s.num_samples and s.spec_token_ids:
                self._verify(s, per_seq[s.request_id][-(len(s.spec_token_ids) + 1):], result)
            if s.num_logit_rows:
                result.logits[s.request_id] = per_seq[s.request_id][-s.num_logit_rows:]
        return result

    @staticmethod
    def _samples_every_row(hidden: torch.Tensor, inp: ModelInput) -> bool:
        """One row per sequence, each sampling its next token from it (no proposals to verify,
        no other logits asked): the logits of all the rows, in order, are what sampling needs."""
        return hidden.shape[0] == len(inp.seqs) and all(
            s.num_samples and not s.spec_token_ids and not s.num_logit_rows for s in inp.seqs)

    def _sample_plain(self, seqs: list[ScheduledSequence], rows: torch.Tensor, result: ModelRunnerOutput) -> None:
        if self.on_logits:
            self.on_logits([s.request_id for s in seqs], rows)
        tokens, logprobs = self.sampler(rows, seqs)
        for s, toks, lps in zip(seqs, tokens, logprobs):
            result.sampled_token_ids[s.request_id] = toks[:1]
            if len(toks) > 1:
                result.forked_token_ids[s.request_id] = toks[1:]
            if lps is not None:
                result.logprobs[s.request_id] = lps[:1]
                if len(toks) > 1:
                    result.forked_logprobs[s.request_id] = lps[1:]

    def _verify(self, seq: ScheduledSequence, rows: torch.Tensor, result: ModelRunnerOutput) -> None:
        tokens, logprobs = self.sampler.verify(rows, seq)
        if self.on_logits:
            self.on_logits([seq.request_id] * len(tokens), rows[:len(tokens)])
        result.sampled_token_ids[seq.request_id] = tokens
        if logprobs is not None:
            result.logprobs[seq.request_id] = logprobs


def _failure(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
