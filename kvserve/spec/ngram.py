"""N-gram prompt lookup: find the request's last n tokens earlier in its context (prompt and
output) and propose the tokens that followed their latest occurrence, trying the longest n first
(vLLM's prompt_lookup_max / prompt_lookup_min). No model runs.

Each request keeps an index of where every n-gram last ended, grown by the new tokens of each
step, so a lookup costs O(1) whatever the context's length:

    tokens   a b c d a b x ... a b      last 2 tokens "a b" last ended before at position 5
    propose  the tokens from position 6 on: x ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvserve.core.request import Request
from kvserve.spec.base import Proposer


@dataclass
class _Index:
    ends: list[dict[tuple[int, ...], int]]  # per n (index n - min_n): n-gram -> where it last ended
    num_indexed: int = 0  # n-grams ending before this position are in
    num_truncations: int = 0


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min <= max n-gram length, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, _Index] = {}

    def propose(self, requests: Sequence[Request], k: int) -> None:
        for req in requests:
            req.spec_token_ids, req.spec_probs = self.lookup(req, k), None

    def lookup(self, req: Request, k: int) -> list[int]:
        tokens = req.all_token_ids
        index = self._index(req)
        last = len(tokens) - 1
        self._extend(index, tokens, last)  # every n-gram ending before the last token
        found: list[int] = []
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = index.ends[n - self.min_n].get(tuple(tokens[last - n + 1:last + 1]))
            if end is not None:
                found = tokens[end + 1:end + 1 + k]
                break
        return found

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.indexes.pop(rid, None)

    def _index(self, req: Request) -> _Index:
        index = self.indexes.get(req.request_id)
        if index is None or index.num_truncations != req.num_truncations:  # output taken back: start over
            index = _Index([{} for _ in range(self.min_n, self.max_n + 1)], 0, req.num_truncations)
            self.indexes[req.request_id] = index
        return index

    def _extend(self, index: _Index, tokens: list[int], upto: int) -> None:
        """Add the n-grams ending at positions [num_indexed, upto)."""
        for end in range(index.num_indexed, upto):
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    index.ends[n - self.min_n][tuple(tokens[end - n + 1:end + 1])] = end
        index.num_indexed = max(index.num_indexed, upto)
