"""Tiny MoE checkpoints for the frontend tests (transformers and vLLM): built by transformers
from a config with random weights, optionally with every expert weight moved onto the packed
INT4 grid (so `expertmesh convert` is lossless and the fabric serves the very model that runs
locally), saved and converted with the `expertmesh` binary. Needs torch and transformers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch
import transformers

from fabric_util import EXAMPLES, expertmesh_bin, topology_with_free_ports

KINDS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3")


def tiny(kind: str, head_dim: int = 16, hidden: int = 64,
         max_positions: int = 128) -> "transformers.PreTrainedModel":
    """A tiny model of family ``kind`` (random weights; seed them first). ``head_dim``: the
    attention head size (vLLM's CPU attention needs 32 or more; transformers takes 16)."""
    heads = hidden // head_dim
    common = dict(vocab_size=64, hidden_size=hidden, num_attention_heads=heads,
                  max_position_embeddings=max_positions)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_key_value_heads=max(1, heads // 2), head_dim=head_dim, num_experts=8,
            num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True, **common)
        return transformers.Qwen3MoeForCausalLM(cfg)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=32, num_hidden_layers=2, num_key_value_heads=max(1, heads // 2),
            num_local_experts=8, num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(cfg)
    if kind == "olmoe":
        cfg = transformers.OlmoeConfig(
            intermediate_size=32, num_hidden_layers=2, num_key_value_heads=heads, num_experts=8,
            num_experts_per_tok=2, **common)
        return transformers.OlmoeForCausalLM(cfg)
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_hidden_layers=2, num_key_value_heads=max(1, heads // 2), num_experts=8,
            num_experts_per_tok=2, **common)
        return transformers.Qwen2MoeForCausalLM(cfg)
    if kind == "deepseek_v3":
        # MLA: transformers takes any size; vLLM's reference CPU MLA (the one that runs
        # float32) only DeepSeek-V3's latent: kv_lora_rank 512 + rope 64.
        mla = (dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
               if head_dim == 16 else
               dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=head_dim,
                    v_head_dim=head_dim))
        cfg = transformers.DeepseekV3Config(
            intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_key_value_heads=heads, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=None, **mla,
            routed_scaling_factor=2.5,
            # What DeepSeek-V3's own config.json says (transformers' config leaves them out;
            # vLLM reads them: without noaux_tc it has no e_score_correction_bias to load).
            topk_method="noaux_tc", scoring_func="sigmoid", **common)
        return transformers.DeepseekV3ForCausalLM(cfg)
    raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")


def make_int4_exact(model: "torch.nn.Module") -> None:
    """Round every expert weight (routed and shared; not the router gates) onto the packed INT4
    grid: groups of 32 along the input dimension, a bf16 scale s = max|w| / 8 and codes in
    [-8, 7] with the largest element at -8. The converter then reproduces these weights
    exactly (quantization error 0), so the fabric serves the very model that runs locally."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            expert = (".experts." in name or ".experts" in name.rsplit(".", 1)[0]
                      or ".shared_expert." in name or ".shared_experts." in name)
            if not expert or p.dim() < 2 or p.shape[-1] % 32:
                continue
            g = p.data.reshape(*p.shape[:-1], p.shape[-1] // 32, 32)
            s = (g.abs().amax(-1, keepdim=True) / 8).to(torch.bfloat16).to(torch.float32)
            s = torch.where(s == 0, torch.ones_like(s), s)
            q = torch.clamp(torch.round(g / s), -8, 7)
            top = g.abs().argmax(-1, keepdim=True)
            q.scatter_(-1, top, -8.0)
            p.data.copy_((q * s).reshape(p.shape))


def save_and_convert(model: "torch.nn.Module", tmp: Path) -> Path:
    """Save ``model`` as a checkpoint under ``tmp`` and convert it into ``tmp / "w"`` with the
    ``expertmesh`` binary; returns the checkpoint folder."""
    ckpt = tmp / "ckpt"
    model.save_pretrained(ckpt, safe_serialization=True)
    topo = topology_with_free_ports(EXAMPLES / "single-host.toml", tmp / "t.toml")
    r = subprocess.run(
        [str(expertmesh_bin()), "convert", "--checkpoint", str(ckpt), "--topology", str(topo),
         "--out", str(tmp / "w")],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    return ckpt
