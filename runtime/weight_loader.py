"""Build a model without initialising it, then fill every parameter from the checkpoint's
safetensors files (one file, or all the shards an index names).

Checked before anything loads: every parameter (every shard of a fused one) and every
tensor a quantized layer's format requires is in the checkpoint exactly once, and every
checkpoint tensor lands somewhere; a missing, unexpected or duplicated tensor, and then a
mis-shaped one, is a ValueError naming the file and the tensor. So no uninitialised
memory survives loading.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.distributed.quantized import install_split_quantized
from sprig.runtime.distributed.shard import build_sharded
from sprig.runtime.layers.linear import MergedLinear, shard_slice
from sprig.runtime.layers.moe import FusedExperts
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models import model_class
from sprig.runtime.quantization.formats import WeightFormat
from sprig.runtime.quantization.install import install_quantized_linears
from sprig.runtime.quantization.linear import QuantizedLinear

log = logging.getLogger("sprig.weights")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints saved
INDEX_FILE = "model.safetensors.index.json"

# (sprig parameter name, or a quantized layer's name + "." + checkpoint leaf; shard or None)
Target = tuple[str, str | None]
# (file, checkpoint tensor name, target, the tensor's rows that target takes: None for all)
Entry = tuple[Path, str, Target, slice | None]


def load_model(
    config: ModelConfig,
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: WeightFormat | None = None,
    tp: TPGroup | None = None,
) -> nn.Module:
    """The registered model for `config`, in `dtype` on `device`, weights from `path`.

    Parameters are allocated uninitialised (built on the meta device, then `to_empty`);
    modules with derived buffers recompute them through `reset_buffers()`. Linear layers
    are quantized as the checkpoint's `quantization_config` says, or, for a float
    checkpoint, with the online format `quantization`. With a tensor-parallel group `tp`
    the model holds rank `tp.rank`'s part (`sprig.runtime.distributed.shard`): only that
    part of each float tensor is read (a quantized layer's tensors are read whole,
    converted, then cut: `sprig.runtime.distributed.quantized`). A mixture-of-experts
    model is float only: a quantized checkpoint or format is a ValueError.
    """
    fmt = config.quantization
    if quantization is not None:
        if fmt is not None:
            raise ValueError(
                f"{Path(path)}: the checkpoint is already quantized ({fmt.name}); online "
                f"quantization ({quantization.name}) applies to float checkpoints"
            )
        fmt = quantization
    if fmt is not None and config.moe is not None:
        raise ValueError(
            f"{Path(path)}: {fmt.name} weights are not supported for mixture-of-experts models "
            f"({config.architecture}): serve the float checkpoint (an int8 KV cache, --kv-cache-dtype int8, works)"
        )
    with torch.device("meta"):
        model = model_class(config.architecture)(config) if tp is None else build_sharded(config, tp)
        if fmt is not None:
            if tp is not None:
                install_split_quantized(model, fmt)
            install_quantized_linears(model, fmt)
    integer = any(isinstance(m, QuantizedLinear) and not m.scheme.float8 for m in model.modules())
    if integer and device.type == "cpu" and dtype == torch.float32:
        log.warning(
            "quantized (%s) linear layers with float32 activations: torch's CPU int8/int4 kernels "
            "take a scalar path for float32 (exact, but slower than float weights); --dtype bfloat16 "
            "runs their vectorised path", fmt.name,
        )
    model.to(dtype=dtype).to_empty(device=device).requires_grad_(False)
    load_weights(model, path, dtype=dtype, device=device)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    return model.eval()


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files to read: those an index names, else every `*.safetensors`."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index}: names shard {f.name}, which does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (other weight formats are not supported)")
    return files


def parameter_count(path: str | Path) -> int:
    """How many weights the checkpoint at `path` holds (read from the files' headers)."""
    total = 0
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def load_weights(model: nn.Module, path: str | Path, *, dtype: torch.dtype, device: torch.device) -> None:
    """Copy every checkpoint tensor into its (slice of a) parameter of `model`, or hand it
    to its quantized layer, which is finalized (built in `dtype` on `device`) as soon as
    its last tensor is in, so only one layer's staged pieces are held at a time. Loading
    again into a loaded model replaces its weights in place (a quantized layer's are
    rebuilt); pieces a failed load left staged are dropped first."""
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for layer in quantized.values():
        layer.discard_staged()
    plan = _plan(model, path, _Names.of(model), quantized)
    pending = Counter(t[0].rpartition(".")[0] for _, _, t, _ in plan)
    params = dict(model.named_parameters())
    fused: tuple[str, dict[str, torch.Tensor]] | None = None  # the last fused tensor converted, by name
    for file, entries in itertools.groupby(plan, key=lambda entry: entry[0]):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for _, name, target, rows in entries:
                owner, _, leaf = target[0].rpartition(".")
                layer = quantized.get(owner)
                if layer is None:
                    _copy(model, params, target, file, name, handle, rows)
                    continue
                try:
                    if rows is None:
                        layer.load(leaf, target[1], handle.get_tensor(name))
                    elif leaf in ("weight", "bias"):
                        layer.load(leaf, target[1], handle.get_slice(name)[rows])
                    else:  # one of a fused tensor's shards: its pieces are converted once, for all shards
                        if fused is None or fused[0] != name:
                            fused = name, _fused_pieces(layer, leaf, handle.get_tensor(name))
                        pieces = {k: v if k == "g_idx" else v[rows] for k, v in fused[1].items()}
                        layer.stage_shard(pieces, target[1])
                except ValueError as e:
                    raise ValueError(f"{file}: tensor {name!r}: {e}") from None
                pending[owner] -= 1
                if pending[owner] == 0:
                    layer.finalize(dtype, device)


def load_named_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each `(checkpoint name, tensor)` into its (slice of a) float parameter of
    `model`, converting its dtype and device; returns how many were copied. All are
    checked before any is copied: a name that is no parameter of the model, one given
    twice, a tensor of another shape, or a quantized layer's weight (its codes would have
    to be computed again: load a checkpoint instead) is a ValueError naming it, and then
    nothing has changed. A tied head's `lm_head.weight` is skipped, as in a checkpoint."""
    names = _Names.of(model)
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    params = dict(model.named_parameters())
    copies: dict[Target, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, tensor in tensors:
        canonical = names.canonical(name)
        if canonical is None:
            continue
        target = _target(canonical, names)
        if target[0].rpartition(".")[0] in quantized:
            raise ValueError(f"{name!r} belongs to a quantized layer, whose codes a tensor cannot replace "
                             "(update from a checkpoint on disk)")
        if target[0] not in params:
            raise ValueError(f"{name!r} is no parameter of the model")
        if target in copies:
            raise ValueError(f"{name!r} is given twice")
        dest = _destination(model, params, target)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{name!r} has shape {list(tensor.shape)}, the model expects {list(dest.shape)}")
        copies[target] = (dest, tensor)
    with torch.no_grad():
        for dest, tensor in copies.values():
            dest.copy_(tensor)
    return len(copies)


def checkpoint_target(model: nn.Module, hf_name: str) -> tuple[str, str | None]:
    """The parameter of `model` a checkpoint tensor named `hf_name` loads into, and its
    shard (None for a whole parameter), e.g. `model.layers.0.self_attn.k_proj.weight` ->
    (`model.layers.0.self_attn.qkv_proj.weight`, "k"), under any naming the model's
    checkpoints use (a multimodal checkpoint's `model.language_model.*` is `model.*`);
    the parameter may not exist."""
    names = _Names.of(model)
    return _target(names.canonical(hf_name) or hf_name, names)


def named_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The float weight a checkpoint names `name` (a view into its parameter, the slice of
    a fused one); ValueError if the model has none by that name, or only quantized codes."""
    if model.config.tie_word_embeddings and name == "lm_head.weight":
        name = "model.embed_tokens.weight"
    target = _target(name, _Names.of(model))
    if isinstance(dict(model.named_modules()).get(target[0].rpartition(".")[0]), QuantizedLinear):
        raise ValueError(f"{name!r} is a quantized layer's weight (codes and scales, no float tensor)")
    params = dict(model.named_parameters())
    if target[0] not in params:
        raise ValueError(f"{name!r} is no parameter of the model")
    return _destination(model, params, target)


def _plan(
    model: nn.Module,
    path: str | Path,
    names: _Names,
    quantized: dict[str, QuantizedLinear],
) -> list[Entry]:
    """Every checkpoint tensor (or, for one a fused layer takes in several shards, each
    shard's rows of it) to load, in file order; a ValueError names an unexpected,
    duplicated or missing tensor before anything loads."""
    required, accepted = _expected_targets(model, quantized)
    loaded: dict[Target, Path] = {}  # -> the file it is in
    plan = []
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                canonical = names.canonical(name)
                if canonical is None:
                    continue
                try:
                    pieces = _pieces(model, _target(canonical, names), names, handle.get_slice(name).get_shape())
                except ValueError as e:
                    raise ValueError(f"{file}: tensor {name!r}: {e}") from None
                for target, rows in pieces:
                    if target not in accepted:
                        raise ValueError(f"{file}: unexpected tensor {name!r} (no such parameter in the model)")
                    if target in loaded:
                        raise ValueError(f"{file}: tensor {name!r} also in {loaded[target]}")
                    loaded[target] = file
                    plan.append((file, name, target, rows))
    missing = sorted(required - loaded.keys(), key=str)
    if missing:
        listed = ", ".join(_hf_name(t, names) for t in missing)
        raise ValueError(f"{Path(path)}: checkpoint is missing tensor(s) {listed}")
    return plan


def _pieces(model: nn.Module, target: Target, names: _Names, shape: list[int]) -> list[tuple[Target, slice | None]]:
    """What a checkpoint tensor of `shape` loads into: `target` whole, or, for a weight or
    bias of a module in `names.split`, each shard of its fused layer with the tensor's
    rows that hold it (the shards stacked in the layer's order). A quantized layer's other
    leaves (a quantized checkpoint's codes, scales, zero points) are converted whole, and
    the rows are those of the canonical pieces (`_fused_pieces`). A tensor-parallel rank's
    layer names the whole layer's shards (`full_sizes`): the rows are every rank's, of
    which the layer keeps its own, as from an unfused checkpoint's q/k/v or gate/up
    tensor. ValueError if a float tensor's rows are not the layer's, or it holds codes for
    a layer that is not quantized."""
    name, shard = target
    owner_name, _, leaf = name.rpartition(".")
    if shard is not None or owner_name.rpartition(".")[2] not in names.split:
        return [(target, None)]
    try:
        owner = model.get_submodule(owner_name)
        sizes = getattr(owner, "full_sizes", None) or owner.out_sizes
    except AttributeError:
        return [(target, None)]  # no such fused layer: an unexpected tensor
    if leaf not in ("weight", "bias"):
        if not isinstance(owner, QuantizedLinear):
            raise ValueError(f"a fused checkpoint tensor's {leaf!r} cannot be cut into its shards "
                             "(the layer is not quantized)")
        return [((name, s), shard_slice(sizes, s)) for s in sizes]  # rows of its converted pieces
    if shape[0] != sum(sizes.values()):
        raise ValueError(f"has {shape[0]} rows, the fused layer stacks {dict(sizes)}")
    return [((name, s), shard_slice(sizes, s)) for s in sizes]


def _fused_pieces(layer: QuantizedLinear, leaf: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The canonical pieces of checkpoint tensor `leaf` of a fused layer, which holds every
    shard's rows (of every tensor-parallel rank: `full_sizes`) in the layer's order, as
    one layer's: the format's conversion is per output row, so shard s's pieces are rows
    `shard_slice(sizes, s)` of them (a g_idx, per input, is every shard's)."""
    sizes = getattr(layer, "full_sizes", None) or layer.out_sizes
    return layer.fmt.convert(leaf, tensor, layer.scheme, sum(sizes.values()), layer.in_features)


def _copy(
    model: nn.Module, params: dict[str, nn.Parameter], target: Target, file: Path, name: str, handle: Any,
    rows: slice | None,
) -> None:
    dest = _destination(model, params, target)
    owner, _, leaf = target[0].rpartition(".")
    index = getattr(model.get_submodule(owner), "checkpoint_index", None)  # a tensor-parallel rank's part
    source = handle.get_slice(name)
    if index is None:
        tensor = None if rows is None else source[rows]
    else:
        part = index(leaf, target[1])
        tensor = source[part if rows is None else _within(rows, part)]
    shape = tuple(source.get_shape() if tensor is None else tensor.shape)
    if shape != tuple(dest.shape):
        raise ValueError(
            f"{file}: tensor {name!r} has shape {list(shape)}, the model expects {list(dest.shape)}"
        )
    with torch.no_grad():
        dest.copy_(handle.get_tensor(name) if tensor is None else tensor)


def _within(rows: slice, index: tuple[slice, ...]) -> tuple[slice, ...]:
    """`index` into the tensor `source[rows]` as an index into `source` (only the rows
    read are those both select)."""
    first = index[0]
    start = rows.start + (first.start or 0)
    stop = rows.stop if first.stop is None else rows.start + first.stop
    return (slice(start, stop), *index[1:])


def _expected_targets(
    model: nn.Module, quantized: dict[str, QuantizedLinear]
) -> tuple[set[Target], set[Target]]:
    """(required, accepted) targets: every shard of every parameter and every quantized
    layer's required tensors; accepted adds the quantized layers' optional ones."""
    required: set[Target] = set()
    for name, _ in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if isinstance(owner, MergedLinear):
            required.update((name, shard) for shard in owner.out_sizes)
        elif isinstance(owner, FusedExperts):
            required.update((name, shard) for shard in owner.checkpoint_shards(leaf))
        else:
            required.add((name, None))
    optional: set[Target] = set()
    for name, layer in quantized.items():
        for shard in layer.out_sizes:
            required.update((f"{name}.{leaf}", shard) for leaf in layer.required_leaves)
            optional.update((f"{name}.{leaf}", shard) for leaf in layer.optional_leaves)
    return required, required | optional


@dataclass(frozen=True)
class _Names:
    """How a model's checkpoint names map to its parameters: `prefixes` (a checkpoint name
    prefix -> sprig's, e.g. a multimodal checkpoint's `language_model.model.` -> `model.`),
    `packed` (HF module name -> (fused module name, shard)), `experts` (an expert's HF
    projection name -> (`FusedExperts` parameter, kind)), `renamed` (HF module name ->
    sprig's), `unused` (prefixes of tensors sprig does not load, e.g. a vision
    tower's), and `split` (checkpoint modules whose one tensor holds all the shards of the
    fused layer of that name, `Phi3ForCausalLM`); see `LlamaForCausalLM`."""

    packed: dict[str, tuple[str, str]]
    experts: dict[str, tuple[str, str]]
    renamed: dict[str, str]
    prefixes: dict[str, str]
    unused: tuple[str, ...]
    tied: bool
    encoder_param: Callable[[str], str | None] | None = None
    encoder_prefix: str = ""
    split: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> _Names:
        return cls(model.packed_modules, getattr(model, "expert_projections", {}), getattr(model, "renamed_modules", {}),
                   getattr(model, "checkpoint_prefixes", {}), tuple(getattr(model, "unused_prefixes", ())),
                   model.config.tie_word_embeddings, getattr(model, "encoder_param", None),
                   getattr(model, "encoder_prefix", ""), tuple(getattr(model, "split_checkpoint_modules", ())))

    def canonical(self, name: str) -> str | None:
        """The checkpoint name `name` as a text-only checkpoint spells it (`prefixes`
        applied), or None for a tensor not loaded: a derived buffer, an `unused` part, a
        tied head."""
        if name.endswith(IGNORED_SUFFIXES):
            return None
        if self.encoder_param is not None and (inner := self.encoder_param(name)) is not None:
            return self.encoder_prefix + inner
        if name.startswith(self.unused):
            return None
        for prefix, replacement in self.prefixes.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        return None if self.tied and name == "lm_head.weight" else name


def _target(hf_name: str, names: _Names) -> Target:
    """HF tensor name -> sprig parameter and shard, e.g. `...self_attn.k_proj.weight` ->
    (`...self_attn.qkv_proj.weight`, "k"), `...experts.3.up_proj.weight` ->
    (`...experts.gate_up_proj`, "3.up"); an image encoder's name stays as it is."""
    if names.encoder_prefix and hf_name.startswith(names.encoder_prefix):
        return hf_name, None
    parts = [names.renamed.get(part, part) for part in hf_name.split(".")]
    for i, part in enumerate(parts):
        if part == "experts" and i + 3 == len(parts) - 1 and parts[i + 1].isdigit() and parts[i + 2] in names.experts:
            param, kind = names.experts[parts[i + 2]]
            return ".".join([*parts[: i + 1], param]), f"{parts[i + 1]}.{kind}"
        if part in names.packed:
            fused, shard = names.packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return ".".join(parts), None


def _hf_name(target: Target, names: _Names) -> str:
    """Inverse of `_target`: the checkpoint name a missing target would have had."""
    name, shard = target
    module, _, leaf = name.rpartition(".")
    if shard is not None and module.rpartition(".")[2] == "experts":
        expert, _, kind = shard.partition(".")
        hf_part = {v: k for k, v in names.experts.items()}[(leaf, kind)]
        name = f"{module}.{expert}.{hf_part}.weight"
    elif shard is not None and name.split(".")[-2] in names.split:
        name = f"{name} (its {shard} rows)"
    elif shard is not None:
        hf_part = {v: k for k, v in names.packed.items()}[(name.split(".")[-2], shard)]
        name = f"{module.rpartition('.')[0]}.{hf_part}.{leaf}"
    original = {v: k for k, v in names.renamed.items()}
    return ".".join(original.get(part, part) for part in name.split("."))


def _destination(model: nn.Module, params: dict[str, nn.Parameter], target: Target) -> torch.Tensor:
    """The tensor (a view) a target's checkpoint tensor is copied into: a shard's rows, or
    the whole parameter as its module's `checkpoint_view` (if it has one) shows it."""
    name, shard = target
    param = params[name]
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if shard is None:
        view = getattr(owner, "checkpoint_view", None)
        return param.data if view is None else view(leaf, param.data)
    return param.data[owner.shard_rows(shard)]
