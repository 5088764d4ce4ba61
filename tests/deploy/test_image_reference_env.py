"""The image started as a reference deployment starts it: only envoyproxy/ratelimit's variables.

No Docker here: the test reads the Dockerfile's sidecar stage (its ENV, ENTRYPOINT, CMD,
HEALTHCHECK and the file it copies to /bin/ratelimit) and runs exactly those commands with
exactly that environment, the venv standing in for /opt/venv. What a user sets is the
reference's variables only (RUNTIME_ROOT and RUNTIME_SUBDIRECTORY for the config,
GRPC_PORT, PORT, PROMETHEUS_ADDR, REDIS_URL ...): the sidecar must serve decisions,
``/healthcheck`` on the reference's HTTP port, and the image's health check must pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from tests.support.deploy import REPO, dockerfile_env, effective, read_dockerfile, stage_chain
from tests.support.redis_servers import RedisServer, fresh_prefix
from tests.support.serve_refusal import cli_in_process
from tests.support.sidecars import free_port, request

RULES = """\
domain: ref
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2}
"""
VENV_BIN = str(Path(sys.executable).parent)
STARTUP_DEADLINE = 30.0


def image_env(reference: dict[str, str]) -> dict[str, str]:
    """The sidecar stage's ENV (its PATH's /opt/venv/bin is this venv's bin) plus ``reference``:
    nothing from the test machine's environment."""
    env = dockerfile_env(stage_chain(read_dockerfile(), "sidecar"))
    env["PATH"] = env["PATH"].replace("/opt/venv/bin", VENV_BIN).replace("$PATH", "/usr/bin:/bin")
    return {**env, **reference}


def image_command() -> list[str]:
    """ENTRYPOINT + CMD of the sidecar stage, as ``docker run IMAGE`` runs them."""
    chain = stage_chain(read_dockerfile(), "sidecar")
    entrypoint, cmd = effective(chain, "ENTRYPOINT"), effective(chain, "CMD")
    assert entrypoint is not None and cmd is not None
    return [*entrypoint.exec_form(), *cmd.exec_form()]


def bin_ratelimit() -> Path:
    """The file the sidecar stage copies to /bin/ratelimit (the reference's entry point)."""
    for instruction in stage_chain(read_dockerfile(), "sidecar")[0].all("COPY"):
        *sources, target = instruction.rest().split()
        if target == "/bin/ratelimit":
            (source,) = sources
            return REPO / source
    pytest.fail("the sidecar stage has no /bin/ratelimit")


def healthcheck_command() -> list[str]:
    check = effective(stage_chain(read_dockerfile(), "sidecar"), "HEALTHCHECK")
    assert check is not None
    return check.exec_form()


