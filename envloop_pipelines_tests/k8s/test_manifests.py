"""k8s/ and the Dockerfile, checked without a cluster: every manifest against the Kubernetes OpenAPI schemas
(``kubernetes-validate``, strict: an unknown field fails), the Helm values against the Dagster chart's own
``values.schema.json``, the files generated from the sandbox backend against the code, the pods against Pod
Security ``restricted``, the training step pod the k8s executor would create, and the image build files.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from envloop_pipelines.core.sandbox.base import SandboxLimits
from envloop_pipelines.core.sandbox.k8s import (
    DEFAULT_NAMESPACE,
    DENY_POLICY_NAME,
    KubernetesSandbox,
    deny_egress_policy,
    input_secret_manifest,
    namespace_manifest,
    runner_rbac,
)
from envloop_pipelines.core.sandbox.k8s_manifests import DAGSTER_NAMESPACE, DAGSTER_SERVICE_ACCOUNT, render
from envloop_pipelines.core.sandbox.k8s_manifests import main as manifests_main

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
VALUES = K8S / "dagster" / "values.yaml"
CHART_SCHEMA = Path(__file__).with_name("dagster_values.schema.json")
#: The oldest Kubernetes minor the manifests target and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.33.0", "1.37.0")
IMAGE_REPOSITORY = "registry.example.com/envloop/envloop-pipelines"
RUN_AS_USER = 10001


def _documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(K8S.rglob("*.yaml")):
        if path == VALUES:
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                yield f"{path.relative_to(REPO)}#{i}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc


DOCUMENTS = dict(_documents())


def _doc(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCUMENTS.values() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _validate(doc: dict[str, Any], version: str = K8S_VERSIONS[0]) -> None:
    """Strict validation; a failure names the field and the reason (not the whole schema, as str() would)."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path))
        raise AssertionError(f"Kubernetes {version} schema: {exc.message} at {where or '/'}") from None


# --------------------------------------------------------------------------- Kubernetes schemas


