"""A round of the draft model's decode steps on the CPU, over contiguous copies of the
requests' contexts.

The runner's general path (`ModelRunner.forward`) builds a paged batch, plans attention
and reads each layer's context K/V out of the pool on every step; on the CPU that is
most of a small draft model's step (its matmuls take a fraction of it). A round of
drafting feeds the same requests several tokens one after another, so `DraftDecoder.run`
gathers each request's context K/V out of the pool once per layer into a padded
`[B, Hkv, L, D]` buffer with room for the round, appends each step's K/V to it, and
calls the layers' weights directly (the same torch references the general path uses:
`rms_norm_ref`, `apply_rotary_ref`, `silu_and_mul_ref`). It writes every fed token's
K/V into the pool at its slot, as the general path would, so the pool afterwards holds
what the general path would have written.

Its logits equal the general path's up to float rounding (attention sums in another
order). Drafts are proposals only: the target verifies each one and the acceptance rule
keeps a draft only if it equals the target's own token, so a rounding difference can
change how many drafts are kept, never an output token. With `shadow` every step also
runs on the general path and `AssertionError` names a step whose logits differ by more
than rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sprig.kernels.activation import silu_and_mul_ref
from sprig.kernels.paged import gather_kv
from sprig.kernels.rmsnorm import rms_norm_ref
from sprig.kernels.rotary import apply_rotary_ref, rotary_rows
from sprig.kernels.store_kv import store_kv_ref
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.models.llama import DecoderModel
from sprig.runtime.speculative.grammar_drafts import GrammarWalk
from sprig.runtime.speculative.runner_rounds import round_step

# |lean - general| allowed in shadow mode, times (1 + the largest |logit|), by model dtype
SHADOW_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, as the general path's modules hold them."""

    eps: float
    input_norm: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: tuple[torch.Tensor, torch.Tensor | None]
    post_norm: torch.Tensor
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]


def supports(runner: ModelRunner) -> bool:
    """Whether `DraftDecoder` can run `runner`'s model: a dense Llama-family decoder with
    SwiGLU, RoPE and full attention in every layer, unscaled (not Granite's), on the CPU, unsharded, with unquantized weights."""
    decoder = getattr(runner.model, "model", None)
    config = runner.model_config
    return (runner.device.type == "cpu" and isinstance(decoder, DecoderModel) and runner.config.quantization is None
            and config.moe is None and config.sliding_window is None and not config.nope_layers
            and config.hidden_act == "silu"
            and config.embedding_multiplier == config.residual_multiplier == config.logits_scaling == 1.0
            and config.attention_softcap is None
            and config.attention_scale is None and config.num_layers == len(decoder.layers))


