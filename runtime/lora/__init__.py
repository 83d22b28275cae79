"""LoRA adapters over the served model: PEFT adapters read (`adapter`), stacked in slots of
the adapted layers and applied per token (`layers`), each tensor-parallel rank holding its
part (`split`), loaded and unloaded by name (`manager`)."""

from sprig.runtime.lora.adapter import LoRAAdapter, read_adapter
from sprig.runtime.lora.manager import LoadedAdapter, LoRAManager

__all__ = ["LoRAAdapter", "LoRAManager", "LoadedAdapter", "read_adapter"]
