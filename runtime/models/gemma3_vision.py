"""Gemma 3's image encoder: pixels -> the text model's embeddings of one image's tokens.

The SigLIP vision tower (`sprig.runtime.models.siglip`) gives one state per patch; the
multimodal projector average-pools the patch grid down to sqrt(tokens_per_image) tokens per
side, applies Gemma's RMSNorm (scale 1 + weight) and projects to the text model's width.
Every op is transformers' (`Gemma3Model.get_image_features`, its `pooler_output`) in the
same order, dtype and layout: on CPU the outputs are bitwise equal to it in float32 and
bfloat16 (tested). On CUDA the projector's norm runs sprig's Triton RMSNorm kernel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sprig.runtime.layers.norm import RMSNorm
from sprig.runtime.models.siglip import SiglipVisionTower, VisionConfig

# config.json's `mm_tokens_per_image` when absent (`Gemma3Config`'s default)
DEFAULT_TOKENS_PER_IMAGE = 256


def pool_window(vision: VisionConfig, tokens_per_image: int) -> int:
    """The side (and stride) of the average-pool window that turns the tower's
    patches_per_side x patches_per_side grid into sqrt(tokens_per_image) tokens per side.
    ValueError unless tokens_per_image is a positive square whose root divides
    patches_per_side (the grid pools evenly, leaving no patch out)."""
    side = math.isqrt(tokens_per_image) if isinstance(tokens_per_image, int) and tokens_per_image > 0 else 0
    if side < 1 or side * side != tokens_per_image or vision.patches_per_side % side:
        raise ValueError(
            f"mm_tokens_per_image {tokens_per_image!r} is not a square whose root divides the patch grid's side "
            f"(image_size {vision.image_size} // patch_size {vision.patch_size} = {vision.patches_per_side})"
        )
    return vision.patches_per_side // side


def tokens_per_image(config: Mapping[str, Any]) -> int:
    """How many tokens each image becomes, from a Gemma 3 checkpoint's config.json dict
    (`mm_tokens_per_image`, default 256); ValueError if its vision tower's patch grid does
    not pool evenly to that (`pool_window`) or the vision config is refused."""
    tokens = config.get("mm_tokens_per_image", DEFAULT_TOKENS_PER_IMAGE)
    pool_window(VisionConfig.from_hf(config.get("vision_config") or {}), tokens)
    return tokens


def encoder_param_name(name: str) -> str | None:
    """The `Gemma3ImageEncoder` parameter a Gemma 3 checkpoint tensor loads into, under any
    of its namings: `vision_tower.vision_model.*` (transformers 4, the Hub's checkpoints),
    `vision_tower.*` (transformers 5 drops the `vision_model.` level), either with a
    `model.` prefix, and `[model.]multi_modal_projector.*`. None for a tensor outside the
    encoder (the language model's) and for SigLIP's pooling head (`vision_model.head.*`,
    present when `vision_use_head`), which Gemma 3 never uses."""
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        name = name.removeprefix("model.")
    if name.startswith("multi_modal_projector."):
        return name
    if not name.startswith("vision_tower."):
        return None
    inner = name.removeprefix("vision_tower.")
    inner = inner if inner.startswith("vision_model.") else "vision_model." + inner
    return None if inner.startswith("vision_model.head.") else "vision_tower." + inner


class Gemma3MultiModalProjector(nn.Module):
    """Vision states -> text embeddings: average-pool the patch grid by `window` (stride =
    window), Gemma's RMSNorm (`mm_soft_emb_norm`, computed in float32, scaled by 1 + weight,
    rounded once), then x @ `mm_input_projection_weight` ([vision_hidden, text_hidden], stored
    as the checkpoint stores it: no transpose)."""

    def __init__(
        self, vision_hidden_size: int, text_hidden_size: int, patches_per_side: int, window: int, eps: float
    ) -> None:
        super().__init__()
        self.patches_per_side, self.window = patches_per_side, window
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden_size, text_hidden_size))
        self.mm_soft_emb_norm = RMSNorm(vision_hidden_size, eps, unit_offset=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, patches_per_side ** 2, vision_hidden], row-major over the grid ->
        [N, (patches_per_side / window) ** 2, text_hidden], tokens row-major."""
        n, _, d = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(n, d, side, side).contiguous()  # [N, Dv, side, side]
        pooled = F.avg_pool2d(grid, self.window)  # [N, Dv, side / window, side / window]
        tokens = pooled.flatten(2).transpose(1, 2)  # [N, tokens, Dv]
        return torch.matmul(self.mm_soft_emb_norm(tokens), self.mm_input_projection_weight)


class Gemma3ImageEncoder(nn.Module):
    """Gemma 3's vision tower and multimodal projector, named as a checkpoint's
    `vision_tower.*` and `multi_modal_projector.*` (see `encoder_param_name`).

    Invariants: sqrt(tokens_per_image) divides vision.image_size // vision.patch_size
    (`pool_window`); the forward keeps no state, so a batch's images do not see each other.
    `rms_norm_eps` is the projector norm's eps, which transformers takes from the vision
    config's `layer_norm_eps` (not the text model's `rms_norm_eps`); `from_hf` passes it.
    """

    def __init__(self, vision: VisionConfig, text_hidden_size: int, tokens_per_image: int, rms_norm_eps: float) -> None:
        super().__init__()
        if isinstance(text_hidden_size, bool) or not isinstance(text_hidden_size, int) or text_hidden_size < 1:
            raise ValueError(f"text_hidden_size must be a positive int, got {text_hidden_size!r}")
        self.tokens_per_image = tokens_per_image
        self.vision_tower = SiglipVisionTower(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision.hidden_size, text_hidden_size, vision.patches_per_side, pool_window(vision, tokens_per_image),
            rms_norm_eps,
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], text_hidden_size: int) -> Gemma3ImageEncoder:
        """The encoder a Gemma 3 checkpoint's config.json dict describes (its `vision_config`
        and `mm_tokens_per_image`, defaults as transformers fills them), for a text model of
        width `text_hidden_size`; the projector norm's eps is the vision config's."""
        vision = VisionConfig.from_hf(config.get("vision_config") or {})
        return cls(vision, text_hidden_size, tokens_per_image(config), vision.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, num_channels, image_size, image_size] -> [N, tokens_per_image,
        text_hidden_size] in the weights' dtype, on their device: row i holds image i's
        token embeddings in the order its image tokens take in the prompt."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))