class DraftDecoder:
    """Runs rounds of decode steps of `runner`'s model (see the module); not thread-safe,
    as the runner is not."""

    def __init__(self, runner: ModelRunner, *, shadow: bool = False) -> None:
        if not supports(runner):
            raise ValueError("DraftDecoder runs an unquantized dense Llama-family model on the CPU")
        self.runner = runner
        self.shadow = shadow
        decoder: DecoderModel = runner.model.model
        self.embedding = decoder.embed_tokens.weight  # [V, H]
        self.rotary = decoder.rotary
        self.final_norm = (decoder.norm.weight, decoder.norm.eps)
        self.layers = [_layer(layer) for layer in decoder.layers]
        attn = decoder.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.sm_scale = attn.sm_scale
        self.dtype = runner.dtype

    @torch.inference_mode()
    def run(self, slots: list[torch.Tensor], starts: list[int], tokens: list[list[int]],
            drafts: list[int], walk: GrammarWalk | None = None) -> list[list[int]]:
        """Greedy decode steps for B requests at once; returns each request's `drafts[b]`
        proposals (each the argmax among what request b's grammar allows, where `walk`
        walks one).

        Request b: its context's first `starts[b]` positions hold the draft's K/V in the
        pool at `slots[b][:starts[b]]`; it is fed `tokens[b]` (at least one) one step at a
        time from position `starts[b]`, then each token it proposes, until it has proposed
        `drafts[b] >= 1` tokens after the last of `tokens[b]`. `slots[b]` (int64, position
        order) covers every position fed; the K/V of the token fed at position p is
        written at `slots[b][p]`.
        """
        B = len(slots)
        steps = [len(t) - 1 + n for t, n in zip(tokens, drafts, strict=True)]  # tokens fed per request
        start = torch.tensor(starts, dtype=torch.int64)  # [B]
        width = max(starts) + max(steps)
        rows = torch.arange(B)
        ks, vs = self._gather(slots, starts, width)
        fed = torch.tensor([t[0] for t in tokens], dtype=torch.int64)  # [B]
        out: list[list[int]] = [[] for _ in range(B)]
        for j in range(max(steps)):
            live = [b for b in range(B) if steps[b] > j]
            loc = torch.stack([slots[b][starts[b] + j] for b in live])  # [B'] slots written now
            expected = self._general(slots, starts, fed, live, j) if self.shadow else None
            logits = self._step(fed, start + j, ks, vs, rows, live, loc, upto=max(starts) + j + 1)  # [B, V]
            if expected is not None:
                _check(logits[live], expected, self.dtype, j)
            if walk is not None:
                walk.mask(logits, [(b, b) for b in live if j + 1 >= len(tokens[b])])
            fed = logits.argmax(dim=-1)
            proposed = fed.tolist()
            for b in live:
                if j + 1 < len(tokens[b]):
                    fed[b] = tokens[b][j + 1]
                else:
                    out[b].append(proposed[b])
                    if walk is not None:
                        walk.take(b, proposed[b])
        return out

    def _gather(self, slots: list[torch.Tensor], starts: list[int], width: int,
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, each request's context K/V, head-major `[B, Hkv, width, D]`; past a
        request's start, the padding slot's (masked in attention until overwritten)."""
        padded = torch.zeros(len(slots), width, dtype=torch.int64)  # [B, width]: slot 0 pads
        for b, (s, n) in enumerate(zip(slots, starts, strict=True)):
            padded[b, :n] = s[:n]
        padded = padded.flatten()
        pool = self.runner.kv_cache
        ks, vs = [], []
        for layer in pool.layers[: len(self.layers)]:
            for kept, buffer, scale in ((ks, layer.k, layer.k_scale), (vs, layer.v, layer.v_scale)):
                rows = gather_kv(buffer, padded, scale, self.dtype)  # [B * width, Hkv, D]
                kept.append(rows.view(len(slots), width, self.kv_heads, self.head_dim).transpose(1, 2).contiguous())
        return ks, vs

    def _step(self, fed: torch.Tensor, positions: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
              rows: torch.Tensor, live: list[int], loc: torch.Tensor, upto: int) -> torch.Tensor:
        """One decode step of every row (rows past their steps too: their results are
        dropped and their K/V not written to the pool); float32 logits `[B, V]`."""
        B, Hq, Hkv, D = fed.shape[0], self.heads, self.kv_heads, self.head_dim
        mask = None
        if B > 1:  # each row attends to its own positions 0 ..= position
            mask = (torch.arange(upto)[None, :] <= positions[:, None])[:, None, :]  # [B, 1, upto]
        rotation = rotary_rows(positions, self.rotary.cos, self.rotary.sin, self.dtype)
        live_rows = torch.tensor(live, dtype=torch.int64)
        pool = self.runner.kv_cache
        hidden, residual = F.embedding(fed, self.embedding), None  # [B, H]
        for i, w in enumerate(self.layers):
            if residual is None:
                residual, hidden = hidden, rms_norm_ref(hidden, w.input_norm, w.eps)
            else:
                hidden, residual = rms_norm_ref(hidden, w.input_norm, w.eps, residual)
            qkv = F.linear(hidden, *w.qkv)  # [B, (Hq + 2 Hkv) D]
            v = qkv[:, (Hq + Hkv) * D :].view(B, Hkv, D)
            if w.q_norm is not None and w.k_norm is not None:
                q = apply_rotary_ref(rms_norm_ref(qkv[:, : Hq * D].view(B, Hq, D), w.q_norm, w.eps),
                                     positions, self.rotary.cos, self.rotary.sin, rows=rotation)
                k = apply_rotary_ref(rms_norm_ref(qkv[:, Hq * D : (Hq + Hkv) * D].view(B, Hkv, D), w.k_norm, w.eps),
                                     positions, self.rotary.cos, self.rotary.sin, rows=rotation)
            else:
                qk = apply_rotary_ref(qkv[:, : (Hq + Hkv) * D].view(B, Hq + Hkv, D), positions,
                                      self.rotary.cos, self.rotary.sin, rows=rotation)
                q, k = qk[:, :Hq], qk[:, Hq:]
            kv = pool.layers[i]
            scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
            store_kv_ref(kv.k, kv.v, loc, k[live_rows], v[live_rows], **scales)
            if kv.k_scale is not None:  # attend to the new token's K/V as the pool holds them
                k = k.clone()
                v = v.clone()
                k[live_rows] = gather_kv(kv.k, loc, kv.k_scale, self.dtype)
                v[live_rows] = gather_kv(kv.v, loc, kv.v_scale, self.dtype)
            ks[i][rows, :, positions] = k
            vs[i][rows, :, positions] = v
            o = _attend(q, ks[i][:, :, :upto], vs[i][:, :, :upto], mask, self.sm_scale)  # [B, Hq, D]
            hidden = F.linear(o.reshape(B, Hq * D), *w.o)
            hidden, residual = rms_norm_ref(hidden, w.post_norm, w.eps, residual)
            hidden = F.linear(silu_and_mul_ref(F.linear(hidden, *w.gate_up)), *w.down)
        hidden, _ = rms_norm_ref(hidden, *self.final_norm, residual)
        return self.runner.model.compute_logits(hidden)

    def _general(self, slots: list[torch.Tensor], starts: list[int], fed: torch.Tensor,
                 live: list[int], j: int) -> torch.Tensor:
        """Shadow mode: step `j` of the live rows on the runner's general path (it writes
        the same slots, which the step after it overwrites)."""
        return self.runner.forward(round_step(slots, starts, fed.tolist(), live, j))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """One query per row: q `[B, Hq, D]` over k, v `[B, Hkv, L, D]` (query head h reads KV
    head h // (Hq / Hkv)), where `mask` `[B, 1, L]` (None: all) says which positions count;
    `[B, Hq, D]`. Two batched matmuls and a softmax: for one query row SDPA's masked path
    is slower on the CPU."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.view(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, L]
    if mask is not None:
        scores.masked_fill_(~mask[:, :, None, :], float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).view(B, Hq, D)


def _layer(layer: torch.nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp

    def linear(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        return module.weight, module.bias

    return _Layer(
        eps=layer.input_layernorm.eps,
        input_norm=layer.input_layernorm.weight,
        qkv=linear(attn.qkv_proj),
        q_norm=None if attn.q_norm is None else attn.q_norm.weight,
        k_norm=None if attn.k_norm is None else attn.k_norm.weight,
        o=linear(attn.o_proj),
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=linear(mlp.gate_up_proj),
        down=linear(mlp.down_proj),
    )


def _check(lean: torch.Tensor, general: torch.Tensor, dtype: torch.dtype, step: int) -> None:
    """AssertionError unless the two paths' logits `[B', V]` agree up to rounding."""
    allowed = SHADOW_TOLERANCE[dtype] * (1.0 + float(general.abs().max()))
    worst = float((lean - general).abs().max())
    if worst > allowed:
        raise AssertionError(f"draft decoder: step {step}'s logits differ from the general path's by {worst:.3g} "
                             f"(allowed {allowed:.3g})")
