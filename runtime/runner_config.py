"""The model runner's settings, and the names its options take. Torch-free: the CLI
builds its flags from these, and `model_runner` resolves them to torch objects."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from sprig.runtime.attention import ATTENTION_BACKENDS
from sprig.runtime.quantization.online_schemes import check_online_scheme

DTYPES = ("float32", "bfloat16", "float16")  # each the name of a torch dtype (`torch.<name>`)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # the keys of radix.kv_cache.KV_CACHE_DTYPES
MAX_LORA_SLOTS = 126  # each slot keys its cached prefixes in a radix namespace of its own (`radix.tree`)
LORA_TARGET_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEVICE = re.compile(r"(cpu|cuda)(:(0|[1-9][0-9]*))?", re.ASCII)  # the device strings accepted besides "auto"


@dataclass(frozen=True)
class RunnerConfig:
    """How to run one model. "auto" means: dtype = the checkpoint's (float32 if it names
    none; float weights in a half dtype that the CPU multiplies slowly get a warning);
    device = cuda if available, else cpu; attention backend = the device's default
    (`attention.DEFAULT_BACKENDS`). A device other than "auto" is `DEVICE`: cpu or cuda,
    with an optional index, as torch spells it. The KV pool holds `max_total_tokens`
    tokens (rounded down to whole pages); when None, on CUDA it takes
    `mem_fraction_static` of the memory free after the weights load, on CPU the bytes of
    `model_runner.CPU_DEFAULT_TOKENS` tokens of a float cache, capped at
    `model_runner.CPU_KV_BUDGET_BYTES`.
    `kv_cache_dtype` (`KV_CACHE_DTYPES`): "auto" stores K/V in the model's dtype; "int8"
    (any device) and "fp8_e4m3" (CUDA only) store them quantized with a float16 scale per
    token and KV head, which every attention backend dequantizes on load; a byte budget
    then holds as many more tokens as the bytes per token shrink.
    `quantization` ("int8", "int4", "fp8" or None) quantizes a float checkpoint's linear
    layers as they load (round-to-nearest; int8 symmetric per output channel, int4 with a
    scale and a zero point per group of `quantization_group_size` inputs, fp8 e4m3 per
    output channel); a quantized checkpoint loads as its config says.
    `cpu_threads` sets torch's intra-op threads for the process. None: on CPU torch's
    default, one per core (on a CPU shared with other processes fewer threads step more
    evenly); on CUDA `model_runner.CUDA_CPU_THREADS`, since the CPU then only does a
    step's index math, which one thread does faster than a team that contends for cores
    with the server's HTTP and detokenizer processes.
    On CUDA with the Triton backend, decode steps of up to `cuda_graph_max_bs` requests
    replay captured CUDA graphs (`sprig.runtime.cuda_graph`) unless `disable_cuda_graph`;
    elsewhere both are ignored.
    `shadow_attention` checks every layer's attention against the plain reference backend
    (`sprig.runtime.attention.shadow`; raises on a mismatch): for tests and debugging, it
    runs attention twice and decodes without CUDA graphs.
    `context_length` overrides the checkpoint's max_position_embeddings as the longest
    context (prompt + output) served, within what its rope config covers
    (`model_config.longest_context`; larger is a `ValueError` when the model loads).
    LoRA (`sprig.runtime.lora`; on when `enable_lora` or `lora_paths`): `lora_paths` are
    the adapters loaded at start, each "NAME=PATH" or a PATH (named by itself; a dict
    {name: path} is taken too), at most `max_loras_per_batch` adapters loaded at a time;
    `max_lora_rank` and `lora_target_modules` (checkpoint module kinds, or "all") size the
    adapter slots, by default from the starting adapters. LoRA decodes without CUDA
    graphs and without tensor parallelism."""

    model_path: str | os.PathLike[str]
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    page_size: int = 1
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    random_seed: int = 0
    cpu_threads: int | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    shadow_attention: bool = False
    quantization: str | None = None
    quantization_group_size: int = 128
    kv_cache_dtype: str = "auto"
    context_length: int | None = None
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_paths, dict):
            object.__setattr__(self, "lora_paths", tuple(f"{k}={v}" for k, v in self.lora_paths.items()))
        elif isinstance(self.lora_paths, str):
            object.__setattr__(self, "lora_paths", (self.lora_paths,))
        object.__setattr__(self, "lora_paths", tuple(str(p) for p in self.lora_paths))
        if self.lora_target_modules is not None:
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
        self._check_lora()
        if not str(self.model_path):
            raise ValueError("model_path must not be empty")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.device != "auto" and not DEVICE.fullmatch(self.device):
            raise ValueError(f"invalid device {self.device!r}: must be 'auto', cpu or cuda[:N]")
        if self.attention_backend != "auto" and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be 'auto' or one of {list(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must be >= page_size ({self.page_size})"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.quantization is not None:
            check_online_scheme(self.quantization, self.quantization_group_size)
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8_e4m3" and self.device != "auto" and not self.device.startswith("cuda"):
            raise ValueError(f"kv_cache_dtype 'fp8_e4m3' needs a CUDA device, got device {self.device!r} (use 'int8')")

    @property
    def lora(self) -> bool:
        """Whether the runner serves LoRA adapters."""
        return self.enable_lora or bool(self.lora_paths)

    def lora_adapters(self) -> dict[str, str]:
        """The starting adapters, name -> path."""
        named = (p.partition("=") if "=" in p else (p, "", p) for p in self.lora_paths)
        return {name: path for name, _, path in named}

    def _check_lora(self) -> None:
        if not 1 <= self.max_loras_per_batch <= MAX_LORA_SLOTS:
            raise ValueError(f"max_loras_per_batch must be in 1..{MAX_LORA_SLOTS}, got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        names = [p.partition("=")[0] if "=" in p else p for p in self.lora_paths]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"lora_paths must name each adapter once (NAME=PATH), got {list(self.lora_paths)}")
        known = (*LORA_TARGET_KINDS, "all")
        for kind in self.lora_target_modules or ():
            if kind not in known:
                raise ValueError(f"lora_target_modules: {kind!r} is not one of {', '.join(known)}")
