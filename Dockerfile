# syntax=docker/dockerfile:1
#
# ratelimit-sidecar: the Envoy RateLimitService next to every app pod.
#
#   docker build -t ratelimit-sidecar:0.1.0 .                                     # the sidecar (default target)
#   docker build -t ratelimit-sidecar:0.1.0-tracing --build-arg EXTRAS=tracing .  # ...with OpenTelemetry
#   docker build -t ratelimit-sidecar-demo-upstream:0.1.0 --target demo-upstream .  # the demo app (compose)
#   docker run --rm -v "$PWD/examples/config:/etc/ratelimit/config:ro" ratelimit-sidecar:0.1.0
#   (or `/bin/ratelimit`, as envoyproxy/ratelimit's manifests run it: the same `serve`)
#
# Stages:
#   builder        pip wheel: the project and every dependency as wheels, installed into
#                  /opt/venv (a venv without pip). Every dependency ships manylinux wheels
#                  for CPython 3.11 (grpcio, uvloop, hiredis, protobuf, PyYAML), so no
#                  compiler is installed anywhere; if one is ever needed, it goes here.
#   runtime        slim Python, a non-root user and the venv copied from builder, nothing else.
#   demo-upstream  runtime + stack/upstream.py, the sample app of the compose demo.
#   sidecar        runtime + how to run the sidecar. Last, so it is what a plain build gives.
#
# Configuration: every `serve` flag has an RLS_* environment variable (README,
# Configuration reference), and envoyproxy/ratelimit's variables are read too
# (docs/migrating.md). The descriptor config is read from the directory
# /etc/ratelimit/config: mount a directory of *.yaml files (a Kubernetes ConfigMap, a
# bind mount) there. That path is RLS_CONFIG_DEFAULT, a default that yields to anything
# the user sets (RLS_CONFIG, or the reference's RUNTIME_ROOT/RUNTIME_SUBDIRECTORY): the
# image sets no RLS_* variable a user's setting could lose to. No config is baked in: a
# sidecar without one refuses to start rather than enforce limits nobody chose.
#
# Listening: gRPC on 127.0.0.1:8081 (the default). In a pod, Envoy shares the pod's
# network namespace, so loopback is right and nothing else can call the service.
# Set RLS_GRPC_ADDRESS=0.0.0.0:8081 only when Envoy runs in another network
# namespace. 9090 is the metrics/admin HTTP port (/metrics, /config, /healthz;
# RLS_METRICS_ADDRESS, loopback by default as well). 8080 is envoyproxy/ratelimit's HTTP
# port: with its RUNTIME_* variables (or HOST/PORT) set, the sidecar serves /healthcheck
# there to everyone (the reference's probes keep working) and /json to loopback clients only.

FROM python:3.11-slim-bookworm AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
# Only what setuptools needs to build the wheel (.dockerignore keeps the rest out).
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar

# EXTRAS: the package's optional extras, comma-separated; "tracing" adds OpenTelemetry
# (docs/deployment.md, Tracing). Empty by default: the smallest image.
ARG EXTRAS=""

# The venv has no pip and no setuptools: the builder's pip installs into it. Nothing
# is fetched there (--no-index: only the wheels just built), so there is no version to pin
# (hadolint's DL3013 reads "WHEEL[extras]" as a package name).
# hadolint ignore=DL3013
RUN pip wheel --wheel-dir /wheels ."${EXTRAS:+[$EXTRAS]}" \
    && python -m venv --without-pip /opt/venv \
    && for wheel in /wheels/ratelimit_sidecar-*.whl; do \
         pip --python /opt/venv/bin/python install --no-index --find-links /wheels "$wheel${EXTRAS:+[$EXTRAS]}"; \
       done


FROM python:3.11-slim-bookworm AS runtime

LABEL org.opencontainers.image.title="ratelimit-sidecar" \
      org.opencontainers.image.description="Envoy RateLimitService sidecar: wall-clock fixed windows, replicas kept consistent through Redis" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# A fixed numeric UID/GID, so Kubernetes' runAsNonRoot can check it without /etc/passwd.
RUN groupadd --system --gid 10001 ratelimit \
    && useradd --system --uid 10001 --gid ratelimit --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin ratelimit

COPY --from=builder /opt/venv /opt/venv

USER 10001:10001


# The sample upstream app of the compose demo (answers 200 "hello from <name>").
# stack/ is not part of the wheel; upstream.py needs only the standard library, uvloop and
# stack/processes.py (its launcher class; standard library only).
FROM runtime AS demo-upstream

WORKDIR /opt/demo
COPY stack/__init__.py stack/processes.py stack/upstream.py ./stack/

EXPOSE 8080
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 8080), timeout=2).close()"]
ENTRYPOINT ["python", "-m", "stack.upstream"]
CMD ["--host", "0.0.0.0", "--port", "8080", "--name", "app"]


# The sidecar: the default target.
FROM runtime AS sidecar

# A default, not RLS_CONFIG: RLS_CONFIG and RUNTIME_ROOT (the reference's) both win over it.
ENV RLS_CONFIG_DEFAULT=/etc/ratelimit/config

# envoyproxy/ratelimit's entry point, for manifests that run `command: ["/bin/ratelimit"]`.
COPY --chmod=0755 deploy/image/ratelimit /bin/ratelimit

# 8081: gRPC (RateLimitService, grpc.health.v1, reflection). 9090: metrics/admin HTTP.
# Both are the defaults of RLS_GRPC_ADDRESS and RLS_METRICS_ADDRESS (a test checks).
# 8080: the reference's HTTP port (/healthcheck), served when its variables are set.
EXPOSE 8081 9090 8080

# Exit 0 only when the health service reports SERVING (config loaded, not draining).
# It dials where serve listens, read from the same variables (RLS_GRPC_ADDRESS, or the
# reference's GRPC_UDS / GRPC_HOST / GRPC_PORT), so moving the port needs no change here.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["ratelimit-sidecar", "health"]

# Exec form: the sidecar is PID 1 and gets SIGTERM itself (drain, flush to Redis, exit 0).
ENTRYPOINT ["ratelimit-sidecar"]
CMD ["serve"]