def reference_variables(tmp_path: Path, **extra: str) -> dict[str, str]:
    """What a reference deployment sets: its config layout and ports (on free ports here, since
    tests run side by side; HOST and GRPC_HOST keep the reference's default, 0.0.0.0)."""
    config = tmp_path / "srv" / "runtime_data" / "current" / "ratelimit" / "config"
    config.mkdir(parents=True)
    (config / "ref.yaml").write_text(RULES)
    return {
        "RUNTIME_ROOT": str(tmp_path / "srv" / "runtime_data" / "current"),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "GRPC_PORT": str(free_port()),
        "PORT": str(free_port()),
        "USE_PROMETHEUS": "true",
        "PROMETHEUS_ADDR": f"127.0.0.1:{free_port()}",
        "LOG_FORMAT": "json",
        **extra,
    }


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    outgoing = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(outgoing, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class Container:
    """One process started as the image starts it; ``logs`` is its stdout and stderr."""

    def __init__(self, command: list[str], env: dict[str, str], workdir: Path) -> None:
        self.env = env
        self.log_path = workdir / "container.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthcheck(self, port: str) -> None:
        """Until ``GET /healthcheck`` on the reference's HTTP port answers 200."""
        deadline = time.monotonic() + STARTUP_DEADLINE
        while True:
            assert self.process.poll() is None, f"exited {self.process.returncode}:\n{self.logs()}"
            try:
                if http("GET", f"http://127.0.0.1:{port}/healthcheck")[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no /healthcheck on {port}:\n{self.logs()}"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for container in started:
        container.stop()


def run_image(command: list[str], env: dict[str, str], tmp_path: Path, started: list[Container]) -> Container:
    container = Container(command, env, tmp_path)
    started.append(container)
    container.wait_healthcheck(env["PORT"])
    return container


def healthcheck(env: dict[str, str], real: bool) -> tuple[int, str, str]:
    """The image's HEALTHCHECK command with ``env``: exit code, stdout, stderr. ``real``: as a
    process; else the same ``ratelimit-sidecar`` arguments through ``main`` in this process
    (a process start costs about a CPU-second; one real check per image command suffices)."""
    command = healthcheck_command()
    if real:
        check = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30, check=False)
        return check.returncode, check.stdout, check.stderr
    assert command[0] == "ratelimit-sidecar", command
    done = cli_in_process(*command[1:], env=env)
    return done.code, done.stdout, done.stderr


def check_serves(container: Container, real_healthcheck: bool = False) -> None:
    """Decisions on GRPC_PORT (via loopback, as Envoy in the pod), the image's HEALTHCHECK
    command, and /json from loopback on the reference's HTTP port."""
    env = container.env
    with grpc.insecure_channel(f"127.0.0.1:{env['GRPC_PORT']}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        codes = [stub.ShouldRateLimit(request("ref", [("user", "ann")]), timeout=5).overall_code for _ in range(3)]
    assert codes == [rls_pb2.RateLimitResponse.OK] * 2 + [rls_pb2.RateLimitResponse.OVER_LIMIT]
    code, stdout, stderr = healthcheck(env, real_healthcheck)
    assert (code, stdout.strip()) == (0, "SERVING"), stderr
    body = json.dumps({"domain": "ref", "descriptors": [{"entries": [{"key": "user", "value": "bob"}]}]})
    status, answer = http("POST", f"http://127.0.0.1:{env['PORT']}/json", body.encode())
    assert (status, json.loads(answer)["overallCode"]) == (200, "OK")


def test_the_image_runs_on_the_reference_environment(tmp_path: Path, containers: list[Container]) -> None:
    """The image's own ENV must not shadow RUNTIME_ROOT (it set RLS_CONFIG, which won), and the
    health check must dial GRPC_PORT (it hard-coded 127.0.0.1:8081)."""
    env = image_env(reference_variables(tmp_path))
    container = run_image(image_command(), env, tmp_path, containers)
    check_serves(container, real_healthcheck=True)
    assert "/etc/ratelimit/config" not in container.logs()


def test_bin_ratelimit_is_the_reference_entry_point(tmp_path: Path, containers: list[Container]) -> None:
    """``command: ["/bin/ratelimit"]`` replaces ENTRYPOINT and CMD: the file alone must serve."""
    env = image_env(reference_variables(tmp_path))
    container = run_image([str(bin_ratelimit())], env, tmp_path, containers)
    check_serves(container)


@pytest.mark.redis
def test_a_redis_url_written_as_a_url(tmp_path: Path, containers: list[Container], redis_server: RedisServer) -> None:
    """``REDIS_URL=redis://HOST:PORT`` (the reference takes HOST:PORT) is read as written."""
    host_port = redis_server.url.removeprefix("redis://").split("/")[0]
    prefix = fresh_prefix()
    variables = reference_variables(tmp_path, REDIS_URL=f"redis://{host_port}", CACHE_KEY_PREFIX=prefix)
    container = run_image(image_command(), image_env(variables), tmp_path, containers)
    check_serves(container)
    assert redis_server.client().keys(f"{prefix}*"), "the counters live in the Redis REDIS_URL names"
