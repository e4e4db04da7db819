"""A real network hop on one machine: two network namespaces joined by a veth pair.

The server runs in one namespace, the trainer in the other, and every byte of
a batch crosses the veth link, through each side's TCP stack, as it would
between two hosts (without the wire: a veth hop costs CPU, not propagation).
The link is optionally shaped with a token bucket (``tc qdisc ... tbf``; this
kernel has no netem) to a rate such as 10 or 1 Gbit/s.

Addresses are in the loopback range (``127.10.0.1`` for the server, ``.2`` for
the trainer), so nothing can ever leave the machine. The kernel drops such
packets on a non-loopback interface unless ``route_localnet`` is set: it is
set inside both namespaces (``all`` and the veth), never on the host. Each
namespace's ``lo`` is up (a process reaches its own addresses through it:
the tf.data service's worker its dispatcher) with 127.0.0.1/32 and without
the local route for 127.0.0.0/8 the kernel adds, which would claim the peer's
address.

Names carry this process's id and a counter, so parallel runs do not collide,
and ``VethLink`` removes both namespaces (which removes the veth pair) however
it is left; those of a process killed outright are removed by the next link
made. Making namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN):
``unavailable_reason()`` says why it cannot be done here, for rows that then
say "unavailable" and tests that skip.

``enter(namespace)`` moves the calling process (its current thread, and every
thread started after) into a namespace: a trainer calls it before it opens
its first channel.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import subprocess

__all__ = ["SERVER_ADDRESS", "CLIENT_ADDRESS", "VethLink", "enter", "unavailable_reason"]

SERVER_ADDRESS = "127.10.0.1"
CLIENT_ADDRESS = "127.10.0.2"
_PREFIX_LENGTH = 24
_CLONE_NEWNET = 0x40000000
_counter = itertools.count()
_OURS = re.compile(r"gpufeed-(\d+)-\d+-(?:server|trainer)")


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"tc {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _rate_bits(rate: str) -> float:
    """"1gbit" -> 1e9 (tc's units: bit, kbit, mbit, gbit)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"rate must end in one of {', '.join(units)}, got {rate!r}")


class VethLink:
    """Two namespaces, a veth pair between them, loopback-range addresses, a rate.

    ``with VethLink(rate="1gbit") as link:`` run the server with
    ``link.server_command(argv)`` listening on ``SERVER_ADDRESS``, and the
    trainer with ``link.client_command(argv)`` (or ``enter(link.client_ns)``).
    """

    def __init__(self, rate: str | None = None):
        number = next(_counter)
        self.server_ns = f"gpufeed-{os.getpid()}-{number}-server"
        self.client_ns = f"gpufeed-{os.getpid()}-{number}-trainer"
        short = f"{os.getpid() % 100000}{number % 100}"
        self.server_dev = f"gfs{short}"  # interface names: at most 15 characters
        self.client_dev = f"gfc{short}"
        self.rate = rate
        self.rate_bits = _rate_bits(rate) if rate else 0.0
        self._made: list[str] = []

    def __enter__(self) -> VethLink:
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _create(self) -> None:
        _remove_orphans()
        for ns in (self.server_ns, self.client_ns):
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("-n", self.server_ns, "link", "add", self.server_dev, "type", "veth",
            "peer", "name", self.client_dev, "netns", self.client_ns)
        for ns, dev, address in ((self.server_ns, self.server_dev, SERVER_ADDRESS),
                                 (self.client_ns, self.client_dev, CLIENT_ADDRESS)):
            _ip("-n", ns, "addr", "add", "127.0.0.1/32", "dev", "lo")  # before up: no /8
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local")
            for key in ("all", dev):  # inside the namespace: the host's own settings stay
                self._sysctl(ns, f"net.ipv4.conf.{key}.route_localnet", "1")
            _ip("-n", ns, "addr", "add", f"{address}/{_PREFIX_LENGTH}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            if self.rate:
                # A bucket of 10 ms at the rate (at least 256 KB, for the veth's 64 KB
                # GSO segments); packets wait up to 50 ms for tokens, then drop.
                burst = max(256 * 1024, int(self.rate_bits / 8 / 100))
                _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                    "burst", str(burst), "latency", "50ms")

    @staticmethod
    def _sysctl(ns: str, key: str, value: str) -> None:
        done = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"sysctl {key} in {ns}: {done.stderr.strip()}")

    def remove(self) -> None:
        """Delete the namespaces this link made (their veth ends go with them)."""
        while self._made:
            ns = self._made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def server_command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.server_ns, *argv]

    def client_command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.client_ns, *argv]

    def set_up(self, up: bool) -> None:
        """Take the link down (both ends: nothing crosses) or bring it back up."""
        state = "up" if up else "down"
        _ip("-n", self.server_ns, "link", "set", self.server_dev, state)
        _ip("-n", self.client_ns, "link", "set", self.client_dev, state)

    def server_tx_bytes(self) -> int:
        """Bytes the server's end has sent (IP packets, headers included)."""
        shown = json.loads(_ip("-j", "-s", "-n", self.server_ns, "link", "show",
                               "dev", self.server_dev))
        return int(shown[0]["stats64"]["tx"]["bytes"])


def _remove_orphans() -> None:
    """Delete the namespaces of links whose process died without removing them (SIGKILL)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        match = _OURS.fullmatch(line.split(" ", 1)[0])
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", match.group(0)], capture_output=True)


def enter(namespace: str) -> None:
    """Move the calling thread (and threads it starts later) into ``namespace``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def unavailable_reason() -> str | None:
    """Why two namespaces and a veth pair cannot be made here; None when they can."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    try:
        with VethLink(rate="1gbit"):
            pass
    except OSError as e:
        return f"cannot make a veth link between network namespaces: {e}"
    return None
