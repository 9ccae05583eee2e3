"""deploy/helm/conveyor: the chart lints, renders to valid Kubernetes objects for the
defaults and for the values users change (GPUs per learner, per-role S3 Secrets,
autoscaling and PodMonitor on), refuses values that cannot work (no S3 credentials,
placeholder keys, loopback API), keeps two releases in one namespace apart, and
deploy/k8s/conveyor.yaml is exactly its default render (deploy/render-k8s.sh)."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from chart_support import CHART, CREDENTIALS, helm_binary, render
from conftest import ROOT
from test_deploy_manifests import validate_object as validate

from conveyor.config import parse_run_config
from conveyor.topics import Topics

WORKLOADS = ("Deployment", "StatefulSet")
CRD_KINDS = ("ScaledObject", "PodMonitor", "PrometheusRule")


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


def objects(text: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(text) if d}


def workloads(objs) -> dict[str, dict]:
    """Role (the container's name) -> its pod spec."""
    return {
        d["spec"]["template"]["spec"]["containers"][0]["name"]: d["spec"]["template"]["spec"]
        for (kind, _), d in objs.items()
        if kind in WORKLOADS
    }


def container(objs, role: str) -> dict:
    return workloads(objs)[role]["containers"][0]


def secret_refs(objs, role: str) -> list[str]:
    return [e["secretRef"]["name"] for e in container(objs, role).get("envFrom", [])]


def run_config(objs, release: str = "conveyor"):
    return parse_run_config(yaml.safe_load(objs[("ConfigMap", f"{release}-run")]["data"]["run.yaml"]), "chart run.yaml")


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_chart_lints(helm):
    out = subprocess.run([helm, "lint", str(CHART), "--set", CREDENTIALS], capture_output=True, text=True, timeout=60)
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
    cfg = run_config(objs)
    assert cfg.run_id == "conveyor"  # the release's name: two releases never share topics
    assert cfg.metrics.port == 9400  # metricsPort, where the probes look
    assert cfg.producer.http_port == container(objs, "producer")["ports"][1]["containerPort"]
    learner = container(objs, "learner")
    assert learner["command"][:2] == ["torchrun", "--nproc-per-node=1"]
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert not [k for k in objs if k[0] == "Secret"]  # the operator's Secret is referenced, never rendered


def test_without_credentials_the_chart_refuses_with_the_way_out(helm):
    out = render(helm, "s3.existingSecret=", check=False)
    assert out.returncode != 0
    assert "s3: no credentials" in out.stderr and "s3.existingSecret" in out.stderr and "create secret generic" in out.stderr
    for bad, reason in [
        (("s3.accessKeyId=change-me", "s3.secretAccessKey=change-me"), "placeholder"),
        (("s3.accessKeyId=AKIA1",), "give both"),
        (("s3.existingSecret=team-s3", "s3.accessKeyId=AKIA1", "s3.secretAccessKey=k"), "not both"),
    ]:
        out = render(helm, *bad, check=False)
        assert out.returncode != 0 and reason in out.stderr, (bad, out.stderr)


def test_explicit_keys_render_the_release_s_secret_and_nothing_else(helm):
    objs = objects(render(helm, "s3.accessKeyId=AKIA1", "s3.secretAccessKey=sekrit", release="exp-1").stdout)
    secret = objs[("Secret", "exp-1-s3")]
    validate(secret)
    assert secret["stringData"] == {
        "CONVEYOR_OBJECT_STORE__ACCESS_KEY_ID": "AKIA1",
        "CONVEYOR_OBJECT_STORE__SECRET_ACCESS_KEY": "sekrit",
    }
    assert secret_refs(objs, "learner") == ["exp-1-s3"]
    assert [k for k in objs if k[0] == "Secret"] == [("Secret", "exp-1-s3")]


def test_per_role_secrets_keep_the_learner_s_keys_to_the_learner(helm):
    objs = objects(render(helm, "s3.existingSecret=shared-s3", "s3.secrets.learner=learner-rw",
                          "s3.secrets.rollout-worker=weights-ro").stdout)  # fmt: skip
    for doc in objs.values():
        validate(doc)
    assert secret_refs(objs, "learner") == ["learner-rw"]
    assert secret_refs(objs, "rollout-worker") == ["weights-ro"]
    assert secret_refs(objs, "storage-sink") == secret_refs(objs, "reward-bridge") == ["shared-s3"]  # the fallback
    assert secret_refs(objs, "producer") == ["shared-s3", "conveyor-api"]  # and the API's tokens, to it only
    holders = {role for role in workloads(objs) if "learner-rw" in secret_refs(objs, role)}
    assert holders == {"learner"}
    # The reward workers run model-written code: no S3 keys at all, so nothing they run can forge state.
    assert "envFrom" not in container(objs, "reward-worker")
    assert not any("OBJECT_STORE" in str(e) for e in container(objs, "reward-worker").get("env", []))


def test_every_role_with_its_own_secret_needs_no_default(helm):
    roles = ("learner", "rollout-worker", "reward-bridge", "storage-sink", "producer")
    objs = objects(render(helm, *(f"s3.secrets.{r}={r}-s3" for r in roles)).stdout)
    for r in roles:
        assert secret_refs(objs, r)[0] == f"{r}-s3"
    out = render(helm, CREDENTIALS, "s3.secrets.rolloutWorker=x", check=False)  # a role's name, not a class's
    assert out.returncode != 0 and "s3.secrets.rolloutWorker: no such role" in out.stderr


def test_every_workload_has_probes_on_a_port_its_process_serves(helm):
    objs = objects(render(helm).stdout)
    cfg = run_config(objs)
    roles = workloads(objs)
    assert set(roles) == {"producer", "rollout-worker", "reward-bridge", "reward-worker", "storage-sink", "learner"}
    for role, pod in roles.items():
        c = pod["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == cfg.metrics.port  # `conveyor serve` binds metrics.port in every role
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = c[probe].get("httpGet") or c[probe]["tcpSocket"]
            assert action["port"] in ports, (role, probe)
            if role == "producer":
                assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
                assert ports["http"] == cfg.producer.http_port
            else:
                assert action["port"] == "metrics", (role, probe)
    learner = roles["learner"]["containers"][0]["startupProbe"]
    assert learner["periodSeconds"] * learner["failureThreshold"] >= 600  # torchrun and torch's import take minutes


def test_network_policy_admits_only_the_release_and_what_is_configured(helm):
    objs = objects(render(helm).stdout)
    policy = objs[("NetworkPolicy", "conveyor")]
    validate(policy)
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector["app.kubernetes.io/instance"] == "conveyor"
    assert all(selects(selector, pod_labels) for pod_labels in pod_labels_of(objs).values())
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open by default
    ingress = policy["spec"]["ingress"]
    assert all(rule.get("from") for rule in ingress)  # a rule without peers would admit every source
    assert {"podSelector": {"matchLabels": selector}} in ingress[0]["from"]
    assert ingress[1]["ports"] == [{"protocol": "TCP", "port": 9400}]  # Prometheus: the metrics port only
    assert ingress[1]["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert ("NetworkPolicy", "conveyor-producer-api") not in objs  # the API: nobody outside unless configured

    objs = objects(render(helm, "networkPolicy.apiFrom[0].ipBlock.cidr=10.0.0.0/8",
                          "networkPolicy.egress[0].to[0].ipBlock.cidr=10.20.0.0/16", "networkPolicy.metricsFrom=null").stdout)  # fmt: skip
    api = objs[("NetworkPolicy", "conveyor-producer-api")]
    validate(api)
    producer_pods = [r for r, labels in pod_labels_of(objs).items() if selects(api["spec"]["podSelector"]["matchLabels"], labels)]
    assert producer_pods == ["producer"]
    assert api["spec"]["ingress"] == [
        {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"protocol": "TCP", "port": 8600}]}
    ]
    policy = objs[("NetworkPolicy", "conveyor")]
    validate(policy)
    assert len(policy["spec"]["ingress"]) == 1  # no metricsFrom: no metrics rule, never an empty `from`
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    egress = policy["spec"]["egress"]
    assert {"protocol": "UDP", "port": 53} in egress[1]["ports"] and egress[2] == {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]}

    assert not [k for k in objects(render(helm, "networkPolicy.enabled=false").stdout) if k[0] == "NetworkPolicy"]


