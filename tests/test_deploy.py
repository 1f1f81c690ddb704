"""The deployment files (deploy/): the container image definition linted with hadolint, the Kubernetes
manifests validated offline against the Kubernetes API schemas (kubernetes-validate, strict), and what ties
them together checked: the gateway config in the ConfigMap loads and names the Services the manifests
define, the probes and the scrape path are routes of the gateway that config builds, the ports agree.

The image is built and started only where a container engine runs (``test_the_image_builds_and_serves``),
which is not this machine: ``docker`` here is a client with no daemon to talk to, podman and buildah are not
installed, and the base image (python:3.11-slim-bookworm) comes from a container registry
(registry-1.docker.io) that this machine cannot reach either. The test says which of these it found when it
skips."""

from __future__ import annotations

import shutil
import socket
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


REGISTRY = ("registry-1.docker.io", 443)  # where the Dockerfile's base image comes from


def container_engine() -> tuple[str | None, list[str]]:
    """A container engine that runs here (``podman`` or ``docker``; None: none), and what stops a build here."""
    missing = []
    for engine in ("podman", "docker"):
        if shutil.which(engine) is None:
            missing.append(f"{engine} is not installed")
            continue
        info = subprocess.run([engine, "info"], capture_output=True, text=True, timeout=60)
        if info.returncode == 0:
            return engine, []
        missing.append(f"{engine} is a client with no engine to talk to ({engine} info exits {info.returncode})")
    if shutil.which("buildah") is None:
        missing.append("buildah is not installed")
    try:
        socket.create_connection(REGISTRY, timeout=5).close()
    except OSError as exc:
        missing.append(f"the base image's registry {REGISTRY[0]} is unreachable ({exc})")
    return None, missing


def test_the_image_builds_and_serves(tmp_path: Path) -> None:
    engine, missing = container_engine()
    if engine is None or missing:
        pytest.skip("the image is not built here: " + "; ".join(missing))
    assert engine is not None
    tag = "localhost/fairgate-test:latest"
    built = subprocess.run(
        [engine, "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(REPO)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    ran = subprocess.run(
        [engine, "run", "--rm", "--entrypoint", "fairgate", tag, "--help"], capture_output=True, text=True
    )
    assert ran.returncode == 0 and "serve" in ran.stdout, ran.stdout + ran.stderr


def test_the_readme_says_why_the_image_is_not_built_here_and_what_a_deployment_needs() -> None:
    readme = (REPO / "README.md").read_text()
    deploying = readme[readme.index("\n## Deploying\n") :]
    deploying = " ".join(deploying[: deploying.index("\n## ", 1)].split())
    engine, _ = container_engine()
    if engine is None:  # what this machine lacks, as the README states it
        assert "no container engine runs on this machine" in deploying
        assert (
            "docker is only a client, with no daemon" in deploying
            and "podman and buildah are not installed" in deploying
        )
    assert "the admin API's writes need a writable config file" in deploying
    assert "edit the ConfigMap and reload each pod" in deploying
    assert "the dashboard and its history are per gateway pod" in deploying


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


def test_the_example_config_writes_into_its_git_ignored_state_folder_made_at_start(tmp_path: Path) -> None:
    """``fairgate serve --config config/fairgate.example.toml`` keeps its ledger, journal and logs in
    ``config/state/``, which git ignores; a copy of the example elsewhere gets a ``state/`` folder beside it."""
    from fairgate.gateway.auth import hash_api_key
    from fairgate.harness.process import free_port
    from tests.conftest import fairgate

    example = REPO / "config" / "fairgate.example.toml"

    def written(config_path: Path) -> list[Path]:
        config = load_gateway_config(config_path)
        files = [config.journal_path, config.event_log_path, config.audit_log_path, config.dashboard_history_path]
        return [Path(config.ledger_url.removeprefix("sqlite:///")), *(f for f in files if f is not None)]

    assert len(written(example)) == 5 and {f.parent for f in written(example)} == {example.parent / "state"}
    if (REPO / ".git").exists():
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", *map(str, written(example))], cwd=REPO, capture_output=True, text=True
        )
        assert ignored.stdout.split() == [str(f) for f in written(example)], ignored.stderr
    copy = tmp_path / "fairgate.toml"
    copy.write_text(example.read_text() + f'\n[[key]]\ntenant = "chat"\nhash = "{hash_api_key("fg-" + "k" * 32)}"\n')
    done = fairgate("serve", "--config", str(copy), "--port", str(free_port()), "--duration", "2", cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "state").iterdir() if p.suffix in (".db", ".jsonl")) == [
        "fairgate-events.jsonl",
        "fairgate-journal.jsonl",
        "fairgate-ledger.db",
    ]
    assert {p.name for p in tmp_path.iterdir()} == {"fairgate.toml", "state"}  # nothing else beside the config
