"""From the scheduler's token outputs to SGLang `/generate` responses, in two stages.

- `OutputDecoder` (one per request): `TokenOutput` → `DetokenizedOutput`: the text delta,
  incrementally decoded and stop-trimmed, and logprob entries as `[logprob, id, text]`.
  The server runs it in the detokenizer process; the offline engine in-process.
- `ResponseState` (one per request): accumulates `DetokenizedOutput`s into the response
  dict. The server runs it in the HTTP process.

`ResponseBuilder` chains both for the offline engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sprig.runtime.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    DetokenizeConfig,
    RequestDetokenizer,
    decode_tokens_for_logprobs,
)
from sprig.runtime.wire import DetokenizedOutput, TokenOutput

if TYPE_CHECKING:
    from sprig.runtime.scheduler.request import Req

LOGPROB_FIELDS = frozenset({"output_logprobs", "output_top_logprobs", "input_logprobs", "input_top_logprobs",
                            "output_token_ids_logprobs", "input_token_ids_logprobs"})
# meta_info lists that a streamed /generate event holds only the new tokens' entries of
STREAMED_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
_DECODED = LOGPROB_FIELDS | {"text_delta"}  # the fields `OutputDecoder.decode` rewrites


class OutputDecoder:
    """Turns one request's `TokenOutput`s, in order, into `DetokenizedOutput`s.

    Invariant: the concatenated `text_delta`s are the stop-trimmed decode of the output
    ids (see `RequestDetokenizer`); `prompt_ids` only needs the prompt's last few ids. An
    output that carries its text (the scheduler decoded it while checking stop strings)
    keeps it: a request's text is decoded once. With `incremental=False` every delta is
    empty until the last, which carries the whole text: one decode per request instead of
    one per step, the same text.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        config: DetokenizeConfig,
        *,
        logprob_text: bool,
        incremental: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_tail = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.config = config
        self.detok: RequestDetokenizer | None = None  # made on the first output without its text
        self.logprob_text = logprob_text
        self.incremental = incremental
        self._held: list[int] = []

    def decode(self, out: TokenOutput) -> DetokenizedOutput:
        """`out` with its text delta, and its logprob entries with their texts."""
        entries = self._entries
        plain = {f.name: getattr(out, f.name) for f in dataclasses.fields(TokenOutput) if f.name not in _DECODED}
        return DetokenizedOutput(
            **plain,
            text_delta=self._text(out),
            output_logprobs=entries(out.output_logprobs),
            output_top_logprobs=[entries(row) for row in out.output_top_logprobs],
            input_logprobs=None if out.input_logprobs is None else entries(out.input_logprobs),
            input_top_logprobs=self._rows(out.input_top_logprobs),
            output_token_ids_logprobs=[entries(row) for row in out.output_token_ids_logprobs],
            input_token_ids_logprobs=self._rows(out.input_token_ids_logprobs),
        )

    def _rows(self, rows: list[Any] | None) -> list[Any] | None:
        return None if rows is None else [None if row is None else self._entries(row) for row in rows]

    def _text(self, out: TokenOutput) -> str:
        if out.text_delta is not None:
            return out.text_delta
        finished = out.finish_reason is not None
        if self.detok is None:
            self.detok = RequestDetokenizer(self.tokenizer, self.prompt_tail, self.config)
        if self.incremental:
            return self.detok.step(out.new_ids, finished=finished).text_delta
        self._held.extend(out.new_ids)
        if not finished:
            return ""
        return self.detok.step(self._held, finished=True).text_delta

    def _entries(self, pairs: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """`[logprob, id]` pairs as SGLang's `[logprob, id, text | None]` triples."""
        if not pairs:
            return []
        texts = decode_tokens_for_logprobs(self.tokenizer, [p[1] for p in pairs]) if self.logprob_text else None
        return [[lp, tok, texts[i] if texts else None] for i, (lp, tok) in enumerate(pairs)]


def spec_meta(histogram: Sequence[int], drafted: int, completion_tokens: int) -> dict[str, Any]:
    """A request's speculative decoding counts in SGLang's `meta_info` names, from the
    passes that emitted its tokens counted by drafts kept (`histogram[k]`: passes that kept
    k drafts; not empty) and the drafts verified for it. `spec_accept_length` is tokens per
    pass, the first token (from prefill) and each pass's own target token included;
    `spec_accept_rate` is drafts kept over drafts verified (0.0 when none was drafted)."""
    passes = sum(histogram)
    kept = sum(k * n for k, n in enumerate(histogram))
    return {
        "spec_verify_ct": passes,
        "spec_accept_length": completion_tokens / passes,
        "spec_num_proposed_drafts": drafted,
        "spec_num_correct_drafts": kept,
        "spec_accept_rate": kept / drafted if drafted else 0.0,
        "spec_correct_drafts_histogram": list(histogram),
    }


class ResponseState:
    """The cumulative `/generate` response of one request. `meta_info` carries the logprob
    lists only when `return_logprob`, the `token_ids_logprob` ones only when it asked for
    some; an `embed` request's response is SGLang's `/encode` one, `{"embedding",
    "meta_info"}`. `snapshot()` is a copy safe to hand out."""

    def __init__(self, rid: str, prompt_tokens: int, *, return_logprob: bool, token_ids_logprob: bool = False,
                 embed: bool = False) -> None:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": None,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "jump_forward_tokens": 0,
            "num_retractions": 0,
            "e2e_latency": 0.0,
            "weight_version": None,
        }
        if return_logprob:
            meta.update(
                input_token_logprobs=[], output_token_logprobs=[], input_top_logprobs=[], output_top_logprobs=[],
                output_token_logprobs_length=0,
            )
            if token_ids_logprob:
                meta.update(input_token_ids_logprobs=[], output_token_ids_logprobs=[])
        self.response: dict[str, Any] = (
            {"embedding": None, "meta_info": meta} if embed else {"text": "", "output_ids": [], "meta_info": meta}
        )

    @property
    def finished(self) -> bool:
        return self.response["meta_info"]["finish_reason"] is not None

    def add(self, out: DetokenizedOutput, elapsed: float) -> None:
        st, meta = self.response, self.response["meta_info"]
        if "embedding" in st:
            st["embedding"] = out.embedding
        else:
            st["text"] += out.text_delta
            st["output_ids"].extend(out.new_ids)
        meta.update(
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            jump_forward_tokens=out.jump_forward_tokens,
            num_retractions=out.retractions,
            prompt_tokens=out.prompt_tokens,
            e2e_latency=elapsed,
            finish_reason=out.finish_reason,
            weight_version=out.weight_version,
        )
        if out.spec_accept_histogram:
            meta.update(spec_meta(out.spec_accept_histogram, out.spec_drafted, out.completion_tokens))
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] += out.output_logprobs
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            meta["output_top_logprobs"] += out.output_top_logprobs
            if "output_token_ids_logprobs" in meta:
                meta["output_token_ids_logprobs"] += out.output_token_ids_logprobs
            if out.input_logprobs is not None:
                meta["input_token_logprobs"] = out.input_logprobs
                if out.input_top_logprobs is not None:
                    meta["input_top_logprobs"] = out.input_top_logprobs
                if out.input_token_ids_logprobs is not None:
                    meta["input_token_ids_logprobs"] = out.input_token_ids_logprobs

    def snapshot(self) -> dict[str, Any]:
        st = self.response
        if "embedding" in st:
            return {"embedding": st["embedding"], "meta_info": dict(st["meta_info"])}
        return {"text": st["text"], "output_ids": list(st["output_ids"]), "meta_info": dict(st["meta_info"])}


