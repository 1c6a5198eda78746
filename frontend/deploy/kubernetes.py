"""Kubernetes manifests for N radixserve workers behind sglang-router (`radixserve deploy kubernetes`).

The manifests are templates kept beside this module (templates/*.yaml, package data); this module
only fills them in. What they encode, and why:

  worker Deployment   one `radixserve serve` per pod (one GPU each with --gpu; no tensor parallelism),
                      startupProbe on /health_generate (a real one-token generation: the model is
                      loaded and the engine steps), readiness and liveness on /health, a preStop pause
                      then SIGTERM, which drains (terminationGracePeriodSeconds covers both), the model
                      read-only from a PersistentVolumeClaim, Prometheus scrape annotations;
  PodDisruptionBudget voluntary disruptions take one worker at a time;
  router Deployment   sglang-router with Kubernetes service discovery (--service-discovery, a label
                      selector matching the worker pods) and --policy cache_aware, plus the
                      ServiceAccount, Role (get/list/watch pods) and RoleBinding that discovery needs;
  Services            the router's (the one client URL) and a headless one for the workers.
"""
from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass
from importlib import resources
from string import Template

from ..config import ROUTER_POLICIES

TEMPLATES = ("router-rbac.yaml", "router.yaml", "router-service.yaml", "worker.yaml", "worker-service.yaml",
             "worker-pdb.yaml")
# The tags the Dockerfile's build lines give (its header): the default --image, for a cluster that has them locally
# (kind load, minikube image load); elsewhere push them to a registry and name that.
CPU_IMAGE = "radixserve:cpu"
CUDA_IMAGE = "radixserve:cuda"
MODEL_MOUNT = "/models"
ROUTER_METRICS_PORT = 29000
PRESTOP_S = 5
API_KEY_ENV = "RADIXSERVE_API_KEY"
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_CPUS = re.compile(r"\d+(\.\d+)?m?")
_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?")
_BLOCK = re.compile(r"^( *)\$\{(\w+)\}$", re.MULTILINE)  # a placeholder alone on its line


