"""Drives Wasm controllers in-process through the controller runtime (services/controller_runtime: its
Runtime, registry and Wasm host) with the real tokenizer and model-free token streams: a `pick` function plays
the model, choosing each sampled token from the mask row the runtime returned. The step loop is the
scheduler's (the AICI runtime protocol, AICI v0.0.x): post_pre_process (post_ops, pre_ops, freed), then mid_process with
clone ops for forks; Splice backtrack/ff_tokens are applied and reported back in the next post_ops."""

from __future__ import annotations

import ctypes
import itertools
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import aici_wire as w
from common.config import Settings
from common.model_source import load_tokenizer, resolve_model
from controllers.native import load_native_controllers
from services.controller_runtime.host import RequestState, SeqHost
from services.controller_runtime.instances import WasmInstance
from services.controller_runtime.registry import ModuleRegistry
from services.controller_runtime.runtime import Runtime
from services.controller_runtime.tokenizer import TokenizerInfo
from services.controller_runtime.wasm import WasmController, WasmEngine

ROOT = Path(__file__).resolve().parents[2]
WASM_DIR = ROOT / "controllers" / "wasm"
CAPS = {"fork": True, "backtrack": True, "ff_tokens": True}

Pick = Callable[["Seq", np.ndarray], int]   # (sequence, allowed token ids) -> token


class Host:
    """The runtime's pieces over the real tokenizer: a WasmEngine, a module registry and a Runtime (for `Run`),
    plus `instantiate`/`mid` for driving one WasmInstance directly (SDK unit tests, forks by hand)."""

    def __init__(self) -> None:
        # one user's controllers back to back in this process: fairness between users is not tested here
        self.settings = Settings(controllers={"user_cpu_share": 0, "max_controlled_per_user": 1 << 30})
        self.hf = load_tokenizer(self.settings)
        self.tok = TokenizerInfo.from_directory(resolve_model(self.settings).directory)
        self.engine = WasmEngine(self.settings.controllers, self.tok)
        self._tmp = tempfile.TemporaryDirectory()
        self.registry = ModuleRegistry(Path(self._tmp.name), self.engine)
        self.runtime = Runtime(self.settings.controllers, self.tok, self.engine, self.registry,
                               load_native_controllers(self.settings.controllers.native))
        self.ids = itertools.count(1)
        self._modules: dict[bytes, object] = {}
        self._mask = (ctypes.c_uint32 * self.tok.mask_words)()

    def module(self, wasm: bytes):
        if wasm not in self._modules:
            self._modules[wasm] = self.engine.prepare(self.engine.compile(wasm))
        return self._modules[wasm]

    def instantiate(self, wasm: bytes, arg: bytes | str | dict = b"", prompt: list[int] | None = None,
                    request: RequestState | None = None, seq_id: int = 1,
                    caps: dict[str, bool] = CAPS) -> WasmInstance:
        if isinstance(arg, dict):
            arg = json.dumps(arg)
        if isinstance(arg, str):
            arg = arg.encode()
        request = request or RequestState(req_id="test", module_arg=arg)
        host = SeqHost(self.tok, request, caps, self.settings.controllers.max_log_bytes)
        host.seq_id = seq_id
        inst = WasmInstance(WasmController(self.engine, self.module(wasm), host), self.settings.controllers)
        inst.setup(prompt if prompt is not None else [])
        return inst

    def mid(self, inst: WasmInstance, fork_group: list[int]):
        """mid_process of a lone instance; returns (result, allowed token ids or None)."""
        addr = ctypes.addressof(self._mask)
        ctypes.memset(addr, 0, ctypes.sizeof(self._mask))
        res = inst.mid_process(fork_group, addr, self.settings.controllers.mid_deadline_ms)
        if res != "Stop" and res.SampleWithBias is not None:
            return res, self.allowed(bytes(self._mask))
        return res, None

    def allowed(self, row: bytes) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(row, dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.tok.vocab_size])

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.tok.token_bytes[t] for t in tokens).decode("utf-8", "replace")


class ControllerFailed(Exception):
    def __init__(self, error: str, logs: str) -> None:
        super().__init__(f"{error}\nlogs: {logs}")
        self.error, self.logs = error, logs


@dataclass
class Seq:
    id: int
    tokens: list[int]
    prompt_len: int
    done: bool = False
    error: str = ""
    logs: str = ""
    events: list[str] = field(default_factory=list)
    storage: list = field(default_factory=list)


