"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): greedy tokens and logprobs equal
transformers' given the same pixels (its processor's prompt ids, image blocks attending
bidirectionally, sliding windows shorter than a block's sequence); a request's output does
not depend on its batch, on the cache (warm, cold, another image's prefix) or on chunking;
different images never share KV."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
)
from vision_checkpoint import TOKENS_PER_IMAGE, build_vision_checkpoint, random_image

from sprig.runtime import Engine
from sprig.runtime.request_contract import InvalidRequest

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [
    "<start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>\n<start_of_turn>model\n",
    "Compare <start_of_image> with <start_of_image>: which is brighter?",
    "<start_of_image>",
]
IMAGES = [[1], [2, 3], [4]]  # seeds of each prompt's images


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision"))


@pytest.fixture(scope="module")
def engine(vision: Path):
    with Engine(str(vision), dtype="float32", device="cpu", check_integrity=True) as e:
        yield e


def hf_inputs(path: Path, text: str, seeds: list[int]) -> dict[str, torch.Tensor]:
    """transformers' processor output for `text` with its images."""
    processor = Gemma3Processor(image_processor=AutoImageProcessor.from_pretrained(path),
                                tokenizer=AutoTokenizer.from_pretrained(path), image_seq_length=TOKENS_PER_IMAGE)
    return processor(text=[text], images=[[random_image(s) for s in seeds]], return_tensors="pt")


def test_prompt_ids_equal_transformers_processor(vision: Path, engine: Engine) -> None:
    for text, seeds in zip(PROMPTS, IMAGES, strict=True):
        out = engine.generate(text, {"max_new_tokens": 1}, image_data=[random_image(s) for s in seeds])
        want = hf_inputs(vision, text, seeds)["input_ids"][0].tolist()
        assert out["meta_info"]["prompt_tokens"] == len(want)
        ids, images = engine.images.prompt(text, [random_image(s) for s in seeds], engine.tokenizer.encode,
                                           param="prompt")
        assert ids == want
        assert [(im.offset, im.length) for im in images] == [
            (i, TOKENS_PER_IMAGE) for i, t in enumerate(want) if t == engine.images.spec.token_id
            and (i == 0 or want[i - 1] != t)]


def test_greedy_tokens_and_logprobs_equal_transformers(vision: Path, engine: Engine) -> None:
    hf = Gemma3ForConditionalGeneration.from_pretrained(vision, dtype=torch.float32).eval()
    outs = engine.generate(PROMPTS, GREEDY, image_data=[[random_image(s) for s in seeds] for seeds in IMAGES],
                           return_logprob=True, logprob_start_len=0)
    for text, seeds, out in zip(PROMPTS, IMAGES, outs, strict=True):
        inputs = hf_inputs(vision, text, seeds)
        ids = inputs["input_ids"]
        with torch.no_grad():
            want = hf.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
            full = torch.cat([ids, torch.tensor([out["output_ids"][:-1]])], dim=1)
            types = torch.cat([inputs["token_type_ids"], torch.zeros(1, full.shape[1] - ids.shape[1], dtype=torch.long)], 1)
            logits = hf(input_ids=full, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[0]
        assert out["output_ids"] == want.tolist()
        logprobs = torch.log_softmax(logits.float(), -1)
        got = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]] + [
            lp for lp, *_ in out["meta_info"]["output_token_logprobs"][:-1]]
        want_lp = logprobs[:-1].gather(1, full[0, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), want_lp, atol=1e-4, rtol=0)


def test_images_steer_the_output(engine: Engine) -> None:
    """The image embeddings reach the model: other pixels, other logprobs."""
    text = PROMPTS[0]
    a, b = (engine.generate(text, GREEDY, image_data=random_image(s), return_logprob=True) for s in (1, 5))
    assert [lp for lp, *_ in a["meta_info"]["output_token_logprobs"]] != [
        lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]


def alone(vision: Path, text: str, seeds: list[int], **engine_kwargs) -> list[int]:
    with Engine(str(vision), dtype="float32", device="cpu", disable_radix_cache=True, **engine_kwargs) as e:
        return e.generate(text, GREEDY, image_data=[random_image(s) for s in seeds])["output_ids"]


def test_output_does_not_depend_on_batch_cache_or_chunks(vision: Path) -> None:
    want = [alone(vision, t, s) for t, s in zip(PROMPTS, IMAGES, strict=True)]
    # chunks of 3 tokens: a chunk never cuts an image's 4 tokens (it stops before or runs through)
    for kwargs in ({}, {"chunked_prefill_size": 3}, {"page_size": 4}):
        with Engine(str(vision), dtype="float32", device="cpu", check_integrity=True, **kwargs) as e:
            cold = [o["output_ids"] for o in e.generate(PROMPTS, GREEDY,
                                                        image_data=[[random_image(s) for s in ss] for ss in IMAGES])]
            warm = [e.generate(t, GREEDY, image_data=[random_image(s) for s in ss])["output_ids"]
                    for t, ss in zip(PROMPTS, IMAGES, strict=True)]
            assert cold == want and warm == want, kwargs


