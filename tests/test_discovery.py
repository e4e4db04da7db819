"""Servers found through DNS, as Kubernetes publishes a headless Service: a real DNS
server (Debian's dnsmasq) on loopback answers one name with several A records, each a
gpufeed server on its own loopback address, and the records change mid-run.

A loader asks the name again at each pass from an epoch's start and when it loses a
server: servers that appear join, those that vanish are failed over, and every pass
delivers every sample exactly once.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess

import grpc
import pytest

from gpufeed.client import FeedClient
from gpufeed.client.discovery import resolve
from gpufeed.server.process import ServerProcess
from support import wait_until

_NAME = "gpufeed.test"
_HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
N = 40


def _free_port(hosts: list[str], kind: int = socket.SOCK_STREAM) -> int:
    """A port free on every one of ``hosts``."""
    while True:
        with socket.socket(socket.AF_INET, kind) as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket(socket.AF_INET, kind) as other:
                    other.bind((host, port))
            return port
        except OSError:
            continue


class _Dns:
    """dnsmasq answering ``_NAME`` from a hosts file that the test rewrites."""

    def __init__(self, folder):
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not os.path.exists(binary):
            pytest.skip("dnsmasq is not installed (.ci/test installs Debian's dnsmasq-base)")
        self.hosts = folder / "hosts"
        self.port = _free_port(["127.0.0.1"], socket.SOCK_DGRAM)
        self.publish([])
        self.proc = subprocess.Popen(
            # --user: stay this user (root's dnsmasq would read the hosts file as nobody)
            [binary, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
             f"--user={pwd.getpwuid(os.getuid()).pw_name}",
             "--no-hosts", f"--addn-hosts={self.hosts}", "--listen-address=127.0.0.1",
             "--local=/test/",  # the test domain is its own: NXDOMAIN, not REFUSED
             "--bind-interfaces", f"--port={self.port}", "--cache-size=0",
             f"--pid-file={folder / 'pid'}", "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # Answering (the name, with no address yet) means its SIGHUP handler is in place:
        # a SIGHUP before that would end it.
        assert wait_until(lambda: _answer(self.target(1)) == []), "dnsmasq did not answer"

    def publish(self, addresses: list[str]) -> None:
        """Make ``_NAME`` resolve to ``addresses`` (dnsmasq rereads the file on SIGHUP)."""
        self.hosts.write_text("".join(f"{a} {_NAME}\n" for a in addresses))
        if hasattr(self, "proc"):
            self.proc.send_signal(signal.SIGHUP)

    def target(self, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{_NAME}:{port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture()
def dns(tmp_path):
    server = _Dns(tmp_path)
    yield server
    server.close()


@pytest.fixture()
def servers(data_dir):
    port = _free_port(_HOSTS)
    started = {host: ServerProcess(["--data-root", str(data_dir), "--threads", "1",
                                    "--listen", f"{host}:{port}"]).start() for host in _HOSTS}
    yield port, started
    for server in started.values():
        server.kill()


def _published(dns: _Dns, port: int, hosts: list[str]) -> None:
    dns.publish(hosts)
    want = [f"{h}:{port}" for h in hosts]
    assert wait_until(lambda: _answer(dns.target(port)) == want), want


def _answer(target: str) -> list[str] | None:
    try:
        return resolve(target)
    except OSError:
        return None


def _streams(server: ServerProcess) -> int:
    return sum("stream open:" in line for line in server.log)


def _pass(loader) -> list[int]:
    return sorted(i for batch in loader for i in batch["index"].tolist())


def test_a_name_stands_for_every_server_it_resolves_to(dns, servers, image_names):
    port, started = servers
    _published(dns, port, _HOSTS[:2])
    with FeedClient(dns.target(port)) as feed:
        assert [s.address for s in feed.servers] == [f"{h}:{port}" for h in _HOSTS[:2]]
        loader = feed.loader(files=image_names[:N], batch_size=4, size=(16, 16), shuffle=True)
        assert _pass(loader) == list(range(N))
        assert _streams(started[_HOSTS[0]]) >= 1 and _streams(started[_HOSTS[1]]) >= 1
        assert _streams(started[_HOSTS[2]]) == 0  # not published: never asked

        # The records change: .2 goes, .4 comes. The next epoch is dealt over .3 and .4.
        _published(dns, port, _HOSTS[1:])
        before = {h: _streams(s) for h, s in started.items()}
        assert _pass(loader) == list(range(N))
        assert _streams(started[_HOSTS[0]]) == before[_HOSTS[0]]
        assert _streams(started[_HOSTS[2]]) > before[_HOSTS[2]]


def test_a_lost_server_is_replaced_by_one_the_name_now_lists(dns, servers, image_names):
    port, started = servers
    _published(dns, port, _HOSTS[:2])
    with FeedClient(dns.target(port)) as feed:
        loader = feed.loader(files=image_names[:N], batch_size=4, size=(16, 16), seed=3,
                             shuffle=True, prefetch=1, reconnect_timeout=60)
        expected = _pass(feed.loader(files=image_names[:N], batch_size=4, size=(16, 16), seed=3,
                                     shuffle=True))
        seen = []
        for k, batch in enumerate(loader):
            seen += batch["index"].tolist()
            if k == 1:  # mid-pass: .3 dies and the name now lists .2 and .4
                _published(dns, port, [_HOSTS[0], _HOSTS[2]])
                started[_HOSTS[1]].kill()
        assert sorted(seen) == expected == list(range(N))  # nothing lost or repeated
        assert _streams(started[_HOSTS[2]]) >= 1  # the lost part went to the new server


def test_servers_behind_a_name_speak_tls_as_the_name(dns, data_dir, image_names, tmp_path):
    """Their certificate names the DNS name, not each pod's address: the client checks
    it against the name it resolved."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert(_NAME)
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    port = _free_port(_HOSTS[:2])
    started = [ServerProcess(["--data-root", str(data_dir), "--threads", "1", "--listen",
                              f"{host}:{port}", "--tls-cert", str(tmp_path / "cert.pem"),
                              "--tls-key", str(tmp_path / "key.pem")]).start()
               for host in _HOSTS[:2]]
    try:
        _published(dns, port, _HOSTS[:2])
        credentials = grpc.ssl_channel_credentials(ca.cert_pem.bytes())
        with FeedClient(dns.target(port), credentials=credentials) as feed:
            loader = feed.loader(files=image_names[:N], batch_size=4, size=(16, 16))
            assert _pass(loader) == list(range(N))
        assert all(_streams(server) >= 1 for server in started)
    finally:
        for server in started:
            server.kill()


def test_a_dual_stack_name_lists_ipv4_then_ipv6(dns):
    dns.publish(["127.0.0.3", "::1", "127.0.0.2"])
    assert wait_until(lambda: _answer(dns.target(7)) is not None
                      and len(_answer(dns.target(7)) or []) == 3)
    assert _answer(dns.target(7)) == ["127.0.0.2:7", "127.0.0.3:7", "[::1]:7"]


def test_targets_that_cannot_be_servers_are_refused_naming_them(dns):
    with pytest.raises(ValueError, match="port 'x' is not a number"):
        resolve("dns:///gpufeed.test:x")
    with pytest.raises(ValueError, match="no host name"):
        resolve("dns:///:50051")
    dns.publish([])
    with pytest.raises(Exception, match="resolves to no address|cannot resolve"):
        FeedClient(dns.target(50051))
    assert resolve("localhost:50051") == ["localhost:50051"]  # not a dns: target: one server
