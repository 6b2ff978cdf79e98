"""Builds every controller in controllers/src/*.c, linked with the SDK in controllers/sdk/, into
controllers/wasm/<name>.wasm (freestanding wasm32, clang + wasm-ld; stripped, so the output is reproducible
byte for byte with the same clang version).

    python controllers/build.py                 # rebuild controllers/wasm/
    python controllers/build.py --out DIR       # build into DIR instead
    python controllers/build.py --check         # rebuild into a temp dir and compare with controllers/wasm/
    python controllers/build.py --extra tests/controllers/sdk_test.c --out DIR   # also build extra sources
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SDK = ROOT / "sdk"
SRC = ROOT / "src"
WASM = ROOT / "wasm"

CFLAGS = [
    "--target=wasm32", "-Oz", "-nostdlib", "-ffreestanding", "-fno-ident",
    "-mbulk-memory", "-mmutable-globals", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
]
LDFLAGS = [
    "-Wl,--no-entry", "-Wl,--stack-first", "-Wl,-z,stack-size=131072",
    "-Wl,--export=__stack_pointer", "-Wl,--strip-all", "-Wl,--gc-sections",
]


def clang() -> str | None:
    """The clang driver, if it and wasm-ld are installed."""
    cc = shutil.which("clang") or shutil.which("clang-14")
    if cc is None or not (shutil.which("wasm-ld") or shutil.which("wasm-ld-14")):
        return None
    return cc


def toolchain() -> str:
    """First line of `clang --version`: the committed bytes are only reproducible with the same version."""
    out = subprocess.run([clang() or "clang", "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


def sdk_sources() -> list[Path]:
    return sorted(SDK.glob("*.c"))


def controller_sources() -> list[Path]:
    return sorted(SRC.glob("*.c"))


def build_one(source: Path, out_dir: Path) -> Path:
    cc = clang()
    if cc is None:
        raise RuntimeError("clang and wasm-ld (Debian: apt-get install clang lld) are needed to build controllers")
    source, out_dir = source.resolve(), out_dir.resolve()
    out = out_dir / f"{source.stem}.wasm"
    # Relative paths keep the command (and so the output) independent of where the checkout lives.
    files = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in [*sdk_sources(), source]]
    cmd = [cc, *CFLAGS, f"-I{SDK.relative_to(ROOT)}", *LDFLAGS, "-o", str(out), *files]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def build_all(out_dir: Path, extra: list[Path] = ()) -> list[Path]:
    """Builds every controller (and `extra` sources) into out_dir; records the compiler in out_dir/TOOLCHAIN."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = [build_one(src, out_dir) for src in [*controller_sources(), *extra]]
    (out_dir / "TOOLCHAIN").write_text(toolchain() + "\n")
    return built


def committed_toolchain() -> str:
    path = WASM / "TOOLCHAIN"
    return path.read_text().strip() if path.exists() else "unknown"


def check() -> list[str]:
    """Names of committed modules that differ from a fresh build (or are missing/extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        built = {p.name: p.read_bytes() for p in build_all(Path(tmp))}
    committed = {p.name: p.read_bytes() for p in WASM.glob("*.wasm")}
    return sorted(n for n in built.keys() | committed.keys() if built.get(n) != committed.get(n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=WASM)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--extra", type=Path, action="append", default=[])
    args = ap.parse_args()
    if args.check:
        bad = check()
        print(f"differ: {', '.join(bad)} (committed with {committed_toolchain()!r}, here {toolchain()!r})"
              if bad else "all controllers match their sources")
        return 1 if bad else 0
    for p in build_all(args.out, [e.resolve() for e in args.extra]):
        print(f"{p}  {p.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
