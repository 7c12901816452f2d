"""The Python client against a real fabric (demo-small: hidden 1024, MoE layers 0-3, 32 experts,
router + two CPU worker processes, exact mode): pipelined calls, out= buffers, every input dtype
and both ways of borrowing arrays, every bad input and the exception it raises (before anything
is sent), router refusals as typed exceptions, asyncio, close()."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import warnings

import numpy as np
import pytest

import expertmesh
from expertmesh import aio

H = 1024
E = 32
LAYERS = (0, 1, 2, 3)


def rand(tokens: int, seed: int, hidden: int = H) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, hidden), dtype=np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    assert np.array_equal(bits(a), bits(b)), "outputs differ"


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns of float32 values (truncated), as uint16."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


class DLPackOnly:
    """An array that exposes only DLPack (as a torch tensor does)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, stream=None):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class RefusesDLPack:
    """An array whose DLPack export refuses, as torch does for a tensor that requires grad."""

    def __dlpack__(self, stream=None):
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")

    def __dlpack_device__(self):
        return (1, 0)


class InterfaceOnly:
    """An array that exposes only NumPy's array interface."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self.__array_interface__ = a.__array_interface__


class ShortStrides:
    """A hand-made array interface whose strides do not match its shape."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        iface = dict(a.__array_interface__)
        iface["strides"] = (a.strides[1],)
        self.__array_interface__ = iface


# --- calls, pipelining, out= -------------------------------------------------------------------


def test_a_call_returns_a_float32_array_of_the_input_shape(client):
    x = rand(4, 1)
    y = client.moe(1, x)
    assert isinstance(y, np.ndarray) and y.shape == (4, H) and y.dtype == np.float32
    assert np.isfinite(y).all() and np.abs(y).sum() > 0
    assert_bits_equal(client.moe(1, x), y)  # deterministic (exact mode)


def test_pipelined_calls_equal_sequential_calls_in_any_wait_order(client):
    cases = [(LAYERS[i % 4], t, 100 + i) for i, t in enumerate([1, 3, 16, 64, 2, 33, 7, 1, 5, 20])]
    want = [client.moe(layer, rand(t, seed)) for layer, t, seed in cases]
    for order in ("reverse", "shuffled"):
        handles = [client.submit(layer, rand(t, seed)) for layer, t, seed in cases]
        assert client.in_flight + client.ready == len(cases)
        idx = list(range(len(cases)))
        if order == "reverse":
            idx.reverse()
        else:
            random.Random(5).shuffle(idx)
        for i in idx:
            h = handles[i]
            assert (h.layer, h.tokens, h.hidden) == (cases[i][0], cases[i][1], H)
            assert_bits_equal(client.wait(h), want[i])
    assert client.in_flight == 0 and client.ready == 0


def test_more_submits_than_max_in_flight_wait_rather_than_fail(fabric):
    with fabric.client(max_in_flight=2) as c:
        assert c.max_in_flight == 2
        x = rand(2, 9)
        want = c.moe(2, x)
        handles = [c.submit(2, x) for _ in range(9)]
        assert c.in_flight <= 2
        for h in handles:
            assert_bits_equal(c.wait(h), want)
        c.max_in_flight = 5
        assert c.max_in_flight == 5


def test_the_input_arrays_may_be_reused_after_submit(client):
    x = rand(3, 11)
    want = client.moe(0, x)
    h = client.submit(0, x)
    x[:] = 0  # encoded into the request before submit returned
    assert_bits_equal(client.wait(h), want)


