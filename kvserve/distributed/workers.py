"""The ranks of a tensor-parallel engine.

Rank 0 is the engine itself: it schedules, prepares each step and samples. Ranks 1..N-1 are
workers, each a ModelRunner over its shard of the weights and its share of every cache block,
with no scheduler, tables or sampler. Before rank 0 moves blocks or runs a forward pass it sends
the same operation to every worker (`TensorParallelWorkers`, the runner's StepMirror):

    rank 0:   schedule -> copies ------> forward ==all-reduce x 2 per layer==> sample
    rank r:          recv copies -> recv forward ==all-reduce x 2 per layer==> (nothing)

Two channels, both existing machinery: the step messages (pickled, a few KB) travel over a
multiprocessing pipe ("mp") or as Ray actor calls ("ray"), which may wait idle as long as the
engine does; the activations' all-reduce runs on a torch.distributed process group (gloo on
CPU, NCCL on CUDA). A worker that dies breaks rank 0's next collective or send with an error;
rank 0 going away ends the workers (their pipe closes, their collectives fail).
"""

from __future__ import annotations

import logging
import pickle
import socket
import time
import weakref
from dataclasses import dataclass, fields, is_dataclass, replace
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from kvserve.attention.backend import AttentionMetadata
from kvserve.config import EngineConfig
from kvserve.core.kv_cache_manager import BlockCopies
from kvserve.distributed.tensor_parallel import check_shardable, install_row_parallel, shard_weights
from kvserve.engine.llm_engine import allocate_cache, resolve_defaults
from kvserve.engine.parallel import CommStats, TensorParallel
from kvserve.kv.sizing import CachePlan
from kvserve.models.loaders.base import LoadedModel
from kvserve.models.registry import build_model
from kvserve.runner.model_runner import CacheLayout, ModelRunner

logger = logging.getLogger("kvserve")
# a collective waits this long for the slowest rank; a dead rank fails it at once (its socket closes)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ShardSpec:
    """What a worker needs to build its rank: rank 0's config and the cache it planned."""

    config: EngineConfig
    weights: LoadedModel  # this rank's shard (no tokenizer)
    plan: CachePlan
    layout: CacheLayout
    layer_tensor: tuple[int, ...]
    world: int
    init_method: str
    num_threads: int


def device_of(config: EngineConfig, rank: int) -> str:
    """cuda:r for rank r on CUDA (one GPU per rank); cpu on CPU."""
    return f"cuda:{rank}" if config.device.startswith("cuda") else "cpu"


def collective_backend(config: EngineConfig) -> str:
    return "nccl" if config.device.startswith("cuda") else "gloo"


class Shard:
    """One worker rank: its model shard, its cache share and a runner to drive them."""

    def __init__(self, spec: ShardSpec, rank: int) -> None:
        c = spec.config
        torch.set_num_threads(spec.num_threads)
        self.device = device_of(c, rank)
        if self.device.startswith("cuda"):
            torch.cuda.set_device(self.device)
        dist.init_process_group(collective_backend(c), init_method=spec.init_method, rank=rank,
                                world_size=spec.world, timeout=COLLECTIVE_TIMEOUT)
        loaded = spec.weights
        c = resolve_defaults(c, loaded)  # rank 0 sends its resolved config; a config built elsewhere resolves alike
        model = build_model(loaded, getattr(torch, c.dtype), self.device, spec.layout.max_model_len, c.weight_dtype,
                            c.packed_activations, c.dense_copy_memory)
        self.stats = CommStats()
        install_row_parallel(model, self.stats)
        storage, swap = allocate_cache(c, loaded.config, spec.plan, spec.layer_tensor, self.device)
        self.runner = ModelRunner(model, storage, swap, spec.layout, c.seed, c.attention_backend, c.linear_backend)
        dist.barrier()  # loaded: rank 0 may send steps

    def handle(self, message: bytes) -> bool:
        """Apply one step message; False when told to stop."""
        kind, *args = pickle.loads(message)
        if kind == "copies":
            self.runner.apply_copies(args[0])
        elif kind == "forward":
            ids, pos, common = (_to_device(a, self.device) for a in args)
            self.runner.forward(ids, pos, common)
        elif kind == "stop":
            dist.destroy_process_group()
            return False
        else:
            raise ValueError(f"unknown step message {kind!r}")
        return True


def mp_worker_main(spec: ShardSpec, rank: int, conn: Any) -> None:
    """A multiprocessing worker: build the shard, then apply messages until stopped or orphaned."""
    shard = Shard(spec, rank)
    try:
        while shard.handle(conn.recv_bytes()):
            pass
    except EOFError:  # rank 0 is gone
        pass


