"""Serve a transformers model's sparse MoE blocks from the fabric: ``attach(model, client)``.

Every sparse MoE block of the model (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 / Kimi K2,
GLM-4.5) is replaced by a :class:`FabricMoE` module that sends its input to the router and
returns the fabric's output; attention, norms, embeddings and dense MLP layers stay local. The
fabric must serve the same checkpoint (``expertmesh convert --checkpoint DIR`` then ``expertmesh
up --weights``)::

    import torch, transformers, expertmesh
    from expertmesh import hf

    model = transformers.AutoModelForCausalLM.from_pretrained(DIR, torch_dtype=torch.bfloat16)
    client = expertmesh.RouterClient("127.0.0.1:47400", cluster="cpu-host")
    hf.attach(model, client)              # replaced blocks: {layer: module name}
    out = model.generate(**tok("Hello", return_tensors="pt"), max_new_tokens=20)

Written against transformers 4.57 and tested with 5.19 and 5.24 too (the MoE block classes ``Qwen3MoeSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock``, ``DeepseekV3MoE``
(also Kimi K2's remote code), ``Glm4MoeMoE``) and torch ≥ 2.1. Blocks are found by class name,
and their decoder layer index by module name (``model.layers.{L}.mlp`` or
``.block_sparse_moe``), which is the ``layer`` the router serves. A block whose original
returned ``(hidden_states, router_logits)`` (transformers 4.x's Qwen/Mixtral/OLMoE blocks)
returns the same pair: the router logits are computed by the block's own gate, kept local.

The hidden states travel as the model's dtype (bf16, f16 or f32; others as f32) straight from
the tensor (DLPack, no copy on CPU; a GPU tensor is copied to the CPU first); the output
(float32) is cast back to the model's dtype and device. Requests above ``max_tokens`` tokens
(the router's ``--max-tokens``, 256 by default) are split and pipelined on the connection.
``drop_experts=True`` (default) lets the replaced blocks' expert weights be freed;
``False`` keeps each original block as ``module.original``.

Needs ``torch`` and ``transformers`` (``pip install torch transformers``; not installed by
``pip install ./python``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from . import _native

__all__ = ["attach", "load_without_experts", "FabricMoE", "MOE_BLOCK_CLASSES"]

# class name -> whether the transformers 4.x block returns (hidden_states, router_logits)
MOE_BLOCK_CLASSES: Dict[str, bool] = {
    "Qwen3MoeSparseMoeBlock": True,
    "Qwen2MoeSparseMoeBlock": True,
    "MixtralSparseMoeBlock": True,
    "OlmoeSparseMoeBlock": True,
    "DeepseekV3MoE": False,
    "Glm4MoeMoE": False,
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)$")


def _torch() -> Any:
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:  # pragma: no cover - exercised only without torch
        raise ImportError("expertmesh.hf needs torch: pip install torch transformers") from e
    return torch


def _returns_pair(class_name: str) -> bool:
    """transformers 5 blocks return only the hidden states (router logits are recorded by
    hooks); 4.x Qwen/Mixtral/OLMoE blocks return the pair."""
    try:
        import transformers  # type: ignore[import-not-found, unused-ignore]

        major = int(transformers.__version__.split(".")[0])
    except Exception:  # pragma: no cover
        major = 4
    return MOE_BLOCK_CLASSES.get(class_name, False) and major < 5


def _make_module_class() -> Any:
    torch = _torch()

    class FabricMoE(torch.nn.Module):  # type: ignore[misc,name-defined]
        """A sparse MoE block served by the fabric: ``forward(hidden_states)`` sends
        ``[..., hidden]`` to the router's ``layer`` and returns its output (and the local gate's
        router logits when the replaced block returned them)."""

        def __init__(
            self,
            client: _native.RouterClient,
            layer: int,
            gate: Optional[Any],
            returns_pair: bool,
            max_tokens: int,
            deadline_ms: Optional[float],
        ) -> None:
            super().__init__()
            self.client = client
            self.layer = layer
            self.gate = gate
            self.returns_pair = returns_pair
            self.max_tokens = max_tokens
            self.deadline_ms = deadline_ms

        def extra_repr(self) -> str:
            return f"layer={self.layer}, router={self.client.addr}"

        def forward(self, hidden_states: Any) -> Any:
            shape, dtype, device = hidden_states.shape, hidden_states.dtype, hidden_states.device
            x = hidden_states.detach().reshape(-1, shape[-1])
            if x.device.type != "cpu":
                x = x.to("cpu")
            if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                x = x.float()
            x = x.contiguous()
            out = torch.empty(x.shape[0], shape[-1], dtype=torch.float32)
            step = max(1, self.max_tokens)
            handles = [
                (i, self.client.submit(self.layer, x[i : i + step], deadline_ms=self.deadline_ms))
                for i in range(0, x.shape[0], step)
            ]
            for i, h in handles:
                self.client.wait(h, out=out[i : i + step])
            y = out.to(device=device, dtype=dtype).reshape(shape)
            if not self.returns_pair:
                return y
            logits = self.gate(hidden_states.reshape(-1, shape[-1])) if self.gate is not None else None
            return y, logits

    return FabricMoE


_FABRIC_MOE: Any = None


def __getattr__(name: str) -> Any:
    # `FabricMoE` needs torch: built on first use, so `import expertmesh.hf` works without it.
    global _FABRIC_MOE
    if name == "FabricMoE":
        if _FABRIC_MOE is None:
            _FABRIC_MOE = _make_module_class()
        return _FABRIC_MOE
    raise AttributeError(name)


def attach(
    model: Any,
    client: _native.RouterClient,
    *,
    max_tokens: int = 256,
    deadline_ms: Optional[float] = None,
    drop_experts: bool = True,
) -> Dict[int, str]:
    """Replace every sparse MoE block of ``model`` by a :class:`FabricMoE` calling ``client``.

    Returns ``{decoder layer index: module name}`` of the replaced blocks. Raises
    ``ValueError`` when the model has none (an unsupported family: see
    :data:`MOE_BLOCK_CLASSES`), and whatever ``client.check_shape`` raises when the router does
    not serve a replaced layer with the model's hidden size (it serves another checkpoint) or
    takes fewer than ``max_tokens`` tokens per request (lower ``max_tokens`` to its
    ``--max-tokens``). Each block sends requests of at most ``max_tokens`` tokens, fewer where
    one shape probe (8 MiB at a byte per value) carries fewer.
    Every block is found and checked before any is replaced: when it raises, the model is as
    it was.
    """
    cls = __getattr__("FabricMoE")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    blocks = []
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind not in MOE_BLOCK_CLASSES:
            continue
        m = _LAYER.search(name)
        if not m:
            raise ValueError(f"{name}: a {kind} outside model.layers.N.mlp; cannot tell its layer")
        blocks.append((int(m.group(1)), name, module, kind))
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no sparse MoE block of a known class "
            f"({', '.join(MOE_BLOCK_CLASSES)}); transformers version mismatch?"
        )
    steps = _request_steps(client, [b[0] for b in blocks], hidden, max_tokens)
    found: Dict[int, str] = {}
    for layer, name, module, kind in blocks:
        found[layer] = name
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        gate = getattr(module, "gate", None)
        replacement = cls(client, layer, gate, _returns_pair(kind), steps[layer], deadline_ms)
        if not drop_experts:
            replacement.original = module  # kept (a submodule): e.g. to compare outputs
        setattr(parent, attr, replacement)
    return found


def _request_steps(
    client: _native.RouterClient, layers: List[int], hidden: Optional[int], max_tokens: int
) -> Dict[int, int]:
    """Tokens per request for each of ``layers``: ``max_tokens``, or fewer where one shape probe
    cannot carry ``max_tokens`` x ``hidden`` (8 MiB at a byte per value: the router is asked
    about that many, and requests are cut to it). Raises ``ValueError`` for
    ``max_tokens`` below 1, and whatever ``client.check_shape`` raises when the router does not
    serve a layer with ``hidden`` values per token or takes fewer than ``max_tokens`` tokens
    per request (its ``--max-tokens``): then every forward of more tokens would fail, so
    attaching fails first. Without ``hidden`` (a model without ``config.hidden_size``) nothing
    is asked."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    if hidden is None:
        return {layer: max_tokens for layer in layers}
    return {
        layer: max(1, min(max_tokens, int(client.check_shape(layer, max_tokens, int(hidden)))))
        for layer in layers
    }


