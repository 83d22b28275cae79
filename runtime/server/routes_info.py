"""/tokenize, /detokenize and /version, in the shapes SGLang's and vLLM's servers answer.

Both token routes run on the input pool like every request (`app.prepare`), after the
body's size limit; texts longer than any text of the context are refused before they are
tokenized (`RequestBuilder.encode`), id lists past `MAX_DETOKENIZE_IDS` before they are
decoded. The response of /detokenize carries the text as SGLang names it (`text`) and as
vLLM does (`prompt`).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.request_contract import InvalidRequest
from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.http_io import json_response, prepare, state_of
from sprig.runtime.server.protocol_tokens import DetokenizeRequest, TokenizeRequest
from sprig.runtime.server.request_builder import RequestBuilder

router = APIRouter()
MAX_DETOKENIZE_IDS = 1 << 20  # far more than a context holds; decoding this many takes ~1 s


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    builder = state_of(request).builder
    return json_response(await prepare(request, lambda body: _tokenize(builder, parse(TokenizeRequest, body)),
                                       new_work=False))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    builder = state_of(request).builder
    return json_response(await prepare(request, lambda body: _detokenize(builder, parse(DetokenizeRequest, body)),
                                       new_work=False))


@router.get("/version")
async def server_version(request: Request) -> Response:
    return json_response({"version": version("sprig")})


def _encode(builder: RequestBuilder, text: str, add_special_tokens: bool, param: str) -> list[int]:
    if not text:  # an empty text is valid here (its special tokens, if any)
        return builder.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return builder.encode(text, add_special_tokens=add_special_tokens, param=param)


def _tokenize(builder: RequestBuilder, req: TokenizeRequest) -> dict[str, Any]:
    if req.chat_template is not None:
        raise ApiError(400, "the server never runs a client's template (start it with --chat-template)",
                       "chat_template")
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        if req.continue_final_message and req.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt false", "continue_final_message")
        text = builder.chat_text(req.messages, req.tools, req.chat_template_kwargs,
                                add_generation_prompt=req.add_generation_prompt,
                                continue_final=req.continue_final_message)
        images = len(builder.chat_images(req.messages))
        if images and builder.images is not None:  # each image's placeholders, as a chat request holds them
            special = bool(req.add_special_tokens)
            try:
                ids = [builder.images.text(text, images, lambda t: _encode(builder, t, special, "messages"), "messages")]
            except InvalidRequest as e:
                raise ApiError(400, str(e), "messages") from None
        else:
            ids = [_encode(builder, text, bool(req.add_special_tokens), "messages")]
        batch = False
    else:
        batch = not isinstance(req.prompt, str)
        texts = req.prompt if batch else [req.prompt]
        if not texts:
            raise ApiError(400, "prompt must not be an empty list", "prompt")
        special = req.add_special_tokens is not False
        ids = [_encode(builder, t, special, "prompt") for t in texts]
    out: dict[str, Any] = {
        "tokens": ids if batch else ids[0],
        "count": [len(i) for i in ids] if batch else len(ids[0]),
        "max_model_len": builder.context_len,
    }
    if req.return_token_strs:
        strs = [builder.tokenizer.convert_ids_to_tokens(i) for i in ids]
        out["token_strs"] = strs if batch else strs[0]
    return out


def _detokenize(builder: RequestBuilder, req: DetokenizeRequest) -> dict[str, Any]:
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    seqs: list[list[int]] = req.tokens if batch else [req.tokens]
    if sum(len(s) for s in seqs) > MAX_DETOKENIZE_IDS:
        raise ApiError(400, f"tokens holds more than {MAX_DETOKENIZE_IDS} ids", "tokens")
    vocab = max(len(builder.tokenizer), builder.vocab_size)
    if bad := [t for s in seqs for t in s if not 0 <= t < vocab][:5]:
        raise ApiError(400, f"tokens has ids outside [0, {vocab}): {bad}", "tokens")
    texts = [builder.tokenizer.decode(s, skip_special_tokens=req.skip_special_tokens) for s in seqs]
    text = texts if batch else texts[0]
    return {"text": text, "prompt": text}
