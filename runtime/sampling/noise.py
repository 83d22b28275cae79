"""Counter-based randomness for seeded requests: the same (seed, step) gives the same bits
on any device, in any batch, at any row.

Row key: `row_key(seed, step)` mixes a request's seed with the number of tokens it has
generated so far (pure Python, once per row per step). Token noise: the SplitMix64
stream of that key, `fmix64(key + (v + 1) * GAMMA)` for vocabulary index v, computed in
torch with wrapping int64 arithmetic; its top 23 bits become a uniform u in (0, 1) and
`-log(u)` an Exp(1) variate. The sampler races `p_v / E_v` (Gumbel-max in log space),
which picks v with probability p_v.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as the unsigned `x`."""
    return x - (1 << 64) if x >= 1 << 63 else x


def fmix64(z: int) -> int:
    """SplitMix64's finalizer on unsigned 64-bit Python ints (a bijection)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def row_key(seed: int, step: int) -> int:
    """The int64 key of one request's draw at `step` (tokens generated so far).

    Nonlinear in both inputs, so neighbouring steps do not share stretches of stream.
    """
    return _signed(fmix64((fmix64(seed & _MASK64) + fmix64(step + 1)) & _MASK64))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _fmix64(z: torch.Tensor) -> torch.Tensor:
    """`fmix64` on int64 tensors; torch int64 multiplication wraps modulo 2**64."""
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def token_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[K, V] int64: the SplitMix64 output for each key (row) and vocabulary index."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device)
    return _fmix64(keys[:, None] + index[None, :] * _signed(_GAMMA))


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[K, V] float32 Exp(1) variates, strictly positive and finite, from int64 `keys` [K]."""
    top23 = _shr(token_bits(keys, vocab_size), 41)  # 23 bits: `top23 + 0.5` is exact in f32
    uniform = (top23.to(torch.float32) + 0.5) * 2.0**-23  # in [2**-24, 1 - 2**-24]
    return -torch.log(uniform)