class ResponseBuilder:
    """Both stages in one process, over a fixed set of requests (the offline engine).
    Unless `stream`, text is decoded once per request, when it finishes."""

    def __init__(
        self, tokenizer, reqs: list[Req], *, return_text_in_logprobs: bool = False, stream: bool,
        indexed: bool = False,
    ) -> None:
        self.order = [r.rid for r in reqs]
        self.index = {rid: i for i, rid in enumerate(self.order)} if indexed else None
        self.decoders = {
            r.rid: OutputDecoder(
                tokenizer,
                r.prompt_ids,
                DetokenizeConfig.of(r.params),
                logprob_text=return_text_in_logprobs,
                incremental=stream,
            )
            for r in reqs
        }
        self.state = {
            r.rid: ResponseState(r.rid, len(r.prompt_ids), return_logprob=r.return_logprob,
                                 token_ids_logprob=bool(r.token_ids_logprob), embed=r.embed)
            for r in reqs
        }

    def add(self, out: TokenOutput, elapsed: float) -> None:
        self.state[out.rid].add(self.decoders[out.rid].decode(out), elapsed)

    def partial(self, rid: str) -> dict[str, Any]:
        """`rid`'s response so far; with `indexed`, with its place in the call's outputs
        as "index" (as SGLang's engine and /generate stream a batch)."""
        out = self.state[rid].snapshot()
        if self.index is not None:
            out["index"] = self.index[rid]
        return out

    def responses(self) -> list[dict[str, Any]]:
        return [self.state[rid].response for rid in self.order]
