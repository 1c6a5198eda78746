"""The repository's Dockerfile, read (CI has no container runtime): a CPU image by default that runs on any x86-64
CPU, a CUDA base as a build argument, the demo model served by default, and the tags its documented build lines
give are the images `radixserve deploy kubernetes` names by default."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from radixserve.frontend.deploy.kubernetes import CPU_IMAGE, CUDA_IMAGE, Deployment, render

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [line for line in DOCKERFILE.splitlines() if line.strip() and not line.lstrip().startswith("#")]
COMMENTS = "\n".join(line.lstrip("# ") for line in DOCKERFILE.splitlines() if line.startswith("#"))


def _build_lines() -> dict[str, str]:
    """tag -> the documented `docker build` command that gives it (continuation lines joined)."""
    joined = COMMENTS.replace("\\\n", " ")
    return {m.group(1): m.group(0) for m in re.finditer(r"docker build -t (\S+).*", joined)}


def _arg(name: str) -> str:
    (value,) = [line.split("=", 1)[1] for line in INSTRUCTIONS if line.startswith(f"ARG {name}=")]
    return value


def test_nothing_in_the_image_targets_the_build_machines_cpu():
    assert not any("march" in line or "mtune" in line for line in INSTRUCTIONS)


def test_cpu_by_default_with_a_cuda_base_as_a_build_argument():
    assert INSTRUCTIONS[0] == f"ARG BASE={_arg('BASE')}" and "FROM ${BASE}" in INSTRUCTIONS
    assert "cuda" not in _arg("BASE") and _arg("TORCH_INDEX").endswith("/whl/cpu")
    assert _arg("TORCH_VERSION") == "2.13.0"
    lines = _build_lines()
    assert "--build-arg" not in lines[CPU_IMAGE]  # the plain build is the CPU one
    assert "--build-arg BASE=nvidia/cuda" in lines[CUDA_IMAGE] and "--build-arg TORCH_INDEX=" in lines[CUDA_IMAGE]


def test_it_serves_the_demo_model_by_default():
    (entrypoint,) = [line for line in INSTRUCTIONS if line.startswith("ENTRYPOINT")]
    (cmd,) = [line for line in INSTRUCTIONS if line.startswith("CMD")]
    assert entrypoint == 'ENTRYPOINT ["radixserve"]'
    assert '"serve"' in cmd and "--model" not in cmd and '"0.0.0.0"' in cmd
    assert any(re.match(r"EXPOSE 30000\b", line) for line in INSTRUCTIONS) and '"30000"' in cmd


@pytest.mark.parametrize("gpu, tag", [(False, CPU_IMAGE), (True, CUDA_IMAGE)], ids=["cpu", "cuda"])
def test_the_manifests_name_the_documented_tags(gpu, tag):
    assert tag in _build_lines()
    manifests = render(Deployment(model="m", gpu=gpu))
    assert set(re.findall(r"^\s+image: (\S+)$", manifests, re.M)) == {tag}  # workers and router
    assert f"docker push registry.example.com/{CPU_IMAGE}" in COMMENTS


def test_the_build_context_keeps_what_pip_install_needs():
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ".git" in ignored and "tests" in ignored
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"], *project["tool"]["setuptools"]["package-dir"].values()]
    for path in needed:
        assert not any(path == entry or path.startswith(entry.rstrip("/") + "/") for entry in ignored), path
