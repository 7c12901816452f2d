"""Per-frontend credentials and several routers from Python (issue 15's client side).

A fabric started by ``expertmesh up --key`` (every process its own credentials) serves a
Python frontend holding ``keys issue --frontend`` credentials; without them, or with another
cluster's, it is refused. A list of routers connects to the first that answers.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

import expertmesh
from fabric_util import EXAMPLES, SplitFabric, UpFabric, expertmesh_bin


def _run(*args: object) -> None:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    assert r.returncode == 0, f"{args}: {r.stdout}\n{r.stderr}"


def _dead_addr() -> str:
    """A loopback address nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("keyed")
    exe = expertmesh_bin()
    key = tmp / "cluster.key"
    _run(exe, "keys", "init", "--out", key)
    placement = EXAMPLES / "single-host-demo-small.placement.toml"
    fabric = UpFabric(tmp, ["--model", "demo-small", "--placement", placement, "--key", key])
    creds = tmp / "py.cred"
    _run(exe, "keys", "issue", "--key", key, "--topology", fabric.topology, "--frontend", "py", "--out", creds)
    yield fabric, creds, tmp
    fabric.close()


def test_a_frontend_with_its_own_credentials_is_served(keyed):
    fabric, creds, _ = keyed
    x = np.random.default_rng(0).standard_normal((3, 1024)).astype(np.float32)
    with expertmesh.RouterClient(fabric.addr, fabric.cluster, credentials=creds) as c:
        a = c.moe(1, x, deadline_ms=10_000)
        b = c.moe(1, x, deadline_ms=10_000)
    assert a.shape == (3, 1024) and np.isfinite(a).all() and np.abs(a).sum() > 0
    # Exact mode over sealed links: the same call answers bit for bit.
    assert np.array_equal(a, b)


def test_a_frontend_without_credentials_is_refused(keyed):
    fabric, _, _ = keyed
    with pytest.raises(expertmesh.AuthFailed, match="credentials"):
        expertmesh.RouterClient(fabric.addr, fabric.cluster, "", connect_timeout_s=5)
    # The legacy shared secret is no frontend identity either.
    with pytest.raises(expertmesh.AuthFailed):
        expertmesh.RouterClient(fabric.addr, fabric.cluster, "s3cret", connect_timeout_s=5)


def test_credentials_of_another_cluster_are_refused_before_connecting(keyed):
    fabric, _, tmp = keyed
    exe = expertmesh_bin()
    other_topo = tmp / "other.toml"
    other_topo.write_text(Path(fabric.topology).read_text().replace(f'"{fabric.cluster}"', '"another"', 1))
    key2 = tmp / "other.key"
    _run(exe, "keys", "init", "--out", key2)
    other = tmp / "other.cred"
    _run(exe, "keys", "issue", "--key", key2, "--topology", other_topo, "--frontend", "py", "--out", other)
    with pytest.raises(ValueError, match="credentials"):
        expertmesh.RouterClient(fabric.addr, fabric.cluster, credentials=other)
    with pytest.raises(ValueError, match="credentials"):
        expertmesh.RouterClient(fabric.addr, fabric.cluster, credentials=tmp / "missing.cred")
    with pytest.raises(ValueError, match="give one"):
        expertmesh.RouterClient(fabric.addr, fabric.cluster, "s3cret", credentials=other)


def test_several_routers_connect_to_the_first_that_answers(fabric: SplitFabric):
    dead = _dead_addr()
    for addr in ([dead, fabric.addr], f"{dead},{fabric.addr}"):
        with expertmesh.RouterClient(addr, fabric.cluster, "", connect_timeout_s=5) as c:
            assert c.addr == fabric.addr
            out = c.moe(1, np.ones((1, 1024), np.float32), deadline_ms=10_000)
            assert out.shape == (1, 1024)
    with pytest.raises(expertmesh.ConnectionFailed):
        expertmesh.RouterClient([dead], fabric.cluster, "", connect_timeout_s=5)
    with pytest.raises(ValueError, match="empty"):
        expertmesh.RouterClient([], fabric.cluster, "")


def test_a_client_of_several_routers_fails_over_when_its_router_stops(tmp_path):
    # Two fabrics of one topology and seed stand in for two routers of one fabric: what one
    # answers, the other answers bit for bit.
    args = ["--model", "demo-small", "--placement", EXAMPLES / "single-host-demo-small.placement.toml"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = UpFabric(tmp_path / "a", args)
    try:
        b = UpFabric(tmp_path / "b", args)
        try:
            assert a.cluster == b.cluster
            x = np.linspace(-1, 1, 2 * 1024, dtype=np.float32).reshape(2, 1024)
            with expertmesh.RouterClient(f"{a.addr},{b.addr}", a.cluster, "", connect_timeout_s=5) as c:
                assert c.addr == a.addr
                want = c.moe(1, x, deadline_ms=30_000)
                a.close()
                got = c.moe(1, x, deadline_ms=30_000)  # router a is gone: b answers
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
                assert c.addr == b.addr  # the router the connection is to now
        finally:
            b.close()
    finally:
        a.close()


def test_getters_answer_while_another_thread_waits_in_a_call(tmp_path):
    # The router is stopped (SIGSTOP), so a call waits (until the router is continued, or
    # the keepalive gives it up after seconds); meanwhile another thread reads the client's
    # counts and router (as of the last call's end) without waiting for that call. Asserted by
    # order: the reads end before the call does (the router is continued only after them).
    import os
    import signal
    import threading
    import time

    args = ["--model", "demo-small", "--placement", EXAMPLES / "single-host-demo-small.placement.toml"]
    f = UpFabric(tmp_path, args)
    try:
        x = np.linspace(-1, 1, 1024, dtype=np.float32).reshape(1, 1024)
        with expertmesh.RouterClient(f.addr, f.cluster, "", connect_timeout_s=5) as c:
            c.moe(1, x, deadline_ms=30_000)
            outcome = []
            ended = []

            def call() -> None:
                try:
                    c.moe(1, x, deadline_ms=60_000)
                    outcome.append("answered")
                except Exception as e:  # noqa: BLE001 - named in the assertion
                    outcome.append(f"{type(e).__name__}: {e}")
                ended.append(time.monotonic())

            os.kill(f.proc.pid, signal.SIGSTOP)
            try:
                waiting = threading.Thread(target=call)
                waiting.start()
                # Let it take the client (on a machine too slow to, the reads below come first
                # and show nothing, but never fail).
                time.sleep(0.5)
                read = (c.in_flight, c.ready, c.max_in_flight, c.addr)
                read_at = time.monotonic()
            finally:
                os.kill(f.proc.pid, signal.SIGCONT)
            waiting.join(120)
            assert ended, "the call never ended"
            assert read_at < ended[0], f"the reads waited for the call to end: {outcome}"
            assert read == (0, 0, 32, f.addr)
    finally:
        f.close()
