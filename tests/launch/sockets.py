"""Which of a run's processes listen off loopback (issue 42: everything binds on loopback only)."""

from __future__ import annotations

import re

import psutil

LOOPBACK = re.compile(r"^(127\.|::1$|::ffff:127\.)")


def listening_off_loopback(pids) -> list[str]:
    """'PID NAME ADDRESS:PORT' of each listening socket of these processes on an address other than loopback."""
    bad = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:
            continue
        bad += [
            f"{pid} {name} {c.laddr.ip}:{c.laddr.port}"
            for c in conns
            if c.status == psutil.CONN_LISTEN and not LOOPBACK.match(c.laddr.ip)
        ]
    return bad
