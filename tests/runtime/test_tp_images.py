"""Gemma 3 with images under tensor parallelism: TP=2 over gloo on the CPU gives TP=1's
greedy tokens, prompt and output logprobs within 1e-4, for a batch mixing a request with
one image, one with two and one without, then for a prompt extending a cached one whose
image its K/V is reused for (rank 0 encodes the images; the other ranks take the
embeddings it sends)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact
from vision_checkpoint import build_vision_checkpoint, random_image

from sprig.runtime import Engine

ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=2048, chunked_prefill_size=12)
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
FIRST = "<start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>\n<start_of_turn>model\n"
BATCH = [FIRST, "Compare <start_of_image> with <start_of_image>: which is brighter?", "No picture here, only words"]
IMAGES = [[1], [2, 3], []]  # seeds of each prompt's images
LATER = FIRST + "It shows noise.<end_of_turn>\n<start_of_turn>user\nAnd the colours?"  # FIRST's image, cached


def run(engine: Engine) -> list[dict]:
    """The mixed batch, then `LATER`, which must reuse the cached image's K/V."""
    outs = engine.generate(BATCH, GREEDY, image_data=[[random_image(s) for s in seeds] for seeds in IMAGES],
                           return_logprob=True, logprob_start_len=0)
    # output logprobs only: prompt logprobs from token 0 would compute the cached prefix again
    later = engine.generate(LATER, GREEDY, image_data=[random_image(1)], return_logprob=True)
    _, (image,) = engine.images.prompt(LATER, [random_image(1)], engine.tokenizer.encode, param="prompt")
    assert later["meta_info"]["cached_tokens"] >= image.end
    assert_idle_and_intact(engine)
    return [*outs, later]


def logprobs(out: dict) -> torch.Tensor:
    meta = out["meta_info"]
    return torch.tensor([lp for lp, *_ in (meta["input_token_logprobs"] or [])[1:] + meta["output_token_logprobs"]])


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision-tp"))


def test_tp2_with_images_equals_tp1(vision: Path) -> None:
    with Engine(str(vision), **ENGINE) as engine:
        want = run(engine)
    with Engine(str(vision), tp_size=2, **ENGINE) as engine:
        assert engine.runner.takes_images and not engine.runner.no_images
        got = run(engine)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        torch.testing.assert_close(logprobs(g), logprobs(w), atol=1e-4, rtol=0)
