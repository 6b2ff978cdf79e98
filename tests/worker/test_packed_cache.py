"""The packed-layer cache (services/worker/packed_cache.py): a warm start takes every layer from it and
reads no GGUF blocks; a file that is corrupt, made for another key or missing a layer is detected,
the layers are packed from the blocks again and the file is rewritten whole.

A small random Llama with random Q4_1 / Q8_0 blocks stands in for the GGUF (the default model's
blocks are covered by test_quantized.py); engines decode greedily to show the layers are right.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM, LlamaConfig

from services.worker.engine import Engine
from services.worker.gguf_blocks import GROUP, Blocks
from services.worker.model_loader import LoadedModel
from services.worker.gguf_linear import BlockLinear
from services.worker import packed_cache
from services.worker.packed_cache import LAYOUTS, PACKING_CODE, PackedStore, cache_key, cache_path
from services.worker.quantized import GgufLinears, Int4Packed
from tests.worker.conftest import Driver

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
KEY = cache_key("0" * 64, "gguf-bf16", "int4pack")
PROMPT = [3, 14, 15, 92, 65]
LAYERS = 4 * CONFIG.num_hidden_layers + 1  # qkv, o, gate|up, down per decoder layer, and the head


def _model() -> LoadedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32).eval()
    return LoadedModel(model=model, config=model.config, name="tiny", device=torch.device("cpu"),
                       dtype=torch.float32, eos_token_ids=[], max_model_len=64, weights="gguf-bf16")


def _blocks(model: torch.nn.Module) -> dict[str, Blocks]:
    """Random blocks for every projection (Q4_1) and the tied embedding (Q8_0)."""
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, module in model.named_modules():
        if name == "lm_head" or not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        rows, cols = module.weight.shape
        scale = (torch.rand(rows, cols // GROUP, generator=generator) / 50).half().float()  # GGUF's are float16
        if isinstance(module, torch.nn.Embedding):
            q = torch.randint(-128, 128, (rows, cols), generator=generator, dtype=torch.int8)
            out[f"{name}.weight"] = Blocks("Q8_0", q, scale, None)
        else:
            q = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
            out[f"{name}.weight"] = Blocks("Q4_1", q, scale, -8 * scale)
    return out


class Start:
    """One worker start over ``directory``: the engine built, and how often the blocks were read."""

    def __init__(self, directory: Path, key: dict[str, str] = KEY, forget: str | None = None) -> None:
        """``forget``: a layer dropped from the store as opened (a runner that fuses differently).
        A key of layout 'gguf_kernel' serves the exact blocks on Tiller's kernel."""
        loaded = _model()
        self.reads = 0
        self.store = PackedStore.open(cache_path(directory, key), key)
        self.found = len(self.store.found)
        if forget is not None:
            del self.store.found[forget]
        kernel = key["layout"] == LAYOUTS[True]
        linears = GgufLinears(loaded.model, self._read, parts=1, release=True, store=self.store, kernel=kernel)
        self.engine = Engine(dataclasses.replace(loaded, linears=linears), num_blocks=16)

    def _read(self) -> dict[str, Blocks]:
        self.reads += 1
        return _blocks(_model().model)

    def layers(self) -> list[Int4Packed | BlockLinear]:
        runner = self.engine.runner
        return [runner.head] + [p for layer in runner.layers for p in layer.projections()]

    def generate(self) -> list[int]:
        return Driver(self.engine).generate(0, PROMPT, 8)


@pytest.fixture
def cold(tmp_path: Path) -> Start:
    start = Start(tmp_path)
    assert start.reads == 1 and start.found == 0 and cache_path(tmp_path, KEY).is_file()
    return start


def _same_layers(a: Start, b: Start) -> None:
    for x, y in zip(a.layers(), b.layers(), strict=True):
        assert type(x) is type(y)
        mine, theirs = x.tensors(), y.tensors()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_warm_start_takes_every_layer_from_the_store_and_reads_no_blocks(tmp_path: Path, cold: Start) -> None:
    warm = Start(tmp_path)
    assert warm.reads == 0 and warm.found == LAYERS
    _same_layers(cold, warm)
    assert warm.generate() == cold.generate()
    assert not warm.store.dirty  # nothing to write again