def test_k8s_folder_holds_the_expected_objects() -> None:
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in DOCUMENTS.values())
    assert kinds == sorted([
        "PersistentVolumeClaim/envloop-home", "PersistentVolumeClaim/envloop-verifier",
        "PersistentVolumeClaim/envloop-models", "Job/envloop-models-fill",
        "ConfigMap/envloop-postgres-init", "Service/envloop-postgres", "StatefulSet/envloop-postgres",
        "PersistentVolumeClaim/envloop-mlflow-artifacts", "Deployment/envloop-mlflow", "Service/envloop-mlflow",
        "Deployment/envloop-inference", "Service/envloop-inference",
        "Namespace/envloop-sandbox", "NetworkPolicy/envloop-sandbox-deny-all", "Role/envloop-sandbox-runner",
        "RoleBinding/envloop-sandbox-runner", "Job/envloop-sb-template",
    ])


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("where", sorted(DOCUMENTS))
def test_every_manifest_is_valid_kubernetes(where: str, version: str) -> None:
    _validate(DOCUMENTS[where], version)


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.__setitem__("readinesProbe", c.pop("readinessProbe")), "'readinesProbe' was unexpected"),
    (lambda c: c["securityContext"].__setitem__("allowPrivilegeEscalaton", False),
     "'allowPrivilegeEscalaton' was unexpected"),
    (lambda c: c["ports"][0].__setitem__("containerPort", "five thousand"), "is not of type 'integer'"),
])
def test_strict_validation_rejects_a_broken_manifest(mutate: Any, message: str) -> None:
    broken = copy.deepcopy(_doc("Deployment", "envloop-mlflow"))
    mutate(broken["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(AssertionError, match="Kubernetes .* schema: .*" + re.escape(message)):
        _validate(broken)


def _runtime_sandbox_documents() -> list[dict[str, Any]]:
    limits = SandboxLimits(cpu_s=30, mem_mb=1024, wall_s=90.5, fsize_mb=16)
    box = KubernetesSandbox(limits, image="python:3.11-slim", cpus=0.5)
    return [
        box.job_for("envloop-sb-plain", ["true"]),
        box.job_for("envloop-sb-stdin", ["cat"], input_secret="envloop-sb-stdin", has_stdin=True, env={"A": "1"}),
        box.job_for("envloop-sb-files", ["python", "-m", "x"], input_secret="envloop-sb-files", has_stdin=True,
                    input_files=["a.parquet", "dir/b.jsonl"], result_channel=True),
        deny_egress_policy(),
        input_secret_manifest("envloop-sb-stdin", DEFAULT_NAMESPACE, b"labels", {"a.parquet": b"\x00\x01"}),
        namespace_manifest(),
        *runner_rbac(service_account=DAGSTER_SERVICE_ACCOUNT, service_account_namespace=DAGSTER_NAMESPACE),
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_the_sandbox_creates_at_run_time_are_valid(version: str) -> None:
    for doc in _runtime_sandbox_documents():
        _validate(doc, version)


# --------------------------------------------------------------------------- Pod Security "restricted"

_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What a pod spec breaks of the Pod Security Standard ``restricted`` (the rules admission checks)."""
    bad = []
    psc = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            bad.append(flag)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            bad.append(f"volume {volume['name']}: {sorted(kinds)}")
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext", {})
        who = f"container {c['name']}"
        if sc.get("privileged"):
            bad.append(f"{who}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{who}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{who}: capabilities must drop ALL and add at most NET_BIND_SERVICE")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            bad.append(f"{who}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{who}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{who}: seccompProfile {seccomp!r}")
    return bad


def test_sandbox_namespace_enforces_restricted_and_its_job_complies() -> None:
    labels = _doc("Namespace", DEFAULT_NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    job_pods = [_doc("Job", "envloop-sb-template")["spec"]["template"]["spec"]]
    job_pods += [d["spec"]["template"]["spec"] for d in _runtime_sandbox_documents() if d["kind"] == "Job"]
    for pod in job_pods:
        assert restricted_violations(pod) == []
        assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("kind, name", [("Deployment", "envloop-mlflow"), ("Deployment", "envloop-inference"),
                                        ("StatefulSet", "envloop-postgres"), ("Job", "envloop-models-fill")])
def test_the_other_pods_comply_too(kind: str, name: str) -> None:
    assert restricted_violations(_doc(kind, name)["spec"]["template"]["spec"]) == []


def test_restricted_check_catches_a_privileged_pod() -> None:
    pod = copy.deepcopy(_doc("Job", "envloop-sb-template")["spec"]["template"]["spec"])
    pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    pod["securityContext"]["runAsNonRoot"] = False
    del pod["containers"][0]["securityContext"]["runAsNonRoot"]
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert len(restricted_violations(pod)) == 3


# --------------------------------------------------------------------------- generated from the code


def test_generated_sandbox_manifests_match_the_code() -> None:
    for name, text in render().items():
        stale = f"k8s/{name} is stale: python -m envloop_pipelines.core.sandbox.k8s_manifests --out k8s"
        assert (K8S / name).read_text() == text, stale
    assert manifests_main(["--out", str(K8S), "--check"]) == 0


def test_generator_check_reports_a_hand_edit(tmp_path: Path) -> None:
    assert manifests_main(["--out", str(tmp_path)]) == 0
    assert manifests_main(["--out", str(tmp_path), "--check"]) == 0
    edited = tmp_path / "verifier.yaml"
    edited.write_text(edited.read_text().replace("egress: []", "egress:\n  - {}"))
    assert manifests_main(["--out", str(tmp_path), "--check"]) == 1


def test_runner_role_grants_get_not_create_on_the_deny_policy() -> None:
    role = _doc("Role", "envloop-sandbox-runner")
    (netpol,) = [r for r in role["rules"] if "networkpolicies" in r["resources"]]
    assert netpol["verbs"] == ["get"] and netpol["resourceNames"] == [DENY_POLICY_NAME]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in role["rules"])
    (subject,) = _doc("RoleBinding", "envloop-sandbox-runner")["subjects"]
    assert (subject["name"], subject["namespace"]) == (DAGSTER_SERVICE_ACCOUNT, DAGSTER_NAMESPACE)


# --------------------------------------------------------------------------- Helm values vs the chart's schema


def _chart_validator() -> jsonschema.protocols.Validator:
    """The chart's schema, its dead Kubernetes-definitions URL served from kubernetes-validate's bundled copy.

    ``required`` is not checked: the file overlays the chart's defaults, and Helm validates the merged values.
    Everything else is: types, enums, and ``additionalProperties: false`` (a misspelled key fails).
    """
    schema = json.loads(CHART_SCHEMA.read_text())
    bundled = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S_VERSIONS[0]}-local-strict"
    defs = json.loads((bundled / "_definitions.json").read_text())["$defs"]
    k8s = Resource.from_contents({"$schema": "https://json-schema.org/draft/2020-12/schema",
                                  "definitions": defs, "$defs": defs})
    urls = set(re.findall(r'"\$ref": "(https://[^"#]+)#', CHART_SCHEMA.read_text()))
    assert urls == {"https://kubernetesjsonschema.dev/v1.18.0/_definitions.json"}
    registry = Registry().with_resources((url, k8s) for url in urls)
    overlay = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"required": lambda *_: None})
    return overlay(schema, registry=registry)


def _values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def test_helm_values_fit_the_chart_schema() -> None:
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _chart_validator().iter_errors(_values())]
    assert errors == []


@pytest.mark.parametrize("path, value", [
    (("dagsterDaemon", "runCordinator"), {"enabled": True}),                           # misspelled key
    (("runLauncher", "type"), "K8sRunLaucher"),                                          # not in the enum
    (("dagsterDaemon", "runRetries", "maxRetries"), "one"),                              # wrong type
    (("runLauncher", "config", "k8sRunLauncher", "jobNamspace"), "envloop"),             # misspelled key
    (("dagsterDaemon", "runCoordinator", "config", "queuedRunCoordinator", "maxConcurentRuns"), 4),
    (("dagster-user-deployments", "deployments", 0, "podSecurityContext", "runAsNonRot"), True),  # k8s fragment
])
def test_chart_schema_rejects_a_broken_value(path: tuple[Any, ...], value: Any) -> None:
    broken = _values()
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(_chart_validator().iter_errors(broken)), f"{path} = {value!r} passed"


def test_helm_values_wire_the_project_together() -> None:
    from envloop_pipelines.defs.rounds.assets import round_job
    from envloop_pipelines.names import GPU_POOL_TAG

    values = _values()
    (dep,) = values["dagster-user-deployments"]["deployments"]
    assert dep["dagsterApiGrpcArgs"] == ["-m", "envloop_pipelines.definitions"]
    assert dep["image"]["repository"] == IMAGE_REPOSITORY
    env = dep["env"]
    assert env["ENVLOOP_EXECUTOR"] == "k8s" and {"ENVLOOP_TASK", "ENVLOOP_RECIPE", "ENVLOOP_HOME"} <= set(env)
    assert dep["includeConfigInLaunchedRuns"] == {"enabled": True}  # the env reaches run and step pods
    run_config = values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    assert dep["resources"] == run_config["containerConfig"]["resources"]
    assert dep["podSecurityContext"] == run_config["podSpecConfig"]["securityContext"]
    assert dep["securityContext"] == run_config["containerConfig"]["securityContext"]
    mlflow = _doc("Service", "envloop-mlflow")
    namespace, port = mlflow["metadata"]["namespace"], mlflow["spec"]["ports"][0]["port"]
    assert env["MLFLOW_TRACKING_URI"] == f"http://envloop-mlflow.{namespace}.svc.cluster.local:{port}"
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    daemon = values["dagsterDaemon"]
    queue = daemon["runCoordinator"]["config"]["queuedRunCoordinator"]
    assert daemon["runCoordinator"]["type"] == "QueuedRunCoordinator" and queue["maxConcurrentRuns"] >= 1
    assert [t["key"] for t in queue["tagConcurrencyLimits"]] == [GPU_POOL_TAG] and GPU_POOL_TAG in round_job.tags
    assert daemon["runMonitoring"]["enabled"] is True and daemon["runRetries"]["enabled"] is True
    # Postgres: external, the Service and Secret of k8s/postgres.yaml.
    assert values["postgresql"]["enabled"] is False
    assert values["postgresql"]["postgresqlHost"].split(".")[0] == _doc("Service", "envloop-postgres")["metadata"]["name"]
    (postgres,) = _doc("StatefulSet", "envloop-postgres")["spec"]["template"]["spec"]["containers"]
    pg_env = {e["name"]: e for e in postgres["env"]}
    assert pg_env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": values["global"]["postgresqlSecretName"], "key": "postgresql-password"}
    assert pg_env["POSTGRES_USER"]["value"] == values["postgresql"]["postgresqlUsername"]
    # One service account, the subject of the sandbox RoleBinding; PVCs that exist.
    assert values["global"]["serviceAccountName"] == values["serviceAccount"]["name"] == DAGSTER_SERVICE_ACCOUNT
    claims = {v["persistentVolumeClaim"]["claimName"] for v in dep["volumes"]}
    assert claims <= {d["metadata"]["name"] for d in DOCUMENTS.values() if d["kind"] == "PersistentVolumeClaim"}


def _step_pod(asset: str) -> dict[str, Any]:
    """The Job ``k8s_job_executor`` builds for ``asset``: run launcher config, deployment env and volumes,
    then the asset's ``dagster-k8s/config`` merged over them (dagster_k8s's own merge and Job builder)."""
    import dagster as dg
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import (
        DagsterK8sJobConfig,
        UserDefinedDagsterK8sConfig,
        construct_dagster_k8s_job,
        get_user_defined_k8s_config,
    )
    from kubernetes.client import ApiClient

    from envloop_pipelines.definitions import defs as load_code_location
    defs = load_code_location()

    values = _values()
    (dep,) = values["dagster-user-deployments"]["deployments"]
    run_cfg = values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    context = K8sContainerContext(
        service_account_name=values["global"]["serviceAccountName"], volumes=dep["volumes"], volume_mounts=dep["volumeMounts"],
        env=[{"name": k, "value": v} for k, v in dep["env"].items()],
        run_k8s_config=UserDefinedDagsterK8sConfig.from_dict({"container_config": run_cfg["containerConfig"],
                                                              "pod_spec_config": run_cfg["podSpecConfig"]}),
    )
    tags = defs.get_repository_def().assets_defs_by_key[dg.AssetKey(asset)].op.tags
    context = context.merge(K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(tags)))
    job_config = DagsterK8sJobConfig(
        job_image=f"{IMAGE_REPOSITORY}:{dep['image']['tag']}", dagster_home="/opt/dagster/dagster_home",
        instance_config_map="dagster-instance", postgres_password_secret=values["global"]["postgresqlSecretName"])
    job = construct_dagster_k8s_job(
        job_config,
        args=["dagster", "api", "execute_step"], job_name=f"dagster-step-{asset.replace('_', '-')}",
        component="step_worker", user_defined_k8s_config=context.run_k8s_config,
    )
    manifest = ApiClient().sanitize_for_serialization(job)
    for version in K8S_VERSIONS:
        _validate(manifest, version)
    return manifest


def test_training_step_pod_from_the_values_and_op_tags_is_valid_and_gets_a_gpu() -> None:
    manifest = _step_pod("lora_checkpoint")
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}  # the op tags win over the run default
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["serviceAccountName"] == DAGSTER_SERVICE_ACCOUNT and pod["securityContext"]["runAsUser"] == RUN_AS_USER
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/envloop-home", "/models"}
    assert {"name": "ENVLOOP_EXECUTOR", "value": "k8s"} in container["env"]


LABEL_STEPS = ("task_benchmark", "noise_floor", "independent_reeval", "promotion_decision")


@pytest.mark.parametrize("asset", [*LABEL_STEPS, "lora_checkpoint", "baseline_eval", "training_dataset_snapshot"])
def test_only_the_steps_that_write_or_score_labels_mount_the_label_volume(asset: str) -> None:
    """Rule 4 on a cluster: the label store is its own volume, mounted over <ENVLOOP_HOME>/verifier in the
    steps that write or score labels and nowhere else (not the training step, not the inference server)."""
    values = _values()
    (dep,) = values["dagster-user-deployments"]["deployments"]
    pod = _step_pod(asset)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    label_path = f"{dep['env']['ENVLOOP_HOME']}/verifier"
    if asset in LABEL_STEPS:
        assert claims[mounts[label_path]] == "envloop-verifier", (claims, mounts)
        assert _doc("PersistentVolumeClaim", "envloop-verifier")["spec"]["accessModes"] == ["ReadWriteMany"]
        assert mounts[dep["env"]["ENVLOOP_HOME"]] == "envloop-home"  # the rest of the home as before
    else:
        assert "envloop-verifier" not in claims.values() and label_path not in mounts, (claims, mounts)


def test_nothing_else_mounts_the_label_volume() -> None:
    values = _values()
    (dep,) = values["dagster-user-deployments"]["deployments"]
    assert "envloop-verifier" not in {v["persistentVolumeClaim"]["claimName"] for v in dep["volumes"]}
    for doc in DOCUMENTS.values():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            volumes = doc["spec"]["template"]["spec"].get("volumes", [])
            assert all(v.get("persistentVolumeClaim", {}).get("claimName") != "envloop-verifier" for v in volumes), doc


# --------------------------------------------------------------------------- images and commands


def test_manifests_use_the_project_image_and_its_user() -> None:
    images = {c["image"] for d in DOCUMENTS.values() if d["kind"] in ("Deployment", "StatefulSet", "Job")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"postgres:17", f"{IMAGE_REPOSITORY}:0.1.0", f"{IMAGE_REPOSITORY}:0.1.0-cu128"}
    for kind, name in [("Deployment", "envloop-mlflow"), ("Deployment", "envloop-inference"), ("Job", "envloop-models-fill")]:
        assert _doc(kind, name)["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == RUN_AS_USER


def test_inference_serves_with_the_real_cli_on_its_health_endpoint(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from envloop_pipelines.cli import main

    deployment = _doc("Deployment", "envloop-inference")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["envloop", "serve"]
    args = [a.replace("$(ENVLOOP_TASK)", "personal_agent") for a in container["args"]]
    port = int(args[args.index("--port") + 1])
    assert container["ports"][0] == {"name": "http", "containerPort": port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    service = _doc("Service", "envloop-inference")
    assert service["spec"]["ports"][0]["port"] == port
    # The real CLI parses these arguments: with an empty home it stops at "no releases yet" (exit 2).
    home = str(tmp_path / "envloop-home")
    result = CliRunner().invoke(main, ["serve", *[home if a == "/envloop-home" else a for a in args]],
                                env={"ENVLOOP_SERVE_KEYS": "k"})
    assert result.exit_code == 2 and "has no releases yet" in result.output, result.output


def test_mlflow_server_command_and_probes() -> None:
    (container,) = _doc("Deployment", "envloop-mlflow")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert container["command"] == ["mlflow", "server"]
    assert args[args.index("--backend-store-uri") + 1].startswith("postgresql://mlflow:$(MLFLOW_DB_PASSWORD)@envloop-postgres.")
    assert args[args.index("--artifacts-destination") + 1] == "/mlartifacts" and "--serve-artifacts" in args
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "5000"
    assert "envloop-mlflow.envloop.svc.cluster.local:5000" in args[args.index("--allowed-hosts") + 1].split(",")
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "envloop-mlflow-postgresql"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/mlartifacts"}