def test_other_images_never_share_kv(vision: Path) -> None:
    """A prompt that differs from a cached one only in its image reuses the prefix before
    the image, never the image's tokens, and equals its own cold run."""
    text = PROMPTS[1]
    want = alone(vision, text, [2, 7])
    with Engine(str(vision), dtype="float32", device="cpu", check_integrity=True) as e:
        first = e.generate(text, GREEDY, image_data=[random_image(2), random_image(3)])
        second = e.generate(text, GREEDY, image_data=[random_image(2), random_image(7)])
        _, (_, second_image) = e.images.prompt(text, [random_image(2), random_image(7)], e.tokenizer.encode,
                                                 param="prompt")
    assert second["output_ids"] == want != first["output_ids"]
    assert second["meta_info"]["cached_tokens"] == second_image.offset  # everything before the other image


def test_refusals(vision: Path, engine: Engine) -> None:
    cases = [
        ("Two <start_of_image> <start_of_image>", [random_image(1)], "image_data", "2 image placeholders"),
        ("No placeholder", [random_image(1)], "image_data", "0 image placeholders"),
        ("<start_of_image>", ["not base64!"], "image_data", "image_data[0]"),
    ]
    for text, images, field, words in cases:
        with pytest.raises(InvalidRequest, match=re.escape(words)) as e:
            engine.generate(text, GREEDY, image_data=images)
        assert e.value.field == field
    image_token = engine.images.spec.token_id
    with pytest.raises(InvalidRequest, match="image tokens") as e:
        engine.generate(input_ids=[1, image_token, image_token, image_token, image_token, 5], sampling_params=GREEDY)
    assert e.value.field == "input_ids"
    with pytest.raises(InvalidRequest, match="at most 16"):
        engine.generate("<start_of_image>" * 17, GREEDY, image_data=[random_image(1)] * 17)
    engine.scheduler.check_integrity()


def test_a_text_model_refuses_images(tmp_path: Path) -> None:
    from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "llama")
    with Engine(str(path), dtype="float32", device="cpu") as e, pytest.raises(InvalidRequest, match="takes no images"):
        e.generate("hi <start_of_image>", GREEDY, image_data=[random_image(1)])


def test_a_lora_adapter_of_the_language_model_equals_peft(vision: Path, tmp_path: Path) -> None:
    """A PEFT adapter of the vision-language model's language model (named
    `model.language_model.*`) runs on requests with images as PEFT's model computes them,
    beside requests without it; one that adapts the vision tower is refused by name."""
    from lora_adapters import peft_adapter
    from peft import PeftModel

    adapter = peft_adapter(vision, tmp_path / "lm", seed=1, scale=0.5,
                           targets=r".*language_model.*\.(q_proj|v_proj|o_proj|down_proj)")
    text, seeds = PROMPTS[0], IMAGES[0]
    with Engine(str(vision), dtype="float32", device="cpu", lora_paths={"lm": str(adapter)},
                check_integrity=True) as e:
        outs = e.generate([text, text], GREEDY, image_data=[[random_image(s) for s in seeds]] * 2,
                          lora_path=["lm", None], return_logprob=True)
        e.scheduler.check_integrity()
    tuned, base = outs
    hf = PeftModel.from_pretrained(Gemma3ForConditionalGeneration.from_pretrained(vision, dtype=torch.float32),
                                   str(adapter)).eval()
    inputs = hf_inputs(vision, text, seeds)
    full = torch.cat([inputs["input_ids"], torch.tensor([tuned["output_ids"][:-1]])], dim=1)
    types = torch.cat([inputs["token_type_ids"], torch.zeros(1, full.shape[1] - inputs["input_ids"].shape[1],
                                                             dtype=torch.long)], 1)
    with torch.no_grad():
        logits = hf(input_ids=full, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[0]
    rows = torch.log_softmax(logits[inputs["input_ids"].shape[1] - 1:].float(), -1)
    assert tuned["output_ids"] == rows.argmax(-1).tolist()
    got = torch.tensor([lp for lp, *_ in tuned["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, rows.gather(1, torch.tensor(tuned["output_ids"])[:, None])[:, 0], atol=1e-4, rtol=0)
    assert base["output_ids"] != tuned["output_ids"] or base["meta_info"]["output_token_logprobs"] != \
        tuned["meta_info"]["output_token_logprobs"]

    tower = peft_adapter(vision, tmp_path / "all", seed=2, targets=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="image encoder"):
        Engine(str(vision), dtype="float32", device="cpu", lora_paths={"all": str(tower)})

