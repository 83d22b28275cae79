"""Gemma 3's image encoder (SigLIP vision tower + multimodal projector) loads every tensor
of a `Gemma3ForConditionalGeneration` checkpoint's `vision_tower.*` and
`multi_modal_projector.*`, under each naming, and its image embeddings are bitwise equal to
transformers' `get_image_features` on CPU, in float32 and bfloat16; its config reads a
sparse `vision_config` as `SiglipVisionConfig` does and refuses what it does not compute."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

from sprig.runtime.models.gemma3_vision import (
    Gemma3ImageEncoder,
    encoder_param_name,
    pool_window,
    tokens_per_image,
)
from sprig.runtime.models.siglip import VisionConfig

TEXT_HIDDEN = 64
# google/gemma-3-4b-it's config.json `vision_config`, as saved (non-default values only)
HUB_VISION = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
              "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}
# VisionConfig field -> SiglipVisionConfig attribute
HF_ATTRS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
            "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "image_size": "image_size",
            "patch_size": "patch_size", "num_channels": "num_channels", "layer_norm_eps": "layer_norm_eps",
            "hidden_act": "hidden_act", "use_head": "vision_use_head"}


@dataclass(frozen=True)
class Spec:
    """A tiny checkpoint's vision tower and image token count."""

    vision: dict[str, Any]
    tokens: int


