"""Ports for what the tests start (servers, routers, torchrun stores, weight-sync groups).

A port the kernel hands out for `bind(0)` comes from the ephemeral range (32768-60999 here), the same
range every outgoing connection of the machine draws its local port from. Between the test reading such
a port and the server binding it, any connection (an HTTP client, a gloo pair, another server's
workers) may take it, and the server dies with "Address already in use"; CI saw exactly that with the
router. So the tests take ports *below* the ephemeral range, where only a listener that asks for a
port by number lands, and check that every port of a block is free before using it.
"""

from __future__ import annotations

import os
import random
import socket

LOW = 20000
"""Lowest port the tests use (above the usual fixed-port services)."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except OSError:
        return 32768, 60999


def _all_free(base: int, n: int, host: str) -> bool:
    socks = []
    try:
        for port in range(base, base + n):
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_block(n: int = 1, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """Base of n consecutive ports, all free now and outside the ephemeral range.

    The start is random (seeded by pid and time), so two test runs on one machine rarely try the same block.
    """
    eph_lo, eph_hi = ephemeral_range()
    if eph_lo - LOW >= n + 1000:
        lo, hi = LOW, eph_lo - n
    elif 65535 - eph_hi >= n + 1000:
        lo, hi = eph_hi + 1, 65535 - n
    else:  # a machine whose ephemeral range covers nearly everything: take any free block, as before
        lo, hi = LOW, 65535 - n
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(attempts):
        base = rng.randrange(lo, hi)
        if _all_free(base, n, host):
            return base
    raise RuntimeError(f"no block of {n} free ports in {lo}-{hi + n} after {attempts} tries")


def free_port(host: str = "127.0.0.1") -> int:
    """One free port outside the ephemeral range."""
    return free_port_block(1, host)
