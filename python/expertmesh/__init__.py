"""ExpertMesh from Python: call the fabric's router once per MoE layer.

A serving frontend (a PyTorch or transformers model server) keeps attention, norms and dense
layers local and sends each sparse MoE layer's hidden states to the fabric, which runs the
experts where their weights live and returns the combined output. Start a fabric with
``expertmesh up`` (it prints the frontend address and the cluster name), then::

    import numpy as np
    import expertmesh

    client = expertmesh.RouterClient("127.0.0.1:47400", cluster="single-host")
    x = np.random.randn(4, 1024).astype(np.float32)      # [tokens, hidden]
    y = client.moe(1, x)                                  # layer 1 -> [tokens, hidden] float32

Inputs are borrowed, not copied: ``x`` is a C-contiguous ``[tokens, hidden]`` float32, float16
or bfloat16-bits-as-uint16 NumPy array, or a CPU torch tensor (float32, float16, bfloat16)
through DLPack. ``out=`` receives the output in place. The GIL is released while a call is in
flight, so other Python threads run meanwhile.

Pipelining: several requests in flight on one connection::

    handles = [client.submit(layer, xs[i]) for i in range(8)]
    outs = [client.wait(h) for h in handles]              # any order

asyncio: :class:`expertmesh.aio.RouterClient` (``await client.moe(...)``).

Errors: every failed call raises a subclass of :class:`Error`. The router's refusals are
:class:`RouterError` subclasses named after its stable error codes — :class:`DeviceDown` (a
device the request needs is down), :class:`DeadlineExceeded`, :class:`Overloaded`,
:class:`BadRequest` (wrong hidden size, too many tokens, NaN), :class:`NotFound` (no such MoE
layer), ...; a connection that cannot be made or broke raises :class:`ConnectionFailed`.
Arguments that are wrong before anything is sent raise ``TypeError`` / ``ValueError`` naming the
argument.

Submodules: :mod:`expertmesh.aio` (asyncio client), :mod:`expertmesh.bench` (``python -m
expertmesh.bench --router ADDR``: Python vs Rust client throughput and latency),
:mod:`expertmesh.hf` (``attach(model, client)``: serve a transformers model's MoE blocks from
the fabric; needs torch and transformers), :mod:`expertmesh.vllm` (the vLLM plugin, entry point
``vllm.general_plugins``; needs vLLM 0.32) and :mod:`expertmesh.bench_vllm` (``python -m
expertmesh.bench_vllm``: vLLM with and without the fabric).
"""

from . import _errors
from ._errors import (
    AuthFailed,
    BadFrame,
    BadRequest,
    ConnectionFailed,
    DeadlineExceeded,
    DeviceDown,
    Error,
    InternalError,
    NotFound,
    NotPermitted,
    Overloaded,
    ProtocolError,
    RouterError,
    ShuttingDown,
    Unsupported,
)
from ._native import DEFAULT_MAX_IN_FLIGHT, Handle, RouterClient

__version__ = "0.1.0"

__all__ = ["RouterClient", "Handle", "DEFAULT_MAX_IN_FLIGHT", *_errors.__all__]

# The submodules, imported on first use as attributes (``expertmesh.aio.RouterClient``, as the
# README writes it), so that ``import expertmesh`` stays light: hf needs torch, vllm needs vLLM.
_SUBMODULES = ("aio", "bench", "bench_vllm", "hf", "vllm")


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
