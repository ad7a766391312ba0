"""The proposer interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from kvserve.core.request import Request


class Proposer(ABC):
    """Guesses up to k next tokens for each decoding request it is given, by setting
    request.spec_token_ids (and request.spec_probs, [k, vocab], where the guesses were drawn
    from a distribution; None for point guesses). A request may get fewer guesses, or none."""

    name: str

    @abstractmethod
    def propose(self, requests: Sequence[Request], k: int) -> None: ...

    def forget(self, request_ids: Sequence[str]) -> None:
        """The requests ended: drop whatever was kept for them."""
