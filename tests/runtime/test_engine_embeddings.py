"""`Engine.encode` / `async_encode` (SGLang's embedding API): each prompt's embedding is
transformers' final hidden state of its last token, L2-normalized, on every architecture;
it does not depend on the batch, the cache, chunked prefill or tensor parallelism; requests
generating beside it keep their tokens; bad arguments name the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact, make_prompts
from transformers import AutoModel, AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.request_contract import InvalidRequest

PROMPTS = make_prompts(6, seed=11)
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def hf_embeddings(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last-token final hidden state of each prompt, run alone, normalized."""
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=0)
                for p in prompts]


def close(got: list[float], want: torch.Tensor | list[float], tol: float = 1e-5) -> None:
    got_t = torch.tensor(got)
    want_t = want if isinstance(want, torch.Tensor) else torch.tensor(want)
    assert got_t.shape == want_t.shape
    assert (got_t - want_t).abs().max().item() <= tol


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_embeddings_equal_transformers_last_hidden_state(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints[arch]
    tok = AutoTokenizer.from_pretrained(path)
    with Engine(path, dtype="float32") as engine:
        outs = engine.encode(PROMPTS)
        assert_idle_and_intact(engine)
    want = hf_embeddings(path, [tok.encode(p) for p in PROMPTS])
    for out, ref, prompt in zip(outs, want, PROMPTS, strict=True):
        close(out["embedding"], ref)
        assert torch.tensor(out["embedding"]).norm().item() == pytest.approx(1.0, abs=1e-5)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(tok.encode(prompt)) and meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert set(out) == {"embedding", "meta_info"}


def test_an_embedding_does_not_depend_on_batch_cache_or_chunks(tiny_llama: Path) -> None:
    with Engine(tiny_llama, dtype="float32") as engine:
        alone = []
        for p in PROMPTS:
            engine.flush_cache()
            alone.append(engine.encode(p)["embedding"])
        engine.flush_cache()
        together = engine.encode(PROMPTS)
        warm = engine.encode(PROMPTS)  # every prompt cached but for its last token
        assert [o["meta_info"]["cached_tokens"] for o in warm] == [o["meta_info"]["prompt_tokens"] - 1 for o in warm]
        longer = engine.encode(PROMPTS[0] + " and more")  # a cached prefix, then new tokens
        assert longer["meta_info"]["cached_tokens"] > 0
        assert_idle_and_intact(engine)
    with Engine(tiny_llama, dtype="float32", chunked_prefill_size=4) as chunked:
        in_chunks = chunked.encode(PROMPTS)
        assert_idle_and_intact(chunked)
    with Engine(tiny_llama, dtype="float32", disable_radix_cache=True) as fresh:
        longer_alone = fresh.encode(PROMPTS[0] + " and more")["embedding"]
    for a, t, w, c in zip(alone, together, warm, in_chunks, strict=True):
        close(t["embedding"], a)
        close(w["embedding"], a)
        close(c["embedding"], a)
    close(longer["embedding"], longer_alone)


def test_token_ids_rids_and_async_beside_generation(tiny_llama: Path) -> None:
    with Engine(tiny_llama, dtype="float32") as engine:
        ids = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
        by_text = engine.encode(PROMPTS[:3], rid=["a", "b", "c"])
        assert [o["meta_info"]["id"] for o in by_text] == ["a", "b", "c"]
        by_ids = engine.encode(input_ids=ids)
        generated = engine.generate(PROMPTS[3:], GREEDY)

        async def both() -> tuple[list[dict], list[dict]]:
            return await asyncio.gather(engine.async_encode(input_ids=ids), engine.async_generate(PROMPTS[3:], GREEDY))

        encoded, beside = asyncio.run(both())
        assert_idle_and_intact(engine)
    for t, i, a in zip(by_text, by_ids, encoded, strict=True):
        close(i["embedding"], t["embedding"])
        close(a["embedding"], t["embedding"])
    assert [o["output_ids"] for o in beside] == [o["output_ids"] for o in generated]


def test_tensor_parallel_embeddings_equal_one_rank(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["qwen3"]
    with Engine(path, dtype="float32") as one:
        want = [o["embedding"] for o in one.encode(PROMPTS)]
    with Engine(path, dtype="float32", tp_size=2) as two:
        got = [o["embedding"] for o in two.encode(PROMPTS)]
        generated = two.generate(PROMPTS[0], GREEDY)  # the ranks still agree on every step after
        assert generated["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        assert_idle_and_intact(two)
    for g, w in zip(got, want, strict=True):
        close(g, w)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "a", "input_ids": [1]}, "prompt"),
        ({"input_ids": [[]]}, "input_ids"),
        ({"input_ids": [1, 99999]}, "input_ids"),
        ({"input_ids": [5] * 1024}, "input_ids"),
        ({"prompt": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"prompt": ["a", "b"], "rid": ["x"]}, "rid"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict, field: str, embed_engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as info:
        embed_engine.encode(**kwargs)
    assert info.value.field == field, info.value
    assert_idle_and_intact(embed_engine)


@pytest.fixture(scope="module")
def embed_engine(tiny_llama: Path):
    with Engine(tiny_llama, dtype="float32") as engine:
        yield engine
