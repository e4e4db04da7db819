"""The deployment files agree with the server and with each other.

Docker cannot run here, so everything that can be checked for real is: the
compose file's server command is run as a real server (data root mapped to a
temp dir, listen mapped to loopback), its ports and Prometheus target must match
that command and docker/prometheus.yml, every dashboard query must name only
metrics that live server exports, promtool must accept the Prometheus config,
and the Dockerfile's health probe must tell a serving server from a dead one.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpufeed.client import FeedClient
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess

_ROOT = Path(__file__).resolve().parents[1]
_COMPOSE = _ROOT / "docker-compose.yml"
_COMPOSE_CPU = _ROOT / "docker-compose.cpu.yml"
_DOCKER = _ROOT / "docker"
_DASHBOARD = _DOCKER / "grafana" / "dashboards" / "gpufeed.json"
_HEALTHCHECK = _DOCKER / "healthcheck.py"
_METRICS_LINE = re.compile(r"gpufeed-server metrics on http://(\S+)/metrics")


# --- reading the files -------------------------------------------------------------------


class _Reset:
    """Compose's ``!reset`` tag: the override removes this key from the base file."""


class _ComposeLoader(yaml.SafeLoader):
    """pyyaml's safe loader plus Compose's ``!reset`` tag."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())


def _load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def _merge(base, override):
    """Compose's merge of an override file, for mappings and ``!reset``."""
    if not isinstance(base, dict) or not isinstance(override, dict):
        return override
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, _Reset):
            merged.pop(key, None)
        else:
            merged[key] = _merge(base.get(key), value)
    return merged


def _flag(args: list[str], name: str) -> str:
    values = [args[i + 1] for i, a in enumerate(args) if a == name]
    assert len(values) == 1, f"{name} should appear exactly once in {args}"
    return values[0]


def _with_flag(args: list[str], name: str, value: str) -> list[str]:
    return [value if i and args[i - 1] == name else a for i, a in enumerate(args)]


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _volume(spec: str) -> tuple[str, str, str]:
    """A short-syntax volume "SOURCE:TARGET[:MODE]" (SOURCE may hold ${VAR:-default})."""
    source, target, *mode = re.split(r":(?![^{]*})", spec)
    return source, target, mode[0] if mode else "rw"


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (_DOCKER / "Dockerfile").read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            pairs.append((instruction.upper(), rest.strip()))
    return pairs


def _instruction(name: str) -> list[str]:
    return [rest for instruction, rest in _dockerfile() if instruction == name]


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                 "or", "unless", "offset", "inf", "nan", "sum", "avg", "min", "max", "count",
                 "group", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values"}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range and subquery durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = match.group()
        if word.lower() in _PROMQL_WORDS or expr[match.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def _dashboard() -> dict:
    return json.loads(_DASHBOARD.read_text())


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


# --- the compose server, run for real ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load(_COMPOSE)


@pytest.fixture(scope="module")
def compose_server(compose, tmp_path_factory):
    """The compose file's server command, run here: what it serves and scrapes.

    Only these values are mapped: the data root to a temp dir, the listen address
    to loopback port 0, the metrics port to a free one, and the device to the
    CPU where there is no GPU. Every other flag is the compose file's own, so a
    flag the CLI does not know fails here.
    """
    args = compose["services"]["gpufeed"]["command"]
    if not torch.cuda.is_available():
        args = _with_flag(args, "--device", "cpu")
    data = tmp_path_factory.mktemp("compose-data")
    rng = np.random.default_rng(1)
    for i in range(6):
        (data / f"{i}.jpg").write_bytes(encode_jpeg(synthetic_photo(rng, 40, 56)))
    local = _with_flag(args, "--data-root", str(data))
    local = _with_flag(local, "--listen", "127.0.0.1:0")
    server = None
    for _ in range(3):
        try:
            server = ServerProcess(_with_flag(local, "--metrics-port", str(_free_port()))).start()
            break
        except RuntimeError as e:  # start() has killed the child already
            if "cannot serve metrics" not in str(e):
                raise
    assert server is not None, "no free metrics port after 3 tries"
    try:
        with FeedClient(server.address) as client:
            loader = client.loader([f"{i}.jpg" for i in range(6)], prefix=f"{data}/",
                                   batch_size=4, size=(32, 32), transport="inline")
            samples = sum(len(batch["index"]) for batch in loader)
        metrics = next(filter(None, map(_METRICS_LINE.search, server.log)))
        with urllib.request.urlopen(f"http://{metrics.group(1)}/metrics", timeout=10) as reply:
            scrape = reply.read().decode()
        yield {"samples": samples, "scrape": scrape, "address": server.address}
    finally:  # not ``with server:``, whose __enter__ would start a second process
        try:
            server.stop()
        except subprocess.TimeoutExpired:
            server.kill()
            raise


# --- tests -------------------------------------------------------------------------------


def test_the_compose_command_runs_the_real_server(compose_server):
    families = {f.name: f for f in text_string_to_metric_families(compose_server["scrape"])}
    inline = [s for s in families["gpufeed_samples"].samples
              if s.name == "gpufeed_samples_total" and s.labels == {"transport": "inline"}]
    assert [s.value for s in inline] == [compose_server["samples"]] == [6]


def test_compose_ports_and_prometheus_target_match_the_command(compose):
    server = compose["services"]["gpufeed"]
    args = server["command"]
    listen_port = _port(_flag(args, "--listen"))
    metrics_port = int(_flag(args, "--metrics-port"))
    assert _flag(args, "--listen").startswith("0.0.0.0:"), "the container must listen on all"
    assert f"{listen_port}:{listen_port}" in server["ports"]
    assert f"{metrics_port}:{metrics_port}" in server["ports"]

    data_root = _flag(args, "--data-root")
    mounts = [_volume(v) for v in server["volumes"]]
    assert [(target, mode) for _, target, mode in mounts if target == data_root] == \
        [(data_root, "ro")], "the data root must be mounted read-only"

    prometheus = compose["services"]["prometheus"]
    config_file = next(a.split("=", 1)[1] for a in prometheus["command"]
                       if a.startswith("--config.file="))
    assert ("./docker/prometheus.yml", config_file, "ro") in map(_volume, prometheus["volumes"])
    scrape = _load(_DOCKER / "prometheus.yml")["scrape_configs"]
    targets = [t for job in scrape for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"gpufeed:{metrics_port}"], "Prometheus must scrape the server service"
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in scrape)


