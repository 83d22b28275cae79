"""The shipped demo model: loads with transformers, answers in format; the task is sound."""

from __future__ import annotations

import pytest

from sprig.runtime.demo import DEMO_MODEL_PATH, ensure_demo_model, tasks


def test_generator_is_deterministic():
    assert tasks.take("train", 50, seed=3) == tasks.take("train", 50, seed=3)
    assert tasks.take("train", 50, seed=3) != tasks.take("train", 50, seed=4)


def test_splits_never_overlap():
    train = {p.question for p in tasks.take("train", 5000)}
    heldout = {p.question for p in tasks.take("heldout", 500)}
    assert not train & heldout
    assert all(tasks.split_of(q) == "heldout" for q in heldout)


def test_solution_ends_with_its_answer():
    for p in tasks.take("heldout", 200):
        assert tasks.extract_answer(p.solution) == p.answer
        assert 0 <= p.answer <= tasks.MAX_VALUE
        assert 1 <= p.solution.count("=") <= 4


@pytest.mark.parametrize(
    ("text", "answer"),
    [("3 + 4 = 7\nAnswer: 7", 7), ("Answer: 12\n", 12), ("Answer: 5 then more", None), ("7", None)],
)
def test_extract_answer(text, answer):
    assert tasks.extract_answer(text) == answer


def test_checkpoint_is_small():
    size = sum(f.stat().st_size for f in ensure_demo_model().iterdir())
    assert size <= 25 * 2**20


def test_greedy_output_ends_with_an_answer_line():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sprig.runtime.demo.evaluate import generate

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH).eval()
    assert tok.eos_token == "<|end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    problems = tasks.take("heldout", 4)
    for text in generate(model, tok, problems):
        assert isinstance(tasks.extract_answer(text[0]), int), text
