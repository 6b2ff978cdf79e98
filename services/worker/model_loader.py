"""Load the configured model onto the configured device, reporting progress as it goes."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from common import model_cache
from common.config import Settings
from common.model_source import resolve_model, tokenizer_class
from common.vision import VisionSpec
from services.worker import gguf_blocks, kernel_build
from services.worker.packed_cache import LAYOUTS, PackedStore, cache_key, cache_path
from services.worker.models import unsupported_reason
from services.worker.quantized import LinearFactory, linear_factory, weights_mode

log = structlog.get_logger()

Progress = Callable[[int, str], None]


@dataclass
class LoadedModel:
    """A model ready to serve and the facts the worker announces about it."""

    model: PreTrainedModel
    config: PretrainedConfig
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: list[int]
    max_model_len: int
    vision: VisionSpec | None = None  # a vision-language model's image facts and processor
    weights: str = "fp32"  # the resolved weights setting
    linears: LinearFactory | None = None  # the native forward's projections (None: dense)
    kernel: bool = False  # Tiller's kernel library serves the projections (GGUF blocks or dense tiles)
    tokenizer: Any = None  # the model's tokenizer (a transformers tokenizer; None: the model has none)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was configured but torch sees no CUDA device")
    return torch.device(setting)


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The dtype a checkpoint's weights ship in, as its config names it (None: it names none)."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else None


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def _ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


def read_tokenizer(directory: Path) -> Any:
    """The model's tokenizer (transformers'), through the class its config names (see :func:`tokenizer_class`:
    a fraction of ``AutoTokenizer``'s cost); None for a model directory without tokenizer files."""
    try:
        return tokenizer_class(directory).from_pretrained(directory)
    except (OSError, ValueError) as exc:
        log.warning("worker.no_tokenizer", directory=str(directory), error=str(exc))
        return None


def eos_token_ids(directory: Path, config: PretrainedConfig, tokenizer: Any) -> list[int]:
    """Union of the end-of-sequence ids named by generation_config.json, config.json and the tokenizer."""
    ids = _ids(getattr(config, "eos_token_id", None))
    try:
        ids += _ids(GenerationConfig.from_pretrained(directory).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    if tokenizer is not None:
        ids += _ids(tokenizer.eos_token_id)
    return sorted(set(ids))


def _own_weights(model: PreTrainedModel, skip_projections: bool = False) -> None:
    """Copy the weights out of the memory-mapped checkpoint into fresh, 64-byte aligned memory.

    safetensors tensors sit at arbitrary file offsets; CPU matmuls over them measured ~25% slower.
    Tied weights stay tied: each Parameter object is visited once. ``skip_projections``: leave the
    linear layers' weights (but the token embedding's) mapped, unread: GGUF blocks or dense tiles
    replace them.
    """
    embedding = model.get_input_embeddings().weight
    skipped = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m.weight is not embedding}
    with torch.no_grad():
        for param in model.parameters():
            if not (skip_projections and id(param) in skipped):
                param.data = param.data.clone()


def return_freed_memory() -> None:
    """Hand the heap memory freed while loading back to the system (glibc's ``malloc_trim``; a
    no-op elsewhere): the dense weights and GGUF blocks dropped once packed are many tensors of
    a few hundred kB each, which glibc keeps in its heap rather than unmapping (measured ~220 MB
    of the default model's resident memory)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def packed_store(settings: Settings, directory: Path, gguf: Path | None, mode: str,
                 kernel: bool = False) -> PackedStore | None:
    """Where a GGUF model's packed layers are kept between starts: beside its conversion
    (``kernel``: laid out for Tiller's own kernel, else for torch's)."""
    if gguf is None or not mode.startswith("gguf"):
        return None
    key = cache_key(model_cache.content_digest(gguf, settings.cache_dir), mode, LAYOUTS[kernel])
    return PackedStore.open(cache_path(directory, key), key)


def model_class(config: PretrainedConfig) -> type:
    """The auto class that builds ``config``: vision-language configs (a ``vision_config``) are not
    causal-LM classes in transformers, but their models are used the same way for text."""
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def load_model(settings: Settings, progress: Progress, keep_dense: bool = False) -> LoadedModel:
    """Resolve ``settings.model`` and load it: pretrained safetensors or random weights seeded by
    ``settings.seed``. ``progress(percent, message)`` is called between stages. ``keep_dense``: dense
    weights packed for Tiller's kernel stay in the transformers model too, which then still runs
    (an oracle beside the native forward, at twice the memory)."""
    hf_logging.disable_progress_bar()  # progress goes to the scheduler, not as tqdm bars on stderr
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    progress(2, f"resolving model {settings.model}")
    source = resolve_model(settings, weights=True)
    config = AutoConfig.from_pretrained(source.directory)
    readable = source.gguf is not None and gguf_blocks.architecture(source.gguf) in gguf_blocks.ARCHS  # its blocks
    mode = weights_mode(settings.weights, device.type, readable, source.pretrained_weights,
                        sharded=settings.distributed.tensor_parallel > 1,
                        kernel=lambda: kernel_build.load(settings.cache_dir))
    limit = settings.limits.max_model_len
    max_len = min(int(getattr(config.get_text_config(), "max_position_embeddings", limit)), limit)
    # Tiller's kernel serves the GGUF's blocks, and dense weights where the native forward runs on one
    # CPU rank with float32 activations (tensor parallel shards them; the fallback runs the model's own)
    tiled = (mode == "fp32" and device.type == "cpu" and dtype == torch.float32
             and settings.distributed.tensor_parallel == 1 and unsupported_reason(config, max_len) is None)
    kernel = (mode == "gguf" or tiled) and kernel_build.load(settings.cache_dir)
    # a bfloat16 or float16 checkpoint's projections are served as they ship on the kernel's tiles
    # (half the bytes a step reads); only what the activations meet otherwise is widened to float32
    shipped = checkpoint_dtype(config) if kernel and tiled and source.pretrained_weights else None
    load_dtype = shipped if shipped in (torch.bfloat16, torch.float16) and settings.dtype == "auto" else dtype
    if source.pretrained_weights:
        progress(10, f"loading weights from {source.directory}")
        model = model_class(config).from_pretrained(source.directory, dtype=load_dtype)
    else:
        progress(10, f"initialising random weights for {config.model_type}")
        torch.manual_seed(settings.seed)
        model = model_class(config).from_config(config, dtype=dtype)
    progress(70, f"moving weights to {device}")
    model = model.to(device).eval()
    if device.type == "cpu" and source.pretrained_weights:
        _own_weights(model, skip_projections=mode.startswith("gguf") or bool(kernel and tiled))
    linears = None
    if mode != "fp32" or kernel:
        progress(75, f"packing {mode} weights")
        store = packed_store(settings, source.directory, source.gguf, mode, kernel) if mode != "fp32" else None
        linears = linear_factory(mode, model, source.gguf, store, kernel=kernel, keep_dense=keep_dense)
    progress(80, "reading tokenizer and generation config")
    tokenizer = read_tokenizer(source.directory)
    eos = eos_token_ids(source.directory, config, tokenizer)
    return LoadedModel(
        model=model,
        config=model.config,
        name=source.name,
        device=device,
        dtype=dtype,
        eos_token_ids=eos,
        max_model_len=max_len,
        vision=VisionSpec.load(source.directory, settings.images.max_image_pixels),
        weights=mode,
        linears=linears,
        kernel=bool(kernel),
        tokenizer=tokenizer,
    )
