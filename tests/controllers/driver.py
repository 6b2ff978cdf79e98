"""Drives Wasm controllers in-process through the controller runtime's host (services/controller_runtime),
with the real tokenizer and model-free token streams: a `pick` function plays the model, choosing each
sampled token from the mask the controller returned. Forks, suspends, splices and ff_tokens are applied
the way the scheduler applies them (seed 001 / AICI v0.0.x)."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.config import Settings
from common.model_source import load_tokenizer
from services.controller_runtime.host import RequestState, SeqHost
from services.controller_runtime.instances import WasmInstance
from services.controller_runtime.tokenizer import TokenizerInfo
from services.controller_runtime.wasm import WasmController, WasmEngine

ROOT = Path(__file__).resolve().parents[2]
WASM_DIR = ROOT / "controllers" / "wasm"
CAPS = {"fork": True, "backtrack": True, "ff_tokens": True}

Pick = Callable[["Seq", np.ndarray], int]   # (sequence, allowed token ids) -> token


class Host:
    """One WasmEngine over the real tokenizer; instantiates controllers like the runtime's `instantiate`."""

    def __init__(self) -> None:
        self.settings = Settings()
        self.hf = load_tokenizer(self.settings)
        self.tok = TokenizerInfo.from_hf(self.hf)
        self.engine = WasmEngine(self.settings.controllers, self.tok)
        self._modules: dict[bytes, object] = {}
        self._mask = (ctypes.c_uint32 * self.tok.mask_words)()

    def module(self, wasm: bytes):
        if wasm not in self._modules:
            self._modules[wasm] = self.engine.prepare(self.engine.compile(wasm))
        return self._modules[wasm]

    def instantiate(self, wasm: bytes, arg: bytes | str | dict = b"", prompt: list[int] | None = None,
                    request: RequestState | None = None, seq_id: int = 1) -> WasmInstance:
        if isinstance(arg, dict):
            arg = json.dumps(arg)
        if isinstance(arg, str):
            arg = arg.encode()
        request = request or RequestState(req_id="test", module_arg=arg)
        host = SeqHost(self.tok, request, CAPS, self.settings.controllers.max_log_bytes)
        host.seq_id = seq_id
        inst = WasmInstance(WasmController(self.engine, self.module(wasm), host), self.settings.controllers)
        inst.setup(prompt if prompt is not None else [])
        return inst

    def mid(self, inst: WasmInstance, fork_group: list[int]):
        """mid_process; returns (result, allowed token ids or None)."""
        addr = ctypes.addressof(self._mask)
        ctypes.memset(addr, 0, ctypes.sizeof(self._mask))
        res = inst.mid_process(fork_group, addr)
        if res != "Stop" and res.SampleWithBias is not None:
            bits = np.unpackbits(np.frombuffer(bytes(self._mask), dtype=np.uint8), bitorder="little")
            return res, np.flatnonzero(bits[: self.tok.vocab_size])
        return res, None

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.tok.token_bytes[t] for t in tokens).decode("utf-8", "replace")


@dataclass
class Seq:
    id: int
    inst: WasmInstance
    tokens: list[int]
    prompt_len: int
    done: bool = False
    error: str = ""
    logs: str = ""
    steps: int = 0
    events: list[str] = field(default_factory=list)


class Run:
    """A request: its sequences (forks included) stepped together, like the scheduler's step loop."""

    def __init__(self, host: Host, wasm: bytes, arg, prompt: str | list[int], pick: Pick,
                 max_steps: int = 200) -> None:
        self.host, self.pick, self.max_steps = host, pick, max_steps
        ids = host.tok.tokenize(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        self.request = RequestState(req_id="run", module_arg=json.dumps(arg).encode() if isinstance(arg, dict)
                                    else (arg.encode() if isinstance(arg, str) else arg))
        inst = host.instantiate(wasm, self.request.module_arg, ids, request=self.request, seq_id=1)
        self.seqs = [Seq(1, inst, ids, len(ids))]
        self.next_id = 2

    def _log(self, seq: Seq) -> None:
        seq.logs += seq.inst.host.logs_text()

    def step(self) -> bool:
        """One scheduler step over all live sequences; False when none is left."""
        live = [s for s in self.seqs if not s.done]
        if not live:
            return False
        mid_ops: list[tuple[Seq, list[int]]] = []
        for s in live:
            pre = s.inst.pre_process()
            self._log(s)
            if pre.ff_tokens:
                s.tokens += pre.ff_tokens
                if s.inst.post_process(pre.ff_tokens, 0).stop:
                    s.done = True
                    continue
            if pre.num_forks == 0:
                s.done = True
                s.events.append("pre:stop")
                continue
            if pre.suspend:
                s.events.append("suspend")
                continue
            group = [s]
            for _ in range(pre.num_forks - 1):
                child = Seq(self.next_id, s.inst.fork(self.next_id), list(s.tokens), s.prompt_len)
                self.next_id += 1
                self.seqs.append(child)
                group.append(child)
            for g in group:
                mid_ops.append((g, [x.id for x in group]))
        for s, group in mid_ops:
            s.steps += 1
            res, allowed = self.host.mid(s.inst, group)
            self._log(s)
            if res == "Stop":
                s.done = True
                s.events.append("mid:stop")
                continue
            if allowed is not None:
                assert len(allowed), "empty mask"
                tok = int(self.pick(s, allowed))
                assert tok in set(allowed.tolist()), f"picked {tok} outside the mask"
                new, bt = [tok], 0
            else:
                new, bt = list(res.Splice.ff_tokens), res.Splice.backtrack
                s.events.append(f"splice:{bt}:{len(new)}")
            if bt:
                del s.tokens[len(s.tokens) - bt:]
            s.tokens += new
            stop = s.inst.post_process(new, bt).stop
            self._log(s)
            if stop:
                s.done = True
                s.events.append("post:stop")
        return True

    def run(self) -> Run:
        for _ in range(self.max_steps):
            if not self.step():
                return self
        raise AssertionError(f"controller did not finish in {self.max_steps} steps")

    def text(self, seq: Seq | None = None) -> str:
        seq = seq or self.seqs[0]
        return self.host.text(seq.tokens[seq.prompt_len:])

    def var(self, name: str) -> str | None:
        v = self.request.storage.vars.get(name)
        return v[1].decode() if v else None


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
