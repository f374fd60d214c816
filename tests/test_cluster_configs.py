"""The Ray cluster launcher files in cluster/: valid for `ray up`, offering the resources that
`vericache serve` places its actors by, and starting the server on the head.

Offline: the schema and the checks of the `ray` package (`prepare_config`, `validate_config`),
no cloud calls. The providers' bootstrap steps (key pairs, IAM roles, subnets, GCP projects) and
AWS's detection of CPU counts need credentials and are not run.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from vericache.cli.main import build_parser
from vericache.serve.launch.cluster import DRAFTER_RESOURCE, VERIFIER_RESOURCE

ROOT = Path(__file__).parents[1]
CONFIGS = {name: ROOT / "cluster" / f"{name}.yaml" for name in ("aws", "gcp", "local")}
CLOUDS = ["aws", "gcp"]  # providers with node types
PLACEMENT_RESOURCES = (VERIFIER_RESOURCE, DRAFTER_RESOURCE)
SHELL_OPERATORS = {";", "&", "&&", "|", "||"}


def load(name: str) -> dict:
    return yaml.safe_load(CONFIGS[name].read_text())


def prepared(name: str) -> dict:
    return prepare_config(load(name))


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as words, redirections dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words, skip_next = [], [], False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in SHELL_OPERATORS:
            commands.append(words)
            words = []
        elif set(token) <= set("<>&"):  # a redirection: drop it and its target
            if token != "<" and words and words[-1] in set("0123456789"):
                words.pop()  # the descriptor of `2>&1` (a guess: shlex drops the spacing)
            skip_next = True
        else:
            words.append(token)
    return [c for c in [*commands, words] if c]


def commands_of(config: dict, key: str) -> list[list[str]]:
    return [c for line in config[key] for c in shell_commands(line)]


def ray_start(config: dict, key: str) -> list[str]:
    (start,) = [c for c in commands_of(config, key) if c[:2] == ["ray", "start"]]
    return start


def start_resources(start: list[str]) -> dict:
    """The `--resources` of a `ray start` command."""
    for i, word in enumerate(start):
        if word.startswith("--resources="):
            return json.loads(word.removeprefix("--resources="))
        if word == "--resources":
            return json.loads(start[i + 1])
    return {}


def serve_commands(config: dict, key: str) -> list[list[str]]:
    return [c[c.index("vericache") + 1 :] for c in commands_of(config, key) if _is_serve(c)]


def _is_serve(words: list[str]) -> bool:
    return any(words[i : i + 2] == ["vericache", "serve"] for i in range(len(words)))


def serve_args(config: dict):
    """The head's `vericache serve` command, parsed by the CLI's own parser."""
    (argv,) = serve_commands(config, "head_start_ray_commands")
    return build_parser().parse_args(argv)


def capacity(config: dict, resource: str) -> float:
    """Units of `resource` the cluster offers at its largest: the head and max_workers of each
    worker type; for the local provider, what `ray start --resources` offers on each machine."""
    if config["provider"]["type"] == "local":
        head = start_resources(ray_start(config, "head_start_ray_commands"))
        worker = start_resources(ray_start(config, "worker_start_ray_commands"))
        num_workers = len(config["provider"]["worker_ips"])
        return head.get(resource, 0) + num_workers * worker.get(resource, 0)
    total = 0
    for name, node_type in config["available_node_types"].items():
        count = 1 if name == config["head_node_type"] else node_type["max_workers"]
        total += count * node_type.get("resources", {}).get(resource, 0)
    return total


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_ray_schema(name):
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(load(name), schema)


@pytest.mark.parametrize("name", CONFIGS)
def test_passes_ray_prepare_and_validate(name):
    validate_config(prepared(name))


@pytest.mark.parametrize("name", CLOUDS)
def test_head_node_type_offers_verifier(name):
    config = prepared(name)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get(VERIFIER_RESOURCE, 0) >= 1
    assert head["resources"].get(DRAFTER_RESOURCE, 0) == 0  # drafters sit behind the slow link


@pytest.mark.parametrize("name", CLOUDS)
def test_placement_resources_are_on_gpu_node_types(name):
    config = prepared(name)
    offering = {
        type_name: node_type["resources"]
        for type_name, node_type in config["available_node_types"].items()
        if any(node_type["resources"].get(r, 0) > 0 for r in PLACEMENT_RESOURCES)
    }
    assert any(r.get(DRAFTER_RESOURCE, 0) > 0 for r in offering.values())
    for type_name, resources in offering.items():
        assert resources.get("GPU", 0) >= 1, type_name


def test_local_start_commands_offer_resources():
    config = load("local")
    head = start_resources(ray_start(config, "head_start_ray_commands"))
    worker = start_resources(ray_start(config, "worker_start_ray_commands"))
    assert head.get(VERIFIER_RESOURCE, 0) >= 1
    assert worker.get(DRAFTER_RESOURCE, 0) >= 1
    assert "--head" in ray_start(config, "head_start_ray_commands")


@pytest.mark.parametrize("name", CONFIGS)
def test_head_starts_server_on_the_cluster(name):
    config = load(name)
    head_commands = commands_of(config, "head_start_ray_commands")
    starts = [i for i, c in enumerate(head_commands) if c[:2] == ["ray", "start"]]
    serves = [i for i, c in enumerate(head_commands) if _is_serve(c)]
    assert len(serves) == 1 and starts and starts[-1] < serves[0]  # joins the Ray it started
    assert serve_commands(config, "worker_start_ray_commands") == []
    args = serve_args(config)
    assert args.address == "auto" and not args.local and not args.long_context
    assert args.host == "0.0.0.0"  # clients connect from other machines
    # Reachable from other machines, so never without keys; the keys file is copied to the head.
    assert args.api_keys_file and not args.insecure_no_auth
    assert Path(args.api_keys_file).name in {Path(t).name for t in config["file_mounts"]}


@pytest.mark.parametrize("name", CONFIGS)
def test_cluster_can_place_the_actors_serve_asks_for(name):
    config = prepared(name)
    args = serve_args(config)
    assert capacity(config, VERIFIER_RESOURCE) >= args.verifiers
    assert capacity(config, DRAFTER_RESOURCE) >= args.drafters


def _makefile_variable(name: str) -> str:
    match = re.search(rf"^{name}\s*[?:]?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, name
    return match.group(1).strip()


@pytest.mark.parametrize("name", CONFIGS)
def test_setup_installs_what_the_makefile_installs(name):
    installs = [c for c in commands_of(load(name), "setup_commands") if c[:2] == ["pip", "install"]]
    no_deps = next(c for c in installs if "--no-deps" in c)
    assert set(_makefile_variable("NO_DEPS_PACKAGES").split()) <= set(no_deps)
    torch_pin = _makefile_variable("TORCH_SPEC").split()[0]
    assert any(torch_pin in c and "--index-url" in c for c in installs)  # the CUDA build
    assert any(any(w.endswith("[serve,gguf]") for w in c) for c in installs)


def test_checks_fail_on_broken_files():
    config = load("aws")
    no_verifier = copy.deepcopy(config)
    del no_verifier["available_node_types"]["vericache.head"]["resources"][VERIFIER_RESOURCE]
    assert capacity(prepare_config(no_verifier), VERIFIER_RESOURCE) == 0
    typo = copy.deepcopy(config)
    typo["available_node_types"]["vericache.drafter"]["resource"] = {DRAFTER_RESOURCE: 1}
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(typo))
    local = load("local")
    local["worker_start_ray_commands"] = ["ray stop", "ray start --address=$RAY_HEAD_IP:6379"]
    assert capacity(local, DRAFTER_RESOURCE) == 0
    bad_option = copy.deepcopy(config)
    bad_option["head_start_ray_commands"] = [
        line.replace("--placement-timeout", "--placement_timeout")
        for line in config["head_start_ray_commands"]
    ]
    with pytest.raises(SystemExit):
        serve_args(bad_option)