def test_out_receives_the_output_in_place(client):
    x = rand(5, 12)
    want = client.moe(3, x)
    out = np.full((5, H), np.nan, np.float32)
    r = client.moe(3, x, out=out)
    assert r is out
    assert_bits_equal(out, want)
    out2 = np.full((5, H), np.nan, np.float32)
    h = client.submit(3, x)
    assert client.wait(h, out=out2) is out2
    assert_bits_equal(out2, want)
    # out may be x itself: x is sent before the output is written.
    y = x.copy()
    assert client.moe(3, y, out=y) is y
    assert_bits_equal(y, want)
    # A row of a bigger C-contiguous buffer is a C-contiguous [tokens, hidden] view.
    big = np.zeros((3, 5, H), np.float32)
    client.moe(3, x, out=big[1])
    assert_bits_equal(big[1], want)
    assert not big[0].any() and not big[2].any()


def test_dropped_handles_leave_nothing_behind(client):
    x = rand(2, 13)
    want = client.moe(1, x)
    for _ in range(5):
        client.submit(1, x)  # dropped at once
    gc.collect()
    assert_bits_equal(client.moe(1, x), want)
    # every abandoned answer has arrived and been discarded by now, or will be
    for _ in range(3):
        client.moe(1, x)
    assert client.ready == 0


# --- dtypes and the two ways of borrowing arrays ----------------------------------------------


