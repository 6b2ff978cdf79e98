"""Tiny test controllers written in WAT: a template that satisfies the ABI, with overridable bodies."""

from __future__ import annotations

import wasmtime

PRE_OK = '{"num_forks":1,"suspend":false,"ff_tokens":[]}'
POST_OK = '{"stop":false}'
MID_SAMPLE = '{"SampleWithBias":{}}'

_IMPORTS = """
  (import "env" "aici_host_read_blob" (func $read_blob (param i32 i32 i32) (result i32)))
  (import "env" "aici_host_process_arg" (func $process_arg (result i32)))
  (import "env" "aici_host_module_arg" (func $module_arg (result i32)))
  (import "env" "aici_host_return_process_result" (func $ret (param i32 i32)))
  (import "env" "aici_host_return_logit_bias" (func $ret_bias (param i32)))
  (import "env" "aici_host_storage_cmd" (func $storage (param i32 i32) (result i32)))
  (import "env" "aici_host_tokenize" (func $tokenize (param i32 i32) (result i32)))
  (import "env" "aici_host_self_seq_id" (func $self_seq_id (result i32)))
  (import "env" "aici_host_vocab_size" (func $vocab_size (result i32)))
  (import "env" "aici_host_eos_token" (func $eos (result i32)))
  (import "env" "aici_host_stop" (func $stop))
  (import "env" "tiller_constraint_new" (func $c_new (param i32 i32 i32) (result i32)))
  (import "env" "tiller_constraint_commit" (func $c_commit (param i32 i32 i32) (result i32)))
  (import "env" "tiller_constraint_return_bias" (func $c_bias (param i32) (result i32)))
  (import "env" "tiller_constraint_mask" (func $c_mask (param i32 i32) (result i32)))
  (import "env" "tiller_constraint_ff_tokens" (func $c_ff (param i32 i32 i32) (result i32)))
  (import "env" "tiller_steer" (func $steer (param i32 i32) (result i32)))
  (import "env" "tiller_readout" (func $readout (param i32 i32) (result i32)))
  (import "env" "tiller_readout_info" (func $readout_info (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
"""


_ONES = "\\ff" * 8192


def str_data(offset: int, text: str) -> str:
    escaped = "".join(c if c.isalnum() or c in " {}[]:,._-" else f"\\{ord(c):02x}" for c in text)
    return f'(data (i32.const {offset}) "{escaped}")'


def ret_const(offset: int, text: str) -> str:
    """Body that returns ``text`` (placed at ``offset`` by a data segment) as the process result."""
    return f"(call $ret (i32.const {offset}) (i32.const {len(text.encode())}))"


def controller(*, init_prompt: str | None = None, pre: str | None = None, mid: str | None = None,
               post: str | None = None, create: str = "(i32.const 7)", extra: str = "", data: str = "",
               pages: int = 2) -> bytes:
    """A controller module; bodies default to: {} / PRE_OK / all-ones bias + SampleWithBias / POST_OK.

    Fixed data: 1024 = "{}", 1100 = PRE_OK, 1200 = POST_OK, 1300 = MID_SAMPLE, 4096.. = all-ones bitset
    (8 KiB), scratch from 16384; a mutable exported global $counter.
    """
    init_prompt = ret_const(1024, "{}") if init_prompt is None else init_prompt
    pre = ret_const(1100, PRE_OK) if pre is None else pre
    post = ret_const(1200, POST_OK) if post is None else post
    mid = f"(call $ret_bias (i32.const 4096)) {ret_const(1300, MID_SAMPLE)}" if mid is None else mid
    wat = f"""(module {_IMPORTS}
  (memory (export "memory") {pages})
  (global $counter (export "counter") (mut i32) (i32.const 0))
  {str_data(1024, "{}")} {str_data(1100, PRE_OK)} {str_data(1200, POST_OK)} {str_data(1300, MID_SAMPLE)}
  (data (i32.const 4096) "{_ONES}")
  {data}
  (func (export "aici_init"))
  (func (export "aici_create") (result i32) {create})
  (func (export "aici_init_prompt") (param $h i32) {init_prompt})
  (func (export "aici_pre_process") (param $h i32) {pre})
  (func (export "aici_mid_process") (param $h i32) {mid})
  (func (export "aici_post_process") (param $h i32) {post})
  {extra}
)"""
    return wasmtime.wat2wasm(wat)
