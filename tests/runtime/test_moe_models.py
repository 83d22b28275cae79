"""Mixture-of-experts checkpoints: what config.json says becomes `MoEConfig` (each family's
keys), the layers it makes sparse, the checkpoint names each expert's tensors go by (and
a missing one named as the checkpoint names it), and what sprig refuses for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact, hf_greedy, make_prompts
from server_helpers import running_server
from weight_checkpoints import edited_copy

from sprig.runtime import Engine
from sprig.runtime.layers.mlp import GatedMLP
from sprig.runtime.layers.moe import SparseMoE
from sprig.runtime.model_config import ModelConfig, MoEConfig
from sprig.runtime.speculative.draft_decoder import supports
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint
from sprig.runtime.weight_loader import load_model


def _config(tmp_path: Path, **cfg) -> ModelConfig:
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(base | cfg))
    return ModelConfig.from_pretrained(tmp_path)


def test_each_familys_keys(tmp_path: Path) -> None:
    assert _config(tmp_path).moe is None
    mixtral = _config(tmp_path, architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2)
    assert mixtral.moe == MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=48, renormalize=True)
    qwen = _config(tmp_path, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=8, norm_topk_prob=True,
                   decoder_sparse_step=2, mlp_only_layers=[3], shared_expert_intermediate_size=24)
    assert qwen.moe == MoEConfig(num_experts=16, top_k=4, expert_intermediate_size=8, renormalize=True,
                                 shared_expert_intermediate_size=24, dense_layers=(0, 2, 3))
    saved = _config(tmp_path, num_local_experts=16, num_experts_per_tok=4, moe_intermediate_size=8)  # transformers 5's Qwen3-MoE
    assert saved.moe.num_experts == 16 and not saved.moe.renormalize and saved.moe.dense_layers == ()
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1\.\.4, got 5"):
        _config(tmp_path, num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)


def test_dense_layers_keep_a_dense_mlp(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "m", "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[2])
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, path, dtype=torch.float32, device=torch.device("cpu"))
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoE, SparseMoE, GatedMLP]
    assert model.model.layers[0].mlp.shared_expert is not None


@pytest.mark.parametrize(("arch", "dropped"), [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.3.down_proj.weight"),
    ("qwen2_moe", "model.layers.1.mlp.shared_expert.up_proj.weight"),
])
def test_a_missing_expert_tensor_is_named_as_the_checkpoint_names_it(
    arch: str, dropped: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    broken = edited_copy(tiny_checkpoints[arch], tmp_path / "broken", lambda w: {k: v for k, v in w.items() if k != dropped})
    config = ModelConfig.from_pretrained(broken)
    with pytest.raises(ValueError, match=f"missing tensor\\(s\\) {dropped.replace('.', '[.]')}$"):
        load_model(config, broken, dtype=torch.float32, device=torch.device("cpu"))


def test_an_expert_tensor_of_another_shape_is_refused(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    broken = edited_copy(tiny_checkpoints["mixtral"], tmp_path / "broken", lambda w: w | {name: w[name][:-1]})
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape \\[63, 64\\], the model expects \\[64, 64\\]"):
        load_model(ModelConfig.from_pretrained(broken), broken, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_weights_are_refused(quantization: str, tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=f"{quantization} weights are not supported for mixture-of-experts models "
                                         r"\(Qwen3MoeForCausalLM\)"):
        Engine(str(tiny_checkpoints["qwen3_moe"]), quantization=quantization)


def test_a_moe_draft_model_runs_through_its_runner(tiny_checkpoints: dict[str, Path]) -> None:
    """The CPU's lean draft decoder wires dense layers only; a mixture-of-experts draft's
    rounds run through its runner, and the outputs stay the target's."""
    path = tiny_checkpoints["qwen3_moe"]
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with Engine(str(path), dtype="float32") as plain:
        expected = plain.generate(["the cat and the dog", "one two"], greedy)
    with Engine(str(path), dtype="float32", check_integrity=True, speculative_algorithm="draft",
                speculative_draft_model_path=str(path), speculative_pass_costs="1,0,0,0,0,0,0") as engine:
        draft_runner = engine.scheduler.speculative.drafter.runner
        assert not supports(draft_runner)
        got = engine.generate(["the cat and the dog", "one two"], greedy)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
        assert engine.scheduler.speculative.stats.mean_accept_length > 2  # a draft equal to the target agrees


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_decode_graphs_capture_the_experts_on_cuda(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    """On CUDA the experts run the Triton path, which never reads routing on the host, so
    decode graphs capture it: greedy tokens in graphs equal transformers' and the eager
    run's."""
    prompts = make_prompts(6, seed=2)
    params = {"max_new_tokens": 10, "temperature": 0}
    expected = hf_greedy(tiny_checkpoints[arch], prompts, 10)
    with Engine(str(tiny_checkpoints[arch]), device="cuda", dtype="float32", disable_cuda_graph=True) as eager:
        assert [o["output_ids"] for o in eager.generate(prompts, params)] == expected
    with Engine(str(tiny_checkpoints[arch]), device="cuda", dtype="float32") as engine:
        assert [o["output_ids"] for o in engine.generate(prompts, params)] == expected
        assert engine.runner.graphs.captured
        assert_idle_and_intact(engine)


def test_served_over_http_with_the_openai_client(tiny_checkpoints: dict[str, Path]) -> None:
    """`sprig serve` on a Mixtral checkpoint: the log says what it loaded; `/generate` and
    the official client's chat completion return transformers' greedy tokens."""
    import openai

    path = tiny_checkpoints["mixtral"]
    prompt = "the cat and the dog"
    expected = hf_greedy(path, [prompt], 8)[0]
    with running_server(path) as server:
        assert "MixtralForCausalLM: a mixture of 4 experts, 2 per token" in server.log.read_text()
        out = server.generate({"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert out["output_ids"] == expected
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=6, temperature=0, logprobs=True)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
        tokens = [t.token for t in chat.choices[0].logprobs.content]
        assert "".join(tokens) == chat.choices[0].message.content
        server.wait_idle()
