"""The LoRA adapters one model runner serves: which layers carry adapter slots, and which
adapter holds each slot.

Layers are chosen once, when the runner starts: those of the kinds in
`lora_target_modules` (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
"all"), else those the starting adapters adapt. Every slot is as wide as
`max_lora_rank` (else the largest starting adapter's rank). An adapter occupies one of
`max_loras_per_batch` slots from its load to its unload, so every loaded adapter can run in
any batch. Adapters apply to the dense layers (attention, dense and shared-expert MLPs),
never to the router or the experts of a mixture-of-experts block.

Under tensor parallelism every rank's manager holds its part of each adapter
(`split.LayerSplit`) in the same slot: rank 0's tells the others of each load and unload
before making it (`RankSync.announce`), and a load takes effect on every rank or on none
(`RankSync.agree`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sprig.radix.tree import TOKEN_MASK
from sprig.runtime.distributed.layers import RowParallelLinear
from sprig.runtime.layers.linear import MergedLinear
from sprig.runtime.lora.adapter import LoRAAdapter, read_adapter
from sprig.runtime.lora.layers import LoRALayer, LoRATokens
from sprig.runtime.lora.split import layer_split
from sprig.runtime.quantization.linear import QuantizedLinear
from sprig.runtime.runner_config import LORA_TARGET_KINDS

# a linear layer's name in sprig -> the checkpoint module kind of each shard
LAYER_KINDS: dict[str, dict[str | None, str]] = {
    "qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
    "o_proj": {None: "o_proj"},
    "gate_up_proj": {"gate": "gate_proj", "up": "up_proj"},
    "down_proj": {None: "down_proj"},
}
TARGET_KINDS = LORA_TARGET_KINDS
# the layers adapters attach to, float or quantized, whole or split over tensor-parallel ranks
LINEAR_TYPES = (nn.Linear, MergedLinear, QuantizedLinear, RowParallelLinear)


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    slot: int


@dataclass(frozen=True)
class RankSync:
    """How a tensor-parallel rank's manager keeps its slots the same as every other rank's:
    `agree(ok)` says whether every rank read and fitted an adapter; `announce(name, path)`
    (rank 0's only, else None) has the other ranks load the adapter at `path` as `name`, or
    unload `name` when `path` is None."""

    agree: Callable[[bool], bool]
    announce: Callable[[str, str | None], None] | None


ALONE = RankSync(agree=bool, announce=None)


class LoRAManager:
    """Adapter slots on `model`'s linear layers (see the module). Not thread-safe, as the
    runner is not."""

    def __init__(self, model: nn.Module, *, paths: dict[str, str], slots: int, max_rank: int | None,
                 target_modules: tuple[str, ...] | None, dtype: torch.dtype, device: torch.device,
                 sync: RankSync = ALONE) -> None:
        self.model, self.num_slots, self.sync = model, slots, sync
        if model.config.vocab_size > TOKEN_MASK + 1:
            raise ValueError(f"LoRA: a vocabulary of {model.config.vocab_size} tokens exceeds the {TOKEN_MASK + 1} the "
                             "radix cache's adapter namespaces leave")
        starting = [read_adapter(name, path, model) for name, path in paths.items()]
        if len(starting) > slots:
            raise ValueError(f"{len(starting)} LoRA adapters do not fit max_loras_per_batch {slots}")
        kinds = set(TARGET_KINDS) if target_modules and "all" in target_modules else set(target_modules or ())
        if target_modules is None:
            kinds = {self._kind(module, shard) for a in starting for module, shard in a.modules}
        rank = max_rank or max((a.rank for a in starting), default=0)
        if not kinds or not rank:
            raise ValueError("LoRA needs lora_paths (adapters to load at start) or both lora_target_modules and "
                             "max_lora_rank (for adapters loaded later)")
        self.rank = rank
        self.tokens = LoRATokens()
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            kinds_here = LAYER_KINDS.get(name.rpartition(".")[2])
            if kinds_here is None or not isinstance(module, LINEAR_TYPES):
                continue
            if kinds & set(kinds_here.values()):
                self.layers[name] = LoRALayer(module, layer_split(module), slots=slots, rank=rank,
                                              tokens=self.tokens, dtype=dtype, device=device)
        self.kinds = frozenset(kinds)
        self.loaded: dict[str, LoadedAdapter] = {}
        for adapter in starting:
            self._install(*self._place(adapter))

    @staticmethod
    def _kind(module: str, shard: str | None) -> str:
        kinds = LAYER_KINDS.get(module.rpartition(".")[2])
        if kinds is None or shard not in kinds:
            raise ValueError(f"LoRA on {module} ({shard or 'whole'}) is not supported: adapters apply to "
                             f"{', '.join(TARGET_KINDS)}")
        return kinds[shard]

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """Read the adapter at `path` and give it a free slot under `name`; ValueError if the
        name is taken, no slot is free, it cannot be read or it does not fit the layers and
        rank chosen at start, on this rank or (tensor parallelism) any other: nothing
        changes then, on any rank."""
        if self.sync.announce is not None:
            self.sync.announce(name, str(path))
        error: Exception | None = None
        try:
            if name in self.loaded:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            if len(self.loaded) >= self.num_slots:
                raise ValueError(f"all {self.num_slots} LoRA slots (max_loras_per_batch) hold adapters: unload one "
                                 "first")
            placed = self._place(read_adapter(name, path, self.model))
        except Exception as e:  # any failure to read it: every rank must still answer `agree`
            error = e
        if not self.sync.agree(error is None):
            if error is None:
                raise ValueError(f"{path}: LoRA adapter {name!r} was not loaded: another tensor-parallel rank "
                                 "could not load it")
            if isinstance(error, ValueError):
                raise error
            raise ValueError(f"{path}: LoRA adapter {name!r} was not loaded: {error}") from error
        return self._install(*placed)

    def unload(self, name: str) -> LoadedAdapter:
        """Free `name`'s slot (its weights zeroed); the caller drops the prefixes cached
        with it and makes sure no request uses it."""
        adapter = self.get(name)
        if self.sync.announce is not None:
            self.sync.announce(name, None)
        for layer in self.layers.values():
            layer.write(adapter.slot, {})
        del self.loaded[name]
        return adapter

    def get(self, name: str) -> LoadedAdapter:
        """The loaded adapter `name`; ValueError listing the loaded ones otherwise."""
        if name not in self.loaded:
            loaded = ", ".join(repr(n) for n in self.loaded) or "none"
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return self.loaded[name]

    def _place(self, adapter: LoRAAdapter) -> tuple[LoRAAdapter, int, dict[str, dict]]:
        """`adapter`, the slot it would take and its modules by layer; ValueError (nothing
        written) unless it fits."""
        by_layer: dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (module, shard), weights in adapter.modules.items():
            kind = self._kind(module, shard)
            if module not in self.layers or kind not in self.kinds:
                raise ValueError(f"{adapter.path}: adapts {kind} ({module}), which this server does not adapt "
                                 f"(enabled: {', '.join(sorted(self.kinds))}; set lora_target_modules at start)")
            by_layer.setdefault(module, {})[shard] = weights
        slot = min(set(range(self.num_slots)) - {a.slot for a in self.loaded.values()})
        for module, modules in by_layer.items():
            self.layers[module].check(slot, modules, f"{adapter.path}: {module}")
        return adapter, slot, by_layer

    def _install(self, adapter: LoRAAdapter, slot: int, by_layer: dict[str, dict]) -> LoadedAdapter:
        for module, layer in self.layers.items():
            layer.write(slot, by_layer.get(module, {}))
        loaded = LoadedAdapter(adapter.name, adapter.path, slot)
        self.loaded[adapter.name] = loaded
        return loaded
