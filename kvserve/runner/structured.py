"""Structured outputs: each constrained request has a matcher (llguidance) over its grammar (a
JSON schema, a regex, a choice of strings, or a Lark/GBNF grammar); before a step's tokens are
drawn, every constrained row's logits outside the tokens its matcher allows are set to -inf (one
bitmask per row, only for the rows that need one), and the drawn token advances its matcher.
When the grammar is complete only end-of-sequence is allowed, so the output always parses.

The tokenizer must be a Hugging Face `tokenizers` one (GGUF and Hugging Face models); llama2.c
models cannot be constrained, which add_request reports.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import torch

from kvserve.core.outputs import ScheduledSequence
from kvserve.config import FieldError

FORMATS = {"json_schema": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        raw = getattr(tokenizer, "tok", None)
        if raw is None or not hasattr(raw, "to_str"):
            raise ValueError("this model's tokenizer cannot drive structured outputs (a Hugging Face "
                             "tokenizers one is needed)")
        eos = list(tokenizer.eos_token_ids)
        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(raw.to_str(), n_vocab=vocab_size, eos_token=eos[0] if eos else None)
        self.vocab_size = vocab_size
        self.matchers: dict[str, Any] = {}
        self._executor: Optional[Any] = None

    def grammar(self, spec: tuple[str, str]) -> str:
        """The grammar of (kind, text); a ValueError naming the problem if it does not compile."""
        kind, text = spec
        if kind == "choice":
            options = json.loads(text) if text.lstrip().startswith("[") else None
            if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
                raise FieldError("structured", "choice: a non-empty JSON list of strings is needed", " ")
        try:
            grammar = self._ll.grammar_from(FORMATS[kind], text)
        except (ValueError, TypeError) as e:
            raise FieldError("structured", f"{kind}: {e}", " ") from e
        matcher = self._ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise FieldError("structured", f"{kind}: {matcher.get_error()}", " ")
        # a grammar that matches nothing (a rule defined only by itself, an empty character class)
        # compiles, and fails at its first mask: found here, not by an empty 200 answer
        import llguidance.torch as lltorch
        lltorch.fill_next_token_bitmask(matcher, lltorch.allocate_token_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise FieldError("structured", f"{kind}: the grammar matches nothing ({matcher.get_error()})", " ")
        return grammar  # type: ignore[no-any-return]

    def mask(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]) -> torch.Tensor:
        """logits [N, vocab] with each constrained row limited to what its matcher allows."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.structured is not None]
        if not rows:
            return logits
        import llguidance.torch as lltorch
        logits = logits.clone()
        bitmask = lltorch.allocate_token_bitmask(len(rows), self.vocab_size)
        if len(rows) == 1:
            lltorch.fill_next_token_bitmask(self._matcher(seqs[rows[0]]), bitmask, 0)
        else:  # the rows' masks on llguidance's threads, outside the GIL
            if self._executor is None:
                self._executor = self._ll.LLExecutor()
            lltorch.fill_next_token_bitmask_par(self._executor, [(self._matcher(seqs[i]), j) for j, i in enumerate(rows)],
                                                bitmask)
        sub = logits[rows]
        lltorch.apply_token_bitmask_inplace(sub, bitmask)
        logits[rows] = sub
        return logits

    def accept(self, seqs: Sequence[ScheduledSequence], tokens: Sequence[Sequence[int]]) -> None:
        for s, toks in zip(seqs, tokens):
            if s.sampling_params.structured is not None:
                matcher = self._matcher(s)
                for t in toks[:1]:
                    if not matcher.is_stopped():
                        matcher.consume_token(t)

    def _matcher(self, seq: ScheduledSequence) -> Any:
        """The request's matcher, caught up with its output (a request that was preempted and
        recomputed keeps its matcher; one created late replays the output)."""
        m = self.matchers.get(seq.request_id)
        if m is None:
            assert seq.sampling_params.structured is not None
            m = self.matchers[seq.request_id] = self._ll.LLMatcher(self.tokenizer,
                                                                   self.grammar(seq.sampling_params.structured))
            for t in seq.output_token_ids:
                m.consume_token(t)
        return m

    def save(self, request_ids: Sequence[str]) -> dict[str, Optional[Any]]:
        return {rid: (m.deep_copy() if (m := self.matchers.get(rid)) is not None else None) for rid in request_ids}

    def restore(self, saved: dict[str, Optional[Any]]) -> None:
        for rid, m in saved.items():
            if m is None:
                self.matchers.pop(rid, None)
            else:
                self.matchers[rid] = m

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
