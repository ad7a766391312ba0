"""The llama2.c tokenizer (tokenizer.bin): sentencepiece-style BPE driven by merge scores.

File format: int32 max_token_length, then per token: float32 score, int32 length, bytes.
Encoding follows run.c: a dummy-prefix space, one token per UTF-8 character (bytes that have
no token fall back to <0xXX> ids 3..258), then the adjacent pair whose merge has the highest
score is merged (leftmost on ties) until no merge exists. A heap keeps this O(n log n).
"""

from __future__ import annotations

import heapq
import struct
from typing import Optional, Sequence

from kvserve.tokenizer.base import Tokenizer

BYTE_FALLBACK_OFFSET = 3  # <0x00> is token 3 in the llama 2 vocabulary


class Llama2cTokenizer(Tokenizer):
    def __init__(self, pieces: list[bytes], scores: list[float], bos_token_id: int = 1,
                 eos_token_id: int = 2) -> None:
        self.pieces, self.scores = pieces, scores
        self.lookup = {p: i for i, p in enumerate(pieces)}
        self.bos_token_id, self.eos_token_ids, self.add_bos = bos_token_id, (eos_token_id,), True
        self.special_ids = {0, bos_token_id, eos_token_id}

    @classmethod
    def from_file(cls, path: str, vocab_size: int) -> "Llama2cTokenizer":
        with open(path, "rb") as f:
            data = f.read()
        pieces, scores, off = [], [], 4  # skip max_token_length
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", data, off)
            off += 8
            pieces.append(data[off:off + length])
            scores.append(score)
            off += length
        return cls(pieces, scores)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._merge(self._initial_ids(" " + text if text else text))
        return [self.bos_token_id] + ids if add_special_tokens and self.bos_token_id is not None else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, prev = bytearray(), None
        for i in token_ids:
            if i in self.special_ids:
                prev = i
                if not skip_special_tokens:
                    out += self.pieces[i]
                continue
            piece = self._piece_bytes(i)
            if prev == self.bos_token_id and piece.startswith(b" "):
                piece = piece[1:]  # the dummy prefix sentencepiece added after BOS
            out += piece
            prev = i
        return out.decode("utf-8", errors="replace")

    def _piece_bytes(self, i: int) -> bytes:
        piece = self.pieces[i]
        if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        return piece

    def _initial_ids(self, text: str) -> list[int]:
        ids = []
        for ch in text:
            i = self.lookup.get(ch.encode())
            if i is not None:
                ids.append(i)
            else:
                ids.extend(b + BYTE_FALLBACK_OFFSET for b in ch.encode())
        return ids

    def _merge(self, ids: list[int]) -> list[int]:
        """Highest-score merge first, leftmost on ties, over a linked list of live tokens."""
        nxt, prv = list(range(1, len(ids) + 1)), list(range(-1, len(ids) - 1))
        heap: list[tuple[float, int, int, int]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j < len(ids):
                merged = self.lookup.get(self.pieces[ids[i]] + self.pieces[ids[j]])
                if merged is not None:
                    heapq.heappush(heap, (-self.scores[merged], i, ids[i], ids[j]))

        for i in range(len(ids) - 1):
            push(i)
        alive = [True] * len(ids)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i] if alive[i] else len(ids)
            if j >= len(ids) or ids[i] != left or ids[j] != right:
                continue  # stale: one side was merged since
            ids[i] = self.lookup[self.pieces[left] + self.pieces[right]]
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < len(ids):
                prv[nxt[j]] = i
            push(i)
            if prv[i] >= 0:
                push(prv[i])
        return [t for t, a in zip(ids, alive) if a]


def find_llama2c_tokenizer(directory: str, explicit: Optional[str]) -> Optional[str]:
    import os
    if explicit:
        return explicit
    for name in ("tokenizer.bin", "tok512.bin"):
        if os.path.exists(os.path.join(directory, name)):
            return os.path.join(directory, name)
    candidates = sorted(f for f in os.listdir(directory) if f.startswith("tok") and f.endswith(".bin"))
    return os.path.join(directory, candidates[0]) if candidates else None
