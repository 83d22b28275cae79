"""SigLIP's vision tower (the image encoder of Gemma 3, PaliGemma and others) without its
pooling head: pixels -> one hidden state per patch.

The image is cut into non-overlapping `patch_size` squares (a convolution of that stride),
each embedded and given its learned position; pre-LayerNorm encoder layers (bidirectional
multi-head self-attention, then a GELU MLP, each added to the residual stream) and a final
LayerNorm follow. Every op is the one transformers' `SiglipVisionModel` runs under its
default (SDPA) attention, in the same order, dtype and memory layout, so the outputs equal
its `last_hidden_state` bitwise (tested on CPU, float32 and bfloat16).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# config.json's `hidden_act` values the MLP computes -> `F.gelu`'s `approximate` (transformers'
# `ACT2FN` runs exactly `F.gelu` for these two)
GELU_APPROXIMATIONS = (("gelu_pytorch_tanh", "tanh"), ("gelu", "none"))
MODEL_TYPE = "siglip_vision_model"
# VisionConfig field -> its key in config.json's `vision_config`: the sizes, then the rest
_SIZE_KEYS = (
    ("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"), ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"), ("image_size", "image_size"), ("patch_size", "patch_size"),
    ("num_channels", "num_channels"),
)
_HF_KEYS = (*_SIZE_KEYS, ("layer_norm_eps", "layer_norm_eps"), ("hidden_act", "hidden_act"),
            ("use_head", "vision_use_head"))


@dataclass(frozen=True)
class VisionConfig:
    """A SigLIP vision tower's geometry; the defaults are `SiglipVisionConfig()`'s.

    Invariants: every size is a positive int; `num_heads` divides `hidden_size`;
    `patch_size <= image_size` (pixels past the last whole patch are ignored, as the
    convolution does); `hidden_act` is one of `GELU_APPROXIMATIONS`. `use_head` says whether
    the checkpoint also holds SigLIP's attention-pooling head (`head.*`), which this tower
    does not build: Gemma 3 reads the per-patch states, never the pooled one.
    """

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    use_head: bool = True

    def __post_init__(self) -> None:
        for name, key in _SIZE_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"vision_config {key} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config num_attention_heads {self.num_heads} does not divide "
                             f"hidden_size {self.hidden_size}")
        if self.patch_size > self.image_size:
            raise ValueError(f"vision_config patch_size {self.patch_size} exceeds image_size {self.image_size}")
        if self.hidden_act not in dict(GELU_APPROXIMATIONS):
            raise ValueError(f"vision_config hidden_act {self.hidden_act!r} is not one of "
                             f"{[act for act, _ in GELU_APPROXIMATIONS]}")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"vision_config layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}")
        if not isinstance(self.use_head, bool):
            raise ValueError(f"vision_config vision_use_head must be a bool, got {self.use_head!r}")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> VisionConfig:
        """Read config.json's `vision_config` as `SiglipVisionConfig` does: an absent key
        takes its default (checkpoints may save only the non-default values); keys the
        tower has no use for (`attention_dropout`, `architectures`, ...) are ignored.
        ValueError, naming the key, for another `model_type` or a value the tower does not
        compute."""
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"vision_config model_type {model_type!r} is not {MODEL_TYPE!r}")
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(**{name: d.get(key, defaults[name]) for name, key in _HF_KEYS})

    @property
    def patches_per_side(self) -> int:
        """Whole patches along each side of the (square) image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Patches per image: the tower's output length."""
        return self.patches_per_side**2

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def gelu_approximation(self) -> str:
        """`F.gelu`'s `approximate` argument for `hidden_act`."""
        return dict(GELU_APPROXIMATIONS)[self.hidden_act]


class SiglipEmbeddings(nn.Module):
    """Patch embedding (a convolution whose stride is its kernel, the patch size) plus a
    learned embedding per patch position, row-major over the patch grid."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, D]
        patches = self.patch_embedding(pixel_values)  # [N, D, S / patch, S / patch]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention over one image's patches; softmax scale
    head_dim ** -0.5; every projection has a bias."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, D)
        self.v_proj = nn.Linear(D, D)
        self.out_proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D] -> [N, P, D]
        n, p, _ = x.shape
        heads = (n, p, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(heads).transpose(1, 2)  # [N, heads, P, head_dim]
        k = self.k_proj(x).view(heads).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # [N, heads, P, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(n, p, self.num_heads * self.head_dim))


class SiglipMLP(nn.Module):
    """fc1, GELU (tanh-approximated for `gelu_pytorch_tanh`, exact for `gelu`), fc2."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.approximate = config.gelu_approximation
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D] -> [N, P, D]
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    """Pre-LayerNorm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D] -> [N, P, D]
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    """The encoder layers, in order."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, D] -> [N, P, D]
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionTransformer(nn.Module):
    """Embeddings, encoder, `post_layernorm`: named as a checkpoint's `vision_model.*`."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, D]
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class SiglipVisionTower(nn.Module):
    """SigLIP's vision tower without its pooling head.

    Parameter names equal a checkpoint's under its tower prefix as transformers 4 saved
    them (Gemma 3 on the Hub: `vision_tower.vision_model.embeddings.patch_embedding.weight`,
    `...encoder.layers.{i}.self_attn.q_proj.weight`, `...post_layernorm.bias`); transformers 5
    saves the same tensors without the `vision_model.` level. Stateless between calls:
    images never see each other, so a batch's outputs are each image's alone (up to the
    matmul kernels' reduction order for a different batch size).
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = SiglipVisionTransformer(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, num_channels, image_size, image_size] (any float dtype, cast to
        the weights' dtype and device) -> [N, num_patches, hidden_size] in the weights' dtype;
        patches row-major over the grid. ValueError for another image shape."""
        c = self.config
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c.num_channels, c.image_size, c.image_size):
            raise ValueError(f"pixel_values must be [N, {c.num_channels}, {c.image_size}, {c.image_size}], "
                             f"got {list(pixel_values.shape)}")
        weight = self.vision_model.embeddings.patch_embedding.weight
        return self.vision_model(pixel_values.to(device=weight.device, dtype=weight.dtype))
