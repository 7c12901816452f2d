"""Local fabrics for the tests: the `expertmesh` binary started as separate processes.

Two ways, both on loopback:

* :class:`SplitFabric`: ``expertmesh router`` and one ``expertmesh worker`` per device, every
  port ephemeral (no clashes between runs). The test owns each worker process, so it can stop
  or kill one (``up`` would restart it).
* :class:`UpFabric`: ``expertmesh up`` on a copy of a topology whose ports are free ones (what
  a user runs); ready when it prints "Ctrl-C to stop.".

The binary: ``$EXPERTMESH_BIN``, else ``target/debug/expertmesh`` under the repository root
(what ``cargo test --workspace`` / ``cargo build`` leave there).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, List, Optional, Sequence

import numpy as np

from expertmesh._ports import free_port_block, topology_with_free_ports  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def expertmesh_bin() -> Path:
    """The `expertmesh` binary the tests run (fails loudly when it is missing)."""
    p = Path(os.environ.get("EXPERTMESH_BIN", REPO / "target" / "debug" / "expertmesh"))
    if not p.is_file():
        raise RuntimeError(
            f"the expertmesh binary {p} does not exist: build it (`cargo build` at the "
            "repository root) or point EXPERTMESH_BIN at one"
        )
    return p


class _Lines:
    """Lines of a child's stdout, read on a thread (so waits can time out)."""

    def __init__(self, stream: IO[str]) -> None:
        self.q: "queue.Queue[Optional[str]]" = queue.Queue()
        self.seen: List[str] = []

        def pump() -> None:
            for line in stream:
                self.q.put(line.rstrip("\n"))
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def wait_for(self, pattern: str, timeout: float, what: str) -> "re.Match[str]":
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: no line matching {pattern!r} in {timeout} s; got {self.seen}")
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{what} exited before printing {pattern!r}; got {self.seen}")
            self.seen.append(line)
            m = rx.search(line)
            if m:
                return m


def _spawn(args: Sequence[object], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(a) for a in args],
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),
        text=True,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
    )


def _stop(p: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 10.0) -> None:
    if p.poll() is not None:
        return
    try:
        p.send_signal(signal.SIGCONT)
        p.send_signal(sig)
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


class SplitFabric:
    """``expertmesh router`` + one ``expertmesh worker`` per device, ephemeral ports."""

    def __init__(
        self,
        tmp: Path,
        *,
        topology: Path = EXAMPLES / "single-host.toml",
        model: str = "demo-small",
        placement: Path = EXAMPLES / "single-host-demo-small.placement.toml",
        devices: Sequence[str] = ("local/cpu0", "local/cpu1"),
        cluster: str = "single-host",
        hidden: int = 1024,
        probe_layer: int = 1,
        router_args: Sequence[str] = ("--batch-window-us", "100", "--micro-batch", "16", "--mode", "exact"),
        secret: Optional[str] = None,
    ) -> None:
        exe = expertmesh_bin()
        self.cluster = cluster
        self.hidden = hidden
        self.secret = secret
        self.workers: List[subprocess.Popen] = []
        deploy = ["--topology", topology, "--model", model, "--placement", placement]
        if secret is not None:
            os.environ["EXPERTMESH_SECRET"] = secret
        try:
            self.router = _spawn(
                [exe, "router", *deploy, "--listen", "127.0.0.1:0", "--mesh-listen", "127.0.0.1:0", *router_args],
                tmp / "router.log",
            )
            lines = _Lines(self.router.stdout)  # type: ignore[arg-type]
            m = lines.wait_for(r"frontends connect to (\S+), workers to (\S+)", 60, "expertmesh router")
            self.addr, mesh = m.group(1), m.group(2)
            for i, d in enumerate(devices):
                w = _spawn(
                    [exe, "worker", *deploy, "--device", d, "--router", mesh, "--listen", "127.0.0.1:0", "--max-tokens", "16"],
                    tmp / f"worker-{i}.log",
                )
                self.workers.append(w)
            for i, w in enumerate(self.workers):
                _Lines(w.stdout).wait_for(r"ready", 60, f"worker {devices[i]}")  # type: ignore[arg-type]
        finally:
            if secret is not None:
                del os.environ["EXPERTMESH_SECRET"]
        self._wait_served(probe_layer)

    def _wait_served(self, layer: int) -> None:
        """Until a call succeeds (workers connect to the router after they print "ready")."""
        import expertmesh

        deadline = time.monotonic() + 60
        x = np.zeros((1, self.hidden), np.float32)
        while True:
            try:
                with expertmesh.RouterClient(self.addr, self.cluster, self.secret or "") as c:
                    c.moe(layer, x, deadline_ms=2000)
                return
            except (expertmesh.DeviceDown, expertmesh.DeadlineExceeded, expertmesh.ConnectionFailed):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def client(self, **kw: object):
        import expertmesh

        return expertmesh.RouterClient(self.addr, self.cluster, self.secret or "", **kw)

    def close(self) -> None:
        for w in self.workers:
            _stop(w, signal.SIGKILL)
        _stop(self.router)


class UpFabric:
    """``expertmesh up`` (its own router and workers) on free ports, until :meth:`close`."""

    def __init__(self, tmp: Path, args: Sequence[object], topology: Path = EXAMPLES / "single-host.toml",
                 free_ports: bool = True) -> None:
        """``free_ports=False`` runs ``topology`` as it is (e.g. to restart a fabric on the
        ports an earlier one had: ``UpFabric(tmp2, args, first.topology, free_ports=False)``)."""
        exe = expertmesh_bin()
        self.topology = topology_with_free_ports(topology, tmp / "topology.toml") if free_ports else topology
        if "--mode" not in [str(a) for a in args]:
            args = [*args, "--mode", "exact"]  # the tests compare bit for bit (up defaults to serving)
        self.proc = _spawn([exe, "up", "--topology", self.topology, *args], tmp / "up.log")
        self.log = tmp / "up.log"
        lines = _Lines(self.proc.stdout)  # type: ignore[arg-type]
        try:
            m = lines.wait_for(r"frontends: (\S+) \(cluster \"([^\"]+)\"\)", 120, "expertmesh up")
            self.addr, self.cluster = m.group(1), m.group(2)
            lines.wait_for(r"Ctrl-C to stop\.", 60, "expertmesh up")
        except BaseException:
            self.close()
            raise RuntimeError(f"expertmesh up failed; its log:\n{self.log.read_text()}")

    def close(self) -> None:
        _stop(self.proc)
