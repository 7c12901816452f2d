"""The exceptions of :mod:`expertmesh`, one per stable router error code.

Every exception the client raises for a failed call derives from :class:`Error`. A refusal by the
router is a :class:`RouterError` whose subclass names the router's stable error code
(``transport/src/codec.rs`` ``ErrorCode``); its ``code`` attribute is the wire number, so code
that predates a new code can still match on :class:`RouterError`. Input that is wrong before
anything is sent (shape, dtype, layout) raises the builtin :class:`ValueError` or
:class:`TypeError` naming the argument instead.

::

    Error
    ├── RouterError              the router refused the request (.code, .code_name, .request_id)
    │   ├── InternalError        1  Internal: a failure inside the router or a worker
    │   ├── BadFrame             2  BadFrame: the request could not be decoded
    │   ├── Unsupported          3  Unsupported: a valid request this router does not support
    │   ├── BadRequest           4  InvalidInput: wrong hidden size, too many tokens, NaN/inf
    │   ├── Overloaded           5  Overloaded: retry later or elsewhere
    │   ├── DeadlineExceeded     6  DeadlineExceeded: the request's deadline passed
    │   ├── DeviceDown           7  PeerUnavailable: a device the request needs is down
    │   ├── AuthFailed           8  AuthFailed: wrong or missing secret
    │   ├── NotFound             9  NotFound: no such MoE layer (a dense layer, past the end)
    │   ├── ShuttingDown        10  ShuttingDown: the router is stopping
    │   └── NotPermitted        11  NotPermitted: this frontend may not do that (placement changes)
    ├── ConnectionFailed         the connection could not be made or broke (also ConnectionError)
    └── ProtocolError            the router answered something that is not an answer
"""

from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "Error",
    "RouterError",
    "InternalError",
    "BadFrame",
    "Unsupported",
    "BadRequest",
    "Overloaded",
    "DeadlineExceeded",
    "DeviceDown",
    "AuthFailed",
    "NotFound",
    "ShuttingDown",
    "NotPermitted",
    "ConnectionFailed",
    "ProtocolError",
]


class Error(Exception):
    """Base of every error of a router call.

    Attributes:
        message: what went wrong (the router's explanation for a :class:`RouterError`).
        code: the router's stable error code (an ``int``), or ``None`` when the router did not
            answer with one.
        code_name: the code's name in the router (``"PeerUnavailable"``, ...), or ``None``.
        request_id: the request's id on the wire (in the router's logs), or ``None``.
    """

    code: Optional[int] = None
    code_name: Optional[str] = None

    def __init__(
        self,
        message: str,
        *,
        code: Optional[int] = None,
        request_id: Optional[int] = None,
        detail: Optional[str] = None,
    ) -> None:
        super().__init__(detail if detail is not None else message)
        self.message = message
        if code is not None:
            self.code = code
            self.code_name = _CODE_NAMES.get(code, f"Other({code})")
        self.request_id = request_id


class RouterError(Error):
    """The router refused the request with an error code (``.code``); see the subclasses."""


class InternalError(RouterError):
    """Code 1 (Internal): a failure inside the router or a worker (see its log)."""

    code = 1
    code_name = "Internal"


class BadFrame(RouterError):
    """Code 2 (BadFrame): the router could not decode the request."""

    code = 2
    code_name = "BadFrame"


class Unsupported(RouterError):
    """Code 3 (Unsupported): a valid request the router does not support."""

    code = 3
    code_name = "Unsupported"


class BadRequest(RouterError, ValueError):
    """Code 4 (InvalidInput): the router rejected the input (hidden size of another model, more
    tokens than its per-request limit, NaN or infinity, logits of the wrong width)."""

    code = 4
    code_name = "InvalidInput"


class Overloaded(RouterError):
    """Code 5 (Overloaded): the router is overloaded; retry later or elsewhere."""

    code = 5
    code_name = "Overloaded"


class DeadlineExceeded(RouterError, TimeoutError):
    """Code 6 (DeadlineExceeded): the request's deadline (``deadline_ms``, else the router's
    default) passed before every device it needs answered."""

    code = 6
    code_name = "DeadlineExceeded"


class DeviceDown(RouterError):
    """Code 7 (PeerUnavailable): a device that holds experts the request needs (and no replica of
    them) is down; the message names it. Raised within the request's deadline."""

    code = 7
    code_name = "PeerUnavailable"


class AuthFailed(RouterError, PermissionError):
    """Code 8 (AuthFailed): authentication failed (the secret differs from the router's, or one
    side has none)."""

    code = 8
    code_name = "AuthFailed"


class NotFound(RouterError, LookupError):
    """Code 9 (NotFound): the router serves no such MoE layer (a dense layer, or past the model's
    last layer); the message says which layers it serves."""

    code = 9
    code_name = "NotFound"


class ShuttingDown(RouterError):
    """Code 10 (ShuttingDown): the router is stopping (or still starting)."""

    code = 10
    code_name = "ShuttingDown"


class NotPermitted(RouterError, PermissionError):
    """Code 11 (NotPermitted): the frontend is authenticated but may not do this; a placement
    change from a frontend that is not one of the router's ``--placement-admins``."""

    code = 11
    code_name = "NotPermitted"


class ConnectionFailed(Error, ConnectionError):
    """The connection to the router could not be made (nothing listens, wrong cluster name, not
    the router's frontend port) or broke; every request in flight on it fails with this error,
    and so does every later call on the same client (one made with several routers moves to
    the next router instead, and raises this only when none answers)."""


class ProtocolError(Error):
    """The router answered something that is not an answer to the request (a version
    mismatch or a bug)."""


# Shown as `expertmesh.DeviceDown` in tracebacks and help(), where users meet them.
for _cls in (
    Error,
    RouterError,
    InternalError,
    BadFrame,
    Unsupported,
    BadRequest,
    Overloaded,
    DeadlineExceeded,
    DeviceDown,
    AuthFailed,
    NotFound,
    ShuttingDown,
    NotPermitted,
    ConnectionFailed,
    ProtocolError,
):
    _cls.__module__ = "expertmesh"
del _cls

_BY_CODE: Dict[int, Type[RouterError]] = {
    c.code: c  # type: ignore[misc]
    for c in (
        InternalError,
        BadFrame,
        Unsupported,
        BadRequest,
        Overloaded,
        DeadlineExceeded,
        DeviceDown,
        AuthFailed,
        NotFound,
        ShuttingDown,
        NotPermitted,
    )
}
_CODE_NAMES: Dict[int, str] = {c: cls.code_name for c, cls in _BY_CODE.items()}  # type: ignore[misc]


def _from_native(
    kind: str, code: Optional[int], request_id: Optional[int], message: str, detail: str
) -> BaseException:
    """The exception for an error of the native client (called from Rust).

    ``kind`` is ``"server"`` (the router refused: ``code`` is its error code), ``"connection"``,
    ``"protocol"``, ``"input"`` or ``"usage"``.
    """
    if kind == "server" and code is not None:
        cls: Type[Error] = _BY_CODE.get(code, RouterError)
        return cls(message, code=code, request_id=request_id, detail=detail)
    if kind == "connection":
        return ConnectionFailed(message, detail=detail)
    if kind == "protocol":
        return ProtocolError(message, request_id=request_id, detail=detail)
    # "input" and "usage": the caller's mistake, caught by the client before anything is sent.
    return ValueError(detail)
