"""gpt-oss: what its config.json says becomes `ModelConfig` (sliding layers, clamped SwiGLU,
MXFP4 experts); float and MXFP4 checkpoints against transformers (logits, greedy
generation); MXFP4 experts stay packed; what sprig refuses for it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact, contexts_step, hf_greedy, make_prompts
from gpt_oss_checkpoints import MXFP4_CONFIG, mxfp4_pair
from transformers import AutoModelForCausalLM, Mxfp4Config
from weight_checkpoints import edited_copy

from sprig.runtime import Engine
from sprig.runtime.distributed.shard import ShardPlan
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.layers.moe import GptOssExperts
from sprig.runtime.model_config import ModelConfig, MoEConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint
from sprig.runtime.weight_loader import load_model

CPU = torch.device("cpu")
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A sharp float gpt-oss (windows of 3), its MXFP4 form and the MXFP4 form's float twin."""
    root = tmp_path_factory.mktemp("gpt_oss")
    float_path = build_tiny_checkpoint(root / "source", "gpt_oss", seed=5, sliding_window=3, num_hidden_layers=3,
                                       initializer_range=0.2)
    mxfp4, twin = mxfp4_pair(float_path, root)
    return {"float": float_path, "mxfp4": mxfp4, "twin": twin}


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


def test_config(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(checkpoints["float"])
    assert config.moe == MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=64, renormalize=True,
                                   clamped_swiglu=(1.702, 7.0))
    assert (config.sliding_window, config.sliding_layers) == (3, (0, 2))
    assert config.attention_bias and config.rope_scaling["rope_type"] == "yarn" and config.quantization is None
    packed = ModelConfig.from_pretrained(checkpoints["mxfp4"])
    assert packed.moe.expert_format == "mxfp4" and packed.quantization is None
    copy = edited_copy(checkpoints["float"], tmp_path / "older", lambda w: w)
    cfg = json.loads((copy / "config.json").read_text())
    del cfg["layer_types"], cfg["swiglu_alpha"]
    cfg["swiglu_limit"] = 5.0
    (copy / "config.json").write_text(json.dumps(cfg))
    older = ModelConfig.from_pretrained(copy)  # gpt-oss's released config.json: no layer_types, no alpha
    assert older.sliding_layers == (0, 2) and older.moe.clamped_swiglu == (1.702, 5.0)


def test_mxfp4_on_other_modules_or_models_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    copy = edited_copy(checkpoints["mxfp4"], tmp_path / "attn", lambda w: w)
    _edit_config(copy, quantization_config=MXFP4_CONFIG | {"modules_to_not_convert": ["lm_head"]})
    with pytest.raises(ValueError, match="MXFP4 weights are supported for gpt-oss's experts only"):
        ModelConfig.from_pretrained(copy)
    llama = build_tiny_checkpoint(tmp_path / "llama", "llama")
    _edit_config(llama, quantization_config=MXFP4_CONFIG)
    with pytest.raises(ValueError, match="MXFP4 weights are supported for gpt-oss's experts only"):
        ModelConfig.from_pretrained(llama)


def test_mxfp4_experts_stay_packed(checkpoints: dict[str, Path]) -> None:
    model = load_model(ModelConfig.from_pretrained(checkpoints["mxfp4"]), checkpoints["mxfp4"],
                       dtype=torch.bfloat16, device=CPU)
    experts = [m for m in model.modules() if isinstance(m, GptOssExperts)]
    assert len(experts) == 3
    for e in experts:
        assert e.gate_up_proj_blocks.dtype == torch.uint8 and e.gate_up_proj_blocks.shape == (4, 128, 2, 16)
        assert e.down_proj_scales.dtype == torch.uint8 and e.down_proj_scales.shape == (4, 64, 2)
        assert e.gate_up_proj_bias.dtype == torch.bfloat16 and not hasattr(e, "gate_up_proj")


