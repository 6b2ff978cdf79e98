"""Builds and loads the GGUF block kernel (``gguf_kernel.cpp``) as a torch operator library.

The library is compiled once per machine into ``<cache_dir>/kernels/``, named by a digest of what
its code depends on: the source, torch's version, the compiler's version and flags, and the CPU's
feature flags (``-march=native`` compiles for this CPU; a cache shared with another CPU builds
again). The first build takes about 20 s (the torch headers), later starts load it in milliseconds.
A compile runs into a temporary file renamed into place, under a lock in the cache: a worker starting
beside one that builds (two containers on a shared cache volume) waits for that build and loads its library
instead of compiling the same one again. Anything that goes wrong (no compiler, a CPU without AVX-512 or
AVX2, a failed build or load) is logged with the reason and reported as ``False``: the caller serves
another kernel instead.

``python -m services.worker.kernel_build`` builds it ahead of the first start (``make install``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import structlog
import torch

from common import model_cache

SOURCE = Path(__file__).with_name("gguf_kernel.cpp")
FLAGS = ("-O3", "-march=native", "-std=c++20", "-fopenmp", "-shared", "-fPIC", "-w")
BUILD_TIMEOUT_S = 300
log = structlog.get_logger()

_loaded: dict[Path, bool] = {}


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def cpu_supported() -> bool:
    """Whether this CPU has the vector instructions the kernel is written in: AVX-512 (AVX-512F), or
    AVX2 with FMA and F16C (its 16-lane vectors then two 8-lane halves)."""
    flags = _cpu_flags()
    if flags in ("AVX512", "AVX2"):  # torch's word for it, where /proc/cpuinfo is not there
        return True
    present = set(flags.split())
    return "avx512f" in present or {"avx2", "fma", "f16c"} <= present


def library_path(cache_dir: Path, compiler: str) -> Path:
    """Where the library for this source, torch, compiler and CPU lives."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    sha = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), version.encode(), " ".join(FLAGS).encode(),
                 _cpu_flags().encode()):
        sha.update(hashlib.sha256(part).digest())
    return cache_dir / model_cache.KERNELS / f"gguf_kernel-{sha.hexdigest()[:16]}.so"


def _compile(compiler: str, target: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [compiler, *FLAGS, abi, *(f"-I{p}" for p in include_paths()), str(SOURCE), "-o", str(tmp),
               f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def _build_once(compiler: str, path: Path) -> None:
    """Compile the library at ``path``, unless another process did while this one waited for the cache's build
    lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():  # built meanwhile
            return
        started = time.monotonic()
        _compile(compiler, path)
        log.info("worker.kernel_built", path=str(path), seconds=round(time.monotonic() - started, 1))
        for other in path.parent.glob("gguf_kernel-*.so"):  # older source, torch or CPU: never loaded again
            if other != path:
                other.unlink(missing_ok=True)


def load(cache_dir: Path) -> bool:
    """Whether ``torch.ops.tiller_gguf.linear`` is there, building the library first if needed."""
    if cache_dir in _loaded:
        return _loaded[cache_dir]
    if hasattr(torch.ops.tiller_gguf, "linear"):  # loaded from another cache directory
        _loaded[cache_dir] = True
        return True
    ok = False
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
        if not cpu_supported():
            raise RuntimeError("this CPU has neither AVX-512 nor AVX2 with FMA and F16C, the instructions the kernel "
                                   "is written in")
        path = library_path(cache_dir, compiler)
        if not path.is_file():
            _build_once(compiler, path)
        torch.ops.load_library(str(path))
        ok = True
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("worker.kernel_unavailable", reason=str(exc))
    _loaded[cache_dir] = ok
    return ok


if __name__ == "__main__":
    from common.config import Settings

    sys.exit(0 if load(Settings().cache_dir) else 1)
