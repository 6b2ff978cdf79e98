"""Regenerate the checked-in Python stubs for Tiller's gRPC protocols.

Run from the repository root::

    python -m common.protos.build

This runs ``grpc_tools.protoc`` on every ``.proto`` in :data:`PROTOS` (paths
relative to this directory, which is the protoc include root) and writes
``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` next to each ``.proto``.

protoc names Python modules after the proto's path (``salience.v1``), but
the stubs live inside the ``common.protos`` package, so generated imports and
module names are rewritten to ``common.protos.salience.v1`` etc.  The proto
*file* names registered in the descriptor pool stay ``salience/v1/salience.proto``
and ``evergreen/v2/evergreen.proto``; nothing of this affects the wire format.

The generated files are checked in, so nothing needs protoc (grpcio-tools) at
run time; ``tests/unit/test_protos.py`` regenerates them into a temporary
directory and checks they are byte-identical to the checked-in ones.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = "common.protos"

PROTOS: tuple[str, ...] = (
    "salience/v1/salience.proto",
    "evergreen/v2/evergreen.proto",
)

GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_files() -> list[str]:
    """Paths (relative to PROTO_ROOT) of every file the build writes."""
    out = []
    for proto in PROTOS:
        stem = proto[: -len(".proto")]
        out.extend(stem + suffix for suffix in GENERATED_SUFFIXES)
    return out


def _proto_packages() -> list[str]:
    """Python package names protoc derives from the proto directories."""
    return sorted({str(Path(p).parent).replace("/", ".") for p in PROTOS})


def _fix_imports(text: str) -> str:
    for pkg in _proto_packages():
        esc = re.escape(pkg)
        # `from salience.v1 import salience_pb2 as ...` (grpc stubs, pyi files)
        text = re.sub(rf"^from {esc} import ", f"from {PACKAGE}.{pkg} import ", text, flags=re.M)
        # `import salience.v1.salience_pb2` (protoc's form for some layouts)
        text = re.sub(rf"^import {esc}\.", f"import {PACKAGE}.{pkg}.", text, flags=re.M)
        # module name given to the builder -> the classes' __module__
        text = re.sub(
            rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'{esc}\.",
            rf"\1'{PACKAGE}.{pkg}.",
            text,
        )
    return text


def _include_dir() -> str:
    import grpc_tools  # imported lazily: only needed to regenerate

    return str(Path(grpc_tools.__file__).resolve().parent / "_proto")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on PROTOS, writing the fixed-up stubs under ``out_dir``.

    Returns the written paths.  Raises RuntimeError if protoc fails.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={_include_dir()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    res = subprocess.run(cmd, cwd=PROTO_ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"protoc failed ({res.returncode}):\n{res.stdout}{res.stderr}")
    written = []
    for rel in generated_files():
        path = out_dir / rel
        if not path.is_file():
            raise RuntimeError(f"protoc did not produce {rel}")
        path.write_bytes(_fix_imports(path.read_text(encoding="utf-8")).encode("utf-8"))
        written.append(path)
    return written


def build() -> list[Path]:
    """Regenerate the checked-in stubs in place (via a scratch dir)."""
    with tempfile.TemporaryDirectory(prefix="tiller-protos-") as tmp:
        generate(Path(tmp))
        dests = []
        for rel in generated_files():
            dest = PROTO_ROOT / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / rel, dest)
            dests.append(dest)
    # every directory from common/protos down to the stubs is a regular package
    for rel in generated_files():
        d = (PROTO_ROOT / rel).parent
        while d != PROTO_ROOT.parent:
            (d / "__init__.py").touch(exist_ok=True)
            d = d.parent
    return dests


def main() -> int:
    for path in build():
        print(path.relative_to(PROTO_ROOT.parent.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
