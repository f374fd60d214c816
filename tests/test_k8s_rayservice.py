"""k8s/rayservice.yaml: the RayService checked strictly against KubeRay's CRD schema, its Serve
config against Ray Serve's own schema, and its application's args by the application's parser;
the replica pinned to the head whose ports the Services expose; worker probes that do not wait for
a Serve proxy the workers never run."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.test_k8s_manifests import (
    IMAGE,
    KUBERNETES_VERSION,
    MANIFESTS,
    PYPROJECT,
    RAYSERVICE_FILE,
    crd_errors,
    port_named,
    ray_resources,
)
from vericache.cli.ray_serve import DEPLOYMENT_NAME, build, parse_options
from vericache.cli.serve import access_from_args
from vericache.errors import InvalidRequestError
from vericache.serve.launch.cluster import DRAFTER_RESOURCE, VERIFIER_RESOURCE

serve_schema = pytest.importorskip("ray.serve.schema")

DOCS = {doc["kind"]: doc for doc in MANIFESTS[RAYSERVICE_FILE]}
SERVICE = DOCS["RayService"]
CLUSTER = SERVICE["spec"]["rayClusterConfig"]
HEAD_GROUP = CLUSTER["headGroupSpec"]
HEAD = HEAD_GROUP["template"]["spec"]["containers"][0]
WORKER_GROUPS = {g["groupName"]: g for g in CLUSTER["workerGroupSpecs"]}
SERVE_CONFIG = yaml.safe_load(SERVICE["spec"]["serveConfigV2"])
(APPLICATION,) = SERVE_CONFIG["applications"]
ARGS = APPLICATION["args"]


def test_the_file_holds_the_rayservice_and_its_store():
    assert [doc["kind"] for doc in MANIFESTS[RAYSERVICE_FILE]] == [
        "PersistentVolumeClaim",
        "RayService",
    ]


def test_rayservice_matches_the_crd_schema_strictly():
    assert crd_errors(SERVICE) == []
    broken = copy.deepcopy(SERVICE)
    broken["spec"]["serveConfig"] = SERVICE["spec"]["serveConfigV2"]  # the old field's name
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert crd_errors(broken, is_strict=False)  # a number where KubeRay wants a string
    assert any("'serveConfig'" in e for e in crd_errors(broken))


def unknown_serve_keys(config: dict) -> list[str]:
    """Keys Ray Serve's schema does not define, at every level it ignores them at."""
    unknown = set(config) - set(serve_schema.ServeDeploySchema.model_fields)
    for app in config["applications"]:
        unknown |= set(app) - set(serve_schema.ServeApplicationSchema.model_fields)
        for deployment in app.get("deployments", []):
            unknown |= set(deployment) - set(serve_schema.DeploymentSchema.model_fields)
    return sorted(unknown)


def test_serve_config_matches_ray_serves_schema_strictly():
    parsed = serve_schema.ServeDeploySchema.model_validate(SERVE_CONFIG)
    assert parsed.proxy_location == "HeadOnly"
    assert unknown_serve_keys(SERVE_CONFIG) == []
    broken = copy.deepcopy(SERVE_CONFIG)
    broken["applications"][0]["import_pth"] = APPLICATION["import_path"]
    broken["applications"][0]["deployments"][0]["num_replica"] = 2
    assert unknown_serve_keys(broken) == ["import_pth", "num_replica"]
    broken["proxy_location"] = "Everywhere"
    with pytest.raises(ValueError, match="proxy_location"):
        serve_schema.ServeDeploySchema.model_validate(broken)


def test_the_application_is_vericache_with_args_its_parser_accepts():
    assert APPLICATION["import_path"] == "vericache.cli.ray_serve:build"
    assert APPLICATION["route_prefix"] == "/"
    build(ARGS)  # raises InvalidRequestError for an option or value `vericache serve` refuses
    args = parse_options(ARGS)
    assert (args.host, args.port) == ("0.0.0.0", port_named(HEAD, "grpc"))
    http = SERVE_CONFIG["http_options"]
    assert (http["host"], http["port"]) == ("0.0.0.0", port_named(HEAD, "serve"))


def test_the_replica_is_pinned_to_the_head_alone():
    (deployment,) = APPLICATION["deployments"]
    assert deployment["name"] == DEPLOYMENT_NAME
    wanted = deployment["ray_actor_options"]["resources"]
    offered = ray_resources(HEAD_GROUP)
    assert wanted.items() <= offered.items()
    for group in WORKER_GROUPS.values():
        assert not set(wanted) & set(ray_resources(group)), group["groupName"]


@pytest.mark.parametrize(
    ("resource", "count"), [(VERIFIER_RESOURCE, "verifiers"), (DRAFTER_RESOURCE, "drafters")]
)
def test_worker_groups_offer_one_resource_per_actor_the_application_places(resource, count):
    offered = 0
    for group in WORKER_GROUPS.values():
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        offered += group["replicas"] * ray_resources(group).get(resource, 0)
    assert offered == getattr(parse_options(ARGS), count)


def test_the_verifiers_store_is_the_shared_claim_of_this_file():
    pod = WORKER_GROUPS["verifiers"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == ARGS["root"]]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = DOCS["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # An upgrade runs the old and the new cluster's verifiers at once, on one store.
    assert SERVICE["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_probes_never_wait_for_what_the_application_starts():
    # The head is probed by KubeRay's own (GCS, raylet); the application deploys after it is ready.
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(HEAD)
    for group in WORKER_GROUPS.values():
        (container,) = group["template"]["spec"]["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            command = " ".join(container[probe]["exec"]["command"])
            assert "local_raylet_healthz" in command and "-/healthz" not in command


def test_api_keys_come_from_an_optional_secret_and_are_required():
    volumes = HEAD_GROUP["template"]["spec"]["volumes"]
    secrets = {v["name"]: v["secret"] for v in volumes if "secret" in v}
    assert all(s["optional"] for s in secrets.values())
    env = {e["name"]: e["value"] for e in HEAD["env"]}
    mounts = {m["name"]: m["mountPath"] for m in HEAD["volumeMounts"]}
    assert env["VERICACHE_API_KEYS_FILE"].startswith(mounts["api-keys"] + "/")
    # Without the Secret the replica refuses to start (it never serves without keys).
    with pytest.raises(InvalidRequestError, match="does not exist"):
        access_from_args(parse_options(ARGS), env)


def test_pods_are_valid_kubernetes_running_the_built_image():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = PYPROJECT["project"]["version"]
    (ray,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["serve"] if "ray" in r[:4]]
    assert CLUSTER["rayVersion"] == ray.split("==")[1]
    kubernetes_validate.validate(DOCS["PersistentVolumeClaim"], KUBERNETES_VERSION, strict=True)
    for group in [HEAD_GROUP, *WORKER_GROUPS.values()]:
        assert {c["image"] for c in group["template"]["spec"]["containers"]} == {
            f"{IMAGE}:{version}"
        }
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                    "template": group["template"]}  # fmt: skip
        kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)
