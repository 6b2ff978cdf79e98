"""Uploaded Wasm modules and their tags, persisted under ``settings.controller_module_dir``:

    wasm/<id>.wasm                 the module as uploaded (id = sha256 hex of these bytes)
    compiled/<id>.<cache_key>.bin  wasmtime's serialized artifact (bound to wasmtime version + config)
    meta/<id>.json                 {"created", "created_by", "wasm_size", "compiled_size", "uploaded_by"}
    tags.json                      {tag: {"module_id", "updated_at", "updated_by", "owner", "public"}}

Files are written to a temporary name and renamed, so a crash never leaves a half-written one.
Only artifacts this registry produced are deserialized (wasmtime artifacts must be trusted).

Ownership. Modules are content-addressed: whoever names a module's id has its bytes (or was given the id), so a
module is usable by anyone who names it. A tag is a name one user gives a module, under the rules of
:mod:`common.tags`: its owner is the user who first set it, an admin's is public (every user sees and may
instantiate it), any other exists only for its owner and admins: another user's ``get_tags`` does not list it,
and instantiating it is "unknown controller module or tag", as for a name no one set. Only its owner or an admin
may move a tag. Tags stored before owners existed stay public.

Quotas (``tenants.max_modules_per_user``, ``max_module_bytes_per_user``; :mod:`common.quotas`): a module counts,
with its Wasm bytes, for every user who uploaded it (``uploaded_by``); uploading one again costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

import wasmtime

from common import quotas, tags
from common.config import Tenants
from common.wire import Principal
from services.controller_runtime.wasm import ControllerError, WasmEngine, WasmModule

_HEX64 = re.compile(r"[0-9a-f]{64}")


class RegistryError(ValueError):
    """A user error (unknown module, bad tag...)."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _owner(entry: dict) -> str:
    return entry.get("owner", entry["updated_by"])


def _uploaders(meta: dict) -> list[str]:
    return meta.get("uploaded_by", [meta["created_by"]])


def _public(entry: dict) -> bool:
    return entry.get("public", "owner" not in entry)


def visible(entry: dict, who: Principal) -> bool:
    """Whether ``who`` sees (and may instantiate) the tag stored as ``entry`` (see the module docstring)."""
    return tags.visible(_owner(entry), _public(entry), who)