def test_compose_reserves_a_gpu_and_the_cpu_override_drops_it(compose):
    server = compose["services"]["gpufeed"]
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert server.get("ipc") == "host" or server.get("shm_size"), "batches need a sized /dev/shm"

    override = _load(_COMPOSE_CPU)
    assert set(override["services"]) <= set(compose["services"])
    merged = _merge(compose, override)
    cpu = merged["services"]["gpufeed"]
    assert "deploy" not in cpu, "the CPU override must drop the GPU reservation"
    assert "--device" not in cpu["command"], "the CPU override must not ask for a GPU"
    # The CPU variant of the image: a plain Python base gets the CPU build of torch.
    assert not cpu["build"]["args"]["BASE_IMAGE"].startswith("pytorch/")
    assert cpu["image"] != server["image"], "the two variants need their own image names"
    assert {k: v for k, v in cpu["build"].items() if k != "args"} == server["build"]
    same = {k: v for k, v in server.items() if k not in ("deploy", "command", "build", "image")}
    assert same == {k: v for k, v in cpu.items() if k not in ("command", "build", "image")}
    assert merged["services"]["prometheus"] == compose["services"]["prometheus"]


def test_the_compose_merge_helper_can_fail():
    """The override check above relies on _merge; make sure it really keeps what it should."""
    merged = _merge({"a": {"deploy": 1, "x": 2}}, {"a": {"deploy": _Reset(), "y": 3}})
    assert merged == {"a": {"x": 2, "y": 3}}


def test_the_dashboard_names_only_metrics_the_server_exports(compose_server):
    exported = {s.name for f in text_string_to_metric_families(compose_server["scrape"])
                for s in f.samples}
    used = set()
    for expr in _exprs():
        names = _metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} names metrics the server does not export: {unknown}"
        used |= names
    # The panels the issue asks for: images, batches, bytes, stage latency,
    # failures, active streams, trainer wait.
    for needed in ("gpufeed_samples_total", "gpufeed_batches_total", "gpufeed_batch_bytes_total",
                   "gpufeed_stage_duration_seconds_bucket", "gpufeed_sample_failures_total",
                   "gpufeed_active_streams", "gpufeed_trainer_wait_seconds_bucket"):
        assert needed in used, f"no dashboard panel queries {needed}"


def test_the_dashboard_shows_one_server_or_all(compose_server):
    """A Server variable (all servers, or some) that every query filters on, and a
    per-server breakdown of throughput, trainer wait and failures."""
    [variable] = _dashboard()["templating"]["list"]
    assert variable["name"] == "instance" and variable["includeAll"] and variable["multi"]
    assert variable["allValue"] == ".*"
    [metric] = re.findall(r"label_values\((\w+), instance\)", variable["definition"])
    assert metric in {f.name for f in text_string_to_metric_families(compose_server["scrape"])}
    for expr in _exprs():
        selectors = re.findall(r"\b(gpufeed_\w+)(\{[^}]*\})?", expr)
        unfiltered = [name for name, matchers in selectors
                      if 'instance=~"$instance"' not in matchers]
        assert not unfiltered, f"{expr!r} does not filter {unfiltered} by the Server variable"
    by_server = {name for expr in _exprs() if re.search(r"by \([^)]*\binstance\b", expr)
                 for name in _metric_names(expr)}
    for needed in ("gpufeed_samples_total", "gpufeed_trainer_wait_seconds_sum",
                   "gpufeed_trainer_wait_seconds_bucket", "gpufeed_sample_failures_total"):
        assert needed in by_server, f"no panel breaks {needed} down by server"


