"""deploy/helm/verst, rendered by a real Helm (deploy/helm/render.py) and checked without a cluster:
every object against the Kubernetes schemas of KUBE_VERSION (kubernetes-validate), and the wiring
between them (selectors, Secrets, settings, probes, ports) against the services' own code."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "verst"
RENDER = ROOT / "deploy" / "helm" / "render.py"
COMPOSE = ROOT / "compose" / "docker-compose.yml"
SHARED_ENV = {"REDIS_URL", "VERST_LOG_LEVEL"}
# the process each `python -m` module is, and the modules whose settings it reads
SETTINGS_MODULES = {
    "services.api": ["services.api.config"],
    "services.controller": ["services.controller.config"],
    "services.router": ["services.router.config"],
    "services.rollout": ["services.rollout.config"],
    "services.runner": ["services.runner.config"],
    "services.reward": ["services.reward.config"],
    "services.trainer": ["services.trainer.config"],
    "services.trainer.launch": ["services.trainer.config", "services.trainer.launch"],
}
# compose service -> chart component
COMPOSE_COMPONENTS = {
    "api": "api",
    "controller": "controller",
    "router": "router",
    "engine": "engine",
    "runner": "runner",
    "reward": "reward",
    "trainer": "trainer",
}

Rendered = tuple[str, list[dict[str, Any]]]
"""A variant's name and the objects its values render."""

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu": {
        "engine": {"replicas": 4, "gpu": {"enabled": True, "count": 2}},
        "trainer": {"procsPerNode": 4, "gpu": {"enabled": True}},
    },
    "external-redis": {
        "redis": {"enabled": False, "external": {"existingSecret": "my-redis", "urlKey": "url"}},
        "apiToken": {"existingSecret": "my-token", "key": "token"},
    },
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "multi-node": {"trainer": {"trainers": 2, "nodesPerTrainer": 2, "weightTransport": "distributed"}},
    "external-reward": {
        "reward": {"enabled": False, "externalAddress": "scorer.tools.svc:50053"},
        "runner": {"env": {"VERST_RUNNER_MAX_CONCURRENT_GROUPS": 64}},
        "redis": {"password": {"existingSecret": "my-redis-password", "key": "password"}},
    },
}


def load_render() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verst_helm_render", RENDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_module = load_render()


@pytest.fixture(scope="module")
def values_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("values")
    for name, values in VARIANTS.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(values))
    return folder


@cache
def rendered(variant: str, values_file: Path) -> tuple[dict[str, Any], ...]:
    return tuple(render_module.render(CHART, [values_file]))


@pytest.fixture(params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, values_dir: Path) -> Rendered:
    name = request.param
    return name, list(rendered(name, values_dir / f"{name}.yaml"))


def defaults() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def merged(variant: str) -> dict[str, Any]:
    """values.yaml with the variant's values over it (as Helm merges them)."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and key in out else value
        return out

    return merge(defaults(), VARIANTS[variant])


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment and StatefulSet."""
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(w["metadata"]["name"], c) for w, pod in pod_specs(objects) for c in pod["spec"]["containers"]]


