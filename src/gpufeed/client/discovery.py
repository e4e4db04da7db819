"""Which servers a FeedClient talks to: fixed addresses, and DNS names that stand for
every address behind them.

A Kubernetes headless Service publishes one DNS A record per ready pod, so its
name is the list of the servers up now. A target in gRPC's own syntax,
``dns:[//authority/]host[:port]``, stands for every address ``host`` resolves
to, each at ``port`` (default 50051, gpufeed's): ``dns:///host:port`` asks the
system's resolver (``getaddrinfo``: /etc/hosts, then the cluster's DNS);
``dns://IP[:PORT]/host:port`` asks that DNS server (with dnspython, the
``dns`` extra). Any other target is one server, as gRPC would dial it (a name
that resolves to several addresses is then one server at the first of them).

``Servers.current()`` resolves the names again: a loader asks it at each new
pass and when it loses a server (loader.py, dealing.py), so servers that appear
join the next pass, or the one that lost a server, and those that vanish are
lost servers whose batches go to the others. A name that resolves to nothing,
or a resolver that fails, keeps the addresses it had (a DNS hiccup must not end
a pass); at the first resolution it is an error, naming the target.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable

import grpc

from .connection import Connection
from .errors import FeedError

__all__ = ["Servers", "host_of", "is_dns_target", "resolve"]

_DEFAULT_PORT = 50051
_SCHEME = "dns:"


def is_dns_target(target: str) -> bool:
    return target.startswith(_SCHEME)


def resolve(target: str) -> list[str]:
    """``target``'s servers as "address:port" strings, sorted (a stable order: on a
    tie, a dealt pass prefers the first); one, as given, when it is not a ``dns:``
    target."""
    if not is_dns_target(target):
        return [target]
    authority, host, port = _parse(target)
    addresses = _ask(authority, host) if authority else _system(host, port)
    return [_join(address, port) for address in sorted(set(addresses), key=_ip_order)]


def host_of(target: str) -> str:
    """The name a ``dns:`` target resolves (its servers' TLS certificates name it)."""
    return _parse(target)[1] if is_dns_target(target) else ""


def _ip_order(address: str) -> tuple[int, int]:
    """IPv4 before IPv6 (a dual-stack name has both), then by address."""
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)


def _parse(target: str) -> tuple[str, str, int]:
    """(authority, host, port) of ``dns:[//authority/]host[:port]``; ValueError naming it."""
    rest = target[len(_SCHEME):]
    authority = ""
    if rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        if not slash:
            raise ValueError(f"{target!r}: a dns target with an authority is "
                             f"dns://AUTHORITY/host[:port]")
    if rest.startswith("["):  # an IPv6 literal needs no resolving, but is allowed
        host, _, port = rest[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not host:
        raise ValueError(f"{target!r}: no host name to resolve")
    try:
        number = int(port) if port else _DEFAULT_PORT
    except ValueError:
        raise ValueError(f"{target!r}: the port {port!r} is not a number") from None
    if not 0 < number < 65536:
        raise ValueError(f"{target!r}: port {number} is out of range")
    return authority, host, number


def _system(host: str, port: int) -> list[str]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve {host!r}: {e.strerror}") from None
    return [str(info[4][0]) for info in found]


def _ask(authority: str, host: str) -> list[str]:
    """A and AAAA records of ``host`` from the DNS server at ``authority`` (IP[:PORT])."""
    try:
        import dns.exception
        import dns.resolver
    except ImportError:
        raise ImportError("a dns:// target naming a DNS server needs dnspython: pip install "
                          "'gpufeed[dns]' (dns:///host:port uses the system's resolver "
                          "without it)") from None
    server, _, port = authority.rpartition(":") if authority.count(":") == 1 else \
        (authority, "", "")
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [server.strip("[]")]
    resolver.port = int(port) if port else 53
    resolver.lifetime = 5.0
    addresses, failed = [], None
    for kind in ("A", "AAAA"):  # a server answering one kind may refuse the other
        try:
            addresses += [record.to_text() for record in resolver.resolve(host, kind)]
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        except dns.exception.DNSException as e:
            failed = e
    if failed is not None and not addresses:
        raise OSError(f"cannot resolve {host!r} at {authority}: {failed}")
    return addresses


def _join(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class Servers:
    """The servers of some targets, each a ``Connection`` made once per address and kept
    until ``close()`` (a loader mid-pass may still stream from one a name no longer
    lists). ``current()`` resolves the targets again, outside the lock (a DNS query
    may take seconds), so other loaders' ``connection()`` calls do not wait for it.
    ``found_later(address)``: the address came from a name, not from the caller, so a
    server there that never answered is one to pass over, not a mistake to report."""

    def __init__(self, targets: list[str], connect: Callable[[str, str], Connection]):
        self.targets = targets
        self._connect = connect  # (address, the DNS name it was found behind, or "")
        self._lock = threading.Lock()
        self._connections: dict[str, Connection] = {}
        self._addresses: dict[str, list[str]] = {}  # by target: what it resolved to last
        self._authority: dict[str, str] = {}  # a found address's name
        self.current()  # a target that resolves to nothing is an error now

    def current(self) -> list[Connection]:
        """Every target's servers now, in the targets' order (a name's sorted)."""
        found = [(target, self._resolve(target)) for target in self.targets]
        with self._lock:
            servers: list[Connection] = []
            for target, addresses in found:
                for address in addresses:
                    if is_dns_target(target):
                        self._authority.setdefault(address, host_of(target))
                    servers.append(self._connection(address))
            return list(dict.fromkeys(servers))  # a server named twice is one server

    def connection(self, address: str) -> Connection:
        with self._lock:
            return self._connection(address)

    def found_later(self, address: str) -> bool:
        with self._lock:
            return address in self._authority

    def close(self) -> None:
        with self._lock:
            for connection in self._connections.values():
                connection.close()
            self._connections.clear()

    def _connection(self, address: str) -> Connection:
        if address not in self._connections:
            self._connections[address] = self._connect(address,
                                                       self._authority.get(address, ""))
        return self._connections[address]

    def _resolve(self, target: str) -> list[str]:
        before = self._addresses.get(target)
        try:
            found = resolve(target)
        except (OSError, ValueError, TypeError) as e:
            if before is None or isinstance(e, ValueError):
                raise FeedError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            return before  # keep the last answer through a resolver's hiccup
        if not found:
            if before is None:
                raise FeedError(grpc.StatusCode.UNAVAILABLE,
                                f"{target!r} resolves to no address")
            return before
        self._addresses[target] = found
        return found
