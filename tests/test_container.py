"""The image and the compose stack, built and run for real with podman.

No Docker engine runs here, and no image registry is reachable, but Debian's
podman can build and run containers once two things are handled (both written
down in docker/README.md):

- every ``FROM`` must be a local image: the base is a Debian bookworm made by
  ``debootstrap`` and imported into podman, cached outside the repository
  (``~/.cache/gpufeed/container``) and in podman's image store, so only the
  first run pays for it;
- runc refuses podman's default rlimits, and crun cannot run under a hybrid
  cgroup hierarchy: podman runs with a containers.conf that sets
  ``default_ulimits = []`` (and runc where it is installed), through
  ``CONTAINERS_CONF``.

The image is built from the compose files' build section (docker-compose.yml
with docker-compose.cpu.yml), only ``BASE_IMAGE`` replaced by the local base;
the CPU torch wheel that lies on this disk is bind-mounted into the build.
The server container then runs with the compose service's settings (ipc and
pid host, the uid mapping, the read-only data mount, its command), ports
published on 127.0.0.1 only, and a trainer on the host streams from it.
Every test skips, with the reason, where podman cannot run a container.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpufeed.client import FeedClient
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from support import shm_prefix, wait_until
from test_compose import _COMPOSE, _COMPOSE_CPU, _load, _merge

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(1800)]

_ROOT = Path(__file__).resolve().parents[1]
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpufeed" / "container"
_BASE = "localhost/gpufeed-base:bookworm"
# One tag per checkout, so two checkouts testing at once do not run each other's image.
_IMAGE = f"localhost/gpufeed-server:test-{hashlib.sha1(str(_ROOT).encode()).hexdigest()[:8]}"
_PROMETHEUS = "localhost/gpufeed-prometheus:test"
_BASE_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
_NUM_IMAGES = 24
_BATCH = 5  # not a divisor of _NUM_IMAGES: the last batch is short


# --- podman ------------------------------------------------------------------------------


class _Podman:
    """podman with this suite's containers.conf; ``say`` prints progress past pytest's capture."""

    def __init__(self, say):
        self.say = say
        conf = _CACHE / "containers.conf"
        runtime = '\n[engine]\nruntime = "runc"\n' if shutil.which("runc") else ""
        conf.write_text(f"[containers]\ndefault_ulimits = []\n{runtime}")
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kwargs)
        if check and done.returncode:
            raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done

    def build(self, log: Path, *args: str) -> None:
        """``podman build``; its output goes to ``log`` (layers are cached between runs)."""
        with log.open("w") as out:
            done = subprocess.run(["podman", "build", "--format", "docker", *args], env=self.env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=1500)
        assert done.returncode == 0, f"podman build failed; last lines of {log}:\n" \
            + "".join(log.read_text().splitlines(keepends=True)[-30:])

    def inspect(self, name: str) -> dict:
        return json.loads(self.run("inspect", name).stdout)[0]


@pytest.fixture(scope="module")
def say(pytestconfig):
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    start = time.monotonic()

    def say(message: str) -> None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[container {time.monotonic() - start:5.0f} s] {message}")

    return say


@pytest.fixture(scope="module")
def podman(say) -> _Podman:
    """A podman that can run a container, else skip with the reason."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (.ci/test installs Debian's podman when root)")
    _CACHE.mkdir(parents=True, exist_ok=True)
    podman = _Podman(say)
    info = podman.run("info", check=False)
    if info.returncode:
        pytest.skip(f"podman does not work here: {info.stderr.strip()[-500:]}")
    _base_image(podman)
    probe = podman.run("run", "--rm", "--network", "none", _BASE, "true", check=False)
    if probe.returncode:
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip()[-500:]}")
    return podman


