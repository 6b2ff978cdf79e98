"""The tokenizer as controllers see it: byte-level tokenize, per-token bytes, and AICI's serialized
token trie (ABI.md §5, toktrie's ``toktree.rs``), built once per process."""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance

TRIE_MAGIC = 0x558B6FD3
TRIE_HEADER_SIZE = 28
NO_TOKEN = 0xFFFFFF


@dataclass
class TokenizerInfo:
    """Everything the host needs from the model's tokenizer."""

    ll: llguidance.LLTokenizer
    vocab_size: int
    eos_token: int
    token_bytes: list[bytes]  # b"" for special tokens (they are not in the trie)
    trie_blob: bytes
    mask_words: int = field(init=False)  # u32 words of a mask row

    def __post_init__(self) -> None:
        self.mask_words = (self.vocab_size + 31) // 32

    def tokenize(self, data: bytes) -> list[int]:
        """HF tokenizer on the valid UTF-8 prefix, greedy trie tokenization of an invalid tail (AICI HEAD)."""
        return self.ll.tokenize_bytes(data)

    @classmethod
    def from_directory(cls, directory: Path) -> TokenizerInfo:
        """From a model directory's tokenizer.json through the tokenizers library (what transformers'
        fast tokenizer wraps): the runtime process needs neither transformers nor torch."""
        text = (directory / "tokenizer.json").read_text()
        eos = eos_token_id(directory, json.loads(text))
        ll = llguidance.LLTokenizer(text, eos_token=eos)
        vocab_size = ll.vocab_size
        token_bytes = [b"" if ll.is_special_token(t) else ll.decode_bytes([t]) for t in range(vocab_size)]
        return cls(ll=ll, vocab_size=vocab_size, eos_token=eos, token_bytes=token_bytes,
                   trie_blob=serialize_trie(token_bytes, eos))


def eos_token_id(directory: Path, tokenizer_json: dict[str, Any]) -> int:
    """The id of tokenizer_config.json's ``eos_token`` (a string or an added-token object) in
    tokenizer.json, else config.json's ``eos_token_id`` (the first, if a list)."""
    config = directory / "tokenizer_config.json"
    token = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    if isinstance(token, dict):
        token = token.get("content")
    ids = {t.get("content"): t.get("id") for t in tokenizer_json.get("added_tokens") or []}
    found = ids.get(token, (tokenizer_json.get("model") or {}).get("vocab", {}).get(token))
    if isinstance(found, int):
        return found
    model_config = directory / "config.json"
    eos = json.loads(model_config.read_text()).get("eos_token_id") if model_config.is_file() else None
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if not isinstance(eos, int):
        raise ValueError(f"{directory} names no end-of-sequence token (tokenizer_config.json eos_token or "
                         "config.json eos_token_id)")
    return eos


class _Node:
    __slots__ = ("children", "token")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.token = NO_TOKEN


def serialize_trie(token_bytes: list[bytes], eos: int) -> bytes:
    """AICI's TokTrie blob: header, DFS pre-order nodes, token offsets, token data (all little-endian).

    Nodes: ``bits = token_id << 8 | byte`` and ``bits2 = subtree_size << 8 | num_parents``; the root has
    byte 0xFF and no token; children are sorted by byte; ``num_parents`` is 1 for a non-last child and the
    parent's + 1 for the last one. Duplicate byte strings keep the first token id. The header's
    ``token_data_bytes`` field repeats ``trie_bytes``, as AICI writes it (its reader ignores the field).
    """
    root = _Node()
    for token, data in enumerate(token_bytes):
        if not data:
            continue
        node = root
        for byte in data:
            child = node.children.get(byte)
            if child is None:
                child = node.children[byte] = _Node()
            node = child
        if node.token == NO_TOKEN:
            node.token = token

    nodes: list[int] = []  # flattened (bits, bits2) pairs

    def emit(node: _Node, byte: int, num_parents: int) -> None:
        idx = len(nodes)
        nodes.extend((node.token << 8 | byte, num_parents))
        kids = sorted(node.children.items())
        for i, (child_byte, child) in enumerate(kids):
            emit(child, child_byte, num_parents + 1 if i == len(kids) - 1 else 1)
        nodes[idx + 1] |= ((len(nodes) - idx) // 2) << 8

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        emit(root, 0xFF, 0)
    finally:
        sys.setrecursionlimit(limit)

    offsets, data = [], bytearray()
    for tok in token_bytes:
        if len(tok) >= 1024:
            raise ValueError("token longer than 1023 bytes cannot be encoded in the trie")
        offsets.append(len(tok) | (len(data) << 10))
        data += tok
    trie_bytes = len(nodes) * 4
    header = struct.pack("<7I", TRIE_MAGIC, TRIE_HEADER_SIZE, trie_bytes, len(offsets) * 4, trie_bytes,
                         len(token_bytes), eos)
    return header + struct.pack(f"<{len(nodes)}I", *nodes) + struct.pack(f"<{len(offsets)}I", *offsets) + bytes(data)
