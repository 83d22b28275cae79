"""Write quantized checkpoints in the formats users download, from a tiny float checkpoint.

A small reference quantizer (round-to-nearest per row and group, optionally in a random
activation order) and a packer per format, written from each format's documented
layout, independently of sprig's loaders:

- GPTQ: `qweight` int32 [K / p, N] (input k in word k // p at bits (k % p) * b),
  `qzeros` int32 [G, N / p] (v1 "gptq": zero - 1; "gptq_v2": zero), `scales` fp16
  [G, N], `g_idx` int32 [K].
- AWQ GEMM: `qweight` int32 [K, N / 8], nibble i of word j = output 8 j + (0 2 4 6 1 3 5
  7)[i]; `qzeros` int32 [G, N / 8] likewise; `scales` fp16 [G, N].
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K / p] (signed code +
  2**(b-1), along the input dim), `weight_scale` bf16 [N, G], `weight_zero_point` int32
  [ceil(N / p), G] (asymmetric: signed zero + 2**(b-1), along the output dim),
  `weight_shape` [N, K], `weight_g_idx` [K] (actorder "group").

- FP8 (`quantize_fp8_checkpoint`): `weight` float8_e4m3fn [N, K] and its float32 scale:
  `weight_scale` [] per tensor ([1] in compressed-tensors), [N, 1] per channel, [N, K /
  group] per group; per block of bn x bk `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]
  (quant_method fp8) or `weight_scale` of that shape (compressed-tensors); `input_scale`
  for static activations.

`quantize_checkpoint` also writes the float checkpoint whose weights are exactly what the
stored codes stand for (with the scales as stored), for transformers to run, and
`check_matches_transformers` compares a runner with transformers on such a checkpoint;
`with_rtn_weights` gives transformers the weights that online quantization computes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from engine_helpers import contexts_step
from safetensors.torch import load_file, save_file

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.quantization.weight import QuantScheme, quantize_rtn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
SHARED_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp",
                "qkv_proj": "attn", "gate_up_proj": "mlp"}  # the last two: Phi-3's fused tensors, one layer each
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
ATOL = 1e-4  # on logits of magnitude ~5: float32 paths that differ in summation order
PROMPT_LENS = (7, 1, 12)
DECODE_STEPS = 6
SCALE_DTYPES = {"gptq": torch.float16, "awq": torch.float16, "compressed-tensors": torch.bfloat16}


@dataclass(frozen=True)
class Spec:
    """One quantized checkpoint to write. group_size None: per output channel."""

    method: str  # gptq | awq | compressed-tensors
    bits: int = 4
    group_size: int | None = 32
    sym: bool = True
    act_order: bool = False
    gptq_v2: bool = False
    keep_float: tuple[str, ...] = ()  # projections left in float (compressed-tensors, AWQ)

    @property
    def label(self) -> str:
        parts = [self.method, f"w{self.bits}", f"g{self.group_size or 'ch'}", "sym" if self.sym else "asym"]
        parts += ["actorder"] * self.act_order + ["v2"] * self.gptq_v2 + list(self.keep_float)
        return "-".join(parts)


@dataclass(frozen=True)
class Quantized:
    codes: torch.Tensor  # [N, K] int64, unsigned, in 0 .. 2**bits - 1
    scales: torch.Tensor  # [N, G] in the format's storage dtype
    zeros: torch.Tensor  # [N, G] int64, unsigned
    g_idx: torch.Tensor  # [K] int64

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        s, z = self.scales.float()[:, self.g_idx], self.zeros[:, self.g_idx].float()
        return (self.codes.float() - z) * s


def quantize(w: torch.Tensor, spec: Spec, order: torch.Tensor | None) -> Quantized:
    """RTN of w [N, K] per (row, group); `order` (a permutation of the inputs) groups the
    inputs in that order, as act-order GPTQ does: input order[j] is in group j // G."""
    n, k = w.shape
    size = spec.group_size or k
    position = torch.empty(k, dtype=torch.long)
    position[order if order is not None else torch.arange(k)] = torch.arange(k)
    g_idx = position // size
    top = (1 << spec.bits) - 1
    groups = k // size
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g].double()
        if spec.sym:
            s = cols.abs().amax(1) / ((1 << (spec.bits - 1)) - 1)
            z = torch.full((n,), 1 << (spec.bits - 1), dtype=torch.long)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / top
            z = torch.round(-lo / torch.where(s > 0, s, 1.0)).long().clamp(0, top)
            if spec.method == "gptq" and not spec.gptq_v2:
                z = z.clamp(min=1)  # v1 stores zero - 1: a zero of 0 cannot be written
        scales[:, g] = torch.where(s > 0, s, 1.0).float()
        zeros[:, g] = z
    scales = scales.to(SCALE_DTYPES[spec.method])  # codes are computed with the stored scale
    s_full, z_full = scales.double()[:, g_idx], zeros[:, g_idx]
    codes = (torch.round(w.double() / s_full) + z_full).clamp(0, top).long()
    return Quantized(codes, scales, zeros, g_idx)


def pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned `values` 32 // bits to an int32 word along `dim`, the lowest bits
    first; `order[i]` names the element (within its run of 32 // bits) in slot i."""
    per = 32 // bits
    v = values.long().movedim(dim, -1)
    if v.shape[-1] % per:  # pad to whole words
        v = torch.nn.functional.pad(v, (0, per - v.shape[-1] % per))
    v = v.reshape(*v.shape[:-1], -1, per)
    word = torch.zeros(v.shape[:-1], dtype=torch.long)
    for slot in range(per):
        word |= v[..., order[slot] if order else slot] << (bits * slot)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def _tensors(spec: Spec, q: Quantized) -> dict[str, torch.Tensor]:
    """The format's tensors for one layer (without the module prefix)."""
    b = spec.bits
    if spec.method == "gptq":
        stored = q.zeros if spec.gptq_v2 else (q.zeros - 1) & ((1 << b) - 1)
        return {"qweight": pack(q.codes.T, b, 0), "qzeros": pack(stored.T, b, 1),
                "scales": q.scales.T.contiguous(), "g_idx": q.g_idx.to(torch.int32)}
    if spec.method == "awq":
        return {"qweight": pack(q.codes.T, 4, 1, AWQ_ORDER), "qzeros": pack(q.zeros.T, 4, 1, AWQ_ORDER),
                "scales": q.scales.T.contiguous()}
    out = {"weight_packed": pack(q.codes, b, 1), "weight_scale": q.scales,
           "weight_shape": torch.tensor(list(q.codes.shape))}
    if not spec.sym:  # the signed zero points plus 2**(b-1) are the unsigned zeros
        out["weight_zero_point"] = pack(q.zeros, b, 0)
    if spec.act_order:
        out["weight_g_idx"] = q.g_idx.to(torch.int32)
    return out


def _quantization_config(spec: Spec) -> dict:
    group = spec.group_size or -1
    if spec.method == "gptq":
        return {"quant_method": "gptq", "bits": spec.bits, "group_size": group, "desc_act": spec.act_order,
                "sym": spec.sym, "checkpoint_format": "gptq_v2" if spec.gptq_v2 else "gptq"}
    if spec.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": list(spec.keep_float) or None}
    weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym,
               "strategy": "group" if spec.group_size else "channel", "group_size": spec.group_size,
               "actorder": "group" if spec.act_order else None, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", *(f"re:.*{p}$" for p in spec.keep_float)], "kv_cache_scheme": None}


def quantize_checkpoint(src: Path, dst: Path, spec: Spec, *, seed: int = 0) -> tuple[Path, Path]:
    """Write `spec`'s quantized form of checkpoint `src` to `dst / "quantized"` and the
    float checkpoint it stands for to `dst / "dequantized"`; returns both paths."""
    if spec.method == "awq" and (spec.bits != 4 or spec.sym):
        raise ValueError("AWQ GEMM checkpoints are 4-bit with zero points")
    if spec.method == "gptq" and spec.keep_float:
        raise ValueError("GPTQ configs name no float layers")
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    quantized, dequantized = {}, dict(tensors)
    for name, w in tensors.items():
        module, _, leaf = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if proj not in PROJECTIONS or proj in spec.keep_float or leaf != "weight":
            quantized[name] = w
            continue
        key = f"{module.rpartition('.')[0]}.{SHARED_INPUT.get(proj, proj)}"
        if spec.act_order and key not in orders:
            orders[key] = torch.randperm(w.shape[1], generator=g)
        q = quantize(w, spec, orders.get(key))
        dequantized[name] = q.dequantize().to(w.dtype)
        quantized.update({f"{module}.{k}": v for k, v in _tensors(spec, q).items()})
    return _write(src, dst, quantized, dequantized, _quantization_config(spec))


def prompts(vocab: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def check_matches_transformers(runner: ModelRunner, hf: torch.nn.Module) -> None:
    """Prefill logits of a batch of prompts within `ATOL` of transformers' (float32), then
    greedy decoding token for token equal to `hf.generate`."""
    batch = prompts(runner.model_config.vocab_size)
    slots, next_slot = [], runner.kv_cache.page_size
    for p in batch:
        slots.append(torch.arange(next_slot, next_slot + len(p), dtype=torch.int32))
        next_slot += len(p)
    logits = runner.forward(contexts_step(
        ForwardMode.EXTEND, [t for p in batch for t in p], [len(p) for p in batch], slots, [0] * len(batch)
    ))
    for got, ids in zip(logits.split(PROMPT_LENS), batch, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    outputs = [[int(rows[-1].argmax())] for rows in logits.split(PROMPT_LENS)]
    for _ in range(DECODE_STEPS - 1):
        slots = [torch.cat([s, torch.tensor([next_slot + i], dtype=torch.int32)]) for i, s in enumerate(slots)]
        next_slot += len(batch)
        step = contexts_step(ForwardMode.DECODE, [o[-1] for o in outputs], [1] * len(batch), slots, [0] * len(batch))
        for out, tok in zip(outputs, runner.forward(step).argmax(-1).tolist(), strict=True):
            out.append(tok)
    for ids, got in zip(batch, outputs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                               pad_token_id=hf.config.eos_token_id)[0, len(ids):].tolist()
        assert got[: len(want)] == want


def with_rtn_weights(hf: torch.nn.Module, scheme: QuantScheme) -> torch.nn.Module:
    """`hf` (a transformers model) with every projection's weight replaced by the float
    weight its RTN codes stand for: what sprig's online quantization computes with."""
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(quantize_rtn(module.weight, scheme).dequantize())
    return hf


@dataclass(frozen=True)
class Fp8Spec:
    """One FP8 checkpoint to write: `method` "fp8" (transformers / DeepSeek / per-tensor
    writers) or "compressed-tensors" (`float-quantized`); `strategy` tensor, channel, group
    (compressed-tensors, groups of 32 columns) or block (`block` rows x columns); `static`
    adds the activations' `input_scale` that static-activation checkpoints carry."""

    method: str
    strategy: str
    block: tuple[int, int] = (24, 32)
    static: bool = False

    @property
    def label(self) -> str:
        return "-".join([self.method, "fp8", self.strategy] + ["static"] * self.static)


def quantize_fp8(w: torch.Tensor, spec: Fp8Spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale as the format stores it, the float weight they stand for):
    each tensor / row / group / block scaled by its largest magnitude over 448."""
    n, k = w.shape
    w = w.float()
    if spec.strategy == "block":
        bn, bk = spec.block
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.stack([torch.stack([w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() for j in range(cols)])
                             for i in range(rows)]) / 448  # [ceil(N / bn), ceil(K / bk)]
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif spec.strategy == "group":
        scale = w.reshape(n, k // 32, 32).abs().amax(-1) / 448  # [N, K / 32]
        full = scale.repeat_interleave(32, 1)
    elif spec.strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448  # [N, 1]
        full = scale.expand(n, k)
    else:
        scale = w.abs().amax() / 448  # []
        full = scale.expand(n, k)
        if spec.method == "compressed-tensors":
            scale = scale.reshape(1)
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.float(), q.float() * full


def _fp8_config(spec: Fp8Spec) -> dict:
    if spec.method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if spec.static else "dynamic",
                "weight_block_size": list(spec.block) if spec.strategy == "block" else None,
                "modules_to_not_convert": ["lm_head"]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": spec.strategy, "dynamic": False,
               "group_size": 32 if spec.strategy == "group" else None,
               "block_structure": list(spec.block) if spec.strategy == "block" else None}
    activations = {"num_bits": 8, "type": "float", "symmetric": True,
                   "strategy": "tensor" if spec.static else "token", "dynamic": not spec.static}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def quantize_fp8_checkpoint(src: Path, dst: Path, spec: Fp8Spec) -> tuple[Path, Path]:
    """Write `spec`'s FP8 form of checkpoint `src` to `dst / "quantized"` and the float
    checkpoint it stands for to `dst / "dequantized"`; returns both paths."""
    if spec.method == "fp8" and spec.strategy not in ("tensor", "block"):
        raise ValueError("quant_method fp8 checkpoints are scaled per tensor or per block")
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, dict(tensors)
    scale_leaf = "weight_scale_inv" if spec.method == "fp8" and spec.strategy == "block" else "weight_scale"
    for name, w in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rpartition(".")[2] not in PROJECTIONS or leaf != "weight":
            quantized[name] = w
            continue
        q, scale, deq = quantize_fp8(w, spec)
        dequantized[name] = deq.to(w.dtype)
        quantized.update({name: q, f"{module}.{scale_leaf}": scale})
        if spec.static:
            quantized[f"{module}.input_scale"] = torch.tensor(0.02 if spec.method == "fp8" else [0.02])
    return _write(src, dst, quantized, dequantized, _fp8_config(spec))


def _write(src: Path, dst: Path, quantized: dict[str, torch.Tensor], dequantized: dict[str, torch.Tensor],
           quantization_config: dict) -> tuple[Path, Path]:
    """`src` copied to `dst / "quantized"` with the `quantized` tensors and
    `quantization_config`, and to `dst / "dequantized"` with the float tensors they stand for."""
    quant_dir, deq_dir = dst / "quantized", dst / "dequantized"
    for d, tensors in ((quant_dir, quantized), (deq_dir, dequantized)):
        shutil.copytree(src, d)
        (d / "model.safetensors").unlink()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quant_dir, deq_dir
