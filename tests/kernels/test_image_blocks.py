"""Bidirectional attention within image blocks (Gemma 3's vision-language models) in the
extend kernels: the torch reference and the Triton kernel (in the interpreter without
CUDA) against the float64 dense definition of the sliding-window tests, given each new
token's `attend_until`. Image blocks sit at the start, in the middle and at the end of
prompts, back to back, across query blocks, across the cached-prefix boundary (new tokens
whose block began in the cache) and wholly in the cache, beside requests without blocks;
with windows (some shorter than a block), soft caps, GQA, int8 pools and bf16."""

from __future__ import annotations

import pytest
import torch
from test_sliding_window import dense_attention, make_case, on_device, poison_unseen

from sprig.kernels import extend_attention, extend_attention_ref
from sprig.kernels.extend_attention import extend_attention_triton
from sprig.kernels.paged import request_attention_ref

Block = tuple[int, int]  # context positions [start, end) of one image's tokens

# 0: a prompt opening with an image; 1: 70 new tokens (two query blocks) with an image in
# the first block, one that crosses into the second and one right after it, ending the
# prompt; 2: a chunk without images; 3: new tokens whose image began in the cached
# prefix; 4: one token after a prefix that holds a whole image; 5: a 60-token image
# across both query blocks and one ending the prompt, after a cached prefix
IMAGE_Q = [12, 70, 9, 15, 1, 100]
IMAGE_PREFIX = [0, 0, 40, 20, 12, 5]
IMAGE_KV = [a + b for a, b in zip(IMAGE_Q, IMAGE_PREFIX, strict=True)]
IMAGE_BLOCKS: list[list[Block]] = [[(0, 5)], [(3, 9), (50, 68), (68, 70)], [], [(14, 27)], [(2, 8)], [(30, 90), (100, 105)]]
# 1; shorter than every image but the first; as long as the 60-token one; past every context; none
WINDOWS = [1, 4, 60, 1000, None]


def image_until(q_lens: list[int], kv_lens: list[int], blocks: list[list[Block]]) -> torch.Tensor:  # [T] int64
    """Each new token's attend_until: the end of the image block holding it, else its
    position + 1."""
    parts = []
    for n, L, spans in zip(q_lens, kv_lens, blocks, strict=True):
        pos = torch.arange(L - n, L)  # [n]
        until = pos + 1
        for start, end in spans:
            until[(pos >= start) & (pos < end)] = end
        parts.append(until)
    return torch.cat(parts)


def block_mask(n: int, L: int, spans: list[Block]) -> torch.Tensor:  # [n, L] bool
    """transformers' Gemma 3 mask of one request's new tokens: causal OR same image block
    (image tokens grouped into consecutive runs, as its token-type ids are)."""
    group = torch.full((L,), -1)
    for i, (start, end) in enumerate(spans):
        group[start:end] = i
    pos = torch.arange(L - n, L)[:, None]
    j = torch.arange(L)[None, :]
    same = (group[pos] == group[j]) & (group[pos] >= 0)
    return (j <= pos) | same


def image_case(hq: int, hkv: int, d: int, dtype: torch.dtype, storage: torch.dtype | None = None, seed: int = 0):
    """(args, scales, attend_until) of the image batch (`make_case`'s pool and slots)."""
    args, scales = make_case(IMAGE_Q, IMAGE_KV, hq, hkv, d, dtype, storage, seed)
    return args, scales, image_until(IMAGE_Q, IMAGE_KV, IMAGE_BLOCKS)


def widened(until: torch.Tensor) -> torch.Tensor:  # [T] bool
    """The new tokens that see past their own position."""
    pos = torch.cat([torch.arange(L - n, L) for n, L in zip(IMAGE_Q, IMAGE_KV, strict=True)])
    return until > pos + 1