class Run:
    """One request: instantiate, then step all its sequences (forks included) like the scheduler does."""

    def __init__(self, host: Host, wasm: bytes, arg, prompt: str | list[int], pick: Pick,
                 max_steps: int = 200) -> None:
        self.host, self.rt, self.pick, self.max_steps = host, host.runtime, pick, max_steps
        ids = host.tok.tokenize(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        module_id = host.registry.create(wasm, "test")["module_id"]
        self.req_id = f"req-{next(host.ids)}"
        ok, res = self.rt.instantiate(self.req_id, ids, module_id, arg)
        if not ok:
            raise ControllerFailed(res.error, res.logs)
        self.init_logs = res.logs
        self.storage: list[dict] = list(res.storage)   # every variable write of the request, in order
        first = Seq(next(host.ids), ids, len(ids))
        self.seqs = [first]
        self.pre_ops = [w.PreOp(id=first.id, req_id=self.req_id)]
        self.post_ops: list[w.PostOp] = []
        self.freed: list[int] = []

    def _finish(self, seq: Seq, event: str, res: dict | None = None) -> None:
        seq.done = True
        seq.events.append(event)
        if res is not None and res.error:
            seq.error = res.error
        self.freed.append(seq.id)

    def _note(self, seq: Seq, res: dict) -> None:
        seq.logs += res.logs
        seq.storage += res.storage
        self.storage += res.storage

    def step(self) -> bool:
        """One scheduler step; False when no sequence is left."""
        by_id = {s.id: s for s in self.seqs}
        reply = self.rt.post_pre_process(w.PostPreProcess(post_ops=self.post_ops, pre_ops=self.pre_ops,
                                                          freed=self.freed))
        self.post_ops, self.pre_ops, self.freed = [], [], []
        for sid, res in reply.post_seqs.items():
            seq = by_id[int(sid)]
            self._note(seq, res)
            if res.error or res.result.stop:
                self._finish(seq, "post:stop", res)
        ops: list[w.MidOp] = []
        for sid, res in reply.pre_seqs.items():
            seq = by_id.get(int(sid))
            if seq is None or seq.done:
                continue
            self._note(seq, res)
            pre = res.result
            if res.error or pre.num_forks == 0:
                self._finish(seq, "pre:stop", res)
                continue
            seq.tokens += pre.ff_tokens
            if pre.suspend:
                seq.events.append("suspend")
                continue
            ops.append(w.MidOp(id=seq.id))
            for _ in range(pre.num_forks - 1):
                child = Seq(next(self.host.ids), list(seq.tokens), seq.prompt_len)
                self.seqs.append(child)
                by_id[child.id] = child
                ops.append(w.MidOp(id=child.id, clone_id=seq.id))
        if not ops:   # everyone suspended or done (freed ids go out with the next step)
            return any(not s.done for s in self.seqs)
        data, rows = self.rt.mid_process(w.MidProcess(ops=ops))
        row_bytes = self.host.tok.mask_words * 4
        for i, op in enumerate(ops):
            seq, res = by_id[op.id], data.seqs[str(op.id)]
            self._note(seq, res)
            result = res.result
            if res.error or result == "Stop":
                self._finish(seq, "mid:stop", res)
                continue
            if result is None:  # sample under the mask row (the AICI runtime protocol: no specific result)
                allowed = self.host.allowed(bytes(rows[i * row_bytes:(i + 1) * row_bytes]))
                assert len(allowed), "empty mask"
                tok = int(self.pick(seq, allowed))
                assert tok in set(allowed.tolist()), f"picked {tok} outside the mask"
                new, bt = [tok], 0
            else:
                new, bt = result.Splice.ff_tokens, result.Splice.backtrack
                seq.events.append(f"splice:{bt}:{len(new)}")
            if bt:
                del seq.tokens[len(seq.tokens) - bt:]
            seq.tokens += new
            self.post_ops.append(w.PostOp(id=seq.id, tokens=new, backtrack=bt))
        return True

    def run(self) -> Run:
        for _ in range(self.max_steps):
            if not self.step():
                self.rt.post_pre_process(w.PostPreProcess(freed=self.freed))   # release the instances
                self.freed = []
                return self
        raise AssertionError(f"controller did not finish in {self.max_steps} steps")

    def text(self, seq: Seq | None = None) -> str:
        seq = seq or self.seqs[0]
        return self.host.text(seq.tokens[seq.prompt_len:])

    def var(self, name: str) -> str | None:
        """The variable's value, replayed from the storage writes the results reported."""
        value = None
        for entry in self.storage:
            write = entry["WriteVar"]
            if write["name"] == name:
                data = bytes.fromhex(write["value"])
                value = (value or b"") + data if write["op"] == "Append" else data
        return None if value is None else value.decode()


def module(name: str) -> bytes:
    return (WASM_DIR / f"{name}.wasm").read_bytes()


def pick_lowest(seq: Seq, allowed: np.ndarray) -> int:
    return int(allowed[0])


def pick_text(host: Host, text: str, eos_after: bool = True) -> Pick:
    """Plays a model that wants to write `text` (its own tokenization, longest allowed token first), then EOS."""
    want = text.encode()
    eos = host.tok.eos_token

    def pick(seq: Seq, allowed: np.ndarray) -> int:
        written = b"".join(host.tok.token_bytes[t] for t in seq.tokens[seq.prompt_len:])
        rest = want[len(written):] if want.startswith(written) else b""
        best, best_len = None, -1
        for t in allowed.tolist():
            b = host.tok.token_bytes[t]
            if b and rest.startswith(b) and len(b) > best_len:
                best, best_len = t, len(b)
        if best is not None:
            return best
        if eos in set(allowed.tolist()) and (eos_after or not rest):
            return eos
        return int(allowed[0])

    return pick