def _base_image(podman: _Podman) -> None:
    """Debian bookworm with Python 3.11, made by debootstrap, cached as a tar and an image."""
    if podman.run("image", "exists", _BASE, check=False).returncode == 0:
        podman.say(f"base image {_BASE}: cached")
        return
    tarball = _CACHE / "bookworm-minbase.tar"
    if not tarball.exists():
        if shutil.which("debootstrap") is None or os.geteuid() != 0:
            pytest.skip("no local base image, and making one needs Debian's debootstrap, as root "
                        "(.ci/test installs it)")
        podman.say("making the base with debootstrap (once; about a minute or two)...")
        with tempfile.TemporaryDirectory(dir=_CACHE) as work:
            rootfs = Path(work) / "rootfs"
            done = subprocess.run(["debootstrap", "--variant=minbase",
                                   f"--include={_BASE_PACKAGES}", "bookworm", str(rootfs)],
                                  capture_output=True, text=True, timeout=1200)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            _trust_the_hosts_certificates(rootfs)
            partial = tarball.with_suffix(".partial")
            subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True,
                           timeout=600)
            partial.rename(tarball)
    podman.say(f"importing {tarball.name} as {_BASE}...")
    podman.run("import", str(tarball), _BASE, timeout=600)


def _trust_the_hosts_certificates(rootfs: Path) -> None:
    """The base trusts what this host trusts, so pip and apt in a build reach their
    indexes the way they do here (through a TLS-inspecting proxy, say)."""
    local = Path("/usr/local/share/ca-certificates")
    if local.is_dir():
        shutil.copytree(local, rootfs / local.relative_to("/"), dirs_exist_ok=True)
    bundle = ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"
    if Path(bundle).is_file():
        shutil.copyfile(bundle, rootfs / "etc/ssl/certs/ca-certificates.crt")


# --- the compose files -------------------------------------------------------------------


def _merged_service(name: str) -> dict:
    """One service of docker-compose.yml with docker-compose.cpu.yml merged in."""
    return _merge(_load(_COMPOSE), _load(_COMPOSE_CPU))["services"][name]


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME:-default}``."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- what the tests run ------------------------------------------------------------------


@pytest.fixture(scope="module")
def image(podman) -> str:
    """The gpufeed image, built as the compose files say, on the local base."""
    build = _merged_service("gpufeed")["build"]
    args = {**build.get("args", {}), "BASE_IMAGE": _BASE}
    wheels = _torch_wheels(podman)
    mount = []
    if wheels:
        args["TORCH_INDEX_URL"] = ""  # torch is in /wheels; PyPI has its dependencies
        mount = ["--volume", f"{wheels}:/wheels:ro"]
    start = time.monotonic()
    podman.say(f"building {_IMAGE} (cached layers are reused; log in {_CACHE / 'build.log'})...")
    podman.build(_CACHE / "build.log", "--file", str(_ROOT / build["dockerfile"]),
                 "--ignorefile", str(_ROOT / "docker" / "Dockerfile.dockerignore"),
                 *[f"--build-arg={k}={v}" for k, v in args.items()], *mount,
                 "--tag", _IMAGE, str(_ROOT / build["context"]))
    podman.say(f"built {_IMAGE} in {time.monotonic() - start:.0f} s")
    return _IMAGE


def _torch_wheels(podman: _Podman) -> Path | None:
    """A directory holding the pinned CPU torch wheel, if pip finds it on this disk."""
    version = re.search(r"^ARG TORCH_VERSION=(\S+)$", (_ROOT / "docker/Dockerfile").read_text(),
                        re.M).group(1)
    wheels = _CACHE / "wheels"
    found = list(wheels.glob(f"torch-{version}+cpu-*.whl"))
    if not found:
        # --no-index: only the wheels pip's configuration points at on this disk, never
        # a download (PyPI's torch of that version is the CUDA build).
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-index",
                        "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
                        "--dest", str(wheels), f"torch=={version}"],
                       capture_output=True, timeout=600)
        found = list(wheels.glob(f"torch-{version}+cpu-*.whl"))
    podman.say(f"torch {version}: " + (f"{found[0].name} bind-mounted into the build" if found
                                      else "no local CPU wheel, the build uses TORCH_INDEX_URL"))
    return wheels if found else None


@pytest.fixture(scope="module")
def data_dir():
    """JPEGs in a directory every uid can read (the container runs as another user)."""
    root = Path(tempfile.mkdtemp(prefix="gpufeed-container-data-"))
    root.chmod(0o755)
    rng = np.random.default_rng(7)
    for i in range(_NUM_IMAGES):
        path = root / f"img{i:03d}.jpg"
        path.write_bytes(encode_jpeg(synthetic_photo(rng, int(rng.integers(40, 90)), 64)))
        path.chmod(0o644)
    yield root
    shutil.rmtree(root)


