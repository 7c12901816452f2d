"""Free loopback ports for one-host fabrics started from Python (the vLLM bench, the tests):
a topology copied with its router, control and data ports moved to free ones."""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    """The first port the kernel gives outgoing connections (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1, below the kernel's ephemeral
    range where there is room (no outgoing connection takes one of them before the fabric's
    processes bind them, as can happen with ports from that range)."""
    rng = random.Random()
    top = _ephemeral_low() - n
    if top <= 11000:
        top = 60000 - n
    for _ in range(200):
        base = rng.randrange(10000, top)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def topology_with_free_ports(src: Path, dst: Path) -> Path:
    """A copy of the topology ``src`` (one node) whose router, control and data ports are free."""
    text = Path(src).read_text()
    devices = len(re.findall(r"\{\s*name\s*=", text.split("devices", 1)[1]))
    base = free_port_block(2 + devices)
    text = re.sub(r"(?m)^port\s*=\s*\d+", f"port = {base}", text)
    text = re.sub(r"(?m)^control_port\s*=\s*\d+", f"control_port = {base + 1}", text)
    text = re.sub(r"(?m)^data_port\s*=\s*\d+", f"data_port = {base + 2}", text)
    Path(dst).write_text(text)
    return Path(dst)
