"""Triton kernels, each beside its torch reference (the reference is the CPU path).

Every public dispatcher runs Triton when its tensors are on CUDA (or when
`SPRIG_FORCE_TRITON=1`) and the torch reference otherwise.
"""

from .activation import act_and_mul, act_and_mul_ref, silu_and_mul, silu_and_mul_ref
from .decode_attention import decode_attention, decode_attention_ref
from .extend_attention import extend_attention, extend_attention_ref
from .logit_mask import apply_token_bitmask, apply_token_bitmask_ref
from .quant_matmul import pack_codes, quant_matmul, quant_matmul_ref
from .rmsnorm import rms_norm, rms_norm_ref
from .rotary import apply_rotary, apply_rotary_ref, rope_cos_sin
from .store_kv import store_kv, store_kv_ref

__all__ = [
    "act_and_mul",
    "act_and_mul_ref",
    "apply_rotary",
    "apply_rotary_ref",
    "apply_token_bitmask",
    "apply_token_bitmask_ref",
    "decode_attention",
    "decode_attention_ref",
    "extend_attention",
    "extend_attention_ref",
    "pack_codes",
    "quant_matmul",
    "quant_matmul_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope_cos_sin",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
]