def test_the_kernels_layout_is_stored_under_its_own_key_and_served_warm(tmp_path: Path, cold: Start,
                                                                          gguf_kernel: None) -> None:
    key = {**KEY, "weights": "gguf", "layout": LAYOUTS[True]}
    first = Start(tmp_path, key=key)
    assert first.reads == 1 and first.found == 0  # torch's layout (the cold start's file) is not taken for it
    assert all(isinstance(layer, BlockLinear) for layer in first.layers())
    warm = Start(tmp_path, key=key)
    assert warm.reads == 0 and warm.found == LAYERS
    _same_layers(first, warm)
    assert warm.generate() == first.generate()


def _flip_a_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")


def _another_keys_file(path: Path) -> None:
    """The file a worker with another torch wrote, found under this key's name."""
    other = {**KEY, "torch": "0.0.0"}
    Start(path.parent, key=other)
    cache_path(path.parent, other).replace(path)


@pytest.mark.parametrize("spoil", [_flip_a_data_byte, _truncate, _garbage, _another_keys_file])
def test_a_spoilt_file_is_detected_repacked_and_rewritten(tmp_path: Path, cold: Start, spoil) -> None:
    path = cache_path(tmp_path, KEY)
    spoil(path)
    with capture_logs() as logs:
        again = Start(tmp_path)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["worker.packed_cache_invalid"]
    assert again.found == 0 and again.reads == 1
    _same_layers(cold, again)
    assert again.generate() == cold.generate()
    healed = Start(tmp_path)
    assert healed.found == LAYERS and healed.reads == 0


def test_a_layer_the_store_lacks_is_packed_from_the_blocks_and_the_file_completed(tmp_path: Path, cold: Start) -> None:
    partial = Start(tmp_path, forget="model.layers.1.mlp.down_proj")
    assert partial.reads == 1
    _same_layers(cold, partial)
    complete = Start(tmp_path)
    assert complete.found == LAYERS and complete.reads == 0
    assert complete.generate() == cold.generate()


def test_the_key_names_what_the_packed_layout_depends_on(tmp_path: Path) -> None:
    assert {"gguf_sha256", "weights", "layout", "torch", "cpu_capability", "code"} <= set(KEY)
    paths = {cache_path(tmp_path, {**KEY, field: "other"}) for field in KEY}
    assert len(paths | {cache_path(tmp_path, KEY)}) == len(KEY) + 1  # every field changes the file's name


def test_the_code_digest_covers_every_file_the_layouts_come_from() -> None:
    """Both layouts' packing code, the kernel's C++ included: a new layout keys a new file by itself."""
    here = Path(packed_cache.__file__).parent
    assert {"gguf_blocks.py", "quantized.py", "gguf_linear.py", "gguf_kernel.cpp"} <= set(PACKING_CODE)
    assert all((here / name).is_file() for name in PACKING_CODE)


def test_a_store_that_cannot_be_written_costs_only_the_next_starts_packing(tmp_path: Path) -> None:
    with capture_logs() as logs:
        start = Start(tmp_path / "not-a-directory")
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["worker.packed_cache_unwritable"]
    assert start.reads == 1 and start.store.dirty and start.generate() == Start(tmp_path).generate()


def test_writing_a_key_removes_the_same_modes_files_of_other_keys(tmp_path: Path, cold: Start) -> None:
    other_torch, other_mode = {**KEY, "torch": "0.0.0"}, {**KEY, "weights": "gguf"}
    Start(tmp_path, key=other_mode)
    Start(tmp_path, key=other_torch)
    assert not cache_path(tmp_path, KEY).exists()  # replaced by the other torch's file
    assert cache_path(tmp_path, other_torch).is_file() and cache_path(tmp_path, other_mode).is_file()
