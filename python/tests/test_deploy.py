"""`expertmesh deploy kubernetes`: the manifests validate against the Kubernetes API schemas.

Every generated object is checked by the PyPI package ``kubernetes-validate`` (the API's
OpenAPI schemas, strict: unknown fields are errors) for two Kubernetes versions, on a
loopback CPU fabric (also with worker tile caches: an emptyDir each, IPC_LOCK) and on a GPU
cluster with RDMA links (GPU and RDMA device resources, IPC_LOCK). That the validator rejects a broken manifest is checked too. Running the pods
themselves (as the kubelet would, in network namespaces) is the Rust test
``tests/it/deploy_engines.rs``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Dict, List

import pytest

from fabric_util import EXAMPLES, expertmesh_bin

kv = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
)
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")

VERSIONS = ["1.30.0", "1.37.0"]


def _deploy(tmp: Path, topology: Path, model: str, placement: Path, *extra: str) -> List[Dict[str, Any]]:
    exe = expertmesh_bin()
    key = tmp / "cluster.key"
    if not key.exists():
        subprocess.run([str(exe), "keys", "init", "--out", str(key)], check=True, capture_output=True)
    out = tmp / "out"
    r = subprocess.run(
        [
            str(exe), "deploy", "kubernetes", "--image", "registry.example/expertmesh:1",
            "--topology", str(topology), "--model", model, "--placement", str(placement),
            "--key", str(key), "--out", str(out), *extra,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    docs: List[Dict[str, Any]] = []
    for f in sorted((out / "kubernetes").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(f.read_text()) if d)
    return docs


def _validate(docs: List[Dict[str, Any]]) -> None:
    for version in VERSIONS:
        for d in docs:
            kv.validate(d, version, strict=True)


def test_cpu_fabric_manifests_validate(tmp_path: Path) -> None:
    docs = _deploy(
        tmp_path, EXAMPLES / "single-host.toml", "demo-small",
        EXAMPLES / "single-host-demo-small.placement.toml", "--namespace", "serving",
    )
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ConfigMap", "Secret", "Secret", "Secret", "Deployment", "Deployment", "Deployment",
         "Service", "PodDisruptionBudget", "PodDisruptionBudget"]
    )
    assert all(d["metadata"]["namespace"] == "serving" for d in docs)
    _validate(docs)


def test_gpu_rdma_cluster_manifests_validate(tmp_path: Path) -> None:
    docs = _deploy(
        tmp_path, EXAMPLES / "mi210-4x4.toml", "deepseek-v3",
        EXAMPLES / "mi210-4x4-deepseek-v3.placement.toml",
        "--rdma-resource", "rdma/hca_shared_devices_a", "--worker-arg=--link", "--worker-arg=rdma",
    )
    workers = [d for d in docs if d["kind"] == "Deployment" and "worker" in d["metadata"]["name"]]
    assert len(workers) == 16
    for w in workers:
        c = w["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"] == {"amd.com/gpu": 1, "rdma/hca_shared_devices_a": 1}
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        # The device plugin shows the pod only its own GPU, as index 0.
        assert {"name": "EXPERTMESH_GPU_INDEX", "value": "0"} in c["env"]
    _validate(docs)


def test_worker_tile_cache_manifests_validate(tmp_path: Path) -> None:
    """A worker's --tile-cache folder is an emptyDir mounted there, with IPC_LOCK to lock the
    tiles in memory; the router gets neither."""
    docs = _deploy(
        tmp_path, EXAMPLES / "single-host.toml", "demo-small",
        EXAMPLES / "single-host-demo-small.placement.toml",
        "--worker-arg=--tile-cache=/var/cache/expertmesh",
    )
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    workers = [d for d in deployments if "worker" in d["metadata"]["name"]]
    assert len(workers) == 2
    for w in workers:
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert {"name": "tile-cache", "mountPath": "/var/cache/expertmesh"} in c["volumeMounts"]
        assert {"name": "tile-cache", "emptyDir": {}} in spec["volumes"]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    router = next(d for d in deployments if "router" in d["metadata"]["name"])
    assert "securityContext" not in router["spec"]["template"]["spec"]["containers"][0]
    _validate(docs)


def test_the_validator_rejects_a_broken_manifest(tmp_path: Path) -> None:
    docs = _deploy(
        tmp_path, EXAMPLES / "single-host.toml", "demo-small",
        EXAMPLES / "single-host-demo-small.placement.toml",
    )
    d = next(d for d in docs if d["kind"] == "Deployment")
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = ["metrics"]
    with pytest.raises(kv.ValidationError):
        kv.validate(d, VERSIONS[0], strict=True)
