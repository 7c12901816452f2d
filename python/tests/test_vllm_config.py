"""The vLLM plugin's parts that need no vLLM (run by CI): it is off unless configured, its
settings are parsed with clear errors, the entry point is declared, and the load format's filter
takes routed expert tensors and nothing else. The plugin with vLLM: test_vllm.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from expertmesh import vllm as plugin


def test_the_plugin_is_off_without_a_router():
    assert plugin.PluginConfig.from_env({}) is None
    assert plugin.PluginConfig.from_env({plugin.ENV_ROUTER: "  "}) is None


def test_register_without_a_router_imports_nothing_and_registers_nothing():
    code = (
        "import os, sys\n"
        f"os.environ.pop({plugin.ENV_ROUTER!r}, None)\n"
        "from expertmesh import vllm as p\n"
        "p.register()\n"
        "assert 'vllm' not in sys.modules, 'register() imported vllm while off'\n"
        "assert not p._REGISTERED and p._CONFIG is None\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_settings_are_read_with_defaults():
    cfg = plugin.PluginConfig.from_env({plugin.ENV_ROUTER: "10.0.0.7:47400"})
    assert cfg == plugin.PluginConfig(router="10.0.0.7:47400")
    cfg = plugin.PluginConfig.from_env({
        plugin.ENV_ROUTER: "r:1", plugin.ENV_CLUSTER: "prod", plugin.ENV_CREDENTIALS: "/k/f.cred",
        plugin.ENV_MAX_TOKENS: "64", plugin.ENV_DEADLINE_MS: "250.5",
    })
    assert cfg == plugin.PluginConfig(router="r:1", cluster="prod", credentials="/k/f.cred",
                                      max_tokens=64, deadline_ms=250.5)


@pytest.mark.parametrize("name,value", [
    (plugin.ENV_MAX_TOKENS, "0"), (plugin.ENV_MAX_TOKENS, "-3"), (plugin.ENV_MAX_TOKENS, "many"),
    (plugin.ENV_MAX_TOKENS, "2.5"), (plugin.ENV_DEADLINE_MS, "0"), (plugin.ENV_DEADLINE_MS, "nan"),
    (plugin.ENV_DEADLINE_MS, "inf"), (plugin.ENV_DEADLINE_MS, "1e13"),
])
def test_a_malformed_setting_is_an_error_naming_it(name, value):
    with pytest.raises(ValueError) as e:
        plugin.PluginConfig.from_env({plugin.ENV_ROUTER: "r:1", name: value})
    assert name in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize("name,routed", [
    ("model.layers.1.mlp.experts.7.up_proj.weight", True),
    ("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv", True),
    ("model.layers.12.mlp.experts.gate_up_proj", True),  # fused (transformers 5)
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", True),  # Mixtral
    ("model.layers.3.mlp.shared_experts.up_proj.weight", False),  # DeepSeek's shared experts
    ("model.layers.3.mlp.shared_expert.gate_proj.weight", False),  # Qwen2-MoE's
    ("model.layers.3.mlp.shared_expert_gate.weight", False),
    ("model.layers.3.mlp.gate.weight", False),
    ("model.layers.3.mlp.gate.e_score_correction_bias", False),
    ("model.layers.0.mlp.down_proj.weight", False),  # a dense layer
    ("model.embed_tokens.weight", False),
])
def test_the_load_format_skips_routed_expert_tensors_only(name, routed):
    assert plugin.is_routed_expert_tensor(name) is routed


def test_the_entry_point_is_declared():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'expertmesh = "expertmesh.vllm:register"' in text


def test_only_the_pinned_vllm_release_is_taken():
    for ok in ("0.32.0", "0.32.3", "0.32.0+cpu"):
        plugin.check_vllm_version(ok)
    for bad in ("0.31.2", "0.33.0", "1.32.0", "0.3.2"):
        with pytest.raises(RuntimeError, match=f"vLLM {bad} is not supported.*0.32"):
            plugin.check_vllm_version(bad)


def test_engines_the_plugin_cannot_serve_are_refused_naming_the_setting():
    fine = dict(tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
                expert_parallel=False, cuda_graphs=False)
    plugin.check_engine(**fine)
    cases = [
        ({"tensor_parallel": 2}, "tensor_parallel_size=2.*--tensor-parallel-size 1"),
        ({"pipeline_parallel": 4}, "pipeline_parallel_size=4"),
        ({"data_parallel": 2}, "data_parallel_size=2"),
        ({"expert_parallel": True}, "enable_expert_parallel"),
        ({"cuda_graphs": True}, "CUDA graphs.*--enforce-eager"),
    ]
    for change, want in cases:
        with pytest.raises(ValueError, match=want):
            plugin.check_engine(**{**fine, **change})
