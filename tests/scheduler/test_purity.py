"""The core and what it uses do no I/O: no sockets, no event loop, no tokenizer or model loading."""

import ast
import subprocess
import sys
from pathlib import Path

PURE = ["core", "state", "admission", "steps", "results", "endings", "membership", "outbox", "controlled",
        "requests", "sessions", "workers", "batch", "batch_ceiling"]
FORBIDDEN = {"zmq", "asyncio", "transformers", "torch", "common.sockets", "common.model_source"}


def test_the_core_modules_import_no_io():
    root = Path(__file__).resolve().parents[2] / "services" / "scheduler"
    for name in PURE:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] in FORBIDDEN or m in FORBIDDEN}, name
        assert not {m for m in imported if m.startswith("services.") and not m.startswith("services.scheduler.")}


def test_importing_the_core_loads_no_socket_library():
    code = "import sys, services.scheduler.core; print(sorted({'zmq', 'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
