"""Steering vector uploads: a GGUF control vector, a safetensors file or JSON, read into a
:class:`common.steering.SteeringVector` (docs/steering.md, "Vectors"). The format is told by the content: GGUF's
magic, a safetensors header (a little-endian u64 length, then a JSON object), else JSON. Every way a file can be
wrong is a :class:`common.steering.SteeringError` whose message says what; nothing else escapes :func:`parse`.

Layer numbers are Tiller's throughout: 0-based, the direction of layer ``i`` added to the output of transformers'
``model.model.layers[i]`` (the residual stream after that decoder layer).

- **GGUF** (llama.cpp's and repeng's control vectors): ``general.architecture = "controlvector"`` and one float32
  1-D tensor ``direction.N`` a layer. ``direction.N`` *is* layer ``N`` here, as in llama.cpp: its loader
  (``common_control_vector_load_one``, common/common.cpp) puts ``direction.N`` at row ``N - 1`` of its buffer,
  ``llama_adapter_cvec::apply`` (src/llama-adapter.cpp) copies row ``il - 1`` into ``tensors[il]``, and every model
  graph calls ``build_cvec(cur, il)`` -> ``apply_to`` on ``cur`` = the FFN output plus its residual at the end of
  0-based layer ``il`` (``l_out``), i.e. the output of layer ``il``. repeng writes ``direction.{layer}`` with the
  layer it read from ``hidden_states[layer + 1]``: the same numbering. llama.cpp refuses ``direction.0`` (it has
  no slot for layer 0's output); Tiller takes it as layer 0. ``controlvector.layer_count`` and
  ``controlvector.model_hint`` are not needed (llama.cpp's loader reads neither).
- **safetensors**: one float32 1-D tensor a layer, named ``N``, ``layers.N`` or ``direction.N``.
- **JSON**: ``{"directions": {"<layer>": [hidden_size numbers]}}``, nothing else.
"""

from __future__ import annotations

import json
import re
import struct
import tempfile
from typing import Any

import numpy as np

from common.steering import SteeringError, SteeringVector

GGUF_MAGIC = b"GGUF"
CONTROL_VECTOR_ARCH = "controlvector"
_GGUF_DIRECTION = re.compile(r"direction\.(0|[1-9][0-9]*)")
_SAFETENSORS_NAME = re.compile(r"(?:layers\.|direction\.)?(0|[1-9][0-9]*)")
_JSON_LAYER = re.compile(r"(0|[1-9][0-9]*)")
_U64 = struct.Struct("<Q")


def detect(data: bytes) -> str:
    """``"gguf"``, ``"safetensors"`` or ``"json"``: what ``data`` looks like (JSON when it is neither of the others)."""
    if data.startswith(GGUF_MAGIC):
        return "gguf"
    if len(data) > _U64.size:
        (header,) = _U64.unpack_from(data)
        if _U64.size < _U64.size + header <= len(data) and data[_U64.size:_U64.size + 1] == b"{":
            return "safetensors"
    return "json"


def parse(data: bytes) -> SteeringVector:
    """The vector an upload holds, in whichever of the three formats it is; SteeringError when it holds none."""
    if not data:
        raise SteeringError("the upload is empty: send a GGUF control vector, a safetensors file or JSON")
    return {"gguf": parse_gguf, "safetensors": parse_safetensors, "json": parse_json}[detect(data)](data)


def _layers(named: dict[str, Any], pattern: re.Pattern[str], what: str) -> dict[int, Any]:
    """``{layer: values}`` from tensors (or JSON entries) named by ``pattern``'s one group; SteeringError naming
    ``what`` for any other name, and for two names of one layer."""
    layers: dict[int, Any] = {}
    for name, values in named.items():
        match = pattern.fullmatch(name)
        if match is None:
            raise SteeringError(f"{what} {name!r} does not name a layer")
        layer = int(match.group(1))
        if layer in layers:
            raise SteeringError(f"layer {layer} appears twice")
        layers[layer] = values
    if not layers:
        raise SteeringError("a steering vector needs at least one layer's direction")
    return layers


def _check_tensor(name: str, dtype: str, shape: list[int]) -> None:
    if dtype != "F32":
        raise SteeringError(f"tensor {name!r} is {dtype}; steering directions must be float32 (F32)")
    if len(shape) != 1:
        raise SteeringError(f"tensor {name!r} has shape {list(shape)}; a layer's direction is one flat "
                            "[hidden_size] tensor")


def parse_gguf(data: bytes) -> SteeringVector:
    """A llama.cpp / repeng control vector (see the module docstring for its layer numbering)."""
    from gguf import GGUFReader  # (imported here: only uploads need it)

    # GGUFReader maps a file; the upload is written to a private temporary one, read, and removed
    with tempfile.NamedTemporaryFile(prefix="tiller-vector-", suffix=".gguf") as file:
        file.write(data)
        file.flush()
        try:
            reader = GGUFReader(file.name)
            arch_field = reader.get_field("general.architecture")
            arch = arch_field.contents() if arch_field is not None else None
            tensors = {t.name: (t.tensor_type, [int(n) for n in t.shape], np.array(t.data)) for t in reader.tensors}
        except Exception as exc:  # the reader fails on malformed bytes in many ways (ValueError, IndexError...)
            raise SteeringError(f"not a readable GGUF file: {type(exc).__name__}: {exc}") from None
    if arch != CONTROL_VECTOR_ARCH:
        raise SteeringError(f"a GGUF steering vector must be a control vector (general.architecture = "
                            f"{CONTROL_VECTOR_ARCH!r}), not {arch!r}")
    for name, (tensor_type, shape, _) in tensors.items():
        _check_tensor(name, tensor_type.name, shape)  # (a GGMLQuantizationType: the reader refuses unknown types)
    layers = _layers({name: values for name, (_, _, values) in tensors.items()}, _GGUF_DIRECTION, "GGUF tensor")
    return SteeringVector.of(layers)


def parse_safetensors(data: bytes) -> SteeringVector:
    """One float32 1-D tensor a layer, named ``N``, ``layers.N`` or ``direction.N``."""
    from safetensors.numpy import load

    (size,) = _U64.unpack_from(data)
    try:
        header = json.loads(data[_U64.size:_U64.size + size])
    except (ValueError, RecursionError) as exc:
        raise SteeringError(f"the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SteeringError("the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
            raise SteeringError(f"the safetensors header's entry for {name!r} is malformed")
        _check_tensor(name, str(info.get("dtype")), info["shape"])
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors' own checks (offsets, sizes) raise its own error types
        raise SteeringError(f"not a readable safetensors file: {type(exc).__name__}: {exc}") from None
    return SteeringVector.of(_layers(tensors, _SAFETENSORS_NAME, "safetensors tensor"))


def parse_json(data: bytes) -> SteeringVector:
    """``{"directions": {"<layer>": [numbers]}}`` (Python's JSON reader, so that a NaN or Infinity in it is named
    as such rather than as bad JSON)."""
    shape = '{"directions": {"<layer>": [hidden_size numbers]}}'
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise SteeringError(f"not a GGUF control vector, a safetensors file or JSON ({shape}): {exc}") from None
    if not isinstance(document, dict) or set(document) != {"directions"} or not isinstance(document["directions"], dict):
        raise SteeringError(f"a JSON steering vector is {shape}, nothing else")
    for layer, values in document["directions"].items():
        if not isinstance(values, list) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                   for v in values):
            raise SteeringError(f"layer {layer}'s direction is not a list of numbers")
    return SteeringVector.of(_layers(document["directions"], _JSON_LAYER, "JSON key"))
