"""gpt-oss checkpoints as OpenAI ships them: the experts in MXFP4 (`*_blocks`, `*_scales`,
`quantization_config` naming the float modules), beside a float twin holding exactly the
values those codes stand for, which transformers loads as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from weight_checkpoints import Tensors, edited_copy

from sprig.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
PROJECTIONS = ("gate_up_proj", "down_proj")  # stored [E, in, out]; MXFP4 packs them as [E, out, in]


def mxfp4_pair(src: Path, root: Path) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, its float twin) of the float gpt-oss checkpoint `src`, written
    under `root`: each expert projection rounded to its nearest MXFP4 value."""

    def codes(weights: Tensors) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # projection -> (blocks, scales)
        return {name: quantize_mxfp4(w.transpose(1, 2).float()) for name, w in weights.items()
                if name.endswith(PROJECTIONS)}

    def packed(weights: Tensors) -> Tensors:
        pairs = codes(weights)
        out = {name: w for name, w in weights.items() if name not in pairs}
        for name, (blocks, scales) in pairs.items():
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        return out

    def rounded(weights: Tensors) -> Tensors:
        exact = {name: dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
                 for name, (blocks, scales) in codes(weights).items()}
        return weights | exact

    quantized = edited_copy(src, root / "mxfp4", packed)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(config | {"quantization_config": MXFP4_CONFIG}, indent=2))
    return quantized, edited_copy(src, root / "float", rounded)


def biased_copy(src: Path, dst: Path, *, seed: int, scale: float = 0.5) -> Path:
    """`src` at `dst` with every bias (attention q/k/v/o, router, experts' gate/up and down)
    drawn from N(0, scale^2): transformers initialises most of them to zeros, where a bias
    added in the wrong place or twice would not show."""
    generator = torch.Generator().manual_seed(seed)

    def draw(weights: Tensors) -> Tensors:
        return {name: torch.randn(w.shape, generator=generator, dtype=torch.float32).to(w.dtype) * scale
                if name.endswith("bias") else w for name, w in weights.items()}

    return edited_copy(src, dst, draw)
