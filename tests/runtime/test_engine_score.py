"""`Engine.score` / `async_score` (SGLang's scoring API): each item's label scores equal
transformers' next-token probabilities after `query + item` (renormalized over the labels
with `apply_softmax`), for text and token-id inputs and either order; an item scores as
it would alone; items that share the query prefill it once; bad arguments name the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact
from transformers import AutoModelForCausalLM, AutoTokenizer

import sprig as sgl
from sprig.runtime import Engine
from sprig.runtime.request_contract import InvalidRequest
from sprig.runtime.scheduler.config import SchedulerConfig

QUERY = "the quick brown fox"
ITEMS = ["", " jumps over", " the cat", " what is"]
LABELS = [9, 300, 41, 2]  # any ids, in any order


def hf_next_token_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits after each prompt, each run alone."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1] for p in prompts]


def hf_scores(path: Path, prompts: list[list[int]], apply_softmax: bool) -> list[list[float]]:
    """SGLang's reference: softmax over the labels' logits, or the labels' probabilities."""
    out = []
    for logits in hf_next_token_logits(path, prompts):
        probs = torch.softmax(logits[LABELS], -1) if apply_softmax else torch.softmax(logits, -1)[LABELS]
        out.append(probs.tolist())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_scores_equal_transformers(arch: str, item_first: bool, tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints[arch]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(i + QUERY if item_first else QUERY + i) for i in ITEMS]
    with Engine(path, dtype="float32") as engine:
        for apply_softmax in (True, False):
            got = engine.score(QUERY, ITEMS, LABELS, apply_softmax=apply_softmax, item_first=item_first)
            want = hf_scores(path, prompts, apply_softmax)
            assert len(got) == len(ITEMS) and all(len(row) == len(LABELS) for row in got)
            for g, w in zip(got, want, strict=True):
                assert g == pytest.approx(w, rel=1e-4, abs=1e-7)
            if apply_softmax:
                assert all(sum(row) == pytest.approx(1.0, abs=1e-9) for row in got)
            else:
                assert all(0 < sum(row) < 1 for row in got)
        assert_idle_and_intact(engine)


def test_token_id_inputs_join_the_lists(tiny_llama: Path) -> None:
    query, items = [5, 17, 230, 8], [[40], [], [77, 3, 12]]
    with Engine(tiny_llama, dtype="float32") as engine:
        got = engine.score(query, items, LABELS, apply_softmax=True)
        first = engine.score(query, items, LABELS, apply_softmax=True, item_first=True)
        assert_idle_and_intact(engine)
    for g, w in zip(got, hf_scores(tiny_llama, [query + i for i in items], True), strict=True):
        assert g == pytest.approx(w, rel=1e-4, abs=1e-7)
    for g, w in zip(first, hf_scores(tiny_llama, [i + query for i in items], True), strict=True):
        assert g == pytest.approx(w, rel=1e-4, abs=1e-7)


def test_an_item_scores_as_it_would_alone_and_a_long_query_is_prefilled_once(tiny_llama: Path) -> None:
    query = QUERY + " and the lazy dog sat on the red mat while two birds sang in the old tree by the river"
    with Engine(tiny_llama, dtype="float32") as engine:
        alone = []
        for item in ITEMS:
            engine.flush_cache()
            alone.append(engine.score(query, item, LABELS)[0])
        engine.flush_cache()
        before = engine.scheduler.stats.prefill_tokens
        together = engine.score(query, ITEMS, LABELS)
        prefilled = engine.scheduler.stats.prefill_tokens - before
        prompts = [engine.tokenizer.encode(query + i) for i in ITEMS]
        assert_idle_and_intact(engine)
    for a, t in zip(alone, together, strict=True):  # batched float32 sums round differently
        assert t == pytest.approx(a, rel=1e-5)
    shared = next(k for k in range(len(prompts[0]) + 1) if k == len(prompts[0]) or len({p[k] for p in prompts}) > 1)
    assert shared >= SchedulerConfig.in_batch_prefix_min  # the scheduler holds back the others a step
    assert prefilled == sum(len(p) for p in prompts) - (len(ITEMS) - 1) * shared