SPECS = {
    # the tower of tests/runtime/test_gemma3_multimodal.py, without the pooling head (as Gemma 3 ships)
    "small": Spec(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       image_size=28, patch_size=7, vision_use_head=False), tokens=4),
    # a 12 x 12 patch grid pooled by 3, exact GELU, a large eps (a wrong eps shows), the default pooling head
    "deep": Spec(dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                      image_size=48, patch_size=4, layer_norm_eps=1e-2, hidden_act="gelu"), tokens=16),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 3 multimodal checkpoint saved by transformers, every vision and
    projector tensor random (Gemma's norms and the projection would start at 0 or 1)."""
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(f"gemma3-vision-{request.param}")
    text = Gemma3TextConfig(vocab_size=256, hidden_size=TEXT_HIDDEN, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = Gemma3Config(text_config=text, vision_config=SiglipVisionConfig(**spec.vision),
                          mm_tokens_per_image=spec.tokens, image_token_index=250, boi_token_index=251,
                          eoi_token_index=252)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.language_model."):
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(path))
    return path


def config_json(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def load_encoder(path: Path, dtype: torch.dtype, file: str = "model.safetensors") -> Gemma3ImageEncoder:
    """The encoder config.json describes, loaded strictly from the checkpoint's tensors."""
    encoder = Gemma3ImageEncoder.from_hf(config_json(path), TEXT_HIDDEN)
    state = {encoder_param_name(n): t for n, t in load_file(str(path / file)).items() if encoder_param_name(n)}
    encoder.load_state_dict(state, strict=True)
    return encoder.to(dtype).eval()


def hf_features(path: Path, pixel_values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' projected image features: [N, tokens_per_image, text hidden]."""
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return hf.model.get_image_features(pixel_values.to(dtype)).pooler_output


def pixels(path: Path, n: int) -> torch.Tensor:  # [n, 3, S, S]
    size = config_json(path)["vision_config"]["image_size"]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(n))


def test_vision_config_reads_the_saved_config_as_transformers(checkpoint: Path) -> None:
    saved = config_json(checkpoint)["vision_config"]
    ours, theirs = VisionConfig.from_hf(saved), SiglipVisionConfig(**saved)
    assert {f: getattr(ours, f) for f in HF_ATTRS} == {f: getattr(theirs, a) for f, a in HF_ATTRS.items()}
    defaults = SiglipVisionConfig()
    sparse = {k: v for k, v in saved.items() if k == "model_type" or v != getattr(defaults, k, None)}
    assert len(sparse) < len(saved) and VisionConfig.from_hf(sparse) == ours


@pytest.mark.parametrize("vision", [HUB_VISION, {}, {"model_type": "siglip_vision_model", "num_channels": 1}])
def test_a_sparse_vision_config_takes_transformers_defaults(vision: dict[str, Any]) -> None:
    ours, theirs = VisionConfig.from_hf(vision), SiglipVisionConfig(**vision)
    assert {f: getattr(ours, f) for f in HF_ATTRS} == {f: getattr(theirs, a) for f, a in HF_ATTRS.items()}


def test_tokens_per_image() -> None:
    hub = {"vision_config": HUB_VISION, "mm_tokens_per_image": 256}
    assert tokens_per_image(hub) == 256 and pool_window(VisionConfig.from_hf(HUB_VISION), 256) == 4  # 64 / 16
    assert tokens_per_image({"vision_config": HUB_VISION}) == 256  # the default
    for spec in SPECS.values():
        assert tokens_per_image({"vision_config": spec.vision, "mm_tokens_per_image": spec.tokens}) == spec.tokens


@pytest.mark.parametrize(("vision", "key"), [
    ({"hidden_act": "gelu_new"}, "hidden_act"),
    ({"hidden_act": "quick_gelu"}, "hidden_act"),
    ({"image_size": [224, 224]}, "image_size"),
    ({"patch_size": 300}, "patch_size"),
    ({"num_attention_heads": 5}, "num_attention_heads"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
    ({"vision_use_head": "no"}, "vision_use_head"),
    ({"model_type": "clip_vision_model"}, "model_type"),
])
def test_vision_config_refusals_name_the_key(vision: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        VisionConfig.from_hf(vision)


# the Hub's 64 x 64 patch grid in a narrow one-layer tower (the grid alone decides the pooling)
NARROW_HUB_VISION = {**HUB_VISION, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2}


@pytest.mark.parametrize("tokens", [0, 8, 9, 64 * 64 * 4])
def test_tokens_that_do_not_pool_evenly_are_refused(tokens: int) -> None:
    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        tokens_per_image({"vision_config": HUB_VISION, "mm_tokens_per_image": tokens})  # a 64 x 64 grid
    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        Gemma3ImageEncoder(VisionConfig.from_hf(NARROW_HUB_VISION), TEXT_HIDDEN, tokens, 1e-6)


def test_transformers_default_config_is_refused() -> None:
    """`Gemma3Config()`'s own defaults clash: 256 tokens from a 14 x 14 grid (224 // 16)."""
    with pytest.raises(ValueError, match="mm_tokens_per_image 256"):
        tokens_per_image({})


def test_every_vision_tensor_loads_and_the_pooling_head_only_when_saved(checkpoint: Path) -> None:
    names = load_file(str(checkpoint / "model.safetensors")).keys()
    vision = [n for n in names if not n.startswith("language_model.")]
    used = {encoder_param_name(n) for n in vision} - {None}
    assert used == set(load_encoder(checkpoint, torch.float32).state_dict())
    heads = sorted(n for n in vision if encoder_param_name(n) is None)
    assert bool(heads) == config_json(checkpoint)["vision_config"].get("vision_use_head", True)
    assert all(n.startswith("vision_tower.head.") for n in heads)
    assert {encoder_param_name(n) for n in names if n.startswith("language_model.")} == {None}


def hub_named(source: Path, out: Path) -> Path:
    """The checkpoint with the Hub's names (transformers 4: `vision_tower.vision_model.*`)."""
    out.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in tensors.items()}
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_names_mirror_the_hub_checkpoints(checkpoint: Path, tmp_path: Path) -> None:
    """The encoder's names are the Hub's, which transformers 5 still loads; `model.`-prefixed
    names map as the bare ones."""
    hub = hub_named(checkpoint, tmp_path / "hub")
    names = load_file(str(hub / "model.safetensors")).keys()
    encoder = load_encoder(hub, torch.float32)
    heads = {n for n in names if n.startswith("vision_tower.vision_model.head.")}
    assert {n for n in names if not n.startswith("language_model.")} - heads == set(encoder.state_dict())
    assert {encoder_param_name(n) for n in names} - {None} == set(encoder.state_dict())
    assert all(encoder_param_name("model." + n) == encoder_param_name(n) for n in names)
    px = pixels(checkpoint, 2)
    with torch.no_grad():
        got = encoder(px)
    assert torch.equal(got, hf_features(hub, px, torch.float32))
    assert torch.equal(got, hf_features(checkpoint, px, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_image_embeddings_equal_transformers_bitwise(checkpoint: Path, dtype: torch.dtype) -> None:
    encoder = load_encoder(checkpoint, dtype)
    px = pixels(checkpoint, 3)
    with torch.no_grad():
        got = encoder(px)
    want = hf_features(checkpoint, px, dtype)
    tokens = config_json(checkpoint)["mm_tokens_per_image"]
    assert got.shape == (3, tokens, TEXT_HIDDEN) and got.dtype == dtype
    assert want.abs().amax() > 1.0  # not a degenerate (all-zero) embedding
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_batch_equals_each_image_alone(checkpoint: Path, dtype: torch.dtype) -> None:
    encoder = load_encoder(checkpoint, dtype)
    px = pixels(checkpoint, 4)
    with torch.no_grad():
        batch = encoder(px)
        alone = torch.cat([encoder(px[i:i + 1]) for i in range(len(px))])
    assert not torch.equal(batch[0], batch[1])
    assert torch.equal(batch, alone)


def test_image_shapes(checkpoint: Path) -> None:
    """No images make no embeddings; an image of another size or channel count is refused."""
    encoder = load_encoder(checkpoint, torch.float32)
    size = config_json(checkpoint)["vision_config"]["image_size"]
    with torch.no_grad():
        assert encoder(torch.zeros(0, 3, size, size)).shape == (0, config_json(checkpoint)["mm_tokens_per_image"],
                                                                  TEXT_HIDDEN)
    for shape in [(1, 3, size + 1, size), (1, 1, size, size), (3, size, size)]:
        with pytest.raises(ValueError, match="pixel_values"):
            encoder(torch.zeros(shape))
