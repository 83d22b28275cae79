"""A Gemma 3 multimodal checkpoint (`Gemma3ForConditionalGeneration`, as gemma-3-4b and up
ship) on text: sprig reads the nested, sparse text config as transformers does and loads
the language model's and the image encoder's tensors under either naming; its logits and
greedy tokens equal transformers' multimodal model on text (images:
`test_gemma3_vision.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForImageTextToText,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

from sprig.runtime import Engine
from sprig.runtime.model_config import TEXT_MODELS, ImageSpec, ModelConfig
from sprig.runtime.models import model_class
from sprig.runtime.tiny_checkpoint import build_tokenizer

PROMPTS = [[2, 17, 99, 310, 45, 8, 77, 201, 5, 63, 150, 9, 300, 41], [2, 480, 12]]


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 3 multimodal checkpoint: a sliding window of 4 (shorter than the
    prompts), a linearly scaled RoPE on the full layers, a one-layer vision tower."""
    path = tmp_path_factory.mktemp("gemma3-mm")
    tok = build_tokenizer(path)
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], initializer_range=0.2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=7)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=500, boi_token_index=501, eoi_token_index=502)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # Gemma's norms start at zero (a scale of 1): perturb them so a wrong norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return path


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:  # [len, V]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_the_config_is_the_text_models(multimodal: Path) -> None:
    saved = json.loads((multimodal / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"]
    c = ModelConfig.from_pretrained(multimodal)
    assert model_class(c.architecture).__name__ == "Gemma3ForConditionalGeneration"
    assert c.image == ImageSpec(token_id=500, begin_id=501, end_id=502, tokens_per_image=4, bidirectional=True,
                                vision={})
    assert c.image.vision["image_size"] == 28 and c.image.vision["patch_size"] == 7
    assert model_class(TEXT_MODELS[c.architecture]).__name__ == "Gemma3ForCausalLM"
    assert (c.sliding_window, c.sliding_layers, c.sliding_rope_theta) == (4, (0, 2), 500.0)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0} and c.rope_theta == 10_000.0
    assert c.attention_scale == 24**-0.5 and c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings


def renamed_checkpoint(source: Path, out: Path) -> Path:
    """The same checkpoint with transformers' in-memory names (`model.language_model.*`,
    `model.vision_tower.*`), as some conversions save it."""
    out.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif not name.startswith("language_model."):
            name = "model." + name
        renamed[name] = t
    assert any(n.startswith("model.vision_tower.") for n in renamed)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("naming", ["saved", "in-memory"])
def test_greedy_tokens_and_logprobs_equal_transformers(multimodal: Path, naming: str, tmp_path: Path) -> None:
    path = multimodal if naming == "saved" else renamed_checkpoint(multimodal, tmp_path / "renamed")
    with Engine(str(path), dtype="float32", device="cpu", check_integrity=True) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 6, "temperature": 0.0,
                                                                     "ignore_eos": True},
                               return_logprob=True, logprob_start_len=0)
    hf = AutoModelForImageTextToText.from_pretrained(multimodal, dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, len(ids):]
        assert out["output_ids"] == want.tolist()
        logprobs = torch.log_softmax(hf_logits(multimodal, ids), -1)
        got = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]]
        want_lp = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), want_lp, atol=1e-4, rtol=0)