def test_async_score_runs_beside_other_calls(tiny_llama: Path) -> None:
    with Engine(tiny_llama, dtype="float32") as engine:
        want = engine.score(QUERY, ITEMS, LABELS, apply_softmax=True)
        generated = engine.generate(QUERY, {"max_new_tokens": 6, "temperature": 0})

        async def both() -> tuple[list[list[float]], dict]:
            return await asyncio.gather(engine.async_score(QUERY, ITEMS, LABELS, apply_softmax=True),
                                        engine.async_generate(QUERY, {"max_new_tokens": 6, "temperature": 0}))

        got, out = asyncio.run(both())
        assert_idle_and_intact(engine)
    assert out["output_ids"] == generated["output_ids"]
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5)


def test_sglangs_score_test_runs_as_written(tiny_llama: Path) -> None:
    """SGLang's own `test_score_api` calls, with `import sprig as sgl`."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    label_token_ids = [tok.encode(t, add_special_tokens=False)[0] for t in [" to", " the"]]
    engine = sgl.Engine(model_path=str(tiny_llama), dtype="float32")
    try:
        for query, items, item_first in (("I pledge allegiance", ["", " to"], False),
                                         (" is a city", ["Tokyo", "Japan"], True)):
            scores = engine.score(query=query, items=items, label_token_ids=label_token_ids,
                                  apply_softmax=True, item_first=item_first)
            assert len(scores) == len(items)
            assert all(isinstance(v, float) and 0 <= v <= 1 for row in scores for v in row)
            assert all(sum(row) == pytest.approx(1.0, abs=1e-6) for row in scores)
        for batch_size in (1, 2, 4, 8):
            scores = engine.score(query="The test was", items=[f"test {i}" for i in range(batch_size)],
                                  label_token_ids=[1, 2, 3], apply_softmax=True)
            assert len(scores) == batch_size and all(len(row) == 3 for row in scores)
        assert_idle_and_intact(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "field", "needle"),
    [
        ({"label_token_ids": None}, "label_token_ids", "non-empty list"),
        ({"label_token_ids": []}, "label_token_ids", "non-empty list"),
        ({"label_token_ids": [1, "a"]}, "label_token_ids", "non-empty list"),
        ({"label_token_ids": [True]}, "label_token_ids", "non-empty list"),
        ({"label_token_ids": [3, 99999]}, "label_token_ids", "outside [0, 512)"),
        ({"label_token_ids": list(range(300))}, "label_token_ids", "at most 256"),
        ({"query": None}, "query", "required"),
        ({"items": None}, "items", "required"),
        ({"items": []}, "items", "non-empty"),
        ({"items": [[1, 2]]}, "items", "must both be text, or both token ids"),
        ({"query": [1, 2], "items": ["a"]}, "items", "must both be text, or both token ids"),
        ({"query": [1, 2], "items": [[3], "a"]}, "items", "must both be text, or both token ids"),
        ({"query": [1, 99999], "items": [[3]]}, "query", "outside [0, 512)"),
        ({"query": [1], "items": [[3], [-1]]}, "items", "outside [0, 512)"),
        ({"query": "", "items": ["a", ""]}, "items", "items[1] is empty"),
        ({"query": [], "items": [[]]}, "items", "items[0] is empty"),
        ({"query": [5] * 1023, "items": [[5]]}, "items", "context length (1024)"),
        ({"apply_softmax": 1}, "apply_softmax", "true or false"),
        ({"item_first": "yes"}, "item_first", "true or false"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict, field: str, needle: str, score_engine: Engine) -> None:
    args = {"query": "a", "items": ["b"], "label_token_ids": [1, 2], "apply_softmax": False,
            "item_first": False} | kwargs
    with pytest.raises(InvalidRequest) as info:
        score_engine.score(**args)
    assert info.value.field == field and needle in str(info.value)
    assert_idle_and_intact(score_engine)


@pytest.fixture(scope="module")
def score_engine(tiny_llama: Path):
    with Engine(tiny_llama, dtype="float32") as engine:
        yield engine
