"""Copy the generated Envoy API modules the sidecar uses into sidecar/protos/.

Why not depend on xds-protos: its wheel (3,700 files) also ships an old copy of the
OpenTelemetry protos at the paths of `opentelemetry-proto` (ResourceSpans without
scope_spans). Whichever of the two pip installs last wins, so `pip install
ratelimit-sidecar[tracing]` could leave an OTLP exporter that cannot encode a span.
The sidecar needs 21 of those files: the RateLimitService v3 and RLQS v3 protos and
what they import. This script takes exactly that closure from one pinned xds-protos
wheel and rewrites its imports (`from envoy.x import y_pb2` becomes
`from sidecar.protos.envoy.x import y_pb2`), so the sidecar's wheel owns no top-level
name another package installs. The serialized descriptors are copied byte for byte:
the proto file names stay Envoy's (envoy/service/ratelimit/v3/rls.proto), which is
what gRPC reflection and Envoy expect.

    .venv/bin/python scripts/vendor_envoy_protos.py            # rewrite sidecar/protos/
    .venv/bin/python scripts/vendor_envoy_protos.py --check    # exit 1 if it differs

One module is not from the wheel: ``ratelimit/config/ratelimit/v3/rls_conf_pb2.py``, the
reference's ``RateLimitConfig`` resource that an xDS control plane pushes
(envoyproxy/ratelimit's api/ratelimit/config/ratelimit/v3/rls_conf.proto, the type URL
``type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig``). xds-protos does
not ship it, so :func:`rls_conf_descriptor` declares its messages here, with the
reference's package, names and field numbers (what the wire format and the type URL
depend on), and the module is emitted from that descriptor: no protoc at build time.

The wheel is downloaded with pip (or read from an installed xds-protos of the pinned
version, if one happens to be there). tests/deploy/test_vendored_protos.py runs --check.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from google.protobuf import descriptor_pb2

XDS_PROTOS_VERSION = "1.85.0"
XDS_PROTOS = f"xds-protos=={XDS_PROTOS_VERSION}"
ROOTS = (
    "envoy/service/ratelimit/v3/rls_pb2.py",
    "envoy/service/ratelimit/v3/rls_pb2_grpc.py",
    "envoy/service/rate_limit_quota/v3/rlqs_pb2.py",
    "envoy/service/rate_limit_quota/v3/rlqs_pb2_grpc.py",
    "envoy/extensions/common/ratelimit/v3/ratelimit_pb2.py",
    "envoy/service/discovery/v3/ads_pb2.py",
    "envoy/service/discovery/v3/ads_pb2_grpc.py",
)
VENDORED_TOP_LEVELS = ("envoy", "udpa", "validate", "xds")
TARGET_PACKAGE = "sidecar.protos"
TARGET = Path(__file__).resolve().parent.parent / "sidecar" / "protos"
IMPORT = re.compile(rf"^from ((?:{'|'.join(VENDORED_TOP_LEVELS)})(?:\.[\w.]+)?) import (\w+)", re.MULTILINE)
STUB = '''"""Typing stub: the generated module's names are built at import time, so they are Any."""

from typing import Any

