"""The KubeRay manifests (k8s/) and the Dockerfile of the image they name.

Ray resources are checked against the KubeRay CRD schemas in ../shared/schemas/kuberay/ made
strict (unknown fields rejected), core kinds with kubernetes-validate; the head's `vericache serve`
command line is parsed by the CLI itself; the Dockerfile installs what the Makefile and
pyproject.toml do.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import string
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.specifiers import SpecifierSet

from vericache.cli.main import build_parser
from vericache.cli.serve import access_from_args, coordinator_config, worker_configs
from vericache.errors import InvalidRequestError
from vericache.serve.front.api import SERVICE_NAME
from vericache.serve.launch.cluster import DRAFTER_RESOURCE, VERIFIER_RESOURCE

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
SCHEMAS = ROOT.parent / "shared" / "schemas" / "kuberay"
CRD_SCHEMAS = {"RayCluster": "raycluster-v1.json", "RayService": "rayservice-v1.json"}
KUBERNETES_VERSION = "1.33.0"  # gRPC probes are GA since 1.27
IMAGE = "vericache"


def load_manifests() -> dict[str, list[dict]]:
    """File name -> its documents, for every manifest the kustomization could list."""
    files = sorted(K8S.glob("*.yaml"))
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in files}


MANIFESTS = load_manifests()
# Applied on its own (`kubectl apply -f`), not by the kustomization: test_k8s_rayservice.py.
RAYSERVICE_FILE = "rayservice.yaml"
DOCS = [
    doc
    for name, docs in MANIFESTS.items()
    if name not in ("kustomization.yaml", RAYSERVICE_FILE)
    for doc in docs
]


def only(kind: str) -> dict:
    found = [doc for doc in DOCS if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


CLUSTER = only("RayCluster")
HEAD_POD = CLUSTER["spec"]["headGroupSpec"]["template"]["spec"]
HEAD = HEAD_POD["containers"][0]
WORKER_GROUPS = {g["groupName"]: g for g in CLUSTER["spec"]["workerGroupSpecs"]}
SETTINGS = only("ConfigMap")["data"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def strict(schema):
    """The schema with `additionalProperties: false` on every object schema that lists
    properties and does not preserve unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(kind: str, is_strict: bool = True) -> jsonschema.Validator:
    path = SCHEMAS / CRD_SCHEMAS[kind]
    if not path.is_file():
        pytest.skip(f"the KubeRay CRD schemas are not in {SCHEMAS}")
    schema = json.loads(path.read_text())
    return jsonschema.Draft7Validator(strict(schema) if is_strict else schema)


def crd_errors(doc: dict, is_strict: bool = True) -> list[str]:
    # The CRD schema covers apiVersion, kind, metadata and spec as the API server sees them.
    errors = crd_validator(doc["kind"], is_strict).iter_errors(doc)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def all_groups() -> list[dict]:
    return [CLUSTER["spec"]["headGroupSpec"], *WORKER_GROUPS.values()]


def ray_resources(group: dict) -> dict[str, float]:
    """The custom resources a group's `ray start --resources` offers (one shell word of JSON)."""
    value = group.get("rayStartParams", {}).get("resources")
    if value is None:
        return {}
    (word,) = shlex.split(value)
    return json.loads(word)


def port_named(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p.get("name") == name]
    return port


def serve_argv() -> list[str]:
    """The head's `vericache serve ...` command line, with the ConfigMap's values substituted."""
    script = HEAD["args"][0].replace("\\\n", " ")
    (line,) = [s.strip() for s in script.splitlines() if "vericache serve" in s]
    words = shlex.split(line.removeprefix("exec "))
    return [string.Template(w).substitute(SETTINGS) for w in words[1:]]


def test_kustomization_lists_every_manifest():
    (kustomization,) = MANIFESTS["kustomization.yaml"]
    listed = kustomization["resources"]
    assert sorted(listed) == sorted(set(MANIFESTS) - {"kustomization.yaml", RAYSERVICE_FILE})
    assert len(listed) == len(set(listed))


def test_no_secret_is_committed():
    assert not [doc for doc in DOCS if doc["kind"] == "Secret"]


@pytest.mark.parametrize(
    "doc", [d for d in DOCS if d["kind"] in CRD_SCHEMAS], ids=lambda d: d["kind"]
)
def test_ray_resources_match_the_crd_schema_strictly(doc):
    assert doc["apiVersion"] == "ray.io/v1"
    assert crd_errors(doc) == []


