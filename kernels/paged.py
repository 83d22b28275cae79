"""Reading one request's context out of the paged KV pool, and the plain attention of
its newest tokens over it: the building blocks of the torch references."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .kv_quant import dequantize_kv_ref
from .softcap import capped_attention, check_softcap


def gather_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # [n, *buffer.shape[1:]]
    """`buffer[slots]` for a pool buffer [S, ...] and int64 slots [n]: one row copy per
    slot (indexing the 2-D view copies whole rows, about twice as fast on the CPU)."""
    return buffer.view(buffer.shape[0], -1).index_select(0, slots).view(-1, *buffer.shape[1:])


def gather_kv(
    buffer: torch.Tensor,  # [S, ..., D] a pool buffer (or a view of one with rows flattened)
    slots: torch.Tensor,  # [n] int64
    scale: torch.Tensor | None,  # [S, ...] float16: the rows' scales in a quantized pool
    dtype: torch.dtype,  # the model's dtype
) -> torch.Tensor:  # [n, ..., D]
    """Rows `slots` of a K or V pool buffer as attention reads them: dequantized by their
    scales (`dequantize_kv_ref`, in `dtype`) in a quantized pool, else as stored."""
    rows = gather_rows(buffer, slots)
    return rows if scale is None else dequantize_kv_ref(rows, gather_rows(scale, slots), dtype)


def check_window(window: int | None) -> None:
    """`ValueError` unless `window` is None (full causal attention) or an int >= 1."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one position, got {window}")


def check_attend_until(attend_until: torch.Tensor | None, q: torch.Tensor) -> None:
    """`ValueError` unless `attend_until` is None (causal attention) or a contiguous int64
    vector with one entry per new token of `q` [T, ...], on q's device. Its values (p + 1
    <= attend_until <= kv_len for a token at position p) are not read: that would wait
    for the device."""
    if attend_until is None:
        return
    if (
        attend_until.dtype != torch.int64
        or attend_until.shape != q.shape[:1]
        or attend_until.device != q.device
        or not attend_until.is_contiguous()
    ):
        raise ValueError(
            f"attend_until is one int64 entry per new token ({q.shape[0]}), contiguous, on {q.device}; "
            f"got {attend_until.dtype} of shape {tuple(attend_until.shape)} on {attend_until.device}"
        )


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """`ValueError` unless `sinks` is None (no sinks) or a contiguous float32 vector with
    one entry per query head of `q` [T, Hq, D], on q's device. Its values are not read:
    that would wait for the device (and break a captured CUDA graph)."""
    if sinks is None:
        return
    if (
        sinks.dtype != torch.float32
        or sinks.shape != q.shape[1:2]
        or sinks.device != q.device
        or not sinks.is_contiguous()
    ):
        raise ValueError(
            f"attention sinks are one float32 entry per query head ({q.shape[1]}), contiguous, on {q.device}; "
            f"got {sinks.dtype} of shape {tuple(sinks.shape)} on {sinks.device}"
        )


MIN_BAND_BLOCK = 16  # queries per block of `banded_attention_ref`, at least (so that short test prompts take blocks too)


def banded_attention_ref(
    q: torch.Tensor,  # [Lq, Hq, D]: the last Lq tokens of the context
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [L] int64, L >= Lq: the context's slots in position order
    *,
    window: int,
    **options: Any,
) -> torch.Tensor:  # [Lq, Hq, D] in q.dtype
    """`request_attention_ref` with a sliding `window` W, its queries taken in blocks of
    max(W, `MIN_BAND_BLOCK`): each block attends over only the slots its window reaches
    (at most block + W - 1), so a long prompt costs O(Lq * W), not O(Lq * L) with most
    of a dense mask false. Equal to one call up to float rounding (each row's softmax is
    over the same scores; the kernels sum them in another order). `options` are
    `request_attention_ref`'s, but `attend_until` (an image block may reach past a
    block's last position): give none."""
    if options.get("attend_until") is not None:
        raise ValueError("banded_attention_ref takes no attend_until: a query may see past its block")
    q_len, kv_len = q.shape[0], slots.numel()
    block = max(window, MIN_BAND_BLOCK)
    if q_len <= block:
        return request_attention_ref(q, k_buffer, v_buffer, slots, window=window, **options)
    out = torch.empty_like(q)
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        out[start:end] = request_attention_ref(q[start:end], k_buffer, v_buffer, slots[: kv_len - q_len + end],
                                               window=window, **options)
    return out


