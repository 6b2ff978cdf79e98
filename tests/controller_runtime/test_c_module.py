"""A controller written in C and compiled with clang (freestanding wasm32, the ABI.md flags): the host
runs it, forks it (static state copied, then independent) and reads its logit bias."""

from __future__ import annotations

import subprocess

import pytest

from common import aici_wire
from tests.controller_runtime.conftest import allowed, mid, row, start

C_SOURCE = r"""
#define IMPORT(n) __attribute__((import_module("env"), import_name(n)))
#define EXPORT(n) __attribute__((export_name(n)))
typedef unsigned int u32;
IMPORT("aici_host_return_process_result") void ret(const char *p, u32 n);
IMPORT("aici_host_return_logit_bias") void ret_bias(const u32 *p);
IMPORT("aici_host_vocab_size") u32 vocab_size(void);
IMPORT("aici_host_eos_token") u32 eos_token(void);
IMPORT("aici_host_self_seq_id") u32 self_seq_id(void);

static u32 mask[4096];
static u32 steps;
static u32 len(const char *s) { u32 n = 0; while (s[n]) n++; return n; }
static void reply(const char *s) { ret(s, len(s)); }

EXPORT("aici_init") void aici_init(void) {}
EXPORT("aici_create") int aici_create(void) { return 1; }
EXPORT("aici_init_prompt") void init_prompt(int h) { reply("{}"); }
EXPORT("aici_pre_process") void pre_process(int h) {
    reply(steps == 1 ? "{\"num_forks\":2,\"suspend\":false,\"ff_tokens\":[]}"
                     : "{\"num_forks\":1,\"suspend\":false,\"ff_tokens\":[]}");
}
EXPORT("aici_mid_process") void mid_process(int h) {
    /* allow token (seq id + steps): forks diverge through seq id, static state through steps */
    u32 t = self_seq_id() * 10 + steps;
    for (u32 i = 0; i < (vocab_size() + 31) / 32; i++) mask[i] = 0;
    mask[t / 32] |= 1u << (t % 32);
    ret_bias(mask);
    reply("{\"SampleWithBias\":{}}");
}
EXPORT("aici_post_process") void post_process(int h) { steps++; reply("{\"stop\":false}"); }
"""


@pytest.fixture(scope="module")
def c_module(have_clang, tmp_path_factory) -> bytes:
    d = tmp_path_factory.mktemp("c")
    (d / "ctl.c").write_text(C_SOURCE)
    subprocess.run([have_clang, "--target=wasm32", "-O2", "-nostdlib", "-Wl,--no-entry", "-Wl,--stack-first",
                    "-mmutable-globals", "-Wl,--export=__stack_pointer", "-o", str(d / "ctl.wasm"), str(d / "ctl.c")],
                   check=True)
    return (d / "ctl.wasm").read_bytes()


def test_c_controller_steps_and_forks(runtime, tokenizer, c_module):
    assert start(runtime, c_module, 1)["result"]["num_forks"] == 1
    data, rows = mid(runtime, (1, None))
    assert allowed(row(rows, 0, tokenizer)) == {10}
    pre = runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=1, tokens=[10])]))
    assert pre["pre_seqs"]["1"]["result"]["num_forks"] == 2
    data, rows = mid(runtime, (1, None), (2, 1))
    assert data["seqs"]["2"]["error"] == "", data
    assert allowed(row(rows, 0, tokenizer)) == {11} and allowed(row(rows, 1, tokenizer)) == {21}
    runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=2, tokens=[21])]))
    data, rows = mid(runtime, (1, None), (2, None))
    assert allowed(row(rows, 0, tokenizer)) == {11} and allowed(row(rows, 1, tokenizer)) == {22}