def __getattr__(name: str) -> Any: ...
'''
PACKAGE_DOC = f'''"""Generated Envoy API modules, copied from {XDS_PROTOS} by scripts/vendor_envoy_protos.py.

Do not edit: rerun the script. Why the sidecar carries them instead of depending on
xds-protos is in that script's docstring and in docs/deployment.md (Install).
Use them as `from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2`.
"""
'''


RLS_CONF_PATH = "ratelimit/config/ratelimit/v3/rls_conf_pb2.py"
RLS_CONF_MODULE = f"""# Emitted by scripts/vendor_envoy_protos.py from its rls_conf_descriptor(): do not edit.
# source: ratelimit/config/ratelimit/v3/rls_conf.proto (the reference's xDS resource)
\"\"\"Generated protocol buffer code.\"\"\"
from google.protobuf import descriptor_pool as _descriptor_pool
from google.protobuf.internal import builder as _builder

DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile({{serialized}})
_globals = globals()
_builder.BuildMessageAndEnumDescriptors(DESCRIPTOR, _globals)
_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, "{TARGET_PACKAGE}.{RLS_CONF_PATH[:-3].replace("/", ".")}", _globals)
"""


def rls_conf_descriptor() -> bytes:
    """The serialized FileDescriptorProto of rls_conf.proto: messages RateLimitConfig,
    RateLimitDescriptor, RateLimitPolicy, RateLimitReplace and enum RateLimitUnit, numbered
    as the reference numbers them (its discovery service is left out: the sidecar reads
    the resource over ADS)."""
    field = descriptor_pb2.FieldDescriptorProto
    package = "ratelimit.config.ratelimit.v3"
    proto = descriptor_pb2.FileDescriptorProto(name="ratelimit/config/ratelimit/v3/rls_conf.proto", package=package)
    proto.syntax = "proto3"

    def message(name: str, *fields: tuple[str, int, int, str, bool]) -> None:
        added = proto.message_type.add(name=name)
        for field_name, number, kind, type_name, repeated in fields:
            label = field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL
            added.field.add(name=field_name, number=number, type=kind, label=label, json_name=camel(field_name))
            if type_name:
                added.field[-1].type_name = f".{package}.{type_name}"

    text, boolean, nested, enum = field.TYPE_STRING, field.TYPE_BOOL, field.TYPE_MESSAGE, field.TYPE_ENUM
    message(
        "RateLimitConfig",
        ("name", 1, text, "", False),
        ("domain", 2, text, "", False),
        ("descriptors", 3, nested, "RateLimitDescriptor", True),
    )
    message(
        "RateLimitDescriptor",
        ("key", 1, text, "", False),
        ("value", 2, text, "", False),
        ("rate_limit", 3, nested, "RateLimitPolicy", False),
        ("descriptors", 4, nested, "RateLimitDescriptor", True),
        ("shadow_mode", 5, boolean, "", False),
    )
    message(
        "RateLimitPolicy",
        ("unit", 1, enum, "RateLimitUnit", False),
        ("requests_per_unit", 2, field.TYPE_UINT32, "", False),
        ("unlimited", 3, boolean, "", False),
        ("name", 4, text, "", False),
        ("replaces", 5, nested, "RateLimitReplace", True),
    )
    message("RateLimitReplace", ("name", 1, text, "", False))
    unit = proto.enum_type.add(name="RateLimitUnit")
    for number, name in enumerate(("UNKNOWN", "SECOND", "MINUTE", "HOUR", "DAY")):
        unit.value.add(name=name, number=number)
    return proto.SerializeToString(deterministic=True)


def camel(name: str) -> str:
    """protoc's json_name: snake_case to lowerCamelCase."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def download_wheel(into: Path) -> Path:
    """The pinned xds-protos wheel, fetched with pip (no install, no dependencies)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(into),
            XDS_PROTOS,
        ],
        check=True,
    )
    return next(into.glob("xds_protos-*.whl"))


def installed_reader() -> Callable[[str], str] | None:
    """Reads files of the installed xds-protos, if it is the pinned version."""
    try:
        distribution = importlib.metadata.distribution("xds-protos")
    except importlib.metadata.PackageNotFoundError:
        return None
    if distribution.version != XDS_PROTOS_VERSION:
        return None
    return lambda path: Path(str(distribution.locate_file(path))).read_text()


def closure(read: Callable[[str], str]) -> dict[str, str]:
    """Path -> source of every module the roots import, transitively (within the vendored top levels)."""
    sources: dict[str, str] = {}
    pending = list(ROOTS)
    while pending:
        path = pending.pop()
        if path in sources:
            continue
        sources[path] = read(path)
        for package, module in IMPORT.findall(sources[path]):
            pending.append(f"{package.replace('.', '/')}/{module}.py")
    return sources


def rewritten(source: str) -> str:
    """The module with its Envoy-family imports pointed into sidecar.protos."""
    return IMPORT.sub(lambda m: f"from {TARGET_PACKAGE}.{m.group(1)} import {m.group(2)}", source)


def wanted_tree(sources: dict[str, str]) -> dict[Path, str]:
    """Relative path -> content of everything sidecar/protos/ should hold: the modules, a
    typing stub beside each (so mypy --strict sees Any, not names it cannot find), and
    the __init__.py files."""
    tree: dict[Path, str] = {Path("__init__.py"): PACKAGE_DOC}
    for path, source in sources.items():
        relative = Path(path)
        tree[relative] = rewritten(source)
        tree[relative.with_suffix(".pyi")] = STUB
    tree[Path(RLS_CONF_PATH)] = RLS_CONF_MODULE.format(serialized=repr(rls_conf_descriptor()))
    tree[Path(RLS_CONF_PATH).with_suffix(".pyi")] = STUB
    for relative in list(tree):
        for parent in relative.parents:
            if parent != Path("."):
                tree.setdefault(parent / "__init__.py", "")
    return tree


def present_tree() -> dict[Path, str]:
    """What sidecar/protos/ holds now (Python sources and stubs)."""
    return {
        path.relative_to(TARGET): path.read_text() for path in TARGET.rglob("*.py*") if path.suffix in (".py", ".pyi")
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if sidecar/protos/ differs")
    args = parser.parse_args()
    read = installed_reader()
    if read is not None:
        wanted = wanted_tree(closure(read))
    else:
        with tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(download_wheel(Path(scratch))) as wheel:
            wanted = wanted_tree(closure(lambda path: wheel.read(path).decode()))
    if args.check:
        present = present_tree()
        differing = sorted(str(p) for p in set(wanted) | set(present) if wanted.get(p) != present.get(p))
        for path in differing:
            print(f"differs from {XDS_PROTOS}: sidecar/protos/{path}", file=sys.stderr)
        return 1 if differing else 0
    for stale in set(present_tree()) - set(wanted):
        (TARGET / stale).unlink()
    for relative, content in wanted.items():
        (TARGET / relative).parent.mkdir(parents=True, exist_ok=True)
        (TARGET / relative).write_text(content)
    modules = sum(1 for path in wanted if path.suffix == ".py" and path.name != "__init__.py")
    print(f"sidecar/protos/: {modules} modules from {XDS_PROTOS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