class RayShard:
    """A Ray actor holding one rank (its methods run one at a time, in call order)."""

    def __init__(self, spec: ShardSpec, rank: int) -> None:
        self.shard = Shard(spec, rank)

    def handle(self, message: bytes) -> bool:
        return self.shard.handle(message)


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, joins the process group, sends each block
    move and forward pass (the ModelRunner's StepMirror), stops them."""

    def __init__(self, loaded: LoadedModel, spec_args: dict[str, Any], threads_before: int) -> None:
        c: EngineConfig = spec_args["config"]
        self.world = spec_args["world"]
        self.backend = c.parallel.distributed_executor_backend
        host = "127.0.0.1" if self.backend == "mp" else _ray_host()
        init = f"tcp://{host}:{free_port()}"
        whole = replace(loaded, tokenizer=None)
        specs = {rank: ShardSpec(weights=shard_weights(whole, rank, self.world), init_method=init, **spec_args)
                 for rank in range(1, self.world)}
        self.num_messages = self.message_bytes = 0
        self.message_s = 0.0
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._actors: list[Any] = []
        self._pending: list[Any] = []
        self.threads_before = threads_before  # this process's threads before the ranks shared them; restored on close
        if c.device.startswith("cuda"):
            torch.cuda.set_device(device_of(c, 0))
        if self.backend == "mp":
            self._start_processes(specs)
        else:
            self._start_actors(specs)
        dist.init_process_group(collective_backend(c), init_method=init, rank=0,
                                world_size=self.world, timeout=COLLECTIVE_TIMEOUT)
        dist.barrier()  # every worker has loaded its shard
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs, self._actors)

    def _start_processes(self, specs: dict[int, ShardSpec]) -> None:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads or torch state
        for rank, spec in specs.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=mp_worker_main, args=(spec, rank, child), daemon=True,
                               name=f"kvserve-tp-rank{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def _start_actors(self, specs: dict[int, ShardSpec]) -> None:
        import ray
        if not ray.is_initialized():
            ray.init(log_to_driver=False)  # RAY_ADDRESS, a cluster started here, or a new local one
        actor = ray.remote(num_cpus=0)(RayShard)  # placement by Ray; threads are set by the spec
        # each actor's constructor joins the process group, which returns only once rank 0 joins
        self._actors = [actor.remote(spec, rank) for rank, spec in specs.items()]

    # ---- StepMirror ----
    def copies(self, copies: BlockCopies) -> None:
        self._send(("copies", copies))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, common: list[AttentionMetadata]) -> None:
        self._send(("forward", input_ids, positions, common))

    def _send(self, message: tuple[Any, ...]) -> None:
        t0 = time.perf_counter()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if self.backend == "mp":
            for conn in self._conns:
                conn.send_bytes(data)
        else:
            self._check_actors()
            self._pending += [a.handle.remote(data) for a in self._actors]
        self.num_messages += 1
        self.message_bytes += len(data)
        self.message_s += time.perf_counter() - t0

    def _check_actors(self) -> None:
        """Raise a failed actor call's error; keep the unfinished ones."""
        import ray
        if not self._pending:
            return
        done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        ray.get(done)

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._finalizer.alive:
            self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.threads_before)


def _stop(conns: Sequence[Any], procs: Sequence[Any], actors: Sequence[Any]) -> None:
    stop = pickle.dumps(("stop",))
    for conn in conns:
        try:
            conn.send_bytes(stop)
            conn.close()
        except OSError:
            pass
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    if actors:
        import ray
        try:
            ray.get([a.handle.remote(stop) for a in actors], timeout=JOIN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead actor is already stopped
            pass
        for a in actors:
            ray.kill(a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ray_host() -> str:
    import ray.util
    return str(ray.util.get_node_ip_address())


def _to_device(obj: Any, device: str) -> Any:
    """Tensors (in lists, tuples and dataclasses) moved to this rank's device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _to_device(getattr(obj, f.name), device) for f in fields(obj) if f.init})
    return obj


def start(config: EngineConfig, loaded: LoadedModel, plan: CachePlan, layout: CacheLayout,
          layer_tensor: Sequence[int]) -> Optional[TensorParallelWorkers]:
    """Ranks 1..N-1 for an engine of tensor_parallel_size N over the whole `loaded` model, each
    handed its shard (None for size 1)."""
    world = config.parallel.tensor_parallel_size
    if world == 1:
        return None
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process (one per process)")
    before = torch.get_num_threads()
    threads = max(1, before // world) if config.device == "cpu" else before
    torch.set_num_threads(threads)  # rank 0 too: the ranks share this machine's cores
    try:
        return TensorParallelWorkers(loaded, dict(config=config, plan=plan, layout=layout,
                                                  layer_tensor=tuple(layer_tensor), world=world, num_threads=threads),
                                     before)
    except BaseException:
        torch.set_num_threads(before)
        raise


# what the engine asks of tensor parallelism (kvserve.engine.parallel), provided through kvserve/__init__.py
TENSOR_PARALLEL = TensorParallel(check_shardable=check_shardable, shard_weights=shard_weights,
                                 install_row_parallel=install_row_parallel, start_ranks=start)
