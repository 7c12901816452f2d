"""asyncio client: ``await client.moe(layer, x)`` from a coroutine.

::

    import asyncio, numpy as np
    from expertmesh import aio

    async def main():
        async with await aio.RouterClient.connect("127.0.0.1:47400", cluster="single-host") as c:
            x = np.random.randn(4, 1024).astype(np.float32)
            ys = await asyncio.gather(*(c.moe(1, x) for _ in range(8)))   # 8 calls in flight

    asyncio.run(main())

How it works: the client holds ``connections`` native connections (:class:`expertmesh.RouterClient`,
4 by default) and as many worker threads. Each ``await moe(...)`` takes an idle connection, runs
the blocking call on a worker thread (the GIL is released while it is in flight, so the event
loop keeps running) and gives the connection back when the call has finished. At most
``connections`` calls are in flight; more wait for a free connection, in order. Arguments,
zero-copy rules and exceptions are those of :meth:`expertmesh.RouterClient.moe`; arguments are
checked before anything is sent.

Cancelling an awaiting task (``asyncio.wait_for``, a ``TaskGroup``) abandons the answer; the call
itself finishes on its thread (the router's deadline bounds it) before its connection is reused.
The arrays must not be modified until the call has finished.
"""

from __future__ import annotations

import asyncio
import collections
import os
import concurrent.futures
import threading
from typing import Any, Deque, List, Optional, Tuple, Union

from . import _native

__all__ = ["RouterClient"]


class RouterClient:
    """An asyncio client of the router: ``connections`` pooled connections.

    Create it with ``await RouterClient.connect(addr, cluster=..., credentials=None,
    connections=4)`` (the constructor connects too, but blocks the event loop while it does).
    """

    def __init__(
        self,
        addr: Union[str, "tuple[str, int]", List[Union[str, "tuple[str, int]"]]],
        cluster: str = "single-host",
        secret: Union[str, bytes, None] = None,
        *,
        credentials: Union[str, "os.PathLike[str]", None] = None,
        connections: int = 4,
        max_in_flight: int = _native.DEFAULT_MAX_IN_FLIGHT,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if connections < 1:
            raise ValueError("connections: must be at least 1")
        self._clients: List[_native.RouterClient] = [
            _native.RouterClient(
                addr,
                cluster,
                secret,
                credentials=credentials,
                max_in_flight=max_in_flight,
                connect_timeout_s=connect_timeout_s,
            )
            for _ in range(connections)
        ]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=connections, thread_name_prefix="expertmesh-aio"
        )
        self._idle = _Idle(self._clients)
        self._closed = False

    @classmethod
    async def connect(
        cls,
        addr: Union[str, "tuple[str, int]", List[Union[str, "tuple[str, int]"]]],
        cluster: str = "single-host",
        secret: Union[str, bytes, None] = None,
        *,
        credentials: Union[str, "os.PathLike[str]", None] = None,
        connections: int = 4,
        max_in_flight: int = _native.DEFAULT_MAX_IN_FLIGHT,
        connect_timeout_s: float = 10.0,
    ) -> "RouterClient":
        """Connect without blocking the event loop (the connections are made on a thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None,
            lambda: cls(
                addr,
                cluster,
                secret,
                credentials=credentials,
                connections=connections,
                max_in_flight=max_in_flight,
                connect_timeout_s=connect_timeout_s,
            ),
        )

    @property
    def addr(self) -> str:
        """The router's address, ``"HOST:PORT"``."""
        return self._clients[0].addr

    @property
    def connections(self) -> int:
        """Connections in the pool (calls in flight at most)."""
        return len(self._clients)

    async def moe(
        self,
        layer: int,
        x: Any,
        logits: Any = None,
        out: Any = None,
        deadline_ms: Optional[float] = None,
    ) -> Any:
        """One MoE layer call (see :meth:`expertmesh.RouterClient.moe`); returns the output
        ``[tokens, hidden]`` float32 (``out`` when given)."""
        return await self._call("moe", layer, x, logits, out, deadline_ms)

    async def check_shape(self, layer: int, tokens: int, hidden: int) -> int:
        """See :meth:`expertmesh.RouterClient.check_shape`."""
        return await self._call("check_shape", layer, tokens, hidden)

    async def _call(self, method: str, *args: Any) -> Any:
        """``method`` of an idle connection, run on a worker thread. A call that waited for a
        connection while the client was closed raises ``ValueError`` as a call after
        ``close`` does."""
        if self._closed:
            raise ValueError("the RouterClient was closed")
        idle = self._idle
        client = await idle.get()
        try:
            if self._closed:
                raise ValueError("the RouterClient was closed")
            try:
                done = self._pool.submit(getattr(client, method), *args)
            except RuntimeError as e:  # the pool shut down: closed meanwhile
                raise ValueError("the RouterClient was closed") from e
        except BaseException:
            idle.put(client)
            raise
        # The connection goes back when the call has finished on its thread, even when the
        # awaiting task was cancelled meanwhile, or its event loop closed.
        done.add_done_callback(lambda _: idle.put(client))
        return await asyncio.wrap_future(done)

    def close(self) -> None:
        """Close every connection (calls in flight finish first) and the worker threads."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for c in self._clients:
            c.close()

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> "RouterClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<expertmesh.aio.RouterClient {self.addr} connections={self.connections}>"


class _Idle:
    """The idle connections, shared by every event loop that uses the client: a connection
    goes back from the worker thread that ran its call, to the longest waiting call whose loop
    still runs (a waiter of a loop that has closed, or a cancelled one, is passed over), else
    to the idle list. An ``asyncio.Queue`` belongs to one loop, so a client used from a second
    ``asyncio.run`` (or whose first loop closed with a call on its thread) lost connections."""

    def __init__(self, clients: List["_native.RouterClient"]) -> None:
        self._lock = threading.Lock()
        self._idle: Deque["_native.RouterClient"] = collections.deque(clients)
        self._waiters: Deque[Tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]"]] = (
            collections.deque()
        )

    async def get(self) -> "_native.RouterClient":
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._idle:
                return self._idle.popleft()
            fut: "asyncio.Future[Any]" = loop.create_future()
            self._waiters.append((loop, fut))
        try:
            return await fut
        except BaseException:
            # Cancelled after a connection was handed over: it goes on to the next.
            if fut.done() and not fut.cancelled():
                self.put(fut.result())
            raise

    def put(self, client: "_native.RouterClient") -> None:
        """Give ``client`` back (from any thread)."""
        with self._lock:
            while self._waiters:
                loop, fut = self._waiters.popleft()
                if loop.is_closed() or fut.done():
                    continue
                try:
                    loop.call_soon_threadsafe(self._hand, fut, client)
                    return
                except RuntimeError:  # the loop closed just now
                    continue
            self._idle.append(client)

    def _hand(self, fut: "asyncio.Future[Any]", client: "_native.RouterClient") -> None:
        # On the waiter's loop; a waiter cancelled meanwhile passes it on.
        if fut.done():
            self.put(client)
        else:
            fut.set_result(client)
