"""Turning the scheduler's token outputs into SGLang `/generate` responses."""

from __future__ import annotations

from typing import Any

from sprig.runtime.detokenizer import (
    DetokenizeConfig,
    RequestDetokenizer,
    decode_tokens_for_logprobs,
)
from sprig.runtime.scheduler import Req, TokenOutput


class ResponseBuilder:
    """Accumulates `TokenOutput`s of a fixed set of requests into response dicts.

    The text is detokenized incrementally and trimmed at stop strings exactly as the
    scheduler matched them; `partial(rid)` gives the cumulative response so far.
    """

    def __init__(self, tokenizer, reqs: list[Req], *, return_text_in_logprobs: bool = False) -> None:
        self.tokenizer = tokenizer
        self.order = [r.rid for r in reqs]
        self.with_text = return_text_in_logprobs
        self.state: dict[str, dict[str, Any]] = {}
        self.detok: dict[str, RequestDetokenizer] = {}
        for r in reqs:
            p = r.params
            config = DetokenizeConfig(
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                stop=p.stop,
                no_stop_trim=p.no_stop_trim,
            )
            self.detok[r.rid] = RequestDetokenizer(tokenizer, r.prompt_ids, config)
            meta: dict[str, Any] = {
                "id": r.rid,
                "finish_reason": None,
                "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": 0,
                "cached_tokens": 0,
                "e2e_latency": 0.0,
            }
            if r.return_logprob:
                meta.update(
                    input_token_logprobs=[], output_token_logprobs=[], input_top_logprobs=[], output_top_logprobs=[]
                )
            self.state[r.rid] = {"text": "", "output_ids": [], "meta_info": meta}

    def add(self, out: TokenOutput, elapsed: float) -> None:
        st = self.state[out.rid]
        meta = st["meta_info"]
        finished = out.finish_reason is not None
        st["text"] += self.detok[out.rid].step(out.new_ids, finished=finished).text_delta
        st["output_ids"].extend(out.new_ids)
        meta.update(
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            prompt_tokens=out.prompt_tokens,
            e2e_latency=elapsed,
            finish_reason=out.finish_reason,
        )
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] += self._entries(out.output_logprobs)
            meta["output_top_logprobs"] += [self._entries(row) for row in out.output_top_logprobs]
            if out.input_logprobs is not None:
                meta["input_token_logprobs"] = self._entries(out.input_logprobs)
                if out.input_top_logprobs is not None:
                    meta["input_top_logprobs"] = [
                        None if row is None else self._entries(row) for row in out.input_top_logprobs
                    ]

    def _entries(self, pairs: list[list[Any]]) -> list[list[Any]]:
        """`[logprob, id]` pairs as SGLang's `[logprob, id, text | None]` triples."""
        texts = decode_tokens_for_logprobs(self.tokenizer, [p[1] for p in pairs]) if self.with_text else None
        return [[lp, tok, texts[i] if texts else None] for i, (lp, tok) in enumerate(pairs)]

    def partial(self, rid: str) -> dict[str, Any]:
        st = self.state[rid]
        return {"text": st["text"], "output_ids": list(st["output_ids"]), "meta_info": dict(st["meta_info"])}

    def responses(self) -> list[dict[str, Any]]:
        return [self.state[rid] for rid in self.order]
