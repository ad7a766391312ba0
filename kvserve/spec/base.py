"""The proposer interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from kvserve.core.request import Request


class Proposer(ABC):
    """Guesses up to k next tokens for each decoding request it is given, by setting
    request.spec_token_ids (request.spec_probs stays None: the target keeps a guess only where it
    is the token it draws itself, so how a guess was made does not matter). A request may get
    fewer guesses, or none."""

    name: str

    @abstractmethod
    def propose(self, requests: Sequence[Request], k: int) -> None: ...

    def forget(self, request_ids: Sequence[str]) -> None:
        """The requests ended: drop whatever was kept for them."""
