"""Putting empty quantized layers into a freshly built (meta-device) model."""

from __future__ import annotations

from torch import nn

from sprig.runtime.layers.linear import MergedLinear
from sprig.runtime.quantization.formats.base import WeightFormat
from sprig.runtime.quantization.linear import QuantizedLinear


def install_quantized_linears(model: nn.Module, fmt: WeightFormat) -> None:
    """Replace every linear layer that `fmt` quantizes with an empty `QuantizedLinear` of
    the same geometry (the loader fills and finalizes it). A fused layer is quantized only
    if `fmt` gives all its checkpoint layers one scheme; ValueError naming the layer if the
    format quantizes some and not others, or if its group size does not divide the inputs.
    An image encoder (under the model's `encoder_prefix`) stays in float: it runs once per
    image, and quantized vision-language checkpoints keep their vision tower in float."""
    hf_parts: dict[tuple[str, str], str] = {v: k for k, v in model.packed_modules.items()}
    encoder = getattr(model, "encoder_prefix", "")
    for name, module in list(model.named_modules()):
        if encoder and (name + ".").startswith(encoder):
            continue
        parent, _, leaf = name.rpartition(".")
        if isinstance(module, MergedLinear):
            out_sizes: dict[str | None, int] = dict(module.out_sizes)
            in_features = module.weight.shape[1]
            checkpoint_names = [f"{parent}.{hf_parts[(leaf, shard)]}" for shard in module.out_sizes]
        elif isinstance(module, nn.Linear):
            out_sizes, in_features, checkpoint_names = {None: module.out_features}, module.in_features, [name]
        else:
            continue
        schemes = {fmt.scheme_for(n) for n in checkpoint_names}
        if len(schemes) > 1:
            raise ValueError(
                f"{', '.join(checkpoint_names)} run fused in sprig but are quantized differently ({fmt.name})"
            )
        scheme = schemes.pop()
        if scheme is None:
            continue
        try:
            layer = QuantizedLinear(
                in_features, out_sizes, bias=module.bias is not None, scheme=scheme, fmt=fmt
            )
        except ValueError as e:
            raise ValueError(f"{checkpoint_names[0]}: {e}") from None
        setattr(model.get_submodule(parent), leaf, layer)