def _names() -> list[str]:
    return [f"img{i:03d}.jpg" for i in range(_NUM_IMAGES)]


def _container_user() -> tuple[int, int]:
    """The trainers' uid and gid, as compose's GPUFEED_UID/GID would be set; a root
    trainer (it can map any segment) keeps the image's own non-root user."""
    if os.getuid() == 0:
        return 10001, 10001
    return os.getuid(), os.getgid()


def _one_pass(address: str, transport: str) -> list[int]:
    """The sample indices one pass delivered to a trainer on the host."""
    with FeedClient(address) as feed:
        loader = feed.loader(_names(), prefix="/data/", batch_size=_BATCH, size=(32, 32),
                             transport=transport)
        indices = []
        for batch in loader:
            assert batch["image"].shape[1:] == (3, 32, 32)
            indices += batch["index"].tolist()
    return indices


def _scrape(port: int) -> dict[str, float]:
    """``gpufeed_samples_total`` by transport, from /metrics on the published port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.labels["transport"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "gpufeed_samples_total"}


def _wait_healthy(podman: _Podman, container: str) -> str:
    """Run the image's HEALTHCHECK until it passes; its output (the probe prints SERVING)."""
    def healthy() -> bool:
        state = podman.inspect(container)["State"]
        assert state["Running"], "the container exited:\n" + podman.run(
            "logs", container, check=False).stderr[-3000:]
        return podman.run("healthcheck", "run", container, check=False).returncode == 0

    assert wait_until(healthy, timeout=120), f"{container} never became healthy"
    state = podman.inspect(container)["State"]
    return state["Health"]["Log"][-1]["Output"]


def _stop(podman: _Podman, container: str) -> int:
    """SIGTERM (the image's stop signal), wait for the drain; the exit code."""
    podman.run("stop", "--time", "60", container, timeout=120)
    state = podman.inspect(container)["State"]
    return state["ExitCode"]


# --- tests -------------------------------------------------------------------------------


def test_the_image_runs_as_the_compose_service_and_streams_to_a_host_trainer(
        podman, image, data_dir):
    service = _merged_service("gpufeed")
    uid, gid = _container_user()
    env = {"GPUFEED_UID": str(uid), "GPUFEED_GID": str(gid), "GPUFEED_DATA": str(data_dir)}
    config = podman.inspect(image)["Config"]
    assert config["User"] not in ("", "root", "0", "0:0"), "the image must not run as root"

    run = ["run", "--detach", "--name", f"gpufeed-test-{os.getpid()}",
           "--ipc", service["ipc"], "--pid", service["pid"],
           "--user", _interpolate(service["user"], env)]
    for volume in service["volumes"]:
        run += ["--volume", _interpolate(volume, env)]
    assert f"{data_dir}:/data:ro" in run, "the data directory must be mounted read-only"
    published = {}
    for spec in service["ports"]:
        container_port = int(spec.rsplit(":", 1)[1])
        published[container_port] = _free_port()
        run += ["--publish", f"127.0.0.1:{published[container_port]}:{container_port}"]
    name = run[3]
    podman.run(*run, image, *service["command"])
    try:
        podman.say(f"started {name}; waiting for its health check")
        assert "SERVING" in _wait_healthy(podman, name)
        address = f"127.0.0.1:{published[50051]}"
        prefix = shm_prefix(address)
        owner = os.stat(f"/dev/shm/{prefix}probe").st_uid
        assert owner == uid, "the server's segments belong to the mapped uid"

        for transport in ("shm", "inline"):
            indices = _one_pass(address, transport)
            assert sorted(indices) == list(range(_NUM_IMAGES)), transport
        podman.say("streamed a pass over shm and over inline")
        counts = _scrape(published[9464])
        assert counts["shm"] == counts["inline"] == _NUM_IMAGES, counts

        assert _stop(podman, name) == 0, podman.run("logs", name).stderr[-3000:]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], \
            "the server left segments in /dev/shm"
    finally:
        podman.run("rm", "--force", "--time", "5", name, check=False)


