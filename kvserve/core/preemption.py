"""How a preempted request gives its blocks back, and which request is the victim.

Two ways to bring a preempted request back: recompute (its blocks go back with their hashes and
its tokens run through prefill again, prefix hits permitting) or swap (its blocks are copied to
the host pool and copied back later). Which is cheaper depends on the request and the machine:

    recompute  ~ tokens computed / prefill speed
    swap       ~ 2 x blocks held x bytes per block / copy bandwidth   (out now, in later)

and swapping needs room in the host pool. The engine measures both speeds as it runs
(`PreemptionCosts.observe_*`, starting from sane estimates) and `AutoPreemption` takes the
cheaper per victim; `RecomputePreemption` and `SwapPreemption` keep the fixed modes. Each choice
comes with its reason, which the scheduler counts for /metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

# Initial estimates, replaced by measurements as soon as the engine has some: a small model's
# CPU prefill and a host memcpy. Their ratio only decides until then.
INITIAL_PREFILL_TOKENS_PER_S = 2_000.0
INITIAL_COPY_BYTES_PER_S = 2e9
SMOOTHING = 0.3  # weight of the newest measurement in the running averages


@dataclass
class PreemptionCosts:
    """The measured speeds a choice is made by, as exponential moving averages."""

    block_bytes: int = 0  # bytes one block holds over all layers (0: swapping is free)
    prefill_tokens_per_s: float = INITIAL_PREFILL_TOKENS_PER_S
    copy_bytes_per_s: float = INITIAL_COPY_BYTES_PER_S
    num_prefill_samples: int = 0
    num_copy_samples: int = 0

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = _average(self.prefill_tokens_per_s, num_tokens / seconds,
                                                 self.num_prefill_samples)
            self.num_prefill_samples += 1

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.copy_bytes_per_s = _average(self.copy_bytes_per_s, num_bytes / seconds, self.num_copy_samples)
            self.num_copy_samples += 1

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def swap_s(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s


def _average(old: float, new: float, num_samples: int) -> float:
    """The first measurement replaces the estimate; later ones are smoothed in."""
    return new if num_samples == 0 else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass(frozen=True)
class Victim:
    """What a choice reads of a request about to be preempted."""

    num_computed_tokens: int
    num_blocks: int  # pool blocks it holds
    can_swap: bool  # a lone sequence (beams are recomputed together) with room in the host pool
    is_gang: bool


class PreemptionMode(ABC):
    name: ClassVar[str]

    def __init__(self, costs: PreemptionCosts) -> None:
        self.costs = costs

    @abstractmethod
    def choose(self, victim: Victim) -> tuple[bool, str]:
        """(swap?, reason)."""

    def restore_cost(self, victim: Victim) -> float:
        """Seconds to bring the victim back the way it would go: the tie-break among victims of
        one priority (the cheapest goes)."""
        swap, _ = self.choose(victim)
        return self.costs.swap_s(victim.num_blocks) if swap else self.costs.recompute_s(victim.num_computed_tokens)


class RecomputePreemption(PreemptionMode):
    name = "recompute"

    def choose(self, victim: Victim) -> tuple[bool, str]:
        return False, "mode"


class SwapPreemption(PreemptionMode):
    name = "swap"

    def choose(self, victim: Victim) -> tuple[bool, str]:
        if victim.is_gang:
            return False, "beams"
        return (True, "mode") if victim.can_swap else (False, "no_host_room")


class AutoPreemption(PreemptionMode):
    name = "auto"

    def choose(self, victim: Victim) -> tuple[bool, str]:
        if victim.is_gang:
            return False, "beams"
        if not victim.can_swap:
            return False, "no_host_room"
        if self.costs.swap_s(victim.num_blocks) < self.costs.recompute_s(victim.num_computed_tokens):
            return True, "swap_cheaper"
        return False, "recompute_cheaper"


MODES: dict[str, type[PreemptionMode]] = {m.name: m for m in (AutoPreemption, RecomputePreemption, SwapPreemption)}


def make_preemption_mode(name: str, costs: PreemptionCosts) -> PreemptionMode:
    if name not in MODES:
        raise ValueError(f"unknown preemption mode {name!r}; choose one of {', '.join(MODES)}")
    return MODES[name](costs)