def pod_labels_of(objs) -> dict[str, dict]:
    return {
        d["spec"]["template"]["spec"]["containers"][0]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for (kind, _), d in objs.items()
        if kind in WORKLOADS
    }


def test_two_releases_in_one_namespace_do_not_collide(helm):
    on = ("autoscaling.enabled=true", "monitoring.podMonitor=true", "s3.accessKeyId=AKIA1", "s3.secretAccessKey=k")
    a, b = (objects(render(helm, *on, release=r).stdout) for r in ("exp-a", "exp-b"))
    assert not set(a) & set(b)
    assert all(name.startswith("exp-a") for _, name in a)
    assert run_config(a, "exp-a").run_id != run_config(b, "exp-b").run_id  # topics and S3 prefixes apart too
    for objs, other in ((a, b), (b, a)):  # no selector of one release picks the other's pods
        selectors = [d["spec"]["selector"].get("matchLabels", d["spec"]["selector"]) for k, d in objs.items()
                     if k[0] in (*WORKLOADS, "Service", "PodMonitor")]  # fmt: skip
        selectors += [d["spec"]["podSelector"]["matchLabels"] for k, d in objs.items() if k[0] == "NetworkPolicy"]
        assert not [s for s in selectors for labels in pod_labels_of(other).values() if selects(s, labels)]
    # and every name a release refers to is one of its own objects
    for objs in (a, b):
        names = {name for _, name in objs}
        for pod in workloads(objs).values():
            refs = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
            refs += [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert set(refs) <= names, refs
        assert {d["spec"]["serviceName"] for k, d in objs.items() if k[0] == "StatefulSet"} <= names
        assert {d["spec"]["scaleTargetRef"]["name"] for k, d in objs.items() if k[0] == "ScaledObject"} <= {
            name for kind, name in objs if kind == "Deployment"
        }


def test_release_names_too_long_for_kubernetes_are_refused(helm):
    out = render(helm, release="r" * 41, check=False)
    assert out.returncode != 0 and "longer than 40 characters" in out.stderr
    assert objects(render(helm, "fullnameOverride=short", release="r" * 41).stdout)[("StatefulSet", "short-learner")]


def test_crd_objects_are_off_by_default_and_valid_when_on(helm):
    assert not [k for k in objects(render(helm).stdout) if k[0] in CRD_KINDS]
    objs = objects(render(helm, "autoscaling.enabled=true", "monitoring.podMonitor=true", "monitoring.prometheusRule=true",
                          "monitoring.podMonitorLabels.release=prometheus").stdout)  # fmt: skip
    for doc in objs.values():
        validate(doc)  # the CRDs against the vendored KEDA / PodMonitor / PrometheusRule schemas
    cfg = run_config(objs)
    topics = Topics(cfg.run_id)
    kafka = objs[("ScaledObject", "conveyor-rollout-worker")]["spec"]["triggers"][0]["metadata"]
    assert kafka["topic"] == topics.tasks and kafka["consumerGroup"] == topics.group("rollout-workers")
    assert kafka["bootstrapServers"] == cfg.transport.bootstrap_servers
    redis = objs[("ScaledObject", "conveyor-reward-worker")]["spec"]["triggers"][0]["metadata"]
    assert redis["listName"] == cfg.reward.queue and redis["address"] == "redis.conveyor.svc:6379"
    monitor = objs[("PodMonitor", "conveyor")]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert all(selects(monitor["spec"]["selector"]["matchLabels"], labels) for labels in pod_labels_of(objs).values())
    # the labels the dashboard and the rules select by: role (the component) and release
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert relabel["role"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    assert relabel["release"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    rules = objs[("PrometheusRule", "conveyor")]["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"ConveyorLearnerStalled", "ConveyorConsumerLagGrowing",
                                           "ConveyorDeadLettersRising", "ConveyorRewardCollapsed"}  # fmt: skip
    assert all('namespace="conveyor", release="conveyor"' in r["expr"] for r in rules)  # this release's series only


def test_values_users_change(helm):
    objs = objects(render(helm, "roles.learner.gpus=8", "s3.existingSecret=team-s3",
                          "roles.reward-worker.replicas=12", "run.run_id=exp-7").stdout)  # fmt: skip
    for doc in objs.values():
        validate(doc)
    learner = container(objs, "learner")
    assert "--nproc-per-node=8" in learner["command"]
    assert learner["resources"]["requests"]["nvidia.com/gpu"] == learner["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert secret_refs(objs, "producer") == ["team-s3", "conveyor-api"]
    assert secret_refs(objs, "reward-bridge") == ["team-s3"]  # the API's tokens go to the producer only
    assert objs[("Deployment", "conveyor-reward-worker")]["spec"]["replicas"] == 12
    assert run_config(objs).run_id == "exp-7"
    cpu_role = workloads(objs)["reward-bridge"]
    assert "tolerations" not in cpu_role and "nvidia.com/gpu" not in cpu_role["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize(
    "sets,reason",
    [
        (("autoscaling.enabled=true", "run.celery.type=rabbitmq", "run.celery.url=amqp://guest:guest@rabbit:5672//"),
         "run.celery.type must be redis"),
        (("run.producer.http_host=127.0.0.1",), "loopback"),
        (("run.metrics.port=9500",), "differs from metricsPort"),
    ],
)  # fmt: skip
def test_values_that_cannot_work_are_refused_with_the_reason(helm, sets, reason):
    out = render(helm, *sets, check=False)
    assert out.returncode != 0
    assert reason in out.stderr