@pytest.fixture(scope="module")
def prometheus_image(podman) -> str:
    """Debian's prometheus on the local base: a stand-in for prom/prometheus."""
    start = time.monotonic()
    podman.say(f"building {_PROMETHEUS} from Debian's prometheus package...")
    with tempfile.TemporaryDirectory() as empty_context:
        podman.build(_CACHE / "build-prometheus.log",
                     "--file", str(_ROOT / "docker" / "Dockerfile.prometheus"),
                     "--build-arg", f"BASE_IMAGE={_BASE}", "--tag", _PROMETHEUS, empty_context)
    podman.say(f"built {_PROMETHEUS} in {time.monotonic() - start:.0f} s")
    return _PROMETHEUS


def test_podman_compose_runs_the_stack_and_prometheus_scrapes_the_server(
        podman, image, prometheus_image, data_dir, tmp_path):
    """docker-compose.yml + docker-compose.cpu.yml under podman-compose: the gpufeed and
    prometheus services, image names and published ports overridden (see docker/README.md)."""
    compose = shutil.which("podman-compose", path=str(Path(sys.executable).parent)) \
        or shutil.which("podman-compose")
    if compose is None:
        pytest.skip("podman-compose is not installed (the dev extra installs it)")
    ports = {"grpc": _free_port(), "metrics": _free_port(), "prometheus": _free_port()}
    override = tmp_path / "compose.local.yml"
    override.write_text(yaml.safe_dump({"services": {
        "gpufeed": {"image": image, "ports": [f"127.0.0.1:{ports['grpc']}:50051",
                                              f"127.0.0.1:{ports['metrics']}:9464"]},
        "prometheus": {"image": prometheus_image,
                       "ports": [f"127.0.0.1:{ports['prometheus']}:9090"]},
    }}).replace("ports:", "ports: !override"))
    uid, gid = _container_user()
    project = f"gpufeed-test-{os.getpid()}"
    # podman-compose 1.6 ignores ``ipc:``; this passes the service's to every container.
    ipc = _merged_service("gpufeed")["ipc"]
    argv = [compose, "--project-name", project, f"--podman-run-args=--ipc={ipc}",
            *[a for path in (_COMPOSE, _COMPOSE_CPU, override) for a in ("--file", str(path))]]
    env = {**podman.env, "GPUFEED_UID": str(uid), "GPUFEED_GID": str(gid),
           "GPUFEED_DATA": str(data_dir)}

    def compose_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv, *args], env=env, capture_output=True, text=True,
                              timeout=300, cwd=_ROOT)

    up = compose_run("up", "--detach", "--no-build", "gpufeed", "prometheus")
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        [server] = podman.run("ps", "--all", "--format", "{{.Names}}",
                              "--filter", f"label=io.podman.compose.project={project}",
                              "--filter", "label=com.docker.compose.service=gpufeed").stdout.split()
        podman.say(f"podman-compose started {server} and its prometheus")
        assert "SERVING" in _wait_healthy(podman, server)
        address = f"127.0.0.1:{ports['grpc']}"
        prefix = shm_prefix(address)
        for transport in ("shm", "inline"):
            assert sorted(_one_pass(address, transport)) == list(range(_NUM_IMAGES)), transport

        query = 'sum(gpufeed_samples_total{job="gpufeed"})'
        api = f"http://127.0.0.1:{ports['prometheus']}/api/v1/query?" \
              + urllib.parse.urlencode({"query": query})

        def scraped() -> bool:
            try:
                with urllib.request.urlopen(api, timeout=5) as reply:
                    result = json.load(reply)["data"]["result"]
            except OSError:
                return False  # Prometheus still starting
            return bool(result) and float(result[0]["value"][1]) == 2 * _NUM_IMAGES

        assert wait_until(scraped, timeout=90), \
            f"Prometheus never reported {query} == {2 * _NUM_IMAGES}"
        podman.say("Prometheus in its container scraped the server's count")

        stop = compose_run("stop")
        assert stop.returncode == 0, stop.stdout[-3000:] + stop.stderr[-3000:]
        assert podman.inspect(server)["State"]["ExitCode"] == 0
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    finally:
        down = compose_run("down", "--volumes")
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