def test_attend_until_states_the_image_block_mask() -> None:
    """The representation: a new token sees j < attend_until exactly where transformers'
    causal-or-same-block mask lets it; the batch has tokens it widens and tokens it leaves."""
    until = image_until(IMAGE_Q, IMAGE_KV, IMAGE_BLOCKS)
    qo = [0, *torch.tensor(IMAGE_Q).cumsum(0).tolist()]
    for b, (n, L) in enumerate(zip(IMAGE_Q, IMAGE_KV, strict=True)):
        mine = torch.arange(L)[None, :] < until[qo[b] : qo[b + 1], None]
        assert torch.equal(mine, block_mask(n, L, IMAGE_BLOCKS[b]))
    wide = widened(until)
    assert bool(wide.any()) and not bool(wide.all())
    # the image begun in the cache: its new tokens but the last (which ends it) see past themselves
    assert wide[qo[3] : qo[3] + 8].tolist() == [True] * 6 + [False] * 2


# ---------------------------------------------------------------- the reference vs the definition


@pytest.mark.parametrize(("window", "softcap", "hq", "hkv", "storage"), [  # every pair of values
    (window, [None, 2.0][(i + j) % 2], hq, hkv, [None, torch.int8][(j + (i >= 2)) % 2])
    for i, window in enumerate(WINDOWS) for j, (hq, hkv) in enumerate([(4, 4), (8, 2), (4, 1)])
])
def test_reference_matches_the_definition(
    window: int | None, softcap: float | None, hq: int, hkv: int, storage: torch.dtype | None,
) -> None:
    args, scales, until = image_case(hq, hkv, 16, torch.float32, storage)
    want = dense_attention(*args, sm_scale=0.3, window=window, softcap=softcap, attend_until=until, **scales)
    got = extend_attention_ref(*args, sm_scale=0.3, window=window, softcap=softcap, attend_until=until, **scales)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_widens_exactly_the_image_tokens(softcap: float | None) -> None:
    """Against plain causal attention: the outputs differ exactly for the tokens that see
    past themselves (attend_until is applied, not dropped), and an attend_until of
    position + 1 everywhere is plain causal attention."""
    args, _, until = image_case(8, 2, 16, torch.float32)
    causal = extend_attention_ref(*args, sm_scale=0.3, softcap=softcap)
    got = extend_attention_ref(*args, sm_scale=0.3, softcap=softcap, attend_until=until)
    assert (got - causal).abs().amax(dim=(1, 2)).gt(1e-4).equal(widened(until))
    plain = torch.cat([torch.arange(L - n, L) for n, L in zip(IMAGE_Q, IMAGE_KV, strict=True)]) + 1
    torch.testing.assert_close(extend_attention_ref(*args, sm_scale=0.3, softcap=softcap, attend_until=plain),
                               causal, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_reference_reads_only_what_the_window_shows(storage: torch.dtype | None) -> None:
    args, scales, until = image_case(8, 2, 16, torch.float32, storage)
    want = dense_attention(*args, sm_scale=0.3, window=5, attend_until=until, **scales)
    assert poison_unseen(args, scales, 5) > 0
    got = extend_attention_ref(*args, sm_scale=0.3, window=5, attend_until=until, **scales)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["int32", "short", "2-D", "strided"])
def test_attend_until_is_checked(bad: str, force_triton: None) -> None:
    args, _, until = image_case(4, 2, 16, torch.float32)
    wrong = {
        "int32": until.to(torch.int32),
        "short": until[1:],
        "2-D": until[:, None],
        "strided": torch.stack([until, until], dim=1)[:, 0],
    }[bad]
    q, k, v, _, _, kv_indices = args
    n = IMAGE_Q[0]
    calls = [
        lambda: request_attention_ref(q[:n], k, v, kv_indices[:n].long(), sm_scale=0.3, attend_until=wrong[:n]),
        lambda: extend_attention_ref(*args, sm_scale=0.3, attend_until=wrong),
        lambda: extend_attention_triton(*args, sm_scale=0.3, max_q_len=max(IMAGE_Q), attend_until=wrong),
        lambda: extend_attention(*args, sm_scale=0.3, max_q_len=max(IMAGE_Q), attend_until=wrong),
    ]
    if bad == "short":  # a prefix of a right-sized one is right-sized for the first request
        calls = calls[1:]
    for call in calls:
        with pytest.raises(ValueError, match="attend_until is one int64 entry per new token"):
            call()


