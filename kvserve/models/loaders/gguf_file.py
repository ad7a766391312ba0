"""A GGUF file read directly: header, metadata and tensor infos parsed once from a memory map,
tensor data dequantized with whole-tensor array operations.

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:     key (u64 length + bytes) | value type u32 | value (arrays: type u32, count u64, items)
    tensor infos: name | n_dims u32 | dims u64[n_dims] (innermost first) | ggml type u32 | offset u64
    padding to general.alignment (32), then the tensor data

The `gguf` package's reader builds a numpy view for every element of every metadata array
(49,152 tokens and as many merges for SmolLM2: about 2.5 s); here a string array is one pass over
its bytes and a number array one `frombuffer`. Q8_0, Q4_0 and Q4_1 tensors are dequantized
here, per block `d * q` (Q8_0), `d * (q - 8)` (Q4_0) and `d * q + m` (Q4_1) over the whole tensor
at once; other types go through `gguf.quants` (the same numbers, row group by row group). The
matrices of the K-quants, Q5_0, Q5_1 and IQ4_NL are not dequantized here at all: the loader keeps
them packed (kvserve.models.packed.BY_GGML_TYPE), dequantizing them only where a float weight is
asked for (kvserve.models.kquants, bit-equal to `gguf.quants`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
# value type -> (struct format, size) for scalars; 8 is a string, 9 an array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30  # ggml type ids
SIXTEEN_BIT = {F16: torch.float16, BF16: torch.bfloat16}  # the float types a tensor keeps at load


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # outermost first, as torch indexes it
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self._view = memoryview(self.data)  # slicing a memoryview is cheap; a memmap's is not
        self._pos = 0
        if bytes(self._view[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        self._pos = 4
        self.version = self._scalar(4)
        if self.version < 2:
            raise ValueError(f"{path}: GGUF version {self.version} is not supported (2 or later)")
        num_tensors, num_kv = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [GGUFTensor(name, kind, shape, start + off, _nbytes(kind, shape))
                        for name, kind, shape, off in infos]
        short = [t.name for t in self.tensors if t.offset + t.nbytes > len(self.data)]
        if short:
            raise ValueError(f"{path}: truncated: tensor data of {short[:3]} lies past the end of the file")

    def dequantize(self, t: GGUFTensor) -> torch.Tensor:
        """The tensor as float32, shaped t.shape."""
        raw = self.data[t.offset:t.offset + t.nbytes]
        return torch.from_numpy(np.ascontiguousarray(_dequantize(raw, t.ggml_type)).reshape(t.shape))

    def floats(self, t: GGUFTensor) -> torch.Tensor:
        """The tensor as torch floats, shaped t.shape: F16 and BF16 as they are stored (float16,
        bfloat16: a copy of the bits, half the memory of float32), every other type dequantize()d."""
        if t.ggml_type not in SIXTEEN_BIT:
            return self.dequantize(t)
        raw = torch.frombuffer(bytearray(self.data[t.offset:t.offset + t.nbytes]), dtype=torch.int16)
        return raw.view(SIXTEEN_BIT[t.ggml_type]).reshape(t.shape)

    # ---- parsing ----
    def _scalar(self, kind: int) -> Any:
        fmt, size = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._scalar(10)
        s = str(self._view[self._pos:self._pos + n], "utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, kind: int) -> Any:
        if kind == 8:
            return self._string()
        if kind != 9:
            return self._scalar(kind)
        item, count = self._scalar(4), self._scalar(10)
        if item in _NUMPY:
            arr = np.frombuffer(self.data, dtype=_NUMPY[item], count=count, offset=self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self._string()
        dims = [self._scalar(10) for _ in range(self._scalar(4))]
        kind, offset = self._scalar(4), self._scalar(10)
        return name, kind, tuple(reversed(dims)), offset


def _block(kind: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    return GGML_QUANT_SIZES[GGMLQuantizationType(kind)]


def _nbytes(kind: int, shape: tuple[int, ...]) -> int:
    values, size = _block(kind)
    return int(np.prod(shape)) // values * size


def _dequantize(raw: np.ndarray, kind: int) -> np.ndarray:
    if kind == F32:
        return raw.view(np.float32).copy()  # the model owns its weights, not the file's map
    if kind == F16:
        return raw.view(np.float16).astype(np.float32)
    if kind == BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if kind == Q8_0:
        blocks = raw.reshape(-1, 34)
        out = blocks[:, 2:].view(np.int8).astype(np.float32)
        out *= blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return out.reshape(-1)
    if kind in (Q4_0, Q4_1):
        blocks = raw.reshape(-1, 18 if kind == Q4_0 else 20)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, -16:]
        out = np.empty((len(blocks), 32), dtype=np.float32)  # the one large allocation
        np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")  # low nibbles: values 0..15
        np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")  # high nibbles: values 16..31
        if kind == Q4_0:
            out -= 8
            out *= d
        else:
            out *= d
            out += blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        return out.reshape(-1)
    import gguf
    return gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(kind)).reshape(-1)
