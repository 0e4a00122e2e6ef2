"""Loopback networking helpers shared by servers, process groups and tests."""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1, or one mapped into IPv6 as ::ffff:127.x)."""
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_wildcard(host: str) -> bool:
    """True for the any-address (0.0.0.0, ::), which listens on every interface."""
    return ipaddress.ip_address(host).is_unspecified


def listening_socket(host: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to `host` alone (not every interface) and listening; port 0 = the OS picks."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name: resolved by bind as IPv4
        return socket.AF_INET


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface that holds address `host`, or None."""
    import psutil

    want = ipaddress.ip_address(host)
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and _same_ip(a.address, want):
                return name
    return None


def _same_ip(address: str, want: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]) == want  # fe80::1%eth0: scope dropped
    except ValueError:
        return False


def route_address(host: str) -> str:
    """This machine's address on the route to `host` (an IP or a name): the source address its packets to
    `host` leave from, as the kernel's routing table chooses it. Connecting a UDP socket sends nothing."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def is_this_host(host: str) -> bool:
    """Whether `host` (an IP or a name) is loopback or one of this machine's own addresses."""
    try:
        address = socket.getaddrinfo(host, None)[0][4][0]
    except socket.gaierror:
        return False
    return is_loopback(address) or interface_of(address) is not None