def _checkpoint_files(checkpoint: Any) -> list:
    """The safetensors files of a checkpoint folder (through its index when sharded)."""
    import json
    from pathlib import Path

    d = Path(checkpoint)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{d}: no model.safetensors or model.safetensors.index.json")


def refuse_quantized(checkpoint: Any, quantization_config: Any) -> None:
    """Raises ``ValueError`` naming the method when ``quantization_config`` (a model config's)
    says the checkpoint is quantized: :func:`load_without_experts` would read its FP8 or
    integer attention and dense weights without their scales."""
    if not quantization_config:
        return
    qc = quantization_config
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    raise ValueError(
        f"{checkpoint}: a quantized checkpoint (quant_method {method!r}): load_without_experts "
        "reads unquantized (bf16/f16/f32) checkpoints only; its non-expert weights would be read "
        "without their scales. The fabric converts this checkpoint's experts (expertmesh "
        "convert); load the frontend from an unquantized copy of the same model."
    )


def load_without_experts(
    checkpoint: Any,
    client: _native.RouterClient,
    *,
    dtype: Any = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    **attach_kwargs: Any,
) -> Any:
    """Build ``checkpoint``'s model with its MoE blocks served by ``client``, reading only the
    tensors the frontend runs: the model is built on the meta device, :func:`attach` replaces
    its MoE blocks, then exactly the remaining parameters and buffers are read from the
    safetensors files (the experts are never read) and non-persistent buffers (rotary
    frequencies) are re-created on ``device``. Returns the model; ``model.expertmesh_layers``
    is what :func:`attach` returned and ``model.expertmesh_loaded`` lists the tensors read.

    ``trust_remote_code`` is passed to transformers (Kimi K2's ``kimi_k2`` model type is
    remote code). Only unquantized (bf16/f16/f32) checkpoints load this way: a quantized one
    (FP8 with block scales, GPTQ, AWQ, compressed-tensors) is refused, since its attention and
    dense weights would need the scales this loader does not apply (the fabric's converter
    reads those checkpoints; load the frontend from an unquantized copy of the same model)."""
    torch = _torch()
    import transformers
    from safetensors import safe_open

    config = transformers.AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    refuse_quantized(checkpoint, getattr(config, "quantization_config", None))
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, torch_dtype=dtype, trust_remote_code=trust_remote_code
        )
    layers = attach(model, client, **attach_kwargs)
    wanted = set(model.state_dict().keys())
    state = {}
    for path in _checkpoint_files(checkpoint):
        with safe_open(str(path), framework="pt", device=device) as f:
            for key in f.keys():
                if key in wanted:
                    t = f.get_tensor(key)
                    if key.endswith(".weight") and not (t.is_floating_point() and t.element_size() >= 2):
                        # (FP8 or packed integers: the scales would be needed.)
                        raise ValueError(
                            f"{checkpoint}: tensor {key} is {t.dtype}, a quantized weight; "
                            "load_without_experts reads unquantized checkpoints only"
                        )
                    state[key] = t.to(dtype)
    missing = sorted(wanted - set(state))
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"{checkpoint}: tensors the model needs are missing: {missing[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device(device):
                fresh = type(module)(config=config)
            setattr(parent, attr, fresh)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{checkpoint}: not loaded: {left[:5]}")
    model.expertmesh_loaded = sorted(state)
    model.expertmesh_layers = layers
    return model.to(device).eval()
