"""Type stubs of the Rust extension `expertmesh._native` (import these from `expertmesh`)."""

import os
from typing import Any, List, Optional, Protocol, Tuple, TypeVar, Union

import numpy as np
import numpy.typing as npt

DEFAULT_MAX_IN_FLIGHT: int

class _DLPack(Protocol):
    """A CPU tensor exporting DLPack (``torch.Tensor``, ...)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

# Hidden states `[tokens, hidden]`: float32, float16, or bfloat16 bits as uint16 (NumPy); a CPU
# tensor of float32, float16 or bfloat16 (DLPack).
HiddenStates = Union[
    npt.NDArray[np.float32], npt.NDArray[np.float16], npt.NDArray[np.uint16], _DLPack
]
# Router logits `[tokens, experts]` float32.
Logits = Union[npt.NDArray[np.float32], _DLPack]
# "HOST:PORT", (host, port), or several routers: "A:P,B:P" or a list (the first that answers,
# then the next when it is lost).
Address = Union[str, Tuple[str, int], List[Union[str, Tuple[str, int]]]]

_Out = TypeVar("_Out")

class Handle:
    """A request sent by :meth:`RouterClient.submit`; wait it once, on the same client."""

    @property
    def request_id(self) -> int:
        """The request's id on the wire (in the router's logs and errors)."""
    @property
    def layer(self) -> int:
        """The MoE layer."""
    @property
    def tokens(self) -> int:
        """Rows of the output."""
    @property
    def hidden(self) -> int:
        """Columns of the output."""
    @property
    def waited(self) -> bool:
        """Whether the handle was already waited."""

class RouterClient:
    """A connection to the ExpertMesh router: one call per MoE layer (see ``help()``)."""

    def __init__(
        self,
        addr: Address,
        cluster: str = "single-host",
        secret: Union[str, bytes, None] = None,
        *,
        credentials: Union[str, "os.PathLike[str]", None] = None,
        max_in_flight: int = 32,
        connect_timeout_s: float = 10.0,
    ) -> None: ...
    def moe(
        self,
        layer: int,
        x: HiddenStates,
        logits: Optional[Logits] = None,
        out: Optional[_Out] = None,
        deadline_ms: Optional[float] = None,
    ) -> Any:
        """One MoE layer call; returns the output ``[tokens, hidden]`` float32 (``out`` itself
        when given, else a new ``numpy.ndarray``)."""
    def submit(
        self,
        layer: int,
        x: HiddenStates,
        logits: Optional[Logits] = None,
        deadline_ms: Optional[float] = None,
    ) -> Handle:
        """Send one MoE layer call without waiting; redeem the handle with :meth:`wait`."""
    def wait(self, handle: Handle, out: Optional[_Out] = None) -> Any:
        """The output of ``handle``'s request (``out`` itself when given)."""
    def check_shape(self, layer: int, tokens: int, hidden: int) -> int:
        """Whether the router accepts ``tokens`` x ``hidden`` for ``layer`` (raises if not)."""
    def close(self) -> None:
        """Close the connection: a call blocked on another thread and later calls raise ``ValueError``."""
    def __enter__(self) -> "RouterClient": ...
    def __exit__(self, *args: object) -> None: ...
    @property
    def addr(self) -> str:
        """The address of the router the connection is to now (a failover moves it)."""
    @property
    def cluster(self) -> str:
        """The cluster name given to the handshake."""
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
    @property
    def max_in_flight(self) -> int:
        """Requests submitted and unanswered at most (settable)."""
    @max_in_flight.setter
    def max_in_flight(self, n: int) -> None: ...
    @property
    def in_flight(self) -> int:
        """Requests submitted and not answered yet, as of the end of the last call (read
        without waiting for another thread's call)."""
    @property
    def ready(self) -> int:
        """Answers held for handles not waited yet, as of the end of the last call."""

def _rust_loop(
    addr: Address,
    cluster: str,
    secret: Union[str, bytes, None],
    layer: int,
    x: npt.NDArray[np.float32],
    iterations: int,
    depth: int = 1,
    warmup: int = 10,
) -> Tuple[int, List[int]]:
    """The bench's limit: the same call loop run by the Rust client (``expertmesh.bench``)."""
