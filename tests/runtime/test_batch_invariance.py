"""A request's tokens do not depend on what runs beside it: the README's own main job
(the demo model on the held-out problems), all at once against one at a time, greedy and
seeded, with a roomy KV pool and with one small enough to retract."""

from __future__ import annotations

import pytest
from engine_helpers import assert_idle_and_intact

from sprig.runtime import Engine
from sprig.runtime.demo.evaluate import prompts
from sprig.runtime.demo.tasks import take

PROBLEMS = take("heldout", 16, seed=0)
GREEDY = {"max_new_tokens": 128, "temperature": 0}


@pytest.fixture(scope="module")
def alone() -> dict[str, list[list[int]]]:
    """Each problem run alone on a fresh engine: greedy, and 3 seeded samples."""
    with Engine(None, check_integrity=True) as engine:
        texts = prompts(engine.tokenizer, PROBLEMS)
        out = {"greedy": [], "sampled": []}
        for text in texts:
            engine.flush_cache()
            out["greedy"].append(engine.generate(text, GREEDY)["output_ids"])
            engine.flush_cache()
            sampled = engine.generate(text, {**GREEDY, "temperature": 0.6, "top_p": 0.9, "n": 3, "seed": 5})
            out["sampled"] += [o["output_ids"] for o in sampled]
        assert_idle_and_intact(engine)
    return out


@pytest.mark.parametrize(
    "options",
    [{}, {"max_total_tokens": 300, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0}],
    ids=["roomy", "retracting"],
)
def test_the_demo_problems_all_at_once_equal_each_alone(options: dict, alone: dict[str, list[list[int]]]) -> None:
    with Engine(None, check_integrity=True, shadow_attention=True, **options) as engine:
        texts = prompts(engine.tokenizer, PROBLEMS)
        greedy = engine.generate(texts, GREEDY)
        sampled = engine.generate(texts, {**GREEDY, "temperature": 0.6, "top_p": 0.9, "n": 3, "seed": 5})
        assert_idle_and_intact(engine)
        retractions = engine.scheduler.stats.retractions
    assert [o["output_ids"] for o in greedy] == alone["greedy"]
    assert [o["output_ids"] for o in sampled] == alone["sampled"]
    lengths = {len(ids) for ids in alone["greedy"]}
    assert len(lengths) > 3  # requests left the batch at many different steps
    assert (retractions > 0) == bool(options)
