"""Prefill/decode disaggregation: one engine computes prompts, another decodes them.

    DisaggregatedLLM.generate
        | prompt ids, params (pipe)
        v
    prefill process: LLMEngine + KVExporter -- each request runs to its first token; its
        |                                      blocks are read just before they go back
        | KVHandover (KVConnector: torch.distributed send/recv, gloo)
        v
    this process: LLMEngine.add_prefilled -- blocks allocated, K/V loaded on admission,
                                             decoding goes on from the first token

The prefill engine's blocks are freed once read (their full blocks stay in its prefix cache,
as any finished request's do); the decode engine never computes a prompt token it was handed.
The connector is an interface (`KVConnector`) so that other transports (shared memory, RDMA)
can carry the same handovers; `QueueConnector` joins two engines in one process.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import queue
import time
import weakref
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from kvserve.config import DEFAULT_MODEL
from kvserve.core.block_math import num_blocks_for
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.handover import KVHandover, read_blocks
from kvserve.kv.storage import BlockTensorStorage

HANDOVER_TIMEOUT = timedelta(minutes=30)


class KVConnector(ABC):
    """Carries handovers from a producer (prefill) engine to a consumer (decode) engine."""

    num_sent = num_received = 0
    bytes_sent = bytes_received = 0
    send_s = receive_s = 0.0

    @abstractmethod
    def send(self, handover: KVHandover) -> None: ...

    @abstractmethod
    def poll(self) -> Optional[KVHandover]:
        """The next handover if one has arrived, else None (never waits)."""

    def _count_sent(self, handover: KVHandover, seconds: float) -> None:
        self.num_sent += 1
        self.bytes_sent += handover.nbytes
        self.send_s += seconds

    def _count_received(self, handover: KVHandover, seconds: float) -> None:
        self.num_received += 1
        self.bytes_received += handover.nbytes
        self.receive_s += seconds


class QueueConnector(KVConnector):
    """Two engines in one process: the handover's tensors are handed over as they are."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[KVHandover]" = queue.SimpleQueue()

    def send(self, handover: KVHandover) -> None:
        self._count_sent(handover, 0.0)
        self._queue.put(handover)

    def poll(self) -> Optional[KVHandover]:
        try:
            handover = self._queue.get_nowait()
        except queue.Empty:
            return None
        self._count_received(handover, 0.0)
        return handover


class TorchDistributedConnector(KVConnector):
    """Over a torch.distributed process group (gloo on CPU): a handover is a header (its fields,
    the tensors' shapes and dtypes, pickled into a uint8 tensor, after its length) and then each
    block tensor, sent point to point. A doorbell (one end of a pipe) rings once per handover
    before it is sent, so the receiver polls without waiting (gloo's receives cannot be polled)
    and posts its receives only when one comes."""

    def __init__(self, peer: int, doorbell: Any) -> None:
        self.peer, self.doorbell = peer, doorbell

    def send(self, handover: KVHandover) -> None:
        t0 = time.perf_counter()
        tensors = [t.contiguous() for part in handover.blocks for t in part.values()]
        shapes = [{name: (tuple(t.shape), t.dtype) for name, t in part.items()} for part in handover.blocks]
        header = pickle.dumps(dataclasses.replace(handover, blocks=shapes), protocol=pickle.HIGHEST_PROTOCOL)
        self.doorbell.send_bytes(b"")
        dist.send(torch.tensor([len(header)], dtype=torch.long), self.peer)
        dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), self.peer)
        for t in tensors:
            dist.send(t, self.peer)
        self._count_sent(handover, time.perf_counter() - t0)

    def poll(self) -> Optional[KVHandover]:
        if not self.doorbell.poll():
            return None
        self.doorbell.recv_bytes()
        length = torch.zeros(1, dtype=torch.long)
        dist.recv(length, self.peer)
        t0 = time.perf_counter()
        header = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(header, self.peer)
        handover: KVHandover = pickle.loads(header.numpy().tobytes())
        blocks = []
        for part in handover.blocks:
            received = {}
            for name, (shape, dtype) in part.items():  # type: ignore[misc]
                received[name] = torch.empty(shape, dtype=dtype)
                dist.recv(received[name], self.peer)
            blocks.append(received)
        handover.blocks = blocks
        self._count_received(handover, time.perf_counter() - t0)
        return handover


