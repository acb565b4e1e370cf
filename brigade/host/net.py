"""The network as one node sees it: ports, the rendezvous endpoint, and which address to advertise.

A multi-node run needs every node to advertise an address its peers can reach. torch falls back
to the hostname, which on many machines (containers, network namespaces, laptops) resolves to
loopback or to nothing; gloo then binds the wrong interface and the rendezvous times out after
minutes. `node_address()` finds the address and interface that route to node 0 instead.
"""

from __future__ import annotations

import random
import socket
import struct
import sys
import time
from dataclasses import dataclass

from brigade.errors import BrigadeError

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class NodeAddress:
    addr: str  # what this node advertises to its peers
    ifname: str | None  # the interface holding `addr`, for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    hostname_ok: bool  # whether this machine's hostname resolves to `addr`


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"10.0.0.1:29500"`` → ("10.0.0.1", 29500).

    Raises:
        BrigadeError: not HOST:PORT.
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BrigadeError(f"--rdzv-endpoint {text!r}: expected HOST:PORT of node 0, like 10.0.0.1:29500")
    return host.strip("[]"), int(port)


def free_port() -> int:
    """A loopback port free now, for a store to listen on a moment later: drawn below the kernel's
    ephemeral range (`ephemeral_start`), so that no outgoing connection (gloo's, another run's)
    can be handed it between this check and the listen; the kernel's own pick (inside that range)
    only where 64 draws below it are all taken. A port taken in that gap failed a test run here
    once: a gloo connection of a neighbouring test got it."""
    low = ephemeral_start()
    draw = random.Random()
    for _ in range(64):
        port = draw.randrange(10000, low) if low > 10000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_start() -> int:
    """The first port the kernel hands outgoing connections (Linux's ip_local_port_range; 32768,
    its default, where that cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Raise BrigadeError if `port` cannot be bound on `host`."""
    listen(host, port).close()


def listen(host: str, port: int | None) -> socket.socket:
    """A socket listening on host:port (a free port if None), for a TCPStore to serve from.

    Binding it here, rather than letting torch's TCPStore bind every interface, is what keeps a
    single-node run's stores on loopback.

    Raises:
        BrigadeError: the port is taken.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port or 0))
    except OSError:
        sock.close()
        raise BrigadeError(f"port {port} on {host} is already in use: pick another with --port, "
                           "or omit it") from None
    sock.listen(1024)
    return sock


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


REACH_WAIT_S = 15.0
"""How long a node waits for node 0's rendezvous endpoint to answer before it gives up."""


def check_reachable(host: str, port: int, timeout_s: float | None = None) -> None:
    """Raise BrigadeError if nothing answers at host:port within `timeout_s` (REACH_WAIT_S).

    A refused connection is retried until then: node 0 may simply be starting a little later.
    """
    timeout_s = REACH_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(left, 0.1)):
                return
        except OSError as exc:
            if time.monotonic() + 0.5 < deadline and not isinstance(exc, socket.timeout):
                time.sleep(0.5)
                continue
            why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
            raise BrigadeError(
                f"rendezvous endpoint {host}:{port} does not answer ({why}, for {timeout_s:.0f} s): "
                "start node 0 first, and check the address, port and firewall"
            ) from None


def route_source(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (nothing is sent)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror:
        raise BrigadeError(f"rendezvous host {host!r} does not resolve: give node 0's IP address in "
                           "--rdzv-endpoint, or add the name to /etc/hosts") from None
    with socket.socket(family[0], socket.SOCK_DGRAM) as s:
        try:
            s.connect(family[4])
        except OSError as exc:
            raise BrigadeError(f"no route from this machine to {host}:{port} ({exc.strerror}): check "
                               "the address in --rdzv-endpoint and this node's network") from None
        return s.getsockname()[0]


def interface_of(addr: str) -> str | None:
    """The name of the interface holding IPv4 address `addr`, or None (not found, not Linux)."""
    try:
        import fcntl
    except ImportError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == addr:
            return name
    return None


def hostname_addresses() -> set[str]:
    """Every address this machine's hostname resolves to (empty if it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except socket.gaierror:
        return set()


def node_address(host: str, port: int, local_addr: str = "") -> NodeAddress:
    """The address this node should advertise in a run whose rendezvous is at host:port.

    Raises:
        BrigadeError: `local_addr` is not an address of this machine.
    """
    addr = local_addr or route_source(host, port)
    ifname = interface_of(addr)
    if local_addr and ifname is None and sys.platform.startswith("linux"):
        raise BrigadeError(f"--local-addr {local_addr} is not an address of this machine: give one of "
                           "its own IPv4 addresses (see `ip -4 addr`), or omit it to use the one that "
                           "routes to node 0")
    return NodeAddress(addr, ifname, addr in hostname_addresses())