def test_float16_and_bf16_inputs_equal_float32_of_the_same_values(client):
    x = rand(6, 21)
    x16 = x.astype(np.float16)
    assert_bits_equal(client.moe(2, x16), client.moe(2, x16.astype(np.float32)))
    b = to_bf16_bits(x)
    assert b.dtype == np.uint16
    assert_bits_equal(client.moe(2, b), client.moe(2, from_bf16_bits(b)))
    # and through submit/wait
    h16, hb = client.submit(2, x16), client.submit(2, b)
    assert_bits_equal(client.wait(hb), client.moe(2, from_bf16_bits(b)))
    assert_bits_equal(client.wait(h16), client.moe(2, x16.astype(np.float32)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
def test_dlpack_only_and_array_interface_only_objects_and_read_only_arrays(client, dtype):
    x = rand(3, 22)
    a = to_bf16_bits(x) if dtype == np.uint16 else x.astype(dtype)
    want = client.moe(0, a)
    assert_bits_equal(client.moe(0, DLPackOnly(a)), want)
    assert_bits_equal(client.moe(0, InterfaceOnly(a)), want)
    ro = a.copy()
    ro.flags.writeable = False  # NumPy exports these through the array interface only
    assert_bits_equal(client.moe(0, ro), want)
    out = np.empty((3, H), np.float32)
    client.moe(0, a, out=DLPackOnly(out))
    assert_bits_equal(out, want)
    out2 = np.empty((3, H), np.float32)
    client.moe(0, a, out=InterfaceOnly(out2))
    assert_bits_equal(out2, want)


def test_torch_tensors(client):
    torch = pytest.importorskip("torch", reason="torch is not installed (CI does not install it)")
    x = rand(4, 23)
    want = client.moe(1, x)
    t = torch.from_numpy(x)
    assert_bits_equal(client.moe(1, t), want)
    bf = t.to(torch.bfloat16)
    assert_bits_equal(client.moe(1, bf), client.moe(1, bf.to(torch.float32).numpy()))
    h = t.to(torch.float16)
    assert_bits_equal(client.moe(1, h), client.moe(1, h.numpy()))
    out = torch.empty(4, H)
    client.moe(1, t, out=out)
    assert_bits_equal(out.numpy(), want)
    with pytest.raises(TypeError, match="x: dtype torch.float64"):
        client.moe(1, t.double())
    with pytest.raises(ValueError, match="x: the array is not C-contiguous"):
        client.moe(1, t.t().contiguous().t())


def test_router_logits_are_used(client):
    x = rand(4, 31)
    logits = np.random.default_rng(3).standard_normal((4, E), dtype=np.float32)
    a = client.moe(1, x, logits=logits)
    assert_bits_equal(client.moe(1, x, logits=logits), a)
    assert not np.array_equal(bits(a), bits(client.moe(1, x)))  # other experts chosen
    h = client.submit(1, x, logits)
    assert_bits_equal(client.wait(h), a)


# --- bad input: the right exception, nothing sent, the connection still usable ----------------


def _bad_calls():
    x = rand(2, 40)
    ro = np.zeros((2, H), np.float32)
    ro.flags.writeable = False
    unaligned = np.frombuffer(bytearray(2 * H * 4 + 1), np.uint8)[1:].view(np.float32).reshape(2, H)
    big_endian = x.astype(">f4")
    return [
        # (what, kwargs of moe, exception, message fragment)
        ("x list", dict(layer=1, x=[[0.0] * H]), TypeError, "x: expected a 2-D numpy array"),
        ("x float64", dict(layer=1, x=x.astype(np.float64)), TypeError, "x: dtype float64 is not accepted"),
        ("x int32", dict(layer=1, x=x.astype(np.int32)), TypeError, "x: dtype int32"),
        ("x big-endian", dict(layer=1, x=big_endian), TypeError, "x: dtype >f4"),
        ("x 1-D", dict(layer=1, x=x[0]), ValueError, "x: expected a 2-D array [tokens, hidden], got shape (1024,)"),
        ("x 3-D", dict(layer=1, x=x[None]), ValueError, "x: expected a 2-D array"),
        ("x strided", dict(layer=1, x=x[:, ::2]), ValueError, "x: the array is not C-contiguous"),
        ("x Fortran", dict(layer=1, x=np.asfortranarray(x)), ValueError, "not C-contiguous"),
        ("x no tokens", dict(layer=1, x=x[:0]), ValueError, "x: has shape (0, 1024)"),
        ("x DLPack refused", dict(layer=1, x=RefusesDLPack()), TypeError, "use tensor.detach()"),
        ("x unaligned", dict(layer=1, x=unaligned), ValueError, "x: the array's data is not aligned"),
        ("x short strides", dict(layer=1, x=ShortStrides(x)), ValueError, "do not match its shape"),
        ("layer negative", dict(layer=-1, x=x), ValueError, "layer: must be in 0..2**32"),
        ("layer str", dict(layer="1", x=x), TypeError, "layer: expected an int"),
        ("layer float", dict(layer=1.0, x=x), TypeError, "layer: expected an int"),
        ("logits float16", dict(layer=1, x=x, logits=np.zeros((2, E), np.float16)), TypeError, "logits: dtype float16"),
        ("logits rows", dict(layer=1, x=x, logits=np.zeros((3, E), np.float32)), ValueError, "logits: shape (3, 32) does not match x's 2 tokens"),
        ("logits 1-D", dict(layer=1, x=x, logits=np.zeros(E, np.float32)), ValueError, "logits: expected a 2-D array [tokens, experts]"),
        ("out shape", dict(layer=1, x=x, out=np.empty((2, 10), np.float32)), ValueError, "out: shape (2, 10) does not match"),
        ("out dtype", dict(layer=1, x=x, out=np.empty((2, H), np.float16)), TypeError, "out: dtype float16"),
        ("out read-only", dict(layer=1, x=x, out=ro), ValueError, "out: the array is read-only"),
        ("out strided", dict(layer=1, x=x, out=np.empty((2, 2 * H), np.float32)[:, ::2]), ValueError, "out: the array is not C-contiguous"),
        ("out list", dict(layer=1, x=x, out=[]), TypeError, "out: expected"),
        ("deadline zero", dict(layer=1, x=x, deadline_ms=0), ValueError, "deadline_ms: must be a positive"),
        ("deadline nan", dict(layer=1, x=x, deadline_ms=float("nan")), ValueError, "deadline_ms"),
        ("deadline str", dict(layer=1, x=x, deadline_ms="5"), TypeError, "deadline_ms: expected a number"),
    ]


@pytest.mark.parametrize("what,kw,exc,msg", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_before_anything_is_sent(client, what, kw, exc, msg):
    before = client.submit(1, rand(1, 41))
    client.wait(before)
    with pytest.raises(exc) as e:
        client.moe(**kw)
    assert msg in str(e.value), str(e.value)
    if "out" not in kw:  # submit checks the same arguments
        kw2 = {k: v for k, v in kw.items() if k != "out"}
        with pytest.raises(exc):
            client.submit(**kw2)
    after = client.submit(1, rand(1, 41))
    assert after.request_id == before.request_id + 1, "a request was sent"
    assert_bits_equal(client.wait(after), client.moe(1, rand(1, 41)))


def test_a_request_too_large_to_frame_raises_value_error_and_the_connection_goes_on(client):
    # 16,400 tokens x 1,024 float32 = 67.2 MB, past the 64 MiB frame limit.
    big = np.zeros((16400, H), np.float32)
    with pytest.raises(ValueError, match="exceeds the configured maximum") as e:
        client.moe(1, big)
    assert not isinstance(e.value, expertmesh.ConnectionFailed)
    x = rand(2, 43)
    assert_bits_equal(client.moe(1, x), client.moe(1, x))


def test_wait_misuse(fabric, client):
    h = client.submit(1, rand(1, 50))
    with pytest.raises(TypeError, match="handle: expected a Handle"):
        client.wait(object())
    with pytest.raises(ValueError, match="out: shape"):
        client.wait(h, out=np.empty((2, H), np.float32))
    assert not h.waited
    client.wait(h)  # still usable after the refused out=
    assert h.waited
    with pytest.raises(ValueError, match="already waited"):
        client.wait(h)
    with fabric.client() as other:
        h2 = other.submit(1, rand(1, 50))
        with pytest.raises(ValueError, match="submitted on another RouterClient"):
            client.wait(h2)
        other.wait(h2)


@pytest.mark.parametrize(
    "kw,exc,code,fragment",
    [
        (dict(layer=1, x=rand(2, 60, hidden=100)), expertmesh.BadRequest, 4, "hidden size 100"),
        (dict(layer=99, x=rand(2, 61)), expertmesh.NotFound, 9, "layer 99"),
        (dict(layer=1, x=rand(300, 62)), expertmesh.BadRequest, 4, "300 tokens"),
        (dict(layer=1, x=np.full((2, H), np.nan, np.float32)), expertmesh.BadRequest, 4, "NaN"),
        (dict(layer=1, x=rand(2, 63), logits=np.zeros((2, 5), np.float32)), expertmesh.BadRequest, 4, "5 columns"),
    ],
    ids=["hidden", "layer", "tokens", "nan", "logits-width"],
)
def test_router_refusals_raise_typed_exceptions(client, kw, exc, code, fragment):
    with pytest.raises(exc) as e:
        client.moe(**kw)
    err = e.value
    assert isinstance(err, expertmesh.RouterError) and isinstance(err, expertmesh.Error)
    assert err.code == code and err.code_name in ("InvalidInput", "NotFound")
    assert err.request_id is not None and err.request_id > 0
    assert fragment in err.message, err.message
    if code == 4:
        assert isinstance(err, ValueError)
    # only that request failed
    x = rand(1, 64)
    assert_bits_equal(client.moe(1, x), client.moe(1, x))


def test_check_shape(client):
    assert client.check_shape(1, 4, H) == 4
    with pytest.raises(expertmesh.NotFound, match="serves MoE layers 0..=3"):
        client.check_shape(50, 4, H)
    with pytest.raises(expertmesh.BadRequest, match=r"\(hidden 1024\)"):
        client.check_shape(1, 4, 8)


def test_connection_errors(fabric):
    with pytest.raises(expertmesh.ConnectionFailed, match="cluster"):
        expertmesh.RouterClient(fabric.addr, cluster="another-cluster")
    with pytest.raises(ValueError, match="addr: .* has no port"):
        expertmesh.RouterClient("localhost")
    with pytest.raises(TypeError, match="addr: expected"):
        expertmesh.RouterClient(47400)
    for nothing in (",", " , ", []):
        with pytest.raises(ValueError, match="addr: the list of routers is empty"):
            expertmesh.RouterClient(nothing)
    with pytest.raises(TypeError, match="secret: expected str or bytes"):
        expertmesh.RouterClient(fabric.addr, secret=5)
    for timeout in (0.0, -1.0, float("inf"), 1e20):
        with pytest.raises(ValueError, match="connect_timeout_s: must be a positive"):
            expertmesh.RouterClient(fabric.addr, connect_timeout_s=timeout)
    host, port = fabric.addr.rsplit(":", 1)
    with expertmesh.RouterClient((host, int(port))) as c:
        assert c.addr == fabric.addr and c.cluster == "single-host"
    # a secret the router does not expect
    with pytest.raises((expertmesh.AuthFailed, expertmesh.ConnectionFailed)):
        expertmesh.RouterClient(fabric.addr, secret="not-the-routers")


def test_close_and_context_manager(fabric):
    c = fabric.client()
    x = rand(1, 70)
    c.moe(1, x)
    h = c.submit(1, x)
    with c:
        pass
    assert c.closed
    with pytest.raises(ValueError, match="closed"):
        c.moe(1, x)
    with pytest.raises(ValueError, match="closed"):
        c.wait(h)
    c.close()  # twice is fine


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_client_made_before_fork_is_refused_in_the_child_and_the_parent_goes_on(fabric):
    # gunicorn --preload, multiprocessing with fork: the child inherits the connection. Two
    # processes on it would read each other's answers (and, sealed, reuse nonces); a child
    # closing it would take the socket out of the epoll instance the parent shares.
    with fabric.client() as c:
        x = rand(3, 80)
        want = c.moe(1, x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    c.moe(1, x)
                except RuntimeError as e:
                    code = 0 if "before fork()" in str(e) else 2
                c.close()
                del c
                gc.collect()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        for _ in range(3):
            assert_bits_equal(c.moe(1, x), want)


def _sockets_to(port: int) -> int:
    """This process's TCP sockets whose remote port is `port` (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                n += 1
    return n


@pytest.mark.skipif(
    not hasattr(os, "fork") or not os.path.exists("/proc/net/tcp"),
    reason="needs fork() and Linux /proc",
)
def test_a_fork_child_closes_its_copy_of_the_connection_so_the_parents_close_ends_it(fabric):
    # While a child kept its copy of the socket, the parent's close() sent no FIN: the router
    # held the connection (and its slot) until every preforked child ended.
    port = int(fabric.addr.rsplit(":", 1)[1])
    gc.collect()  # other tests' clients, closed when collected
    before = _sockets_to(port)
    c = fabric.client()
    x = rand(2, 80)
    want = c.moe(1, x)
    assert _sockets_to(port) == before + 1, "the parent holds its connection"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = 0 if _sockets_to(port) == 0 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), status
    assert os.WEXITSTATUS(status) == 0, "the child kept a copy of the router connection"
    assert_bits_equal(c.moe(1, x), want)
    c.close()
    assert _sockets_to(port) == before


# --- asyncio ----------------------------------------------------------------------------------


def test_asyncio_client_runs_calls_concurrently_with_equal_results(fabric, client):
    xs = [rand(t, 80 + t) for t in (1, 2, 4, 8, 16, 3, 5, 7)]
    want = [client.moe(2, x) for x in xs]

    async def main():
        c = await aio.RouterClient.connect(fabric.addr, fabric.cluster, "", connections=3)
        async with c:
            got = await asyncio.gather(*(c.moe(2, x) for x in xs))
            with pytest.raises(TypeError, match="x: dtype float64"):
                await c.moe(2, xs[0].astype(np.float64))
            with pytest.raises(expertmesh.NotFound):
                await c.moe(77, xs[0])
            out = np.empty_like(xs[0])
            assert (await c.moe(2, xs[0], out=out)) is out
            # a cancelled call gives its connection back once it has finished
            t = asyncio.ensure_future(c.moe(2, xs[4]))
            await asyncio.sleep(0)
            t.cancel()
            again = await asyncio.gather(*(c.moe(2, x) for x in xs))
            assert await c.check_shape(2, 4, H) == 4
        return got, again

    got, again = asyncio.run(main())
    for g, a, w in zip(got, again, want):
        assert_bits_equal(g, w)
        assert_bits_equal(a, w)


def test_asyncio_calls_waiting_for_a_connection_when_closed_raise_value_error(fabric):
    x = rand(4, 91)

    async def main():
        c = await aio.RouterClient.connect(fabric.addr, fabric.cluster, "", connections=1)
        first = asyncio.ensure_future(c.moe(1, x))
        await asyncio.sleep(0)  # it takes the only connection
        waiting = asyncio.ensure_future(c.moe(1, x))
        await asyncio.sleep(0)  # it waits for that connection
        await c.aclose()  # the call in flight finishes first
        await first
        with pytest.raises(ValueError, match="the RouterClient was closed"):
            await waiting

    asyncio.run(main())


# --- authentication, docs, bench ----------------------------------------------------------------


def test_a_router_with_a_secret_refuses_other_secrets_with_auth_failed(tmp_path, monkeypatch):
    from fabric_util import SplitFabric

    f = SplitFabric(tmp_path, secret="s3cret")
    try:
        for wrong in ("wrong", b"", ""):
            with pytest.raises(expertmesh.AuthFailed) as e:
                expertmesh.RouterClient(f.addr, secret=wrong)
            assert e.value.code == 8 and isinstance(e.value, PermissionError)
        x = rand(1, 90)
        with expertmesh.RouterClient(f.addr, secret=b"s3cret") as c:
            want = c.moe(1, x)
        # secret=None reads EXPERTMESH_SECRET, as the command-line tools do
        monkeypatch.setenv("EXPERTMESH_SECRET", "s3cret")
        with expertmesh.RouterClient(f.addr) as c:
            assert_bits_equal(c.moe(1, x), want)
        monkeypatch.delenv("EXPERTMESH_SECRET")
        secret_file = tmp_path / "secret"
        secret_file.write_text("s3cret\n")
        monkeypatch.setenv("EXPERTMESH_SECRET_FILE", str(secret_file))
        # A secret file other users may read is refused, as a credential file is.
        secret_file.chmod(0o644)
        with pytest.raises(ValueError, match="readable by other users.*chmod 600"):
            expertmesh.RouterClient(f.addr)
        secret_file.chmod(0o600)
        with expertmesh.RouterClient(f.addr) as c:
            assert_bits_equal(c.moe(1, x), want)
    finally:
        f.close()


def test_help_reads_well():
    import pydoc

    text = pydoc.render_doc(expertmesh, renderer=pydoc.plaintext)
    for needle in ("RouterClient", "moe(self, /, layer, x, logits=None, out=None, deadline_ms=None)",
                   "submit(", "wait(", "DeviceDown", "DeadlineExceeded", "Overloaded", "BadRequest",
                   "Pipelining", "GIL is released"):
        assert needle in text, needle
    assert expertmesh.DeviceDown.__module__ == "expertmesh"
    assert expertmesh.RouterClient.__module__ == "expertmesh"


def test_bench_reports_python_against_rust(fabric):
    from expertmesh import bench

    results = bench.run(fabric.addr, fabric.cluster, "", tokens=(1, 4), depth=4, seconds=0.05, rounds=1)
    names = {(r["name"], r["batch"]) for r in results}
    for t in (1, 4):
        for n in ("python_client_calls_per_s", "python_client_latency_p50", "python_client_latency_p99"):
            assert (n, t) in names
    for r in results:
        assert r["achieved"] > 0 and r["limit"] > 0 and r["ratio"] > 0
        assert r["better"] == ("lower" if r["unit"] == "us" else "higher")
        assert (r["layer"], r["hidden"]) == (0, H)  # discovered from the router
    # Its Rust loop keeps a latency per iteration and a handle per request in flight: bounded.
    from expertmesh import _native

    x = rand(1, 90)
    for iterations, depth in ((10**12, 1), (1, 10**12)):
        with pytest.raises(ValueError, match="at most"):
            _native._rust_loop(fabric.addr, fabric.cluster, "", 0, x, iterations, depth, 0)


def test_hf_module_imports_without_torch():
    from expertmesh import hf

    assert "Qwen3MoeSparseMoeBlock" in hf.MOE_BLOCK_CLASSES and "DeepseekV3MoE" in hf.MOE_BLOCK_CLASSES
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install torch transformers"):
            hf.attach(object(), None)


def test_every_router_error_code_has_its_exception():
    from expertmesh._errors import _from_native

    want = {
        1: expertmesh.InternalError, 2: expertmesh.BadFrame, 3: expertmesh.Unsupported,
        4: expertmesh.BadRequest, 5: expertmesh.Overloaded, 6: expertmesh.DeadlineExceeded,
        7: expertmesh.DeviceDown, 8: expertmesh.AuthFailed, 9: expertmesh.NotFound,
        10: expertmesh.ShuttingDown, 11: expertmesh.NotPermitted,
    }
    for code, cls in want.items():
        e = _from_native("server", code, 17, "why", f"router refused request 17: why ({code})")
        assert type(e) is cls and isinstance(e, expertmesh.RouterError)
        assert (e.code, e.request_id, e.message) == (code, 17, "why") and e.code_name == cls.code_name
        assert str(e) == f"router refused request 17: why ({code})"
    other = _from_native("server", 77, 3, "new", "new code")
    assert type(other) is expertmesh.RouterError and other.code == 77 and other.code_name == "Other(77)"
    assert isinstance(_from_native("connection", None, None, "closed", "closed"), ConnectionError)
    assert type(_from_native("protocol", None, None, "odd", "odd")) is expertmesh.ProtocolError
    assert type(_from_native("input", None, None, "bad", "bad")) is ValueError
    assert issubclass(expertmesh.DeadlineExceeded, TimeoutError)


def test_submodules_are_attributes_as_the_readme_writes_them():
    # The README's `expertmesh.aio.RouterClient.connect(...)` after a plain `import expertmesh`,
    # in a fresh interpreter (this file imports `aio` itself, which would hide the problem).
    import subprocess
    import sys

    code = (
        "import expertmesh\n"
        "assert expertmesh.aio.RouterClient.__name__ == 'RouterClient'\n"
        "try:\n"
        "    expertmesh.nothing\n"
        "except AttributeError as e:\n"
        "    assert \"no attribute 'nothing'\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_hf_attach_asks_the_router_for_its_request_size(client):
    """`hf.attach`'s request sizes come from the router (no torch needed for this part): the
    asked size where the router takes it, a refusal where the router's --max-tokens (256 here)
    is smaller, so a model fails at attach instead of on its first long forward."""
    from expertmesh import hf

    assert hf._request_steps(client, [0, 1], H, 256) == {0: 256, 1: 256}
    assert hf._request_steps(client, [2], H, 8) == {2: 8}
    with pytest.raises(expertmesh.Error, match="300 tokens"):
        hf._request_steps(client, [1], H, 300)
    with pytest.raises(expertmesh.Error):
        hf._request_steps(client, [1], 8, 16)  # another hidden size: another checkpoint
    assert hf._request_steps(client, [3], None, 64) == {3: 64}
    with pytest.raises(ValueError, match="at least 1"):
        hf._request_steps(client, [1], H, 0)