class KVExporter:
    """Makes an engine a prefill engine: a request added through `add` stops after its first
    token, and just before its blocks go back its K/V is read into a handover (`take`)."""

    def __init__(self, engine: Any) -> None:
        check_disaggregable(engine)
        self.engine = engine
        self._wanted: dict[str, SamplingParams] = {}  # request -> its own params (max_tokens)
        self._prompts: dict[str, Optional[str]] = {}
        self._ready: list[KVHandover] = []
        engine.scheduler.on_release.add(self._capture)

    def add(self, request_id: str, prompt: Union[str, Sequence[int]], params: SamplingParams) -> str:
        if params.n > 1 or params.use_beam_search:
            raise ValueError("disaggregated prefill hands over one sequence: n > 1 and beam search are not served")
        first_only = dataclasses.replace(params, max_tokens=min(params.max_tokens, 1))
        rid = self.engine.add_request(request_id, prompt, first_only)
        self._wanted[rid] = params
        self._prompts[rid] = prompt if isinstance(prompt, str) else None
        return rid

    def take(self) -> list[KVHandover]:
        ready, self._ready = self._ready, []
        return ready

    def _capture(self, req: Request) -> None:
        params = self._wanted.pop(req.request_id, None)
        prompt = self._prompts.pop(req.request_id, None)
        if params is None or req.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            return
        e = self.engine
        continues = req.status == RequestStatus.FINISHED_LENGTH and params.max_tokens > 1
        num_tokens = req.num_computed_tokens if continues else 0
        storage = e.storage
        assert isinstance(storage, BlockTensorStorage)
        blocks = e.kv.block_table(req.request_id)[:num_blocks_for(num_tokens, e.plan.block_size)]
        self._ready.append(KVHandover(
            req.request_id, prompt, list(req.prompt_token_ids), list(req.output_token_ids),
            list(req.output_logprobs), e.kv_identity(), num_tokens, storage.kind, tuple(storage.layer_to_tensor),
            read_blocks(storage, blocks) if blocks else [{}], e.runner.sampler.key(req.request_id)))


def check_disaggregable(engine: Any) -> None:
    """Refuse, by name, the engines whose cache a handover cannot carry yet."""
    if engine.storage is None:
        raise ValueError("disaggregated prefill hands over the KV cache: --no-cache has none")
    if engine.storage.kind == "int4" or not isinstance(engine.storage, BlockTensorStorage):
        raise ValueError(f"disaggregated prefill does not hand over {engine.config.kv_cache_dtype} caches yet "
                         "(int4 keeps its partial block outside the blocks): use a float, int8 or fp8 kv cache")
    if engine.storage.kind.startswith("latent"):
        raise ValueError("disaggregated prefill does not hand over latent (MLA) caches yet")
    if len(engine.kv.groups) != 1 or engine.kv.groups[0].spec.window is not None:
        raise ValueError("disaggregated prefill hands over full-attention caches only (no sliding windows)")
    if engine.config.parallel.tensor_parallel_size > 1:
        raise ValueError("disaggregated prefill with tensor parallelism is not served yet")


# ---- two processes ----
def prefill_main(config: Any, loaded: Any, conn: Any, doorbell: Any, init_method: str) -> None:
    """The prefill process: rank 0 of a 2-rank group; requests arrive on the pipe, handovers
    leave through the connector."""
    from kvserve.engine.llm_engine import LLMEngine
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=2, timeout=HANDOVER_TIMEOUT)
    engine = LLMEngine(config, loaded)
    exporter, connector = KVExporter(engine), TorchDistributedConnector(1, doorbell)
    conn.send(("ready",))
    try:
        while True:
            if conn.poll(0 if engine.has_unfinished() else None):
                kind, *args = conn.recv()
                if kind == "stop":
                    break
                if kind == "add":
                    try:
                        exporter.add(*args)
                    except ValueError as err:
                        conn.send(("error", args[0], str(err)))
                elif kind == "stats":
                    engine.check_integrity()
                    s = engine.stats().scheduler
                    conn.send(("stats", dict(num_blocks=s.num_blocks, num_free_blocks=s.num_free_blocks,
                                             num_cached_blocks=s.num_cached_blocks, num_running=s.num_running,
                                             num_waiting=s.num_waiting, num_sent=connector.num_sent,
                                             bytes_sent=connector.bytes_sent, send_s=connector.send_s,
                                             num_prompt_tokens_computed=engine.num_prompt_tokens_computed)))
                continue
            for out in engine.step():
                if out.finished and out.error:
                    conn.send(("error", out.request_id, out.error))
            for handover in exporter.take():
                connector.send(handover)
    except EOFError:  # the decode side is gone
        pass
    finally:
        dist.destroy_process_group()