def _hf_logits(path: Path, ids: list[int], **kwargs) -> torch.Tensor:  # [len, V]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _sprig_logits(path: Path, ids: list[int]) -> torch.Tensor:  # [len, V]
    runner = ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", max_total_tokens=64))
    first = runner.kv_cache.page_size  # slots of the first page are reserved
    slots = torch.arange(first, first + len(ids), dtype=torch.int32)
    return runner.forward(contexts_step(ForwardMode.EXTEND, ids, [len(ids)], [slots], [0]))


def test_float_and_mxfp4_match_transformers(checkpoints: dict[str, Path]) -> None:
    ids = torch.randint(3, 500, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    want = _hf_logits(checkpoints["twin"], ids)
    # transformers reads the MXFP4 checkpoint (dequantizing it) as the float twin
    torch.testing.assert_close(_hf_logits(checkpoints["mxfp4"], ids, quantization_config=Mxfp4Config(dequantize=True)),
                               want, atol=1e-5, rtol=0)
    packed, twin = _sprig_logits(checkpoints["mxfp4"], ids), _sprig_logits(checkpoints["twin"], ids)
    assert torch.equal(packed, twin)  # packed experts compute exactly the values they stand for
    torch.testing.assert_close(twin, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(_sprig_logits(checkpoints["float"], ids), _hf_logits(checkpoints["float"], ids),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [None, 3])
def test_engine_greedy_equals_transformers(checkpoints: dict[str, Path], chunk: int | None) -> None:
    prompts = make_prompts(4, seed=2)
    want = hf_greedy(checkpoints["twin"], prompts, 10)
    with Engine(str(checkpoints["mxfp4"]), dtype="float32", chunked_prefill_size=chunk) as engine:
        batched = [o["output_ids"] for o in engine.generate(prompts, GREEDY)]
        alone = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
        assert_idle_and_intact(engine)
    assert batched == want and alone == want


def test_a_missing_expert_tensor_is_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    dropped = "model.layers.1.mlp.experts.down_proj_scales"
    broken = edited_copy(checkpoints["mxfp4"], tmp_path / "broken", lambda w: {k: v for k, v in w.items() if k != dropped})
    with pytest.raises(ValueError, match=f"missing tensor\\(s\\) {dropped.replace('.', '[.]')}$"):
        load_model(ModelConfig.from_pretrained(broken), broken, dtype=torch.float32, device=CPU)


def test_mxfp4_experts_split_over_ranks_only_in_whole_blocks(checkpoints: dict[str, Path]) -> None:
    """The experts' 64 features split into 32 a rank at TP=2 (one block of MXFP4 codes) and
    16 at TP=4: float splits either way; MXFP4 at TP=4 is refused before any rank starts,
    naming the sizes, and leaves no process behind."""
    ShardPlan(ModelConfig.from_pretrained(checkpoints["float"]), 3, 4)
    ShardPlan(ModelConfig.from_pretrained(checkpoints["mxfp4"]), 1, 2)
    before = _children()
    with pytest.raises(ValueError, match="blocks of 32; an expert intermediate size of 64 over 4 ranks is 16 per rank"):
        Engine(str(checkpoints["mxfp4"]), tp_size=4, dtype="float32", device="cpu")
    assert _children() == before


def _children() -> set[int]:
    """The ids of this process's child processes, exited and unreaped included (Linux's /proc)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])  # after the name: state, then ppid
        except OSError:  # exited meanwhile
            continue
        if ppid == os.getpid():
            pids.add(int(stat.parent.name))
    return pids


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_cuda_graphs_and_triton_equal_transformers(checkpoints: dict[str, Path], kind: str) -> None:
    """On CUDA the sinks run in the Triton attention kernels and the (MXFP4) experts in the
    Triton expert kernel, captured in decode graphs: greedy tokens equal transformers' in
    graphs and eagerly."""
    prompts = make_prompts(6, seed=3)
    want = hf_greedy(checkpoints["float" if kind == "float" else "twin"], prompts, 10)
    for graphs in (False, True):
        with Engine(str(checkpoints[kind]), device="cuda", dtype="float32", disable_cuda_graph=not graphs) as engine:
            assert [o["output_ids"] for o in engine.generate(prompts, GREEDY)] == want
            assert_idle_and_intact(engine)
