"""One layer's paged decode attention over a batch of contexts of mixed lengths, in four orders:
all of the mean length, shuffled, ascending and descending (a server's batch in the order its
requests came: the oldest, longest, together). The kernel splits its tasks over the threads by
the positions each reads (csrc/parallel_tasks.h), so the order should not change the time; a
split by count gave one thread the long contexts.

SmolLM2-135M's shape (9 query heads, 3 K/V heads, head dim 64), a bf16 cache in shuffled blocks of
16 tokens, contexts drawn from 64..384 (the offline throughput workload's), each timed call
reading the next of 8 layers' caches (out of the CPU's caches at 64 sequences). Medians of the
repeats, the orders interleaved; every order's outputs are checked against torch (1e-4) first.

    .venv/bin/python benchmarks/attention_batch_order.py [--batches 16 64] [--threads 2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import kernels

BLOCK, H, KVH, D, LAYERS = 16, 9, 3, 64, 8
SHORTEST, LONGEST = 64, 384


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
              lens: torch.Tensor) -> torch.Tensor:
    """Each sequence's attention over its gathered rows, in fp32 (SDPA)."""
    out = []
    for b, n in enumerate(lens.tolist()):
        rows = table[b, :-(-n // BLOCK)]
        kb, vb = (x[rows].reshape(-1, KVH, D)[:n].float().transpose(0, 1) for x in (k, v))
        kb, vb = kb.repeat_interleave(H // KVH, 0), vb.repeat_interleave(H // KVH, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[b].unsqueeze(1), kb, vb).squeeze(1))
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    module = kernels.load("paged_attention")
    if module is None:
        raise SystemExit(f"no paged_attention kernel: {kernels.failure('paged_attention')}")
    print(f"paged_attention ({module.isa()}), {a.threads} thread(s), bf16 cache, "
          f"ms a layer (medians of {a.repeats})")
    g = torch.Generator().manual_seed(0)
    for batch in a.batches:
        lens = torch.randint(SHORTEST, LONGEST + 1, (batch,), generator=g)
        orders = {"equal": torch.full((batch,), int(lens.float().mean())), "shuffled": lens,
                  "ascending": lens.sort().values, "descending": lens.sort(descending=True).values}
        per = LONGEST // BLOCK
        blocks = batch * per * LAYERS + 1
        k = torch.randn(blocks, BLOCK, KVH, D, generator=g).bfloat16()
        v = torch.randn(blocks, BLOCK, KVH, D, generator=g).bfloat16()
        perm = torch.randperm(blocks - 1, generator=g)
        tables = [perm[i * batch * per:(i + 1) * batch * per].view(batch, per).contiguous()
                  for i in range(LAYERS)]
        q = torch.randn(batch, H, D, generator=g)
        for name, n in orders.items():
            got = module.paged_decode(q, k, v, tables[0], n, D ** -0.5, 0)
            err = (got - reference(q, k, v, tables[0], n)).abs().max().item()
            assert err < 1e-4, f"{name}: {err}"
        times: dict[str, list[float]] = {name: [] for name in orders}
        for _ in range(a.repeats):
            for name, n in orders.items():
                t = time.perf_counter()
                for table in tables:
                    module.paged_decode(q, k, v, table, n, D ** -0.5, 0)
                times[name].append((time.perf_counter() - t) / LAYERS * 1e3)
        print(f"{batch:3} contexts of {SHORTEST}..{LONGEST} tokens: " +
              ", ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items()))


if __name__ == "__main__":
    main()