def test_strict_schema_rejects_unknown_fields():
    broken = copy.deepcopy(CLUSTER)
    broken["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    broken["spec"]["workerGroupSpecs"][0]["replica"] = 1
    assert crd_errors(broken, is_strict=False) == []  # the CRD alone lets them through
    errors = crd_errors(broken)
    assert any("readinesProbe" in e for e in errors) and any("'replica'" in e for e in errors)


def test_ray_start_params_are_strings():
    for group in all_groups():
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), params
        assert all(isinstance(v, str) for v in group.get("resources", {}).values())
    broken = copy.deepcopy(CLUSTER)
    broken["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert crd_errors(broken)


def test_worker_groups_offer_vericache_resources_on_gpus():
    assert ray_resources(WORKER_GROUPS["verifiers"]) == {VERIFIER_RESOURCE: 1}
    assert ray_resources(WORKER_GROUPS["drafters"]) == {DRAFTER_RESOURCE: 1}
    assert ray_resources(CLUSTER["spec"]["headGroupSpec"]) == {}
    for group in WORKER_GROUPS.values():
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1, group["groupName"]


@pytest.mark.parametrize(
    ("resource", "setting"),
    [(VERIFIER_RESOURCE, "VERICACHE_VERIFIERS"), (DRAFTER_RESOURCE, "VERICACHE_DRAFTERS")],
)
def test_actor_counts_match_the_worker_groups(resource, setting):
    offered = 0
    for group in WORKER_GROUPS.values():
        # The coordinator's actor count is fixed at start: the groups do not scale.
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        offered += group["replicas"] * ray_resources(group).get(resource, 0)
    assert int(SETTINGS[setting]) == offered


def test_head_runs_vericache_serve_with_valid_options():
    args = build_parser().parse_args(serve_argv())  # an unknown flag exits
    assert args.command == "serve" and args.address == "auto" and args.host == "0.0.0.0"
    assert args.port == port_named(HEAD, "grpc")
    coordinator_config(args)  # values in range
    verifier, _ = worker_configs(args)  # sizes parse
    assert args.verifiers == int(SETTINGS["VERICACHE_VERIFIERS"])
    # The verifier actors' --root is the store volume of the verifiers' pods.
    pod = WORKER_GROUPS["verifiers"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == str(args.root)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = only("PersistentVolumeClaim")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    if WORKER_GROUPS["verifiers"]["replicas"] > 1:  # verifiers share one root
        assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert str(verifier.root) == str(args.root)


def test_head_command_settings_all_come_from_the_configmap():
    env = {e["name"] for e in HEAD.get("env", [])}
    used = set(re.findall(r"\$\{?(VERICACHE_\w+)", HEAD["args"][0]))
    assert used <= set(SETTINGS) | env
    assert [s["configMapRef"]["name"] for s in HEAD["envFrom"]] == [
        only("ConfigMap")["metadata"]["name"]
    ]


def test_service_is_headless_on_the_grpc_port():
    service = only("Service")
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    target = port["targetPort"]
    container_port = port_named(HEAD, target) if isinstance(target, str) else target
    assert port["port"] == container_port == port_named(HEAD, "grpc")
    assert service["spec"]["selector"] == {
        "ray.io/cluster": CLUSTER["metadata"]["name"],
        "ray.io/node-type": "head",
    }


def test_probes_use_grpc_health_on_the_plaintext_health_port():
    # Kubelet's gRPC probes cannot speak TLS: they use the health-only port, never the API's.
    args = build_parser().parse_args(serve_argv())
    health_port = port_named(HEAD, "health")
    assert args.health_port == health_port != port_named(HEAD, "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(HEAD[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert HEAD[probe]["grpc"]["port"] == health_port, probe
    assert HEAD["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_metrics_port_is_served_declared_and_annotated():
    args = build_parser().parse_args(serve_argv())
    annotations = CLUSTER["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert args.metrics_port == port_named(HEAD, "metrics")
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    assert annotations["prometheus.io/scrape"] == "true"


def test_api_keys_and_tls_come_from_optional_secrets():
    secrets = {v["name"]: v["secret"] for v in HEAD_POD["volumes"] if "secret" in v}
    assert {"vericache-api-keys", "vericache-tls"} == {s["secretName"] for s in secrets.values()}
    assert all(s["optional"] for s in secrets.values())  # the cluster starts without them
    mounts = {m["name"]: m["mountPath"] for m in HEAD["volumeMounts"]}
    secret_dirs = [mounts[name] for name in secrets]
    env = {e["name"]: e["value"] for e in HEAD["env"]}
    paths = [value for name, value in env.items() if name.endswith("_FILE")]
    assert len(paths) == 3
    # The names `vericache serve` reads: without the keys file it refuses to start.
    args = build_parser().parse_args(serve_argv())
    assert not args.insecure_no_auth and args.api_keys_file is None
    with pytest.raises(InvalidRequestError, match="does not exist"):
        access_from_args(args, env)
    assert all(any(p.startswith(d + "/") for d in secret_dirs) for p in paths), paths


def test_core_kinds_are_valid_kubernetes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    core = [doc for doc in DOCS if doc["kind"] not in CRD_SCHEMAS]
    assert {doc["kind"] for doc in core} >= {"Service", "ConfigMap"}
    # Ray pod templates too, as the PodTemplates KubeRay makes pods from.
    for group in all_groups():
        core.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                     "template": group["template"]})  # fmt: skip
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(only("Service"))
    broken["spec"]["ports"][0]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_ray_version_is_the_serve_extra_pin():
    (ray,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["serve"] if "ray" in r[:4]]
    assert ray.split("==")[1] == CLUSTER["spec"]["rayVersion"]


def test_every_container_runs_the_built_image():
    version = PYPROJECT["project"]["version"]
    images = [c["image"] for g in all_groups() for c in g["template"]["spec"]["containers"]]
    assert set(images) == {f"{IMAGE}:{version}"}
    (kustomization,) = MANIFESTS["kustomization.yaml"]
    (image,) = kustomization["images"]
    assert image["name"] == IMAGE and image["newTag"] == version


# --- the Dockerfile -------------------------------------------------------------------------

DOCKERFILE = (ROOT / "Dockerfile").read_text()
DOCKER_ARGS = {
    m[1]: " ".join(shlex.split(m[2])) for m in re.finditer(r"^ARG (\w+)=(.*)$", DOCKERFILE, re.M)
}


def makefile_value(name: str) -> str:
    (value,) = re.findall(rf"^{name} [:?]?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    return value.strip()


def test_dockerfile_installs_the_makefile_pins():
    assert DOCKER_ARGS["TORCH_SPEC"] == makefile_value("TORCH_SPEC")
    assert DOCKER_ARGS["NO_DEPS_PACKAGES"].split() == makefile_value("NO_DEPS_PACKAGES").split()
    assert re.search(r"pip install \$\{TORCH_SPEC\} --index-url \$\{TORCH_INDEX\}", DOCKERFILE)
    assert "/whl/cu" in DOCKER_ARGS["TORCH_INDEX"]  # the CUDA build
    assert "pip install --no-deps ${NO_DEPS_PACKAGES}" in DOCKERFILE
    assert re.search(r"^FROM nvidia/cuda:\S+$", DOCKERFILE, re.M)


def test_dockerfile_extras_and_python_fit_pyproject():
    extras = DOCKER_ARGS["EXTRAS"].split(",")
    assert {"serve", "gguf"} <= set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert 'pip install ".[${EXTRAS}]"' in DOCKERFILE
    python = DOCKER_ARGS["PYTHON_VERSION"]
    assert python == "3.11" and SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(
        python + ".0"
    )


def test_dockerfile_copies_what_the_package_is_built_from():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert ".venv" in ignored and ".git" in ignored
    package_dirs = {"vericache", *PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    copied = {
        w for m in re.finditer(r"^COPY (?!--)(.+) \S+$", DOCKERFILE, re.M) for w in m[1].split()
    }
    needed = package_dirs | {"pyproject.toml", PYPROJECT["project"]["readme"]}
    assert needed <= copied
    assert not needed & ignored


def test_dockerfile_bakes_the_configured_model_and_serves_the_api_port():
    assert DOCKER_ARGS["MODEL"] == SETTINGS["VERICACHE_MODEL"]
    assert (
        re.search(r"^ENV VERICACHE_CACHE=(\S+)$", DOCKERFILE, re.M)[1]
        == SETTINGS["VERICACHE_CACHE"]
    )
    (exposed,) = re.findall(r"^EXPOSE (\d+)$", DOCKERFILE, re.M)
    assert int(exposed) == port_named(HEAD, "grpc")
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", DOCKERFILE, re.M)[1])
    command = json.loads(re.search(r"^CMD (.+)$", DOCKERFILE, re.M)[1])
    assert entrypoint == ["vericache"]
    args = build_parser().parse_args(command)
    assert args.local and args.port == int(exposed) and args.host == "0.0.0.0"


def test_dockerfile_builds_the_cpu_kernels_as_make_install_does():
    build = "python -m vericache.kernels.cpu_build"
    assert build in (ROOT / "Makefile").read_text().replace("$(PY)", "python")
    assert re.search(rf"^RUN .*{re.escape(build)}", DOCKERFILE, re.M)
    (folder,) = re.findall(r"^ENV TORCH_EXTENSIONS_DIR=(\S+)$", DOCKERFILE, re.M)
    assert re.search(rf"chown -R vericache .*{re.escape(folder)}", DOCKERFILE)  # its user may build
    assert re.search(r"apt-get install .* g\+\+", DOCKERFILE)
