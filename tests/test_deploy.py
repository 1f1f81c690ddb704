"""The deployment files (deploy/): the container image definition linted with hadolint, the Kubernetes
manifests validated offline against the Kubernetes API schemas (kubernetes-validate, strict), and what ties
them together checked: the gateway config in the ConfigMap loads and names the Services the manifests
define, the probes and the scrape path are routes of the gateway that config builds, the ports agree.

The image is not built here: a builder (podman, from Debian) installs, but the base image
(python:3.11-slim-bookworm) comes from a container registry, which this machine cannot reach."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
BIN = Path(sys.executable).parent


def documents() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of the manifests by (kind, name)."""
    found = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def test_the_dockerfile_passes_hadolint() -> None:
    done = subprocess.run([str(BIN / "hadolint"), str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_each_manifest_is_valid_kubernetes(manifest: Path) -> None:
    done = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", str(manifest)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout + done.stderr and "error" not in (done.stdout + done.stderr).lower()


def test_the_configmap_config_loads_and_matches_the_services_probes_and_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-the-secret")  # as the Deployment's env sets it
    objects = documents()
    toml = objects[("ConfigMap", "fairgate-config")]["data"]["fairgate.toml"]
    (tmp_path / "fairgate.toml").write_text(toml)
    config = load_gateway_config(tmp_path / "fairgate.toml")
    # The ledger and the upstream are the Services the manifests define, on their ports.
    redis, vllm = objects[("Service", "fairgate-redis")], objects[("Service", "vllm")]
    assert config.ledger_url.startswith(f"redis://fairgate-redis:{redis['spec']['ports'][0]['port']}/")
    [upstream] = config.upstreams
    assert upstream.url == f"http://vllm:{vllm['spec']['ports'][0]['port']}/v1" and upstream.kind == "vllm"
    served = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert served[served.index("--served-model-name") + 1] == upstream.model
    # The gateway pods together use the engine's slots, no more (each process its share: README, scale-out).
    pods = objects[("Deployment", "fairgate")]["spec"]["replicas"]
    assert int(served[served.index("--max-num-seqs") + 1]) == upstream.max_batch * pods
    # The gateway's probes and scrape path are routes of the app this config builds.
    [gateway] = objects[("Deployment", "fairgate")]["spec"]["template"]["spec"]["containers"]
    routes = {getattr(route, "path", None) for route in create_gateway(config).routes}
    assert {gateway["readinessProbe"]["httpGet"]["path"], gateway["livenessProbe"]["httpGet"]["path"]} <= routes
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] in routes and scrape["authorization"]["type"] == "Bearer"
    pod_label = objects[("Deployment", "fairgate")]["spec"]["template"]["metadata"]["labels"]
    assert scrape["relabel_configs"][0]["regex"] == pod_label["app.kubernetes.io/name"]
    # Every environment variable the config reads comes from the Secret the manifests name; ports agree.
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in gateway["env"]}
    assert env[upstream.api_key_env or ""] == "fairgate-secrets"
    assert env[config.delegation.secret_env] == "fairgate-secrets"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"EXPOSE {gateway['ports'][0]['containerPort']}" in dockerfile
    assert '"--port", "8000"' in dockerfile and gateway["args"] == ["--config", "/etc/fairgate/fairgate.toml"]
    # Files the gateway writes are under the writable state volume (the root file system is read-only).
    mounts = {m["mountPath"]: m for m in gateway["volumeMounts"]}
    assert gateway["securityContext"]["readOnlyRootFilesystem"] and mounts["/etc/fairgate"]["readOnly"]
    for written in (config.journal_path, config.event_log_path):
        assert written is not None and written.parent == Path("/var/lib/fairgate"), written
    assert config.gateway.access_log == "-"
