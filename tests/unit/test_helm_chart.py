"""deploy/helm/conveyor: the chart lints, renders to valid Kubernetes objects for the
defaults and for the values users change (GPUs per learner, autoscaling off, an
existing S3 secret), refuses values that cannot work, and deploy/k8s/conveyor.yaml
is exactly its default render (deploy/render-k8s.sh)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from conftest import ROOT, service_unavailable
from test_deploy_manifests import validate_object as validate

from conveyor.config import parse_run_config

CHART = ROOT / "deploy" / "helm" / "conveyor"


@pytest.fixture(scope="module")
def helm() -> str:
    found = shutil.which("helm") or (str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists() else None)
    if found is None:
        service_unavailable("helm is not installed (bash install.sh puts it in .tools/bin)")
    return found


def render(helm: str, *sets: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [helm, "template", "conveyor", str(CHART), "--namespace", "conveyor"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=check)


def objects(text: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(text) if d}


def container(objs, kind: str, name: str) -> dict:
    return objs[(kind, name)]["spec"]["template"]["spec"]["containers"][0]


def test_chart_lints(helm):
    out = subprocess.run([helm, "lint", str(CHART)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_plain_manifests_are_the_default_render(helm):
    rendered = render(helm, "createNamespace=true").stdout
    committed = (ROOT / "deploy" / "k8s" / "conveyor.yaml").read_text()
    assert objects(committed) == objects(rendered), "deploy/k8s/conveyor.yaml is stale: run deploy/render-k8s.sh"


def test_default_render_is_valid_and_consistent(helm):
    objs = objects(render(helm).stdout)
    for doc in objs.values():
        validate(doc)
    assert ("Namespace", "conveyor") not in objs  # helm install --create-namespace makes it
    cfg = parse_run_config(yaml.safe_load(objs[("ConfigMap", "conveyor-run")]["data"]["run.yaml"]), "chart run.yaml")
    kafka = objs[("ScaledObject", "rollout-worker")]["spec"]["triggers"][0]["metadata"]
    assert kafka["topic"] == f"conveyor.{cfg.run_id}.tasks" and kafka["bootstrapServers"] == cfg.transport.bootstrap_servers
    redis = objs[("ScaledObject", "reward-worker")]["spec"]["triggers"][0]["metadata"]
    assert redis["listName"] == cfg.reward.queue and redis["address"] == "redis.conveyor.svc:6379"
    learner = container(objs, "StatefulSet", "learner")
    assert learner["command"][:2] == ["torchrun", "--nproc-per-node=1"]
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_values_users_change(helm):
    objs = objects(render(helm, "roles.learner.gpus=8", "autoscaling.enabled=false", "s3.existingSecret=team-s3",
                          "roles.reward-worker.replicas=12", "run.run_id=exp-7", "monitoring.podMonitor=false").stdout)  # fmt: skip
    for doc in objs.values():
        validate(doc)
    learner = container(objs, "StatefulSet", "learner")
    assert "--nproc-per-node=8" in learner["command"]
    assert learner["resources"]["requests"]["nvidia.com/gpu"] == learner["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert not [k for k in objs if k[0] in ("ScaledObject", "PodMonitor")]
    assert ("Secret", "conveyor-s3") not in objs
    assert container(objs, "Deployment", "producer")["envFrom"] == [
        {"secretRef": {"name": "team-s3"}},
        {"secretRef": {"name": "conveyor-api"}},
    ]
    assert container(objs, "Deployment", "reward-bridge")["envFrom"] == [
        {"secretRef": {"name": "team-s3"}}
    ]  # the API's tokens go to the producer only
    assert objs[("Deployment", "reward-worker")]["spec"]["replicas"] == 12
    assert "run_id: exp-7" in objs[("ConfigMap", "conveyor-run")]["data"]["run.yaml"]
    cpu_role = objs[("Deployment", "reward-bridge")]["spec"]["template"]["spec"]
    assert "tolerations" not in cpu_role and "nvidia.com/gpu" not in cpu_role["containers"][0]["resources"]["limits"]


def test_autoscaling_on_a_rabbitmq_run_is_refused_with_the_reason(helm):
    out = render(helm, "run.celery.type=rabbitmq", "run.celery.url=amqp://guest:guest@rabbit:5672//", check=False)
    assert out.returncode != 0
    assert "run.celery.type must be redis" in out.stderr
