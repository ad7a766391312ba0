"""With host_memory applied, freed activations are reused instead of being faulted in again:
glibc otherwise may serve large blocks with fresh mmaps (unmapped when freed) and trim freed
heap memory back to the OS, so every new tensor faults its pages."""

import sys

import pytest

from tests.processes import run

CODE = """
import ctypes, resource, sys, torch, torch.nn.functional as F
from kvserve.runner import host_memory
torch.set_num_threads(1)  # one malloc arena: the count does not depend on thread scheduling
if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory()
else:
    # glibc's starting behaviour, pinned: blocks over 128 KiB get their own mmap. (Left alone,
    # glibc raises that threshold as mmapped blocks are freed, sometimes, so it cannot be compared.)
    assert ctypes.CDLL("libc.so.6").mallopt(host_memory.M_MMAP_THRESHOLD, 128 << 10)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# one SwiGLU MLP of SmolLM2's shape over a 1,024-token prefill: 6 MiB activations
x, wg, wu, wd = torch.randn(1024, 576), torch.randn(1536, 576), torch.randn(1536, 576), torch.randn(576, 1536)
def mlp(x):
    return x + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
y = mlp(x)
for _ in range(5):  # the heap grows to its working size
    y = mlp(y / y.norm())
before = faults()
for _ in range(20):
    y = mlp(y / y.norm())
print(faults() - before)
"""
ONE_STEP_PAGES = (4 * 1024 * 1536 + 3 * 1024 * 576) * 4 // 4096  # what one MLP step allocates


def page_faults(mode: str) -> int:
    out = run([sys.executable, "-c", CODE, mode], check=True)  # a failure shows its stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_activations_are_reused_without_page_faults():
    kept, fresh = page_faults("keep"), page_faults("fresh")
    # measured over 20 steps: 0-3,072 faults kept, ~150,000 with every block mmapped
    assert kept < ONE_STEP_PAGES, (kept, ONE_STEP_PAGES)
    assert fresh > 10 * ONE_STEP_PAGES, (fresh, ONE_STEP_PAGES)
