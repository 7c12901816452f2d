"""Tiny Hugging Face MoE checkpoint folders written with NumPy only (config.json +
model.safetensors), the way the published Qwen3-MoE and Mixtral checkpoints name their tensors.

safetensors: an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` (offsets into the data that follows), then the raw
little-endian tensors. Weights are BF16 (as real checkpoints), random with standard deviation
``1/sqrt(fan_in)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import numpy as np


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = u + 0x7FFF + ((u >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: Dict[str, np.ndarray]) -> None:
    """``tensors``: float32 arrays (stored F32) or uint16 arrays (stored as BF16 bits)."""
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: List[bytes] = []
    offset = 0
    for name, a in tensors.items():
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16"}[a.dtype]
        raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_tiny_checkpoint(
    out: Path,
    model_type: str = "qwen3_moe",
    *,
    hidden: int = 64,
    moe_inter: int = 32,
    experts: int = 8,
    top_k: int = 2,
    layers: int = 3,
    seed: int = 0,
) -> Dict[str, object]:
    """Write a tiny checkpoint folder of ``model_type`` (``qwen3_moe``: layer 0 dense, the
    others MoE; ``mixtral``: every layer MoE) and return its config."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)

    def w(rows: int, cols: int) -> np.ndarray:
        return bf16_bits(rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols))

    t: Dict[str, np.ndarray] = {"model.embed_tokens.weight": w(16, hidden)}
    if model_type == "qwen3_moe":
        dense = [0]
        config: Dict[str, object] = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": experts,
            "moe_intermediate_size": moe_inter,
            "intermediate_size": 2 * hidden,
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense,
            "norm_topk_prob": True,
        }
        for l in range(layers):
            p = f"model.layers.{l}.mlp"
            if l in dense:
                t[f"{p}.gate_proj.weight"] = w(2 * hidden, hidden)
                t[f"{p}.up_proj.weight"] = w(2 * hidden, hidden)
                t[f"{p}.down_proj.weight"] = w(hidden, 2 * hidden)
                continue
            t[f"{p}.gate.weight"] = w(experts, hidden)
            for e in range(experts):
                t[f"{p}.experts.{e}.gate_proj.weight"] = w(moe_inter, hidden)
                t[f"{p}.experts.{e}.up_proj.weight"] = w(moe_inter, hidden)
                t[f"{p}.experts.{e}.down_proj.weight"] = w(hidden, moe_inter)
    elif model_type == "mixtral":
        config = {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": experts,
            "intermediate_size": moe_inter,
        }
        for l in range(layers):
            p = f"model.layers.{l}.block_sparse_moe"
            t[f"{p}.gate.weight"] = w(experts, hidden)
            for e in range(experts):
                t[f"{p}.experts.{e}.w1.weight"] = w(moe_inter, hidden)
                t[f"{p}.experts.{e}.w3.weight"] = w(moe_inter, hidden)
                t[f"{p}.experts.{e}.w2.weight"] = w(hidden, moe_inter)
    else:
        raise ValueError(f"model_type {model_type!r}: qwen3_moe or mixtral")
    config.update(
        {
            "model_type": model_type,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_experts_per_tok": top_k,
            "hidden_act": "silu",
            "vocab_size": 16,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(out / "model.safetensors", t)
    return config
