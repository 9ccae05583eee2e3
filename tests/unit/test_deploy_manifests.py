"""deploy/: Kubernetes manifests validated against the Kubernetes schemas
(kubernetes-validate), the CRDs against the vendored schemas of what they use,
and every cross-reference (config, roles, consumer groups, queues) checked
against the code."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from conftest import ROOT

from conveyor.config import parse_run_config

DEPLOY = ROOT / "deploy"
CRD_SCHEMAS = {"ScaledObject": "keda-scaledobject.json", "PodMonitor": "podmonitor.json", "PrometheusRule": "prometheusrule.json"}


def docs():
    out = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


@pytest.mark.parametrize("name,doc", docs(), ids=lambda x: x if isinstance(x, str) else f"{x['kind']}/{x['metadata']['name']}")
def test_manifest_is_valid(name, doc):
    validate_object(doc)


def validate_object(doc: dict) -> None:
    """Core kinds against the Kubernetes 1.30 schemas, CRDs against the vendored schemas."""
    if doc["kind"] in CRD_SCHEMAS:
        jsonschema.validate(doc, json.loads((DEPLOY / "schemas" / CRD_SCHEMAS[doc["kind"]]).read_text()))
    else:
        import kubernetes_validate

        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_cross_references_hold():
    """The plain manifests apply on a bare cluster (no CRDs) with the two Secrets the operator creates
    (conveyor-s3, conveyor-api); the KEDA objects' references are tested on the chart
    (tests/unit/test_helm_chart.py), where autoscaling is turned on."""
    from launch.cli.serve import app as serve_app

    all_docs = [d for _, d in docs()]
    by_kind: dict[str, dict[str, dict]] = {}
    for d in all_docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    assert not set(by_kind) & CRD_SCHEMAS.keys(), "deploy/k8s/ must apply without KEDA or the Prometheus operator"
    (run_cm,) = [cm for cm in by_kind["ConfigMap"].values() if "run.yaml" in cm["data"]]
    cfg = parse_run_config(yaml.safe_load(run_cm["data"]["run.yaml"]), f"ConfigMap {run_cm['metadata']['name']}")
    roles = {c.name for c in serve_app.registered_commands}
    secrets: set[str] = set()
    pods = {}
    for kind in ("Deployment", "StatefulSet"):
        for d in by_kind[kind].values():
            pod = d["spec"]["template"]["spec"]
            c = pod["containers"][0]
            args = c["args"]
            assert args[0] == "serve" and args[1] in roles, args
            pods[args[1]] = pod
            assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} == {run_cm["metadata"]["name"]}
            claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
            assert claims <= by_kind["PersistentVolumeClaim"].keys()
            assert {p["containerPort"] for p in c["ports"] if p["name"] == "metrics"} == {cfg.metrics.port}
            secrets |= {e["secretRef"]["name"] for e in c.get("envFrom", [])}
    assert secrets == {"conveyor-s3", "conveyor-api"}  # deploy/helm/conveyor/values.yaml says how to create them
    assert "envFrom" not in pods["reward-worker"]["containers"][0]  # no S3 keys where model-written code runs
    sandbox = pods["reward-worker"]["containers"][0]["securityContext"]
    assert sandbox["seccompProfile"]["type"] == "Unconfined" and sandbox["allowPrivilegeEscalation"] is False
    (policy,) = by_kind["NetworkPolicy"].values()
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])


def test_compose_file_and_its_run_config():
    from launch.cli.serve import app as serve_app

    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    roles = {c.name for c in serve_app.registered_commands}
    services = compose["services"]
    assert {"kafka", "redis", "s3"} <= services.keys()
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    for name, svc in services.items():
        if "command" in svc and svc["command"][0] == "serve":
            assert svc["command"][1] in roles, (name, svc["command"])
    assert {svc["command"][1] for svc in services.values() if svc.get("command", [""])[0] == "serve"} == roles
    parse_run_config(yaml.safe_load((DEPLOY / "run.compose.yaml").read_text()), "deploy/run.compose.yaml")


def test_grafana_dashboard_queries_metrics_the_code_exports():
    """Every series a panel asks for is one the services export (the integration test runs every
    query against a real Prometheus scraping a run); panels follow the datasource and role variables."""
    import re
    from collections import Counter

    from conveyor.metrics import LearnerMetrics, RewardMetrics, RolloutMetrics, SinkMetrics, TransportMetrics, make_registry
    from producers.api import ApiCollector

    dash = json.loads((DEPLOY / "grafana" / "conveyor-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["role"]["datasource"]["uid"] == "${datasource}" and variables["role"]["includeAll"]
    targets = [t for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    assert all(t["datasource"]["uid"] == "${datasource}" for t in targets)
    registry = make_registry()
    for kind in (TransportMetrics, RolloutMetrics, RewardMetrics, SinkMetrics, LearnerMetrics):
        kind.create(registry)
    registry.register(ApiCollector({"r": 1}, Counter({422: 1})))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    exported = {f.name + end for f in registry.collect() for end in suffixes[f.type]}
    for t in targets:
        for metric in re.findall(r"\b(conveyor_[a-z_]+)\{", t["expr"]):
            assert metric in exported, f"{metric} is exported by no service"
        for selector in re.findall(r"\b(?:conveyor|process)_[a-z_]+(\{[^}]*\})", t["expr"]):
            assert 'role=~"$role"' in selector, t["expr"]
