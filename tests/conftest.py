"""Shared fixtures: tiny random checkpoints of each supported family, saved by transformers itself,
and the embedded model (converted once per machine into $VERICACHE_CACHE)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from vericache.engine.engine import Engine, EngineConfig
from vericache.model import loader
from vericache.model.loader import ensure_embedded, ensure_embedded_tokenizer, load_model
from vericache.model.runner import ModelRunner

# `make test` runs the suite on two pytest-xdist workers: each takes one core's torch thread.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Every test that starts Ray (`ray_cluster`) is marked `ray`; under xdist those run on one
    worker, which holds the session's one Ray cluster, and the others never start one."""
    unmarked = [
        item.nodeid
        for item in items
        if "ray_cluster" in getattr(item, "fixturenames", ())
        and item.get_closest_marker("ray") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"tests that start Ray must be marked `ray`: {unmarked}")
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))


TINY_BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# family name -> (transformers config class name, extra config fields)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": 24, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    # The window applies from layer max_window_layers on: layer 0 attends to everything.
    "qwen2-window": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "qwen3-window": (
        "Qwen3Config",
        {"head_dim": 32, "use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
    ),
}


def save_tiny_checkpoint(family: str, path, seed: int = 0, **overrides):
    import transformers

    config_name, extra = TINY_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**TINY_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; larger weights make greedy choices decisive, closer
    # to a trained model's confidence.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 or name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    made = {}

    def get(family: str = "llama", **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            made[key] = save_tiny_checkpoint(family, path, **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint):
    """Engine over the tiny Llama, no tokenizer; one per EngineConfig."""
    engines = {}

    def get(config: EngineConfig = EngineConfig(), family: str = "llama"):
        if (config, family) not in engines:
            loaded = load_model(str(tiny_checkpoint(family)))
            runner = ModelRunner(loaded.config, loaded.weights, static_shapes=config.static_shapes)
            engines[config, family] = Engine(runner, None, config)
        return engines[config, family]

    return get


@pytest.fixture(autouse=True)
def fast_tests_never_convert_the_embedded_model(request, monkeypatch):
    """`make test-fast` (-m "not slow") must run without converting the embedded model's weights:
    a test that is not marked slow fails if it asks for them."""
    if request.node.get_closest_marker("slow") is not None:
        return
    needs_weights = {"embedded_dir", "embedded_engine"} & set(request.fixturenames)
    assert not needs_weights, f"a test using {sorted(needs_weights)} must be marked slow"

    def refuse(name: str):
        raise AssertionError(f"a test not marked slow converts the {name} weights: mark it slow")

    monkeypatch.setattr(loader, "ensure_embedded", refuse)


@pytest.fixture(scope="session")
def embedded_dir():
    return ensure_embedded("smollm2-135m")


@pytest.fixture(scope="session")
def embedded_tokenizer_dir():
    """The embedded model's tokenizer and chat template, without converting its weights."""
    return ensure_embedded_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory, embedded_tokenizer_dir):
    """A tiny Llama with the embedded model's vocabulary, tokenizer and chat template."""
    path = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_checkpoint("llama", path, vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded_tokenizer_dir / name).is_file():
            shutil.copy(embedded_tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def embedded_engine(embedded_dir):
    return Engine.from_pretrained("smollm2-135m")


@pytest.fixture(scope="session")
def ray_cluster():
    """The one Ray cluster of a test session (Ray starts slowly and keeps state per process): a
    head node offering the `verifier` resource and a second node offering one `drafter`."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=1, resources={"verifier": 1}, include_dashboard=False,
            object_store_memory=100 << 20,
        ),
    )  # fmt: skip
    cluster.add_node(num_cpus=1, resources={"drafter": 1}, object_store_memory=100 << 20)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def stub(server):
    """The API's raw stub on the `server` of the module asking for it."""
    from tests.serve_fixtures import raw_stub

    with raw_stub(server) as opened:
        yield opened
