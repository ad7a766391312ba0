"""Beam search inside the engine: a request's beams are the members of its group, decoded
together each step, sharing their common blocks (forks raise reference counts; a dropped beam
releases its blocks at once; only a shared partly filled block is ever copied).

Each step every live beam's last row of logits comes back (the scheduler asks for it instead of
sampling); then, as Hugging Face generate(num_beams=k, do_sample=False) does:

    candidates = top max(2, 1 + #eos) * k of  (beam score + log_softmax(logits)) over all beams
    a candidate that ends a hypothesis (an EOS token, or the length limit) and ranks among the
    first k joins the finished hypotheses, scored  sum logprobs / generated_len ** length_penalty,
    which keep the best k
    the best k candidates that do not end become the next beams: a beam that is the parent of
    several forks, one that is the parent of none is dropped
    stop when k hypotheses are finished and early_stopping is True, or no running beam can beat
    the worst finished one (by the same heuristic as Hugging Face), or every candidate ends

The n best finished hypotheses are the request's outputs, in order, with their scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from kvserve.core.request import Request, RequestGroup, RequestStatus
from kvserve.core.scheduler import Scheduler

DEAD = -1.0e9  # Hugging Face's score for an empty or excluded slot


@dataclass
class Hypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / generated_len ** length_penalty
    ends_with_eos: bool


@dataclass
class BeamState:
    group: RequestGroup
    prompt_len: int
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    scores: dict[str, float] = field(default_factory=dict)  # running beam -> cumulative logprob
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    improvement_possible: bool = True
    done: bool = False

    @property
    def width(self) -> int:
        width = self.group.first.sampling_params.beam_width
        assert width is not None
        return width

    def running(self) -> list[Request]:
        """The live beams, best first (ties by their place in the group)."""
        live = [m for m in self.group.members if not m.is_finished]
        return sorted(live, key=lambda m: -self.scores.get(m.request_id, 0.0))


class BeamSearch:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.states: dict[str, BeamState] = {}

    def add(self, req: Request, max_new_tokens: int) -> None:
        assert req.group is not None
        self.states[req.group_id] = BeamState(req.group, req.num_prompt_tokens, max_new_tokens,
                                              () if req.sampling_params.ignore_eos else req.eos_token_ids)

    def forget(self, group_id: str) -> None:
        self.states.pop(group_id, None)

    def step(self, logits: dict[str, torch.Tensor]) -> list[BeamState]:
        """Advance every beam group whose live beams all got their row this step; returns the
        groups that finished. A group whose beams did not all run (the token budget or a
        preemption split it) takes back the rows it got, to run again in step with the others."""
        finished = []
        for state in list(self.states.values()):
            beams = state.running()
            have = [b.request_id in logits for b in beams]
            if not any(have):
                continue
            if not all(have):
                for beam, got in zip(beams, have):
                    if got:
                        self.scheduler.rollback(beam, beam.num_computed_tokens - 1)
                continue
            self._advance(state, beams, torch.stack([logits[b.request_id][-1] for b in beams]))
            if state.done:
                finished.append(state)
                del self.states[state.group.group_id]
        return finished

    def _advance(self, state: BeamState, beams: list[Request], rows: torch.Tensor) -> None:
        k, vocab = state.width, rows.shape[-1]
        params = state.group.first.sampling_params
        base = torch.tensor([state.scores.get(b.request_id, 0.0) for b in beams], dtype=torch.float32)
        totals = (rows.float().log_softmax(-1) + base.unsqueeze(1)).reshape(-1)
        keep = min(max(2, 1 + len(state.eos_token_ids)) * k, totals.numel())
        values, index = totals.topk(keep)
        gen_len = beams[0].num_output_tokens + 1  # generated tokens once this step's token is added
        at_limit = gen_len >= state.max_new_tokens or state.prompt_len + gen_len >= self.scheduler.max_model_len
        candidates = [(float(v), int(i) // vocab, int(i) % vocab) for v, i in zip(values.tolist(), index.tolist())]
        ends = [at_limit or token in state.eos_token_ids for _, _, token in candidates]
        self._collect_finished(state, beams, candidates, ends, gen_len, params.length_penalty, params.early_stopping)
        nxt = [c for c, e in zip(candidates, ends) if not e][:k]
        self._reassign(state, beams, nxt)
        self._check_done(state, gen_len, any(not e for e in ends), params.length_penalty, params.early_stopping)

    def _collect_finished(self, state: BeamState, beams: list[Request], candidates: list[tuple[float, int, int]],
                          ends: list[bool], gen_len: int, length_penalty: float, early_stopping: object) -> None:
        k = state.width
        full = len(state.finished) == k and early_stopping is True
        if full or not state.improvement_possible:
            return
        for rank, ((total, parent, token), end) in enumerate(zip(candidates, ends)):
            if rank >= k or not end:
                continue
            hyp = Hypothesis(beams[parent].output_token_ids + [token], total, total / (gen_len ** length_penalty),
                             token in state.eos_token_ids)
            state.finished.append(hyp)
        state.finished.sort(key=lambda h: -h.score)
        del state.finished[k:]

    def _reassign(self, state: BeamState, beams: list[Request], nxt: list[tuple[float, int, int]]) -> None:
        """The next beams as requests: a parent continues as its first child and forks the
        others (sharing its blocks); parents with no child are dropped (their blocks freed)."""
        children: dict[int, list[tuple[float, int]]] = {}
        for total, parent, token in nxt:
            children.setdefault(parent, []).append((total, token))
        scores: dict[str, float] = {}
        for i, beam in enumerate(beams):
            kids = children.get(i, [])
            if not kids:
                self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
                continue
            members = [beam] + self.scheduler.fork(beam, len(kids) - 1)
            for member, (total, token) in zip(members, kids):
                self.scheduler.extend(member, [token])
                scores[member.request_id] = total
        state.scores = scores

    def _check_done(self, state: BeamState, gen_len: int, can_continue: bool, length_penalty: float,
                    early_stopping: object) -> None:
        """Hugging Face's stopping rule: all k hypotheses found (early_stopping=True), or the best
        running beam cannot beat the worst finished one, or nothing can continue."""
        k = state.width
        if len(state.finished) == k and state.scores:
            if early_stopping == "never" and length_penalty > 0:
                best_len = state.max_new_tokens
            else:
                best_len = gen_len
            best_running = max(state.scores.values()) / (best_len ** length_penalty)
            state.improvement_possible = state.improvement_possible and best_running > state.finished[-1].score
        all_found = len(state.finished) == k and early_stopping is True
        if not state.improvement_possible or all_found or not can_continue or not state.scores:
            state.done = True
            for beam in state.running():
                self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)

    def outputs(self, state: BeamState) -> list[Hypothesis]:
        """The n best hypotheses, best first."""
        return state.finished[:state.group.first.sampling_params.n]

