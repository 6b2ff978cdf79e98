"""Packed per-slot arrays (token ids, sequence ids, logprobs) as message fields carry them: little-endian
``bytes``, whatever the host's order."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any


_SWAP = sys.byteorder != "little"


def _pack(typecode: str, values: Iterable[Any]) -> bytes:
    packed = array(typecode, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: bytes) -> list[Any]:
    """ValueError when ``data`` is not whole entries."""
    return _unpack_array(typecode, data).tolist()


def _unpack_array(typecode: str, data: bytes) -> array:
    packed = array(typecode)
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed


def pack_ids(seq_ids: Iterable[int]) -> bytes:
    """Sequence ids as int64 (``Step.follows``)."""
    return _pack("q", seq_ids)


def unpack_ids(data: bytes) -> list[int]:
    return _unpack("q", data)


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as int32 (``StepResult.tokens``)."""
    return _pack("i", tokens)


def unpack_tokens(data: bytes) -> list[int]:
    return _unpack("i", data)


def token_array(data: bytes) -> array:
    """Token ids from :func:`pack_tokens` bytes as an ``array("i")``: how the scheduler keeps a prompt and
    a sequence's tokens. Unlike a list it holds no objects, so the cyclic garbage collector never walks it
    (thousands of live prompts as lists made each collection walk millions of ints)."""
    return _unpack_array("i", data)


def token_array_bytes(tokens: array) -> bytes:
    """An ``array("i")`` of token ids as :func:`pack_tokens` packs them (a copy of its memory)."""
    if _SWAP:
        tokens = array("i", tokens)
        tokens.byteswap()
    return tokens.tobytes()


def pack_logprobs(logprobs: Iterable[float]) -> bytes:
    """Logprobs as float32 (``StepResult.logprobs``): they are float32 log-softmax values, so nothing is lost."""
    return _pack("f", logprobs)


def unpack_logprobs(data: bytes) -> list[float]:
    return _unpack("f", data)


assert array("q").itemsize == 8 and array("i").itemsize == 4 and array("f").itemsize == 4
