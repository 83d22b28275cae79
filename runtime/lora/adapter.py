"""Reading a PEFT LoRA adapter (`adapter_config.json` and `adapter_model.safetensors`, as
`PeftModel.save_pretrained` writes them) for one served model.

A LoRA module adds `scale * B @ A` to a linear layer's weight, `A [r, in]`, `B [out, r]`,
`scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). What sprig cannot
apply exactly is refused, naming the setting: DoRA, trained biases, `modules_to_save`
(whole replaced layers, e.g. a new head), embedding or expert targets, `alpha_pattern`,
`fan_in_fan_out`, `layer_replication`. A per-module rank (`rank_pattern`) is read from
each module's tensors. A module the checkpoint stores fused (Phi-3's `qkv_proj` and
`gate_up_proj`) is read as its shards, each with the module's `A` and its rows of `B`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from sprig.runtime.layers.linear import shard_slice
from sprig.runtime.weight_loader import checkpoint_target

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# adapter_config.json settings sprig refuses when set: (key, its harmless values, why)
_REFUSED: tuple[tuple[str, tuple[object, ...], str], ...] = (
    ("target_parameters", (None, []), "LoRA on a mixture-of-experts block's experts is not implemented"),
    ("use_dora", (None, False), "DoRA's weight decomposition is not implemented"),
    ("bias", (None, "none"), "trained biases are not applied"),
    ("lora_bias", (None, False), "trained biases are not applied"),
    ("modules_to_save", (None, []), "whole replaced layers are not loaded"),
    ("alpha_pattern", (None, {}), "a per-module lora_alpha is not read"),
    ("fan_in_fan_out", (None, False), "transposed (Conv1D) weights do not occur in the supported models"),
    ("layer_replication", (None, []), "replicated layers are not built"),
)

Target = tuple[str, str | None]  # (sprig linear module name, shard of a fused one or None)


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's modules: for each target, `A [r, in]` and `scale * B [out, r]`
    (float32, on the CPU). `rank` is its largest module rank."""

    name: str
    path: str
    rank: int
    modules: dict[Target, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def read_adapter(name: str, path: str | Path, model: nn.Module) -> LoRAAdapter:
    """The adapter at `path` (a directory) for `model`; ValueError naming the file and
    what is wrong: no adapter there, a refused setting, a tensor for a module the model
    does not have, a mis-shaped or unpaired tensor."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not path.is_dir() or not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path}: not a PEFT LoRA adapter (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_file}: peft_type {config['peft_type']!r} is not LORA")
    for key, harmless, why in _REFUSED:
        if config.get(key) not in harmless:
            raise ValueError(f"{config_file}: {key} {config[key]!r} is not supported ({why})")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    pieces: dict[Target, dict[str, torch.Tensor]] = {}
    modules = dict(model.named_modules())  # float or quantized linear layers alike
    with safe_open(str(weights_file), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            module, part = _split(key, weights_file)
            param, shard = checkpoint_target(model, module.removeprefix(PEFT_PREFIX) + ".weight")
            layer = param.removesuffix(".weight")
            encoder = getattr(model, "encoder_prefix", "")
            if encoder and param.startswith(encoder):
                raise ValueError(f"{weights_file}: tensor {key!r} adapts the image encoder ({module!r}); adapters "
                                 "adapt the language model only (train with target_modules that exclude the "
                                 "vision tower)")
            if not param.endswith(".weight") or layer not in modules:
                raise ValueError(f"{weights_file}: tensor {key!r} is for {module!r}, which the model has no "
                                 "linear layer for")
            pieces.setdefault((layer, shard), {})[part] = f.get_tensor(key).float()
    if not pieces:
        raise ValueError(f"{weights_file}: no lora_A/lora_B tensors")
    adapted = {}
    for target, parts in pieces.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise ValueError(f"{weights_file}: {target[0]} ({target[1] or 'whole'}) has only {', '.join(parts)}")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"{weights_file}: {target[0]} ({target[1] or 'whole'}): lora_A {list(a.shape)} and "
                             f"lora_B {list(b.shape)} do not multiply")
        r = a.shape[0]
        b = b * (alpha / math.sqrt(r) if rslora else alpha / r)
        for shard_target, shard_b in _fused_shards(model, modules, target, b, weights_file):
            adapted[shard_target] = (a, shard_b)
    return LoRAAdapter(name, str(path), max(a.shape[0] for a, _ in adapted.values()), adapted)


def _fused_shards(model: nn.Module, modules: dict[str, nn.Module], target: Target, b: torch.Tensor,
                  file: Path) -> list[tuple[Target, torch.Tensor]]:
    """`[(target, b)]`, or for a module whose checkpoint fuses its layer's shards (Phi-3's
    `qkv_proj`, `gate_up_proj`: `split_checkpoint_modules`) each shard with its rows of
    `b`: `B @ A` restricted to a shard's rows is that shard's delta, with the same `A`."""
    layer, shard = target
    if shard is not None or layer.rpartition(".")[2] not in getattr(model, "split_checkpoint_modules", ()):
        return [(target, b)]
    owner = modules[layer]
    sizes = getattr(owner, "full_sizes", None) or owner.out_sizes  # every tensor-parallel rank's rows
    if b.shape[0] != sum(sizes.values()):
        raise ValueError(f"{file}: {layer}: lora_B has {b.shape[0]} rows, the fused layer stacks {dict(sizes)}")
    return [((layer, s), b[shard_slice(sizes, s)]) for s in sizes]


def _split(key: str, file: Path) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (`base_model.model.<module>`, "lora_A")."""
    module, _, rest = key.rpartition(".lora_")
    if rest not in ("A.weight", "B.weight"):
        what = "an embedding's LoRA" if "lora_embedding" in key else "not a lora_A or lora_B weight"
        raise ValueError(f"{file}: tensor {key!r} is {what} (not supported)")
    return module, "lora_" + rest[0]