def verst_containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, c) for name, c in containers(objects) if c["name"] != "redis"]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)} rendered"
    return hits[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def settings_env_names(cls: type[BaseSettings]) -> set[str]:
    env_name = getattr(cls, "env_name", None)  # ServiceSettings and the launcher's settings have one
    if callable(env_name):
        return {env_name(field) for field in cls.model_fields}
    prefix = str(cls.model_config.get("env_prefix", ""))
    return {f"{prefix}{field}".upper() for field in cls.model_fields}


def known_env(module: str) -> set[str]:
    names = set(SHARED_ENV)
    for config in SETTINGS_MODULES[module]:
        for value in vars(importlib.import_module(config)).values():
            # only the module's own classes: an imported base (ServiceSettings) has another prefix
            if isinstance(value, type) and issubclass(value, BaseSettings) and value.__module__ == config:
                names |= settings_env_names(value)
    return names


def python_module(container: dict[str, Any]) -> str:
    command = container["command"]
    assert command[:2] == ["python", "-m"] and len(command) == 3, command
    return command[2]


# -- the chart and its values -------------------------------------------------------------------


def test_values_match_the_schema_and_helm_lints_them(values_dir: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    for name in VARIANTS:
        jsonschema.validate(merged(name), schema)
        report = render_module.lint(CHART, [values_dir / f"{name}.yaml"])
        assert "0 chart(s) failed" in report, report


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"redis": {"maxmemoryPolicy": "allkeys-lru"}}, "maxmemoryPolicy"),
        ({"reward": {"enabled": False}}, "externalAddress"),
        ({"redis": {"enabled": False}}, "existingSecret"),
        ({"trainer": {"nodesPerTrainer": 0}}, "nodesPerTrainer"),
        ({"engine": {"env": {"ENGINE_PORT": "1"}}}, "ENGINE_PORT"),
        ({"apiToken": {"value": "short"}}, "value"),
    ],
)
def test_the_schema_refuses_bad_values(values: dict[str, Any], says: str, tmp_path: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    candidate = {**defaults(), **{k: {**defaults()[k], **v} for k, v in values.items()}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(candidate, schema)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(render_module.HelmError, match=says):
        render_module.render(CHART, [path])


def test_a_grace_period_shorter_than_a_step_is_refused() -> None:
    with pytest.raises(render_module.HelmError, match=r"trainer\.terminationGracePeriodSeconds"):
        render_module.render(CHART, set_values=["trainer.terminationGracePeriodSeconds=10"])


def test_the_command_line_renders(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(RENDER), str(CHART), "-f", str(CHART / "values.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(done.stdout) if doc}
    assert {"Deployment", "StatefulSet", "Service", "Secret", "PersistentVolumeClaim"} <= kinds


# -- every object is valid Kubernetes -----------------------------------------------------------


def test_every_object_is_valid_for_the_pinned_kubernetes(variant: Rendered) -> None:
    _, objects = variant
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_service_monitor_scrapes_every_metrics_port
        kubernetes_validate.validate(obj, render_module.KUBE_VERSION, strict=True)


def test_names_are_unique_and_env_is_set_once(variant: Rendered) -> None:
    _, objects = variant
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys)), keys
    for workload, container in containers(objects):
        names = [entry["name"] for entry in container.get("env", [])]
        assert len(names) == len(set(names)), f"{workload} sets a variable twice: {names}"


def test_a_long_release_name_still_fits_dns_labels() -> None:
    objects = render_module.render(CHART, release="r" * 53)
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    trainer = next(o for o in objects if o["kind"] == "StatefulSet" and "trainer" in o["metadata"]["name"])
    pod = f"{trainer['metadata']['name']}-999"  # a pod's hostname is a DNS label too
    assert len(pod) <= 63, pod


# -- wiring ---------------------------------------------------------------------------------------


def test_every_service_selects_a_pod_template_and_its_ports(
    variant: Rendered,
) -> None:
    _, objects = variant
    pods = pod_specs(objects)
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        matching = [pod for _, pod in pods if selector.items() <= pod["metadata"]["labels"].items()]
        name = service["metadata"]["name"]
        assert len(matching) == 1, f"Service {name} selects {len(matching)} pod templates"
        ports = {p["name"] for c in matching[0]["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{name}: {port['targetPort']}"
    for workload, pod in pods:
        labels = workload["spec"]["selector"]["matchLabels"]
        assert labels.items() <= pod["metadata"]["labels"].items()


def test_every_secret_reference_exists(variant: Rendered) -> None:
    name, objects = variant
    values = merged(name)
    provided = {
        (s["metadata"]["name"], key) for s in objects if s["kind"] == "Secret" for key in s.get("data", {})
    }
    # Secrets the user brings (documented in values.yaml as existingSecret)
    for existing, key in [
        (values["apiToken"]["existingSecret"], values["apiToken"]["key"]),
        (values["redis"]["password"]["existingSecret"], values["redis"]["password"]["key"]),
        (values["redis"]["external"]["existingSecret"], values["redis"]["external"]["urlKey"]),
    ]:
        if existing:
            provided.add((existing, key))
    refs = [
        (entry["valueFrom"]["secretKeyRef"]["name"], entry["valueFrom"]["secretKeyRef"]["key"])
        for _, container in containers(objects)
        for entry in container.get("env", [])
        if "secretKeyRef" in entry.get("valueFrom", {})
    ]
    assert refs
    missing = set(refs) - provided
    assert not missing, f"env refers to Secret keys nobody provides: {sorted(missing)}"


def test_every_verst_variable_is_a_settings_field(variant: Rendered) -> None:
    _, objects = variant
    for workload, container in verst_containers(objects):
        module = python_module(container)
        names = {n for n in env_of(container) if n.startswith("VERST_") or n == "REDIS_URL"}
        unknown = names - known_env(module)
        assert not unknown, f"{workload} sets variables `{module}` does not read: {sorted(unknown)}"


def test_commands_are_real_entry_points(variant: Rendered) -> None:
    _, objects = variant
    for workload, container in verst_containers(objects):
        module = python_module(container)
        assert module in SETTINGS_MODULES, f"{workload}: {module}"
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{workload}: no module {module}"
        if spec.submodule_search_locations is not None:
            assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module} has no __main__"


def test_probes_target_declared_ports(variant: Rendered) -> None:
    _, objects = variant
    for workload, container in containers(objects):
        ports = container.get("ports", [])
        numbers = {p["containerPort"] for p in ports}
        names = {p["name"] for p in ports}
        probes = [container[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container]
        for probe in probes:
            if "grpc" in probe:
                assert probe["grpc"]["port"] in numbers, f"{workload}: gRPC probe on an undeclared port"
            for kind in ("httpGet", "tcpSocket"):
                if kind in probe:
                    assert probe[kind]["port"] in names | numbers, f"{workload}: {kind} probe port"


def test_grpc_services_listen_where_they_are_probed(variant: Rendered) -> None:
    """Each gRPC service's VERST_*_PORT is its `grpc` port, which its probes check (the trainer's
    followers serve none, so multi-node trainers carry no probes)."""
    name, objects = variant
    for workload, container in verst_containers(objects):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = env_of(container)
        port_vars = [n for n in env if n.endswith("_PORT") and n.startswith("VERST_") and "METRICS" not in n]
        listen = next(n for n in port_vars if n.count("_") == 2)  # VERST_<SERVICE>_PORT
        declared = ports.get("grpc", ports.get("http"))
        assert int(env[listen]["value"]) == declared, f"{workload}: {listen}"
        metrics = [n for n in env if n.endswith("_METRICS_PORT")]
        for var in metrics:
            assert int(env[var]["value"]) == ports["metrics"], f"{workload}: {var}"
        multi_node = workload.endswith("-trainer") and merged(name)["trainer"]["nodesPerTrainer"] > 1
        assert ("readinessProbe" in container) != multi_node, workload
        if "grpc" in ports and not multi_node:
            assert container["readinessProbe"]["grpc"]["port"] == ports["grpc"]
            assert container["livenessProbe"]["grpc"]["port"] == ports["grpc"]


def test_the_chart_sets_what_compose_sets() -> None:
    """No VERST_* variable of a compose service is forgotten here (compose/docker-compose.yml)."""
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    objects = render_module.render(CHART)
    by_component = {
        w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: c
        for w, pod in pod_specs(objects)
        for c in pod["spec"]["containers"]
    }
    optional = {"VERST_TRAINER_WEIGHT_TRANSPORT_HOST"}  # only with weightTransport distributed
    for service, component in COMPOSE_COMPONENTS.items():
        # compose reads secrets from files (X_FILE); the chart sets X from a Secret, and puts the
        # Redis password into REDIS_URL
        expected = {name.removesuffix("_FILE") for name in compose[service]["environment"]} - optional
        expected = {"REDIS_URL" if name == "VERST_REDIS_PASSWORD" else name for name in expected}
        missing = expected - set(env_of(by_component[component]))
        assert not missing, f"{component} lacks {sorted(missing)} that compose sets"


# -- what each component needs ------------------------------------------------------------------


def test_one_controller_and_an_api_that_runs_none() -> None:
    objects = render_module.render(CHART, set_values=["api.replicas=3"])
    controller = find(objects, "Deployment", "verst-controller")
    assert controller["spec"]["replicas"] == 1
    assert controller["spec"]["strategy"]["type"] == "Recreate"  # never two during an upgrade
    api = find(objects, "Deployment", "verst-api")
    assert api["spec"]["replicas"] == 3
    env = env_of(api["spec"]["template"]["spec"]["containers"][0])
    assert env["VERST_API_CONTROLLER"]["value"] == "false"
    assert "secretKeyRef" in env["VERST_API_TOKEN"]["valueFrom"]


def test_engines_scale_and_advertise_their_pod_ip(values_dir: Path) -> None:
    objects = list(rendered("gpu", values_dir / "gpu.yaml"))
    engine = find(objects, "Deployment", "verst-engine")
    assert engine["spec"]["replicas"] == 4
    container = engine["spec"]["template"]["spec"]["containers"][0]
    env = list(env_of(container))
    pod_ip = env_of(container)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert pod_ip == "status.podIP"
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert env_of(container)["VERST_ENGINE_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{grpc_port}"
    assert env.index("POD_IP") < env.index("VERST_ENGINE_ADVERTISE_ADDRESS")  # Kubernetes expands in order


def test_gpus_are_requested_only_when_asked(values_dir: Path) -> None:
    cpu = list(rendered("default", values_dir / "default.yaml"))
    for _, container in verst_containers(cpu):
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    gpu = list(rendered("gpu", values_dir / "gpu.yaml"))
    engine = find(gpu, "Deployment", "verst-engine")["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert engine["resources"]["limits"]["memory"] == defaults()["engine"]["resources"]["limits"]["memory"]
    trainer = find(gpu, "StatefulSet", "verst-trainer")["spec"]["template"]["spec"]["containers"][0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 4  # one per process
    assert env_of(trainer)["VERST_TRAINER_PROCS_PER_NODE"]["value"] == "4"


def test_trainer_ranks_meet_through_the_headless_service(values_dir: Path) -> None:
    objects = list(rendered("multi-node", values_dir / "multi-node.yaml"))
    trainer = find(objects, "StatefulSet", "verst-trainer")
    spec = trainer["spec"]
    assert spec["replicas"] == 4  # 2 trainers x 2 nodes
    assert spec["podManagementPolicy"] == "Parallel"
    headless = find(objects, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # ranks meet before any is ready
    container = spec["template"]["spec"]["containers"][0]
    assert python_module(container) == "services.trainer.launch"
    env = env_of(container)
    index = env["VERST_TRAINER_POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["VERST_TRAINER_NODES"]["value"] == "2"
    host = env["VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE"]["value"].format(index=2)
    assert host == f"verst-trainer-2.{headless['metadata']['name']}.verst.svc"  # pod 2's DNS name
    rendezvous = int(env["VERST_TRAINER_RENDEZVOUS_PORT"]["value"])
    assert rendezvous in {p["port"] for p in headless["spec"]["ports"]}
    assert rendezvous in {p["containerPort"] for p in container["ports"]}
    assert env["VERST_TRAINER_WEIGHT_TRANSPORT_HOST"]["value"] == "$(POD_IP)"
    grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= defaults()["trainer"]["longestStepSeconds"]


def test_in_chart_redis_keeps_every_entry(values_dir: Path) -> None:
    objects = list(rendered("default", values_dir / "default.yaml"))
    redis = find(objects, "StatefulSet", "verst-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--maxmemory") + 1] == defaults()["redis"]["maxmemory"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "secretKeyRef" in env_of(container)["REDIS_PASSWORD"]["valueFrom"]
    claims = redis["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == [m["name"] for m in container["volumeMounts"]]
    service = find(objects, "Service", "verst-redis")
    for workload, verst in verst_containers(objects):
        env = list(env_of(verst))
        url = env_of(verst)["REDIS_URL"]["value"]
        assert url == "redis://:$(REDIS_PASSWORD)@verst-redis:6379/0", workload
        assert env.index("REDIS_PASSWORD") < env.index("REDIS_URL"), workload
    assert [p["port"] for p in service["spec"]["ports"]] == [6379]


def test_external_redis_comes_from_its_secret(values_dir: Path) -> None:
    objects = list(rendered("external-redis", values_dir / "external-redis.yaml"))
    assert not [o for o in objects if "redis" in o["metadata"]["name"]]
    assert not [o for o in objects if o["kind"] == "Secret"]  # both credentials are the user's
    for workload, container in verst_containers(objects):
        ref = env_of(container)["REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "my-redis", "key": "url"}, workload
        assert "REDIS_PASSWORD" not in env_of(container)


def test_an_external_reward_service_replaces_the_deployment(values_dir: Path) -> None:
    objects = list(rendered("external-reward", values_dir / "external-reward.yaml"))
    assert not [o for o in objects if o["metadata"]["name"] == "verst-reward"]
    for workload, container in verst_containers(objects):
        for name, entry in env_of(container).items():
            if name.endswith("_REWARD_ADDRESS"):
                assert entry["value"] == "scorer.tools.svc:50053", workload
    runner = find(objects, "Deployment", "verst-runner")["spec"]["template"]["spec"]["containers"][0]
    assert env_of(runner)["VERST_RUNNER_MAX_CONCURRENT_GROUPS"]["value"] == "64"


def test_a_reward_image_of_ones_own(tmp_path: Path) -> None:
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump({"reward": {"image": {"repository": "me/scorer", "tag": "2"}}}))
    objects = render_module.render(CHART, [path])
    reward = find(objects, "Deployment", "verst-reward")["spec"]["template"]["spec"]["containers"][0]
    assert reward["image"] == "me/scorer:2"
    assert find(objects, "Deployment", "verst-router")["spec"]["template"]["spec"]["containers"][0][
        "image"
    ] == ("verst:" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def test_every_verst_pod_shares_the_checkpoint_volume(values_dir: Path) -> None:
    objects = list(rendered("default", values_dir / "default.yaml"))
    claim = find(objects, "PersistentVolumeClaim", "verst-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "storageClassName" not in claim["spec"]  # empty: the cluster's default
    for workload, pod in pod_specs(objects):
        if workload["metadata"]["name"] == "verst-redis":
            continue
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "verst-checkpoints"
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["checkpoints"] == "/data"
    classed = render_module.render(CHART, set_values=["checkpoints.storageClass=nfs-client"])
    assert (
        find(classed, "PersistentVolumeClaim", "verst-checkpoints")["spec"]["storageClassName"]
        == "nfs-client"
    )


def test_service_monitor_scrapes_every_metrics_port(values_dir: Path) -> None:
    assert not [o for o in rendered("default", values_dir / "default.yaml") if o["kind"] == "ServiceMonitor"]
    objects = list(rendered("monitoring", values_dir / "monitoring.yaml"))
    monitor = find(objects, "ServiceMonitor", "verst")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    assert spec["namespaceSelector"] == {"matchNames": ["verst"]}
    endpoints = {e["port"]: e for e in spec["endpoints"]}
    assert all(e["path"] == "/metrics" and e["interval"] == "30s" for e in endpoints.values())
    scraped = set()
    for service in (o for o in objects if o["kind"] == "Service"):
        labels = service["metadata"]["labels"]
        if not spec["selector"]["matchLabels"].items() <= labels.items():
            continue
        (rule,) = spec["selector"]["matchExpressions"]
        if labels.get(rule["key"]) not in rule["values"]:
            continue
        ports = {p["name"] for p in service["spec"]["ports"]} & set(endpoints)
        assert ports, f"{service['metadata']['name']} is selected but exposes no scraped port"
        scraped.add(labels["app.kubernetes.io/component"])
    assert scraped == {"api", "controller", "router", "engine", "runner", "reward", "trainer"}
