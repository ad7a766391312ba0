"""Random valid blocks of the GGUF types the gguf package cannot quantize (and of those it can):
random bytes are a valid block of every type once its fp16 fields hold sane scales."""

import torch

from kvserve.models.packed import FORMATS, PackedWeight

# where each type's fp16 fields (d, and dmin or m) sit in its block
HALF_OFFSETS = {"q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,), "q2_k": (80, 82), "q3_k": (108,),
                "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
KQUANT_FORMATS = sorted(HALF_OFFSETS)


def random_packed(n: int, k: int, name: str, seed: int = 0, scale: float = 0.01) -> PackedWeight:
    """[n, k] of type `name`: random bytes, each fp16 field in +-scale (rows of different scales)."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    nb = k // fmt.block
    blocks = torch.randint(0, 256, (n, nb, fmt.block_bytes), generator=g, dtype=torch.uint8)
    row_scale = torch.rand(n, 1, generator=g) + 0.1
    for offset in HALF_OFFSETS[name]:
        half = ((torch.rand(n, nb, generator=g) * 2 - 1) * scale * row_scale).to(torch.float16)
        blocks[..., offset:offset + 2] = half.unsqueeze(-1).view(torch.uint8)
    return PackedWeight(fmt, blocks.reshape(n, -1), (n, k))