def test_each_dashboard_panel_has_its_unit():
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in _dashboard()["panels"]}
    for title, unit in units.items():
        if "share" in title:
            assert unit == "percentunit", title
        elif "latency" in title or "wait time" in title:
            assert unit == "s", title
        elif "Bytes" in title:
            assert unit == "Bps", title
        elif title.startswith("Images/s"):
            assert unit == "suffix: img/s", title
        else:
            assert unit != "short", f"{title}: say what it counts"


def test_the_promql_name_parser():
    assert _metric_names('histogram_quantile(0.99, sum by (stage, le) '
                         '(rate(gpufeed_x_bucket{stage="read"}[$__rate_interval])))') \
        == {"gpufeed_x_bucket"}
    assert _metric_names("sum without (instance) (a_total) / on (job) group_left b + 1e3") \
        == {"a_total", "b"}


def test_grafana_is_provisioned_from_the_mounted_files(compose):
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = {target: source for source, target, _ in map(_volume, grafana["volumes"])}
    provisioning = _ROOT / mounts["/etc/grafana/provisioning"]
    assert provisioning == _DOCKER / "grafana" / "provisioning"

    datasources = _load(provisioning / "datasources" / "prometheus.yml")["datasources"]
    [datasource] = datasources
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[-1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    assert datasource["type"] == "prometheus"

    [provider] = _load(provisioning / "dashboards" / "gpufeed.yml")["providers"]
    dashboards_dir = provider["options"]["path"]
    assert _ROOT / mounts[dashboards_dir] == _DASHBOARD.parent
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_dir + "/")
    assert (_DASHBOARD.parent / home.removeprefix(dashboards_dir + "/")).is_file()

    dashboard = _dashboard()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (.ci/test installs Debian's prometheus)")
    check = subprocess.run([promtool, "check", "config", str(_DOCKER / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_dockerfile_matches_the_compose_service(compose):
    base = _instruction("ARG")[0].split("=", 1)[1]
    assert base.startswith("pytorch/pytorch:") and "cuda" in base
    assert _instruction("FROM") == ["${BASE_IMAGE}"]
    assert any(re.search(r'pip install (--\S+ \S+ )*"\.\[server,s3\]"', run)
               for run in _instruction("RUN"))
    [user] = _instruction("USER")
    assert user.split(":")[0] not in ("root", "0")
    assert json.loads(_instruction("ENTRYPOINT")[0]) == ["gpufeed-server"]
    # The image defaults to the CPU; compose adds the GPU, the CPU override takes it away.
    cmd = json.loads(_instruction("CMD")[0])
    assert compose["services"]["gpufeed"]["command"] == [*cmd, "--device", "cuda:0"]
    assert _load(_COMPOSE_CPU)["services"]["gpufeed"]["command"] == cmd
    assert compose["services"]["gpufeed"]["pid"] == "host"  # CUDA IPC across containers
    exposed = {int(p) for line in _instruction("EXPOSE") for p in line.split()}
    published = {int(p.split(":")[-1]) for p in compose["services"]["gpufeed"]["ports"]}
    assert exposed == published


def test_the_healthcheck_probes_a_live_server_and_a_dead_one(compose_server, tmp_path):
    """The Dockerfile's HEALTHCHECK command, run here against the compose server."""
    [healthcheck] = _instruction("HEALTHCHECK")
    argv = json.loads(healthcheck[healthcheck.index("CMD") + 3:])
    copied = {line.split()[-1]: line.split()[0] for line in _instruction("COPY")}
    assert copied[argv[1]] == "docker/healthcheck.py", "HEALTHCHECK runs the copied probe"
    assert argv[0] == "python"
    probe = [sys.executable, str(_HEALTHCHECK), compose_server["address"]]
    alive = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0 and "SERVING" in alive.stdout, alive.stdout + alive.stderr
    dead = subprocess.run([*probe[:2], f"127.0.0.1:{_free_port()}"], capture_output=True,
                          text=True, timeout=60)
    assert dead.returncode == 1 and "unhealthy" in dead.stderr, shlex.join(probe)
