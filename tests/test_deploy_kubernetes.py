"""`radixserve deploy kubernetes`: the manifests validate against a pinned Kubernetes version's
schemas (kubernetes-validate, strict: unknown fields are errors) and say what the deployment needs:
probes, drain settings, GPUs, the model claim, scrape annotations, service discovery and its RBAC."""
from __future__ import annotations

import subprocess
import sys

import pytest

from radixserve.frontend.cli import main

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

K8S_VERSION = "1.31.0"  # pinned: the schemas kubernetes-validate checks against


def manifests(capsys, *args: str) -> dict[tuple[str, str], dict]:
    assert main(["deploy", "kubernetes", *args]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(by_kind) == len(docs)  # no object twice
    return by_kind


def test_worker_deployment_probes_drain_gpu_model_and_scraping(capsys):
    objs = manifests(capsys, "--model", "llama-3.1-8b", "--replicas", "4", "--gpu", "--model-pvc", "models")
    worker = objs[("Deployment", "radixserve-worker")]
    assert worker["spec"]["replicas"] == 4
    pod = worker["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["startupProbe"]["httpGet"]["path"] == "/health_generate"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "preStop" in c["lifecycle"]
    args = c["args"]
    graceful = int(args[args.index("--graceful-timeout") + 1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > graceful + 5  # the preStop pause + the drain
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and "--device" in args
    assert args[args.index("--model") + 1] == "/models/llama-3.1-8b"
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == "models"
    assert c["volumeMounts"][0]["mountPath"] == "/models" and c["volumeMounts"][0]["readOnly"] is True
    assert ("PersistentVolumeClaim", "radixserve-model") not in objs  # an existing claim was named
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(c["ports"][0]["containerPort"])
    pdb = objs[("PodDisruptionBudget", "radixserve-worker")]
    assert pdb["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert worker["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]


def test_router_discovers_the_workers_by_label_with_the_rbac_it_needs(capsys):
    objs = manifests(capsys, "--model", "m", "--replicas", "2", "--namespace", "serving", "--name", "rs")
    worker_labels = objs[("Deployment", "rs-worker")]["spec"]["template"]["metadata"]["labels"]
    router = objs[("Deployment", "rs-router")]
    spec = router["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = c["args"]
    assert c["command"][-1] == "sglang_router.launch_router" and "--service-discovery" in args
    assert args[args.index("--policy") + 1] == "cache_aware"
    assert args[args.index("--service-discovery-namespace") + 1] == "serving"
    rest = args[args.index("--selector") + 1:]
    selector = rest[:next(i for i, a in enumerate(rest) if a.startswith("--"))]
    assert dict(a.split("=", 1) for a in selector) == worker_labels
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    role = objs[("Role", "rs-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = objs[("RoleBinding", "rs-router")]
    assert binding["roleRef"]["name"] == "rs-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"],
                                    "namespace": "serving"}]
    assert ("ServiceAccount", spec["serviceAccountName"]) in objs
    assert objs[("Service", "rs")]["spec"]["selector"] == router["spec"]["template"]["metadata"]["labels"]
    assert objs[("Service", "rs-worker")]["spec"]["selector"] == worker_labels
    assert all(o["metadata"]["namespace"] == "serving" for o in objs.values())
    pvc = objs[("PersistentVolumeClaim", "rs-model")]  # no --model-pvc: a claim is part of the manifests
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    (c_worker,) = objs[("Deployment", "rs-worker")]["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in c_worker["resources"]["limits"] and "--num-threads" in c_worker["args"]


def test_api_key_comes_from_a_secret_for_workers_and_router(capsys):
    objs = manifests(capsys, "--model", "m", "--api-key-secret", "rs-key")
    for name in ("radixserve-worker", "radixserve-router"):
        (c,) = objs[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["RADIXSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "rs-key", "key": "api-key"}
        assert c["args"][c["args"].index("--api-key") + 1] == "$(RADIXSERVE_API_KEY)"


def test_the_validator_rejects_what_kubernetes_would(capsys):
    objs = manifests(capsys, "--model", "m")
    bad = objs[("Deployment", "radixserve-worker")]
    bad["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("args, message", [
    (["--model", "../etc"], "must name a directory on the model volume"),
    (["--model", "m", "--name", "Bad_Name"], "is not a Kubernetes name"),
    (["--model", "m", "--replicas", "0"], "--replicas must be >= 1"),
    (["--model", "m", "--memory", "lots"], "is not a Kubernetes quantity"),
    (["--model", "m", "--cpus", "4Gi"], "is not a CPU quantity"),
])
def test_bad_options_exit_2_with_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "radixserve.frontend.cli", "deploy", "kubernetes", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("radixserve: error: ") and message in r.stderr and r.stderr.count("\n") == 1
