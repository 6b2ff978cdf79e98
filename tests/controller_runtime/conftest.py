"""In-process runtime fixtures: the real tokenizer, one Wasm engine with small limits, a registry in
a temporary directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from common import aici_wire
from common.config import Controllers, Settings
from common.model_source import resolve_model
from controllers.native import load_native_controllers
from services.controller_runtime.registry import ModuleRegistry
from services.controller_runtime.runtime import Runtime
from services.controller_runtime.tokenizer import TokenizerInfo
from services.controller_runtime.wasm import WasmEngine

LIMITS = Controllers(max_memory_bytes=4 << 20, mid_deadline_ms=100.0, max_tokenize_bytes=4096)


@pytest.fixture(scope="session")
def tokenizer() -> TokenizerInfo:
    return TokenizerInfo.from_directory(resolve_model(Settings()).directory)


@pytest.fixture(scope="session")
def engine(tokenizer: TokenizerInfo) -> WasmEngine:
    return WasmEngine(LIMITS, tokenizer)


class WireRuntime(Runtime):
    """The runtime with its replies read as they travel: encoded, then decoded to plain data, so that the
    tests check the AICI runtime protocol's JSON shapes."""

    def instantiate(self, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        ok, outcome = super().instantiate(*args, **kwargs)
        return ok, as_sent(outcome)

    def post_pre_process(self, req: aici_wire.PostPreProcess) -> Any:
        return as_sent(super().post_pre_process(req))

    def mid_process(self, req: aici_wire.MidProcess) -> tuple[Any, bytearray]:
        reply, rows = super().mid_process(req)
        return as_sent(reply), rows

    def post_pre_mid(self, req: aici_wire.PostPreProcess) -> tuple[Any, bytearray]:
        reply, rows = super().post_pre_mid(req)
        return as_sent(reply), rows


def as_sent(reply: object) -> Any:
    return msgspec.msgpack.decode(aici_wire.encode(reply))


def wire_runtime(limits: Controllers, tmp_path: Path, engine: WasmEngine, tokenizer: TokenizerInfo) -> WireRuntime:
    registry = ModuleRegistry(tmp_path / "modules", engine)
    return WireRuntime(limits, tokenizer, engine, registry, load_native_controllers(limits.native))


@pytest.fixture
def runtime(tmp_path: Path, engine: WasmEngine, tokenizer: TokenizerInfo) -> Runtime:
    return wire_runtime(LIMITS, tmp_path, engine, tokenizer)


def start(runtime: Runtime, wasm_or_ref: bytes | str, seq_id: int, arg: object = "", prompt=(1,),
          **bind: Any) -> dict:
    """Upload (bytes) or reference a controller, instantiate it as req 'r<seq_id>' and bind it to ``seq_id`` (the
    PreOp's other fields ``bind``); returns that sequence's first pre_process result."""
    return bound(runtime, wasm_or_ref, seq_id, arg, prompt, **bind)["pre_seqs"][str(seq_id)]


def bound(runtime: Runtime, wasm_or_ref: bytes | str, seq_id: int, arg: object = "", prompt=(1,),
          **bind: Any) -> dict:
    """As :func:`start`, returning the whole reply of the binding call."""
    ref = wasm_or_ref if isinstance(wasm_or_ref, str) else runtime.registry.create(wasm_or_ref, "test")["module_id"]
    ok, result = runtime.instantiate(f"r{seq_id}", list(prompt), ref, arg)
    assert ok, result
    op = aici_wire.PreOp(id=seq_id, req_id=f"r{seq_id}", **bind)
    return runtime.post_pre_process(aici_wire.PostPreProcess(pre_ops=[op]))


def mid(runtime: Runtime, *ops: tuple[int, int | None]) -> tuple[dict, bytearray]:
    return runtime.mid_process(aici_wire.MidProcess(ops=[aici_wire.MidOp(id=i, clone_id=c) for i, c in ops]))


def row(rows: bytearray, index: int, tokenizer: TokenizerInfo) -> bytes:
    n = tokenizer.mask_words * 4
    return bytes(rows[index * n:(index + 1) * n])


def allowed(bitset: bytes) -> set[int]:
    value = int.from_bytes(bitset, "little")
    return {i for i in range(len(bitset) * 8) if value >> i & 1}
