"""Fixed-seed mutation of client input for the fuzz tests: JSON bodies and frames (wrong types, extremes, deep
nesting, broken bytes), protobuf messages of any type built from their descriptors (field values from pools that
reach past the first checks, then sometimes corrupted: truncated, flipped, invalid UTF-8), and Wasm modules.

Most cases are refused before anything generates; the ones that generate ask for a token or two.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from google.protobuf import any_pb2, struct_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

# JSON values that broke servers before: huge and negative integers, denormal and enormous floats, wrong types,
# empty and nested lists, emoji and a lone surrogate
VALUES: list[Any] = [None, True, False, 0, -1, 1, 2, 7, 2**31, 2**63, -(2**63) - 1, 2**64, 0.5, -0.5, 1e308, 1e-320,
                     "", "x", "abc" * 50, [], [1], [-1], [2**40], ["a"], [[1, 2]], [[]], {}, {"a": 1}, {"1": 5},
                     [None], "\ud7ff", "\ud800", "😀" * 3, {"role": "user", "content": "Hi"},
                     [{"role": "user", "content": 5}], [{"role": "x"}]]
DEEP = "__deep__"  # stands for a nested value too deep to build with json.dumps
DEPTHS = [63, 64, 65, 300, 999, 5000]


def deep_json(rng: random.Random) -> str:
    depth = rng.choice(DEPTHS)
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return '{"a": ' * depth + "1" + "}" * depth


def corrupt(rng: random.Random, data: bytes) -> bytes:
    """Broken bytes: truncated, a byte changed, invalid UTF-8 inserted, or noise."""
    kind = rng.randrange(5)
    if kind == 0 or not data:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    pos = rng.randrange(len(data))
    if kind == 1:
        return data[:pos]
    if kind == 2:
        return data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1:]
    if kind == 3:
        return data[:pos] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]) + data[pos:]
    return data + data[: rng.randrange(len(data))]


def json_case(rng: random.Random, base: dict[str, Any], fields: list[str]) -> bytes:
    """``base`` with one to three fields removed, retyped or nested too deep (the first one of ``base``'s own, so
    that most cases are refused); sometimes its bytes broken."""
    body = json.loads(json.dumps(base))
    deep = None
    for i in range(rng.randint(1, 3)):
        field = rng.choice(list(base) if i == 0 else fields)
        roll = rng.random()
        if roll < 0.1:
            body.pop(field, None)
        elif roll < 0.2:
            body[field], deep = DEEP, deep_json(rng)
        else:
            body[field] = rng.choice(VALUES)
    text = json.dumps(body)
    if deep is not None:
        text = text.replace(json.dumps(DEEP), deep, 1)
    data = text.encode("utf-8", "surrogatepass")
    return corrupt(rng, data) if rng.random() < 0.15 else data


# -- protobuf ---------------------------------------------------------------------------------------

INTS = [0, 1, 2, 3, -1, 7, 100, 2**31 - 1, -(2**31)]
FLOATS = [0.0, 0.5, 1.0, -1.0, 2.0, math.inf, math.nan, 1e30]
STRINGS = ["", "x", "a b", "😀", "p", "r"]
STRUCT_URL = "type.googleapis.com/google.protobuf.Struct"


class ProtoFuzzer:
    """Random messages of any type: each field set or not, from ``pools[field name]`` when there is one."""

    def __init__(self, rng: random.Random, pools: dict[str, list[Any]] | None = None) -> None:
        self.rng = rng
        self.pools = pools or {}

    def message(self, cls: type[Message], depth: int = 0) -> Message:
        msg = cls()
        if cls is any_pb2.Any:
            msg.type_url = self.rng.choice([STRUCT_URL, STRUCT_URL, "type.googleapis.com/google.protobuf.Value", "x"])
            msg.value = self._struct_bytes() if self.rng.random() < 0.8 else corrupt(self.rng, self._struct_bytes())
            return msg
        for field in cls.DESCRIPTOR.fields:
            if self.rng.random() < 0.5 or (field.message_type is not None and depth > 3):
                continue
            if field.is_repeated:
                for _ in range(self.rng.randrange(4)):
                    self._add(msg, field, depth)
            else:
                self._set(msg, field, depth)
        return msg

    def _struct_bytes(self) -> bytes:
        struct = struct_pb2.Struct()
        for _ in range(self.rng.randrange(4)):
            key = self.rng.choice(self.pools.get("config_keys", ["max_tokens"]))
            value = self.rng.choice([v for v in VALUES if not isinstance(v, str) or v != "\ud800"])
            try:
                struct.update({key: value})
            except (ValueError, TypeError):  # a value Struct cannot hold (an int past a double)
                continue
        return struct.SerializeToString()

    def _value(self, field: FieldDescriptor) -> Any:
        pool = self.pools.get(field.name)
        if pool is not None:
            return self.rng.choice(pool)
        if field.type == FieldDescriptor.TYPE_STRING:
            return self.rng.choice(STRINGS)
        if field.type == FieldDescriptor.TYPE_BYTES:
            return self.rng.choice([b"", b"Hi", b"\xff\xfe", b"hello world"])
        if field.type == FieldDescriptor.TYPE_BOOL:
            return self.rng.random() < 0.5
        if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            return self.rng.choice(FLOATS)
        if field.type == FieldDescriptor.TYPE_ENUM:
            return self.rng.choice([v.number for v in field.enum_type.values])
        unsigned = field.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED32,
                                  FieldDescriptor.TYPE_FIXED64)
        return abs(self.rng.choice(INTS)) if unsigned else self.rng.choice(INTS)

    def _set(self, msg: Message, field: FieldDescriptor, depth: int) -> None:
        if field.message_type is not None:
            getattr(msg, field.name).CopyFrom(self.message(field.message_type._concrete_class, depth + 1))
        else:
            setattr(msg, field.name, self._value(field))

    def _add(self, msg: Message, field: FieldDescriptor, depth: int) -> None:
        if field.message_type is not None:
            getattr(msg, field.name).append(self.message(field.message_type._concrete_class, depth + 1))
        else:
            getattr(msg, field.name).append(self._value(field))

    def case(self, cls: type[Message]) -> bytes:
        """A message's bytes; one in five broken, one in ten with a string field that is not UTF-8."""
        data = self.message(cls).SerializeToString()
        roll = self.rng.random()
        if roll < 0.2:
            return corrupt(self.rng, data)
        if roll < 0.3:
            strings = [f for f in cls.DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_STRING]
            if strings:
                field = self.rng.choice(strings)
                return data + bytes([field.number << 3 | 2, 2]) + b"\xff\xfe"
        return data


# -- Wasm modules -----------------------------------------------------------------------------------

WASM_HEADER = b"\x00asm\x01\x00\x00\x00"
# an empty type section and an empty function section: a valid module with nothing in it
WASM_SECTIONS = [b"\x01\x01\x00", b"\x03\x01\x00", b"\x00\x03\x01ab", b"\x07\x01\x00"]


def wasm_case(rng: random.Random, controller: bytes) -> bytes:
    """A module: now and then ``controller`` as it is (compiled once), else a header with sections in any order,
    or broken bytes."""
    module = WASM_HEADER + b"".join(rng.sample(WASM_SECTIONS, rng.randrange(len(WASM_SECTIONS) + 1)))
    roll = rng.random()
    if roll < 0.02:
        return controller
    if roll < 0.6:
        return corrupt(rng, module)
    if roll < 0.8:
        return module + bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    return module
