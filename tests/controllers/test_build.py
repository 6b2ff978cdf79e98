"""The committed controllers/wasm/*.wasm are exactly what controllers/build.py makes from source."""

import subprocess
import sys

from controllers import build


def test_committed_modules_match_a_fresh_build(have_clang, tmp_path):
    built = {p.name: p.read_bytes() for p in build.build_all(tmp_path)}
    committed = {p.name: p.read_bytes() for p in build.WASM.glob("*.wasm")}
    assert sorted(built) == sorted(committed) == ["concept_guard.wasm", "constrain.wasm", "declctrl.wasm",
                                                  "uppercase.wasm", "yesno.wasm"]
    stale = [name for name in built if built[name] != committed[name]]
    assert not stale, (f"{stale} differ from a fresh build: rebuild with `python controllers/build.py` and commit "
                       f"(committed with {build.committed_toolchain()!r}, this machine has {build.toolchain()!r})")


def test_build_is_deterministic(have_clang, tmp_path):
    outs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        outs.append(build.build_one(build.SRC / "declctrl.c", tmp_path / name).read_bytes())
    assert outs[0] == outs[1]


def test_check_cli_reports_match(have_clang):
    proc = subprocess.run([sys.executable, str(build.ROOT / "build.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all controllers match" in proc.stdout


def test_modules_are_small_and_export_the_abi():
    import wasmtime

    engine = wasmtime.Engine()
    for path in build.WASM.glob("*.wasm"):
        assert path.stat().st_size < 64 * 1024, path
        names = {e.name for e in wasmtime.Module(engine, path.read_bytes()).exports}
        assert {"memory", "__stack_pointer", "aici_init", "aici_create", "aici_init_prompt", "aici_pre_process",
                "aici_mid_process", "aici_post_process"} <= names, path
