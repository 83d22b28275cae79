"""When a request stops: stop tokens, its grammar, stop strings and `stop_regex`, its
token budget and the context; and the grammar's forced text appended without sampling
(jump-forward).

Stop strings are checked here, on the token ids as they are emitted, by one incremental
detokenizer per request that has them, so a request ends on the step its stop appears.
That decode is the request's only one: its text goes out with its tokens (`take_text`),
and the detokenizer process decodes only the requests without stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sprig.runtime.detokenizer import DecodeDelta, DetokenizeConfig, RequestDetokenizer
from sprig.runtime.scheduler.request import FinishReason, Req

JUMP_CONTEXT_TOKENS = 4  # output tokens re-tokenized with a forced continuation


def _text_stop(delta: DecodeDelta) -> FinishReason | None:
    """How a stop string or `stop_regex` ends the request, if this step's text does."""
    if delta.stop_error is not None:
        return FinishReason("abort", message=delta.stop_error, status_code=400)
    return None if delta.stop_matched is None else FinishReason("stop", matched=delta.stop_matched)


@dataclass
class _Text:
    """One request's stop checker: the text decoded and not yet sent, and how many of its
    output ids the checker has seen."""

    checker: RequestDetokenizer
    unsent: list[str] = field(default_factory=list)
    fed: int = 0


class Stops:
    """The stop checks of every request in the scheduler (`register` when it is queued,
    `forget` when it has reported its end)."""

    def __init__(self, tokenizer: Any, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self._text: dict[str, _Text] = {}

    def register(self, req: Req) -> None:
        """Prepare `req`'s stop-string checker; ValueError without a tokenizer to run it."""
        p = req.params
        if not (p.stop or p.stop_regex):
            return
        if self.tokenizer is None:
            raise ValueError("stop strings and stop_regex need the scheduler to have a tokenizer")
        self._text[req.rid] = _Text(RequestDetokenizer(self.tokenizer, req.prompt_ids, DetokenizeConfig.of(p)))

    def forget(self, rid: str) -> None:
        self._text.pop(rid, None)

    def take_text(self, req: Req) -> str | None:
        """The stop-trimmed text `req` added since the last call (once it has finished: the
        rest of it, every output id decoded and nothing held back); None for a request
        without stop strings, whose text is decoded elsewhere."""
        text = self._text.get(req.rid)
        if text is None:
            return None
        if req.finished:  # a stop token, or the token that ended a grammar, was not fed yet
            text.unsent.append(text.checker.step(req.output_ids[text.fed :], finished=True).text_delta)
            text.fed = len(req.output_ids)
        out = "".join(text.unsent)
        text.unsent.clear()
        return out

    def _decode(self, req: Req, ids: list[int]) -> FinishReason | None:
        """Feed `req`'s stop checker its newest `ids`, if it has one; how its text stops
        the request."""
        text = self._text.get(req.rid)
        if text is None:
            return None
        delta = text.checker.step(ids)
        text.unsent.append(delta.text_delta)
        text.fed += len(ids)
        return _text_stop(delta)

    def after_token(self, req: Req, token: int) -> FinishReason | None:
        """Whether `req`, having just emitted `token` (already in its output), stops."""
        p, n_out = req.params, len(req.output_ids)
        reason = None
        if req.grammar is not None and not req.grammar.accept_token(token):
            reason = FinishReason("abort", message=f"the grammar refused sampled token {token}")
        elif token in req.stop_ids and n_out >= p.min_new_tokens:
            reason = FinishReason("stop", matched=token)
        elif req.grammar is not None and req.grammar.is_finished():
            reason = FinishReason("stop", matched=None)
        else:
            reason = self._decode(req, [token])
        if reason is None and (n_out >= p.max_new_tokens or len(req.prompt_ids) + n_out >= self.context_len):
            reason = FinishReason("length", length=n_out)
        return reason

    def jump_forward(self, req: Req) -> tuple[int, FinishReason | None]:
        """Append the text `req`'s grammar forces next (e.g. `{"name":"`) without sampling
        it: (tokens appended, how the request stops, if it does).

        The forced text is tokenized in context (after the last few output tokens), a
        special token's name in it as text, as the grammar backends read it; the jump
        happens only where that tokenization keeps the existing tokens, so no emitted
        token is ever taken back. The last of its tokens is left to the model:
        the model's own token there may run on past the forced text (`":` where `"` is
        forced and `: ` or `:` may follow), and a token cut at the boundary would put it
        off the tokenization it learned. The tokens are fed in the next step at once.
        """
        forced = req.grammar.forced_continuation()
        room = min(req.params.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len - 1)
        if not forced or room <= 0 or self.tokenizer is None:
            return 0, None
        tail = req.output_ids[-JUMP_CONTEXT_TOKENS:]
        context = self.tokenizer.decode(tail)
        if "\ufffd" in context:
            return 0, None
        ids = self.tokenizer.encode(context + forced, add_special_tokens=False, split_special_tokens=True)
        if ids[: len(tail)] != tail:
            return 0, None
        new = ids[len(tail) : len(tail) + room][:-1]
        if not new or not req.grammar.accept_tokens(new):
            return 0, None
        req.output_ids.extend(new)
        req.jump_forward_tokens += len(new)
        reason = self._decode(req, new)
        if reason is None and (req.grammar.is_finished() or len(req.output_ids) >= req.params.max_new_tokens):
            reason = FinishReason("stop" if req.grammar.is_finished() else "length",
                                  matched=None, length=len(req.output_ids))
        return len(new), reason