# ---------------------------------------------------------------- Triton vs the definition


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (4, 4)])
def test_triton_matches_the_definition(window: int | None, hq: int, hkv: int, device: str, force_triton: None) -> None:
    args, scales, until = image_case(hq, hkv, 32, torch.float32)
    want = dense_attention(*args, sm_scale=0.2, window=window, attend_until=until)
    args, _ = on_device(device, args, scales)
    out = torch.full_like(args[0], float("nan"))
    got = extend_attention(*args, sm_scale=0.2, max_q_len=max(IMAGE_Q), out=out, window=window,
                           attend_until=until.to(device))
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


def test_triton_widens_exactly_the_image_tokens(device: str, force_triton: None) -> None:
    args, scales, until = image_case(4, 2, 32, torch.float32)
    args, _ = on_device(device, args, scales)
    causal = extend_attention(*args, sm_scale=0.2, max_q_len=max(IMAGE_Q))
    got = extend_attention(*args, sm_scale=0.2, max_q_len=max(IMAGE_Q), attend_until=until.to(device))
    assert (got - causal).abs().amax(dim=(1, 2)).gt(1e-4).cpu().equal(widened(until))


@pytest.mark.parametrize(("dtype", "storage", "window", "softcap"), [
    (torch.float32, None, None, 2.0),
    (torch.float32, torch.int8, 4, 5.0),
    (torch.bfloat16, torch.int8, 60, None),
    (torch.bfloat16, None, 1, 1.0),
])
def test_triton_with_caps_in_16_bit_and_over_int8_pools(
    dtype: torch.dtype, storage: torch.dtype | None, window: int | None, softcap: float | None,
    device: str, force_triton: None,
) -> None:
    tol = {torch.float32: 2e-5, torch.bfloat16: 4e-2}[dtype]
    args, scales, until = image_case(8, 2, 32, dtype, storage, seed=1)
    want = dense_attention(*args, sm_scale=0.2, window=window, softcap=softcap, attend_until=until, **scales)
    args, dev_scales = on_device(device, args, scales)
    got = extend_attention(*args, sm_scale=0.2, max_q_len=max(IMAGE_Q), window=window, softcap=softcap,
                           attend_until=until.to(device), **dev_scales)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_triton_reads_only_what_the_window_shows(storage: torch.dtype | None, device: str, force_triton: None) -> None:
    """Positions before every token's window hold NaN: a kernel that loaded one (even to
    mask it) would return NaN, however far an image lets a token see forward."""
    args, scales, until = image_case(8, 2, 32, torch.float32, storage)
    want = dense_attention(*args, sm_scale=0.2, window=6, attend_until=until, **scales)
    assert poison_unseen(args, scales, 6) > 0
    args, dev_scales = on_device(device, args, scales)
    got = extend_attention(*args, sm_scale=0.2, max_q_len=max(IMAGE_Q), window=6, attend_until=until.to(device),
                           **dev_scales)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_triton_query_blocks_inside_one_image(window: int | None, device: str, force_triton: None) -> None:
    """A 140-token image opening a 150-token prompt: its first two query blocks see the
    whole image, key blocks that every row sees included (unmasked but for a window of 40,
    which cuts inside them); beside a request without an image."""
    q_lens, kv_lens, blocks = [150, 20], [150, 30], [[(0, 140)], []]
    args, scales = make_case(q_lens, kv_lens, 4, 2, 32, torch.float32, seed=3)
    until = image_until(q_lens, kv_lens, blocks)
    want = dense_attention(*args, sm_scale=0.2, window=window, attend_until=until)
    args, _ = on_device(device, args, scales)
    got = extend_attention(*args, sm_scale=0.2, max_q_len=150, window=window, attend_until=until.to(device))
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- compiled, on a real GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (512, 50.0), (100, None)])
def test_gpu_long_prompts_with_images(window: int | None, softcap: float | None) -> None:
    q_lens, kv_lens = [1000, 1, 333], [1000, 2001, 850]
    blocks = [[(10, 266), (600, 856)], [], [(500, 756)]]
    args, _ = make_case(q_lens, kv_lens, 32, 8, 128, torch.bfloat16)
    args = tuple(t.cuda() for t in args)
    until = image_until(q_lens, kv_lens, blocks).cuda()
    kw = {"sm_scale": 128**-0.5, "window": window, "softcap": softcap, "attend_until": until}
    got = extend_attention(*args, max_q_len=1000, **kw)
    torch.testing.assert_close(got, extend_attention_ref(*args, **kw), atol=2e-2, rtol=2e-2)