class DisaggregatedLLM:
    """`LLM`'s generate over two engines: a prefill engine in its own process and a decode
    engine in this one, the K/V of every prompt handed over by torch.distributed (gloo)."""

    def __init__(self, model: str = DEFAULT_MODEL, loaded: Optional[Any] = None,
                 prefill_options: Optional[dict[str, Any]] = None, **options: Any) -> None:
        import multiprocessing as mp

        from kvserve.distributed.workers import free_port
        from kvserve.engine.args import engine_config
        from kvserve.engine.llm_engine import LLMEngine
        from kvserve.models.registry import load_weights
        if dist.is_initialized():
            raise RuntimeError("a process group is already running in this process (one distributed engine per process)")
        decode_config = engine_config(model, **options)
        prefill_config = engine_config(model, **{**options, **(prefill_options or {})})
        loaded = loaded or load_weights(decode_config.model, decode_config.tokenizer)
        init = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        bell, child_bell = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=prefill_main, args=(prefill_config, loaded, child, child_bell, init),
                                 daemon=True, name="kvserve-prefill")
        self._proc.start()
        child.close()
        child_bell.close()
        dist.init_process_group("gloo", init_method=init, rank=1, world_size=2, timeout=HANDOVER_TIMEOUT)
        self.engine = LLMEngine(decode_config, loaded)
        check_disaggregable(self.engine)
        self.connector = TorchDistributedConnector(0, bell)
        self._expect("ready")
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, _stop_prefill, self._conn, self._proc)

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]], params: Optional[SamplingParams] = None) -> list:
        params = params or SamplingParams()
        ids = []
        for prompt in prompts:
            tokens = self.engine.encode(prompt)
            self.engine._validate(tokens, params)  # refused here, before the prefill side sees it
            rid = f"disagg-{next(self._ids)}"
            self._conn.send(("add", rid, prompt if isinstance(prompt, str) else tokens, params))
            ids.append(rid)
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            self._take_handovers(params)
            self._take_errors()
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
            else:
                time.sleep(0.001)
        return [done[rid] for rid in ids]

    def prefill_stats(self) -> dict[str, Any]:
        """The prefill engine's pool (after its integrity check) and what it has sent."""
        self._conn.send(("stats",))
        return self._expect("stats")[0]  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._finalizer.alive:
            self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _take_handovers(self, params: SamplingParams) -> None:
        while (handover := self.connector.poll()) is not None:
            self.engine.add_prefilled(handover, params)

    def _take_errors(self) -> None:
        while self._conn.poll():
            kind, *args = self._conn.recv()
            if kind == "error":
                raise RuntimeError(f"prefill of request {args[0]} failed: {args[1]}")

    def _expect(self, kind: str) -> list[Any]:
        while True:
            if not self._proc.is_alive() and not self._conn.poll():
                raise RuntimeError(f"the prefill process exited (code {self._proc.exitcode})")
            if self._conn.poll(0.1):
                got, *args = self._conn.recv()
                if got == kind:
                    return args
                if got == "error":
                    raise RuntimeError(f"prefill of request {args[0]} failed: {args[1]}")


def _stop_prefill(conn: Any, proc: Any) -> None:
    try:
        conn.send(("stop",))
        conn.close()
    except OSError:
        pass
    proc.join(30)
    if proc.is_alive():
        proc.kill()
