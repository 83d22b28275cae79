"""Phi-3, Phi-3.5 and Phi-4 (`Phi3ForCausalLM`): Llama's network without biases, whose
checkpoints store q/k/v and gate/up already fused (`qkv_proj`, `gate_up_proj`, stacked in
sprig's shard order). What differs lives in the config (`ModelConfig`): longrope scaling,
partial rotary (Phi-4-mini), a sliding window in every layer (Phi-3-mini-4k), a tied head
(Phi-4-mini). Its dropouts (`resid_pdrop`, `embd_pdrop`, `attention_dropout`) are
training-only and absent here."""

from __future__ import annotations

from typing import ClassVar

from sprig.runtime.layers.attention import AttentionOptions
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """`split_checkpoint_modules`: the checkpoint modules whose one tensor holds every
    shard of the fused layer of the same name, in its shard order (the loader cuts it
    into its shards, then, under tensor parallelism, each shard into the rank's heads or
    features, as it would an unfused checkpoint's q/k/v and gate/up tensors)."""

    split_checkpoint_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "gate_up_proj")

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions()
