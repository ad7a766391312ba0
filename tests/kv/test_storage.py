"""The dense KV storage: slots written are the slots gathered, blocks copy and swap whole,
tensors are shared across cache groups as the layout says, and bytes are counted exactly."""

import resource

import pytest
import torch

from kvserve.kv.storage import DenseKVStorage, zeros


def make(layer_to_tensor=(0, 1, 2), num_blocks=9, bs=4, kvh=2, hd=8, dtype=torch.float32):
    return DenseKVStorage(list(layer_to_tensor), num_blocks, bs, kvh, hd, dtype, "cpu")


def test_written_slots_are_gathered_back():
    s = make()
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([4 * 5 + 0, 4 * 5 + 1, 4 * 5 + 2, 4 * 2 + 0, 4 * 2 + 1, 4 * 2 + 3])
    s.write(1, k, v, s.plan_writes(slots))
    gk, gv = s.gather(1, torch.tensor([[5, 2]]), 4)  # [1, 8 slots, kvh, hd]
    assert torch.equal(gk[0, [0, 1, 2, 4, 5, 7]], k) and torch.equal(gv[0, [0, 1, 2, 4, 5, 7]], v)
    assert not gk[0, [3, 6]].any()  # never written: zeros
    assert not s.k[0].any() and not s.k[2].any()  # other layers untouched
    narrow, _ = s.gather(1, torch.tensor([5]), 2)  # the first 2 slots of each block only
    assert torch.equal(narrow, k[:2])


def test_copy_blocks_and_swap_round_trip():
    s, cpu = make(), make(num_blocks=4)
    for layer in range(3):
        s.write(layer, torch.randn(4, 2, 8), torch.randn(4, 2, 8), s.plan_writes(torch.arange(12, 16)))  # block 3
    block3 = [t[3].clone() for t in s.k + s.v]
    s.copy_blocks([(3, 7)])
    assert all(torch.equal(t[7], b) for t, b in zip(s.k + s.v, block3))
    s.swap_out(cpu, [(3, 1)])
    for t in s.k + s.v:
        t[3].zero_()
    s.swap_in(cpu, [(1, 3)])
    assert all(torch.equal(t[3], b) for t, b in zip(s.k + s.v, block3))


def test_groups_share_tensors_and_bytes_are_exact():
    s = make(layer_to_tensor=(0, 0, 1, 1), num_blocks=5, bs=4, kvh=2, hd=8)  # two groups of two layers
    assert len(s.k) == 2 and s.layer_tensors(1)["k"] is s.layer_tensors(0)["k"]
    assert s.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4  # (K, V) x tensors x slots x kvh x hd x fp32
    assert s.nbytes == 5 * s.bytes_per_block == sum(t.numel() * 4 for t in s.k + s.v)
    assert make(dtype=torch.bfloat16).bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2


def test_writes_cast_to_the_storage_dtype():
    s = make(dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8)
    s.write(0, k, k, s.plan_writes(torch.tensor([0])))
    assert s.k[0].dtype == torch.bfloat16 and torch.equal(s.k[0][0, 0], k[0].bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_zeros_are_zero_and_cost_no_memory_until_written(dtype):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = zeros((256, 1024, 1024), dtype, "cpu")  # 0.5 to 1 GiB
    assert t.dtype == dtype and t.shape == (256, 1024, 1024)
    assert not t[::37, ::101, ::7].any()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 << 10  # pages come on first write, not at allocation
    t[3].fill_(1)
    assert t[3].float().sum().item() == 1024 * 1024 and t[4].count_nonzero().item() == 0