@dataclass(frozen=True)
class Deployment:
    model: str  # checkpoint directory on the model volume (relative to it, or under /models)
    replicas: int = 2
    gpu: bool = False
    model_pvc: str | None = None  # None: the manifests include a PVC named <name>-model
    name: str = "radixserve"
    namespace: str = "default"
    image: str | None = None  # None: CPU_IMAGE, or CUDA_IMAGE with gpu
    policy: str = "cache_aware"
    port: int = 8000
    service_port: int = 80
    service_type: str = "ClusterIP"
    cpus: str = "4"
    memory: str = "16Gi"
    model_storage: str = "50Gi"
    api_key_secret: str | None = None  # a Secret with key "api-key": workers and router require it
    graceful_timeout_s: int = 60
    startup_timeout_s: int = 600

    def __post_init__(self) -> None:
        for label, value in (("name", self.name), ("namespace", self.namespace),
                             ("model-pvc", self.model_pvc), ("api-key-secret", self.api_key_secret)):
            if value is not None and not (_DNS_NAME.fullmatch(value) and len(value) <= 63):
                raise ValueError(f"--{label} {value!r} is not a Kubernetes name (lower-case letters, digits "
                                 "and '-', at most 63)")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas!r}")
        if not _CPUS.fullmatch(self.cpus):
            raise ValueError(f"--cpus {self.cpus!r} is not a CPU quantity (e.g. 4, 0.5, 500m)")
        for label, value in (("memory", self.memory), ("model-storage", self.model_storage)):
            if not _QUANTITY.fullmatch(value):
                raise ValueError(f"--{label} {value!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        self.model_path()  # fails early on a path outside the model volume

    def model_path(self) -> str:
        path = posixpath.normpath(posixpath.join(MODEL_MOUNT, self.model))
        if not self.model or not path.startswith(MODEL_MOUNT + "/"):
            raise ValueError(f"--model {self.model!r} must name a directory on the model volume (mounted at "
                             f"{MODEL_MOUNT}), e.g. llama-3.1-8b or {MODEL_MOUNT}/llama-3.1-8b")
        return path

    def image_name(self) -> str:
        if self.image is not None:
            return self.image
        return CUDA_IMAGE if self.gpu else CPU_IMAGE

    def served_name(self) -> str:
        return posixpath.basename(self.model_path())


def render(dep: Deployment) -> str:
    """All manifests as one multi-document YAML stream."""
    values = _values(dep)
    names = TEMPLATES if dep.model_pvc else ("model-pvc.yaml", *TEMPLATES)
    docs = [_fill(resources.files(__package__).joinpath("templates", n).read_text(), values) for n in names]
    return "---\n".join(doc if doc.endswith("\n") else doc + "\n" for doc in docs)


def _values(dep: Deployment) -> dict[str, str | list[str]]:
    app = {"app.kubernetes.io/name": "radixserve", "app.kubernetes.io/instance": dep.name}
    worker = {**app, "app.kubernetes.io/component": "worker"}
    router = {**app, "app.kubernetes.io/component": "router"}
    key_args = ["--api-key", f"$({API_KEY_ENV})"] if dep.api_key_secret else []
    worker_args = ["--model", dep.model_path(), "--served-model-name", dep.served_name(), "--host", "0.0.0.0",
                   "--port", str(dep.port), "--graceful-timeout", str(dep.graceful_timeout_s),
                   *(["--device", "cuda"] if dep.gpu else ["--num-threads", str(max(1, math.floor(_cores(dep.cpus))))]),
                   *key_args]
    router_args = ["--service-discovery", "--selector", *[f"{k}={v}" for k, v in worker.items()],
                   "--service-discovery-port", str(dep.port), "--service-discovery-namespace", dep.namespace,
                   "--policy", dep.policy, "--host", "0.0.0.0", "--port", str(dep.port),
                   "--prometheus-host", "0.0.0.0", "--prometheus-port", str(ROUTER_METRICS_PORT),
                   "--shutdown-grace-period-secs", str(dep.graceful_timeout_s), *key_args]
    limits = {"cpu": dep.cpus, "memory": dep.memory, **({"nvidia.com/gpu": "1"} if dep.gpu else {})}
    return {
        "name": dep.name, "namespace": dep.namespace, "replicas": str(dep.replicas), "image": dep.image_name(),
        "port": str(dep.port), "service_port": str(dep.service_port), "service_type": dep.service_type,
        "policy": dep.policy, "model_pvc": dep.model_pvc or f"{dep.name}-model", "model_mount": MODEL_MOUNT,
        "model_storage": dep.model_storage, "router_metrics_port": str(ROUTER_METRICS_PORT),
        "grace_period_s": str(dep.graceful_timeout_s + PRESTOP_S + 15), "prestop_s": str(PRESTOP_S),
        "startup_failures": str(max(1, math.ceil(dep.startup_timeout_s / 10))),
        "gpu_note": "one GPU each (no tensor parallelism)" if dep.gpu else f"{dep.cpus} CPUs each",
        "worker_args": ", ".join(json.dumps(a) for a in worker_args),
        "router_args": ", ".join(json.dumps(a) for a in router_args),
        "app_labels": _mapping(app), "worker_labels": _mapping(worker), "router_labels": _mapping(router),
        "resources": ["requests:", *_mapping(limits, 2), "limits:", *_mapping(limits, 2)],
        "worker_env": [*_env("TOKENIZERS_PARALLELISM", "false"), *_key_env(dep)],
        "router_env": _key_env(dep) or ["[]"],
    }


def _fill(template: str, values: dict[str, str | list[str]]) -> str:
    """Block placeholders (alone on a line) take a list of lines at their indent; the rest substitute."""
    def block(m: re.Match) -> str:
        value = values[m.group(2)]
        lines = value if isinstance(value, list) else [value]
        return "\n".join(m.group(1) + line.replace("$", "$$") for line in lines)

    return Template(_BLOCK.sub(block, template)).substitute(values)


def _mapping(items: dict[str, str], indent: int = 0) -> list[str]:
    return [" " * indent + f"{k}: {json.dumps(v)}" for k, v in items.items()]


def _env(name: str, value: str) -> list[str]:
    return [f"- name: {name}", f"  value: {json.dumps(value)}"]


def _key_env(dep: Deployment) -> list[str]:
    if not dep.api_key_secret:
        return []
    return [f"- name: {API_KEY_ENV}", "  valueFrom:", "    secretKeyRef:", f"      name: {dep.api_key_secret}",
            "      key: api-key"]


def _cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
