"""Loading a config file or a directory of them, the way Kubernetes mounts a ConfigMap."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sidecar.config.errors import ConfigError
from sidecar.config.load import config_files, load_config


def rules(domain: str, key: str = "k") -> str:
    return (
        f"domain: {domain}\n"
        "descriptors:\n"
        f"  - key: {key}\n"
        "    rate_limit:\n"
        "      unit: second\n"
        "      requests_per_unit: 1\n"
    )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def refused(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return caught.value


def test_single_file(tmp_path):
    path = write(tmp_path / "one.yaml", rules("alpha"))
    config = load_config(path)
    assert set(config.domains) == {"alpha"}
    assert config.files == (str(path),)
    assert config.domains["alpha"].source == str(path)
    assert len(config.digest) == 64


def test_single_file_as_string_and_any_suffix(tmp_path):
    path = write(tmp_path / "rules.conf", rules("alpha"))
    assert set(load_config(str(path)).domains) == {"alpha"}


def test_directory_loads_yaml_and_yml_recursively(tmp_path):
    write(tmp_path / "a.yaml", rules("a"))
    write(tmp_path / "b.yml", rules("b"))
    write(tmp_path / "nested" / "deeper" / "c.yaml", rules("c"))
    write(tmp_path / "notes.txt", "not yaml at all: [")
    write(tmp_path / "d.json", "{}")
    write(tmp_path / "upper.YAML", "not: [loaded")
    config = load_config(tmp_path)
    assert set(config.domains) == {"a", "b", "c"}
    assert config.files == tuple(str(tmp_path / name) for name in ("a.yaml", "b.yml", "nested/deeper/c.yaml"))


def test_directory_ignores_dot_files_and_dot_directories(tmp_path):
    write(tmp_path / "a.yaml", rules("a"))
    write(tmp_path / ".hidden.yaml", "broken: [")
    write(tmp_path / ".git" / "x.yaml", "broken: [")
    write(tmp_path / "sub" / ".cache" / "y.yml", "broken: [")
    assert set(load_config(tmp_path).domains) == {"a"}


def test_hidden_parent_of_the_config_directory_does_not_hide_it(tmp_path):
    root = tmp_path / ".config" / "ratelimit"
    write(root / "a.yaml", rules("a"))
    assert set(load_config(root).domains) == {"a"}


def configmap_mount(root: Path, files: dict[str, str]) -> Path:
    """What the kubelet writes for a ConfigMap volume: files behind ``..data``."""
    timestamped = root / "..2024_01_01_00_00_00.1"
    for name, text in files.items():
        write(timestamped / name, text)
    os.symlink(timestamped.name, root / "..data")
    for name in files:
        os.symlink(Path("..data") / name, root / name)
    return root


def test_kubernetes_configmap_mount_loads_each_file_exactly_once(tmp_path):
    root = configmap_mount(tmp_path, {"x.yaml": rules("x"), "y.yml": rules("y")})
    assert (root / "x.yaml").is_symlink()
    assert (root / "x.yaml").read_text() == rules("x")
    assert config_files(root) == [root / "x.yaml", root / "y.yml"]
    config = load_config(root)
    # A file loaded twice would be refused as a duplicate domain.
    assert set(config.domains) == {"x", "y"}
    assert config.files == (str(root / "x.yaml"), str(root / "y.yml"))


def test_configmap_update_changes_the_digest(tmp_path):
    root = configmap_mount(tmp_path, {"x.yaml": rules("x")})
    before = load_config(root).digest
    assert load_config(root).digest == before
    newer = tmp_path / "..2024_01_02_00_00_00.2"
    write(newer / "x.yaml", rules("x", key="other"))
    os.unlink(root / "..data")
    os.symlink(newer.name, root / "..data")
    assert load_config(root).digest != before


def test_duplicate_domain_across_two_files(tmp_path):
    first = write(tmp_path / "a.yaml", rules("shared"))
    second = write(tmp_path / "sub" / "b.yaml", "# the same domain again\n" + rules("shared"))
    error = refused(tmp_path)
    assert len(error.issues) == 1
    issue = error.issues[0]
    assert (issue.file, issue.line, issue.path) == (str(second), 2, "domain")
    assert str(issue) == (f"{second}:2: domain: duplicate domain 'shared' (also in {first}:1)")


def test_errors_from_several_files_are_all_listed(tmp_path):
    write(tmp_path / "a.yaml", "domain: a\ndescriptors:\n  - key: ''\n")
    write(tmp_path / "b.yaml", "domain: b\ndescriptors: [\n")
    write(tmp_path / "c.yaml", rules("c"))
    error = refused(tmp_path)
    assert [(Path(issue.file).name, issue.line, issue.path) for issue in error.issues] == [
        ("a.yaml", 3, "descriptors[0].key"),
        ("b.yaml", 3, ""),
    ]
    assert "invalid YAML" in error.issues[1].message


def test_empty_directory(tmp_path):
    write(tmp_path / "README.md", "no rules here")
    write(tmp_path / ".hidden.yaml", rules("hidden"))
    error = refused(tmp_path)
    assert [str(issue) for issue in error.issues] == [f"{tmp_path}: directory holds no *.yaml or *.yml files"]


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    error = refused(missing)
    assert [str(issue) for issue in error.issues] == [f"{missing}: no such file or directory"]


def test_unreadable_bytes_are_reported_with_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"domain: caf\xe9\n")
    error = refused(tmp_path)
    assert len(error.issues) == 1
    assert error.issues[0].file == str(bad)
    assert error.issues[0].message.startswith("cannot read:")


def test_empty_file_in_a_directory(tmp_path):
    empty = write(tmp_path / "empty.yaml", "")
    write(tmp_path / "ok.yaml", rules("ok"))
    error = refused(tmp_path)
    assert [str(issue) for issue in error.issues] == [
        f"{empty}:1: expected a mapping with 'domain' and 'descriptors', got an empty file"
    ]