class ModuleRegistry:
    def __init__(self, root: Path, engine: WasmEngine, limits: Tenants | None = None) -> None:
        self.root = root
        self.engine = engine
        self.limits = limits or Tenants()
        for sub in ("wasm", "compiled", "meta"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._tags_path = root / "tags.json"
        self._tags: dict[str, dict] = json.loads(self._tags_path.read_text()) if self._tags_path.exists() else {}
        self._loaded: dict[str, WasmModule] = {}
        self._lock = threading.Lock()  # mk_module/instantiate run in worker threads
        self._uploading: dict[tuple[str, str], int] = {}  # (user, module id) -> bytes, counted by the quotas

    def _artifact(self, module_id: str) -> Path:
        return self.root / "compiled" / f"{module_id}.{self.engine.cache_key}.bin"

    def _meta(self, module_id: str) -> dict:
        return json.loads((self.root / "meta" / f"{module_id}.json").read_text())

    def exists(self, module_id: str) -> bool:
        return bool(_HEX64.fullmatch(module_id)) and (self.root / "wasm" / f"{module_id}.wasm").exists()

    def create(self, wasm: bytes, user: str) -> dict:
        """mk_module: validate, compile, cache; returns {"module_id","wasm_size","compiled_size","time"}."""
        if len(wasm) > self.engine.settings.max_module_bytes:
            raise RegistryError(f"module is {len(wasm)} bytes, more than the limit of "
                                f"{self.engine.settings.max_module_bytes}")
        module_id = hashlib.sha256(wasm).hexdigest()
        start = time.perf_counter()
        with self._lock:  # checked and reserved at once: two uploads at a time cannot both take the last slot
            new = not (self.exists(module_id) and user in _uploaders(self._meta(module_id)))
            if new:
                self._check_quotas(user, module_id, len(wasm))
                self._uploading[(user, module_id)] = len(wasm)
        try:
            return self._store(wasm, module_id, user, start)
        finally:
            with self._lock:
                self._uploading.pop((user, module_id), None)

    def _store(self, wasm: bytes, module_id: str, user: str, start: float) -> dict:
        compiled_size = None
        if not (self.exists(module_id) and self._artifact(module_id).exists()):
            try:
                compiled = self.engine.compile(wasm)
                prepared = self.engine.prepare(compiled)
            except ControllerError as exc:
                raise RegistryError(str(exc)) from exc
            artifact = compiled.serialize()
            compiled_size = len(artifact)
        with self._lock:  # the module, its artifact and its meta change together (the same module may be uploading twice)
            meta_path = self.root / "meta" / f"{module_id}.json"
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {
                "created": int(time.time()), "created_by": user, "wasm_size": len(wasm), "uploaded_by": []}
            if compiled_size is not None:
                _write_atomic(self.root / "wasm" / f"{module_id}.wasm", wasm)
                _write_atomic(self._artifact(module_id), artifact)
                self._loaded[module_id] = prepared
                meta["compiled_size"] = compiled_size
            if compiled_size is not None or user not in _uploaders(meta):
                meta["uploaded_by"] = [*_uploaders(meta), *([] if user in _uploaders(meta) else [user])]
                _write_atomic(meta_path, json.dumps(meta).encode())
        return {"module_id": module_id, "wasm_size": meta["wasm_size"], "compiled_size": meta["compiled_size"],
                "time": round((time.perf_counter() - start) * 1000)}

    def _check_quotas(self, user: str, module_id: str, size: int) -> None:
        """Whether ``user`` may upload one more module (``module_id``, ``size`` bytes), counting the ones
        they have and the ones they are uploading now; QuotaExceeded if not. Under the lock."""
        limits = self.limits
        if not (limits.max_modules_per_user or limits.max_module_bytes_per_user):
            return  # (no limit: no walk over every module's meta)
        theirs = {mid: meta["wasm_size"] for mid, meta in ((mid, self._meta(mid)) for mid in self._module_ids())
                  if user in _uploaders(meta)}
        theirs.update({mid: size for (who, mid), size in self._uploading.items() if who == user})
        theirs.pop(module_id, None)  # (the same module uploading twice at once counts once)
        quotas.check("max_modules_per_user", limits.max_modules_per_user, user, len(theirs), 1, "controller modules")
        quotas.check("max_module_bytes_per_user", limits.max_module_bytes_per_user, user,
                     sum(theirs.values()), size, "bytes of controller modules")

    def _module_ids(self) -> list[str]:
        return [path.stem for path in (self.root / "meta").glob("*.json")]

    def resolve(self, ref: str, who: Principal) -> tuple[str, WasmModule]:
        """A module id or a tag ``who`` sees -> (module id, ready module); RegistryError when unknown."""
        entry = self._tags.get(ref)
        tagged = entry["module_id"] if entry is not None and visible(entry, who) else None
        module_id = ref if _HEX64.fullmatch(ref) else tagged
        if module_id is None or not self.exists(module_id):
            raise RegistryError(f"unknown controller module or tag {ref!r}")
        with self._lock:
            module = self._loaded.get(module_id)
            if module is None:
                module = self._load(module_id)
                self._loaded[module_id] = module
        return module_id, module

    def _load(self, module_id: str) -> WasmModule:
        artifact = self._artifact(module_id)
        if artifact.exists():
            try:
                return self.engine.prepare(self.engine.deserialize(artifact.read_bytes()))
            except wasmtime.WasmtimeError:  # damaged artifact: recompile from the module
                pass
        compiled = self.engine.compile((self.root / "wasm" / f"{module_id}.wasm").read_bytes())
        _write_atomic(artifact, compiled.serialize())
        return self.engine.prepare(compiled)

    def _tag_info(self, tag: str) -> dict:
        entry = self._tags[tag]
        meta = self._meta(entry["module_id"])
        return {"tag": tag, "module_id": entry["module_id"], "updated_at": entry["updated_at"],
                "updated_by": entry["updated_by"], "wasm_size": meta["wasm_size"],
                "compiled_size": meta["compiled_size"]}

    def set_tags(self, module_id: object, names: object, who: Principal) -> list[dict]:
        if not isinstance(module_id, str) or not self.exists(module_id):
            raise RegistryError(f"unknown module id {module_id!r}")
        if not isinstance(names, list) or not names:
            raise RegistryError("tags must be a non-empty list of strings")
        now = int(time.time())
        with self._lock:
            try:  # all or nothing: every tag is checked before any moves
                checked = [tags.check_tag(t, who.user, who.admin) for t in names]
                for tag in checked:
                    entry = self._tags.get(tag)
                    tags.check_move(tag, None if entry is None else _owner(entry), who)
            except tags.TagError as exc:
                raise RegistryError(str(exc)) from exc
            for tag in checked:
                entry = self._tags.get(tag)
                owner, public = tags.new_tag(who) if entry is None else (_owner(entry), _public(entry))
                self._tags[tag] = {"module_id": module_id, "updated_at": now, "updated_by": who.user,
                                   "owner": owner, "public": public}
            _write_atomic(self._tags_path, json.dumps(self._tags, indent=1).encode())
        return [self._tag_info(t) for t in checked]

    def get_tags(self, who: Principal) -> list[dict]:
        """The tags ``who`` sees, most recently updated first (ties by name)."""
        with self._lock:
            names = sorted((t for t, entry in self._tags.items() if visible(entry, who)),
                           key=lambda t: (-self._tags[t]["updated_at"], t))
            return [self._tag_info(t) for t in names]
