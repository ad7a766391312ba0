"""The dense KV storage: slots written are the slots gathered, blocks copy and swap whole,
tensors are shared across cache groups as the layout says, and bytes are counted exactly."""

import os

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


def resident_kib(t: torch.Tensor) -> int:
    """How much of t's own bytes are resident: its pages that /proc/self/pagemap marks present
    (bit 63). Not the Rss of the mappings around it: the kernel merges neighbouring anonymous
    mappings into one, so those can count other allocations of the process (1.2 GiB once, for a
    0.5 GiB tensor nobody had written)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    flags = memoryview(entries).cast("Q")
    return sum(1 for e in flags if e >> 63) * page >> 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_zeros_are_zero_and_cost_no_memory_until_written(dtype):
    t = zeros((256, 1024, 1024), dtype, "cpu")  # 0.5 to 1 GiB, a mapping of its own
    assert t.dtype == dtype and t.shape == (256, 1024, 1024)
    assert not t[::37, ::101, ::7].any()
    assert resident_kib(t) < 64 << 10  # pages come on first write, not at allocation
    t[3].fill_(1)
    assert resident_kib(t) >= t[3].numel() * t.element_size() >> 10  # the written slice
    assert t[3].float().sum().item() == 1024 * 1024 and t[4].count_nonzero().item() == 0


def all_pages(storage) -> list:
    tensors = [t for ts in storage.tensors for t in ts.values()]
    return tensors + [t for r in getattr(storage, "residual", []) for t in r.values()]


@pytest.mark.parametrize("kind", ["dense", "int8", "fp8", "int4", "latent", "latent_int8"])
def test_populate_writes_every_page_and_keeps_the_zeros(kind):
    """--kv-cache-populate: after populate() every page of every tensor of the storage (an int4
    cache's residual slots too) is resident, and the cache still holds its zeros."""
    from kvserve.kv.latent import make_latent_storage
    from kvserve.kv.storage import Fp8KVStorage, Int4KVStorage, Int8KVStorage
    blocks = 512  # 8 MiB a dense fp32 tensor: pages of their own, none written yet
    s = {"dense": lambda: DenseKVStorage([0, 1], blocks, 16, 4, 64, torch.float32, "cpu"),
         "int8": lambda: Int8KVStorage([0, 1], blocks, 16, 4, 64, "cpu"),
         "fp8": lambda: Fp8KVStorage([0, 1], blocks, 16, 4, 64, "cpu", "fp8_e4m3"),
         "int4": lambda: Int4KVStorage([0, 1], blocks, 16, 4, 64, "cpu", torch.float32, 64),
         "latent": lambda: make_latent_storage("dense", "float32", [0, 1], blocks, 16, 128, 64, "cpu"),
         "latent_int8": lambda: make_latent_storage("int8", "int8", [0, 1], blocks, 16, 128, 64, "cpu")}[kind]()
    tensors = all_pages(s)
    size_kib = [t.numel() * t.element_size() >> 10 for t in tensors]
    assert sum(resident_kib(t) for t in tensors) < sum(size_kib) // 2  # lazy until written
    s.populate()
    page_kib = os.sysconf("SC_PAGE_SIZE") >> 10
    for t, kib in zip(tensors, size_kib):
        assert resident_kib(t) >= kib - page_kib  # every page (a part of one counts as none)
        assert not t.any()


def mapping_flags(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_cpu_zeros_ask_for_huge_pages():
    """The cache's mapping is advised into transparent huge pages (VmFlags "hg"), and where the
    OS gives them on request (THP mode "madvise" or "always", not turned off for this process)
    it is eligible for them."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    t = zeros((16, 1024, 1024), torch.float32, "cpu")  # 64 MiB
    t[0].fill_(1)
    flags = mapping_flags(t.data_ptr())
    assert "hg" in flags["VmFlags"].split()
    assert t[0].sum().item() == 1024 * 1024 and t[1].count_nonzero().item() == 0
    with open("/proc/self/status") as f:
        disabled = any(line.split() == ["THP_enabled:", "0"] for line in f)
    if "[never]" not in mode and not disabled:
        assert flags.get("THPeligible", "1") == "1"


# ---- quantized storages ----
from kvserve.kv import quant  # noqa: E402
from kvserve.kv.storage import Fp8KVStorage, Int4KVStorage, Int8KVStorage  # noqa: E402


def int4(num_blocks=9, slots=2):
    return Int4KVStorage([0, 1], num_blocks, 4, 2, 8, "cpu", torch.float32, slots)


def write_tokens(s, layer, slots, seed):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(len(slots), 2, 8, generator=g), torch.randn(len(slots), 2, 8, generator=g)
    s.begin_step()
    s.write(layer, k, v, s.plan_writes(torch.tensor(slots)))
    return k, v


def test_int4_block_waits_in_its_slot_until_full_then_is_quantized_once():
    s = int4()
    ks, vs = [], []
    for i in range(3):  # three tokens into block 5, one step each: the block stays open
        k, v = write_tokens(s, 0, [5 * 4 + i], seed=i)
        ks.append(k), vs.append(v)
        assert int(s.slot_of[5]) >= 0
        gk, gv = s.gather(0, torch.tensor([5]), 4)
        assert torch.equal(gk[:i + 1], torch.cat(ks)) and torch.equal(gv[:i + 1], torch.cat(vs))  # exact
    k, v = write_tokens(s, 0, [5 * 4 + 3], seed=3)
    ks.append(k), vs.append(v)
    assert int(s.slot_of[5]) == -1  # full: quantized, slot given back
    gk, gv = s.gather(0, torch.tensor([5]), 4)
    full_k, full_v = torch.cat(ks), torch.cat(vs)
    assert torch.equal(gk, quant.dequantize_int4(*quant.quantize_int4(full_k, -3), -3))  # keys per channel
    assert torch.equal(gv, quant.dequantize_int4(*quant.quantize_int4(full_v, -1), -1))  # values per token


def test_int4_blocks_filled_in_one_step_need_no_slot_and_reopen_after_a_rollback():
    s = int4(slots=1)
    k, v = write_tokens(s, 1, list(range(8, 16)), seed=0)  # blocks 2 and 3 in one step
    assert s.num_residual_slots == 1 and int(s.slot_of[2]) == int(s.slot_of[3]) == -1
    before_k, _ = s.gather(1, torch.tensor([3]), 4)
    k2, _ = write_tokens(s, 1, [3 * 4 + 2], seed=9)  # a rollback left 2 tokens of block 3: write the third
    gk, _ = s.gather(1, torch.tensor([3]), 3)
    assert torch.equal(gk[:2], before_k[:2]) and torch.equal(gk[2], k2[0])  # kept tokens come back dequantized
    assert int(s.slot_of[3]) >= 0


def test_int4_copy_swap_release_and_growth_carry_the_open_block():
    s, cpu = int4(), int4(num_blocks=4)
    k, _ = write_tokens(s, 0, [4 * 4, 4 * 4 + 1], seed=0)  # block 4 open with 2 tokens
    s.copy_blocks([(4, 6)])  # copy-on-write of an open block copies its slot's tokens
    assert torch.equal(s.gather(0, torch.tensor([6]), 2)[0], k) and int(s.slot_of[6]) != int(s.slot_of[4])
    s.swap_out(cpu, [(4, 1)])
    s.release([4, 6])
    assert int(s.slot_of[4]) == int(s.slot_of[6]) == -1 and len(s._free_slots) == s.num_residual_slots
    s.swap_in(cpu, [(1, 7)])
    assert torch.equal(s.gather(0, torch.tensor([7]), 2)[0], k)
    for block in (0, 1, 2):  # more open blocks than slots: the residual grows
        write_tokens(s, 0, [block * 4], seed=block)
    assert s.num_residual_slots >= 4 and torch.equal(s.gather(0, torch.tensor([7]), 2)[0], k)
    assert s.nbytes == s.num_blocks * s.bytes_per_block + s.residual_nbytes


@pytest.mark.parametrize("make", [
    lambda: Int8KVStorage([0], 5, 4, 2, 8, "cpu"),
    lambda: Fp8KVStorage([0], 5, 4, 2, 8, "cpu", "fp8_e4m3"),
], ids=["int8", "fp8_e4m3"])
def test_per_token_formats_round_trip_copy_and_swap(make):
    s, cpu = make(), make()
    if isinstance(s, Fp8KVStorage):
        scales = torch.full((1, 2, 2), 0.02)
        s.set_scales(scales), cpu.set_scales(scales)
    k, v = write_tokens(s, 0, [9, 10], seed=1)
    gk, gv = s.gather(0, torch.tensor([2]), 3)
    for got, x in ((gk[1:3], k), (gv[1:3], v)):  # within half an fp8 (3-bit mantissa) or int8 step
        assert ((got - x).abs() <= x.abs() / 16 + x.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()
    s.copy_blocks([(2, 4)])
    s.swap_out(cpu, [(4, 0)])
    assert torch.equal(cpu.gather(0, torch.tensor([0]), 3)[0], gk)


def test_int8_writes_through_the_kernel_equal_the_torch_write():
    """Where the layer_ops kernel is built, an int8 cache's writes (`write`, and the fast path's
    one-call store from `fixed_decode`) give the tensors the torch write gives, bit for bit."""
    from kvserve import kernels
    if kernels.load("layer_ops") is None:
        pytest.skip(f"the layer_ops kernel is not built: {kernels.failure('layer_ops')}")
    fast, plain, fixed = (Int8KVStorage([0, 1], 5, 4, 2, 8, "cpu") for _ in range(3))
    plain.ops = None
    assert fast.ops is not None and fixed.fixed_decode(1) is not None and plain.fixed_decode(1) is None
    g = torch.Generator().manual_seed(3)
    for layer, slots in ((0, [9, 10, 3]), (1, [0, 19, 4])):
        k, v = torch.randn(3, 2, 8, generator=g) * 10, torch.randn(3, 8, 2, generator=g).transpose(1, 2)
        k[1, 0] = 0
        plan = torch.tensor(slots)
        fast.write(layer, k, v, plan)
        plain.write(layer, k, v, plan)
        store, operands = fixed.fixed_decode(layer)
        store(plan, k, v)
        assert all(a is b for a, b in zip(operands, fixed.decode_operands(layer)))
    for layer in (0, 1):
        for name in ("k", "k_scale", "v", "v_scale"):
            want = plain.layer_tensors(layer)[name]
            assert torch.equal(fast.layer_tensors(layer)[name], want)
            assert torch.equal(fixed.layer_tensors(layer)[name], want)
