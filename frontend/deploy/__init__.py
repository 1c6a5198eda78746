"""`radixserve deploy ...`: manifests for running radixserve on a cluster (printed, never applied).

    radixserve deploy kubernetes --model llama-3.1-8b --replicas 4 --gpu --model-pvc models | kubectl apply -f -

Only `kubernetes` for now (frontend/deploy/kubernetes.py; its templates are package data).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import ROUTER_POLICIES


def add_parser(sub: Any) -> None:
    """The `deploy` subcommand on cli.py's subparsers."""
    from .kubernetes import CPU_IMAGE, CUDA_IMAGE, Deployment

    deploy = sub.add_parser("deploy", help="print deployment manifests (kubectl apply -f -)")
    targets = deploy.add_subparsers(dest="target", required=True)
    k8s = targets.add_parser("kubernetes", help="workers + sglang-router with service discovery, as Kubernetes "
                             "manifests on stdout", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = Deployment(model="model")
    k8s.add_argument("--model", required=True, help="checkpoint directory on the model volume (mounted at /models)")
    k8s.add_argument("--replicas", "--dp-size", type=int, default=d.replicas, help="worker pods")
    k8s.add_argument("--gpu", action="store_true", help="one NVIDIA GPU per worker pod (nvidia.com/gpu: 1)")
    k8s.add_argument("--model-pvc", default=None, help="an existing PersistentVolumeClaim holding the model "
                     "(default: the manifests include a ReadOnlyMany claim NAME-model)")
    k8s.add_argument("--name", default=d.name, help="name prefix and app.kubernetes.io/instance label")
    k8s.add_argument("--namespace", default=d.namespace, help="namespace of every object")
    k8s.add_argument("--image", default=argparse.SUPPRESS, help="an image with radixserve[router] installed (default: "
                     f"{CPU_IMAGE}, or {CUDA_IMAGE} with --gpu: the tags the repository's Dockerfile builds)")
    k8s.add_argument("--policy", default=d.policy, choices=ROUTER_POLICIES, help="sglang-router policy")
    k8s.add_argument("--port", type=int, default=d.port, help="container port of workers and router")
    k8s.add_argument("--service-port", type=int, default=d.service_port, help="the router Service's port")
    k8s.add_argument("--service-type", default=d.service_type, choices=("ClusterIP", "NodePort", "LoadBalancer"),
                     help="the router Service's type")
    k8s.add_argument("--cpus", default=d.cpus, help="CPU request and limit per worker (its torch threads on CPU)")
    k8s.add_argument("--memory", default=d.memory, help="memory request and limit per worker")
    k8s.add_argument("--model-storage", default=d.model_storage, help="size of the model claim it creates")
    k8s.add_argument("--api-key-secret", default=None, help="a Secret with key 'api-key': workers and router "
                     "then require 'Authorization: Bearer <key>'")
    k8s.add_argument("--graceful-timeout", dest="graceful_timeout_s", type=int, default=d.graceful_timeout_s,
                     help="seconds a draining worker lets running requests finish")
    k8s.add_argument("--startup-timeout", dest="startup_timeout_s", type=int, default=d.startup_timeout_s,
                     help="seconds a worker may take to load its model before it is restarted")


def run(args: argparse.Namespace) -> int:
    from .kubernetes import Deployment, render

    fields = {k: v for k, v in vars(args).items() if k not in ("command", "target")}
    sys.stdout.write(render(Deployment(**fields)))
    return 0