def request_attention_ref(
    q: torch.Tensor,  # [Lq, Hq, D]: the last Lq tokens of the context
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [L] int64, L >= Lq: the context's slots in position order
    *,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16 for a quantized pool
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
    window: int | None = None,
    softcap: float | None = None,
    attend_until: torch.Tensor | None = None,  # [Lq] int64, p + 1 <= attend_until[i] <= L
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [Lq, Hq, D] in q.dtype
    """One request's attention: new token i, at position p = L - Lq + i, attends to context
    positions `0 ..= p` (with `attend_until`, to those below `attend_until[i]`: an image
    block's tokens see the whole block), and with a sliding `window` W only to those from
    `max(0, p - W + 1)` on, in float32 (one SDPA call; the fused causal kernel when
    nothing is cached, no window bites and no `attend_until` is given) over the K/V as
    `gather_kv` reads them. Only the slots some token sees are gathered. GQA: query head h
    reads KV head h // (Hq // Hkv). The inputs carry a batch dimension: on the CPU, 3-D
    GQA inputs take SDPA's unfused path (6x slower for 544 tokens, 8 query and 4 KV
    heads). A `softcap` caps the scaled scores before the mask (`softcap.py`), and
    `sinks` add exp(sinks[h]) to each softmax denominator of query head h (gpt-oss): SDPA
    can do neither, so the scores are then written out (`capped_attention`)."""
    check_window(window)
    check_softcap(softcap)
    check_attend_until(attend_until, q)
    check_sinks(sinks, q)
    Hq, Hkv = q.shape[1], k_buffer.shape[1]
    q_len = q.shape[0]
    # the first token sees from L - Lq - W + 1 on; later ones from further on
    cut = 0 if window is None else max(0, slots.numel() - q_len - window + 1)
    slots = slots[cut:]
    until = None if attend_until is None else attend_until - cut  # [Lq]: in the cut context's positions
    kv_len = slots.numel()
    k = gather_kv(k_buffer, slots, k_scale, q.dtype).float().transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = gather_kv(v_buffer, slots, v_scale, q.dtype).float().transpose(0, 1)[None]  # [1, Hkv, L, D]
    if softcap is not None or sinks is not None:
        o = capped_attention(
            q.float().transpose(0, 1), k[0], v[0], sm_scale=sm_scale, softcap=softcap, window=window,
            attend_until=until, sinks=sinks,
        )
        return o.transpose(0, 1).to(q.dtype)
    qb = q.float().transpose(0, 1)[None]  # [1, Hq, Lq, D]
    # the window bites when the last token, which starts furthest in, does not see slot 0
    bites = window is not None and kv_len > window
    if kv_len == q_len and not bites and until is None:
        mask, causal = None, True
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)  # [Lq, 1]
        cols = torch.arange(kv_len, device=q.device)[None, :]  # [1, L]
        mask, causal = (cols <= rows) if until is None else (cols < until[:, None]), False  # [Lq, L]
        if bites:
            mask &= cols > rows - window
    o = F.scaled_dot_product_attention(
        qb, k, v, attn_mask=mask, is_causal=causal, scale=sm_scale, enable_gqa=Hq != Hkv
    )  # [1, Hq, Lq, D]
    return o[0].transpose(0, 1).to(q.dtype)
