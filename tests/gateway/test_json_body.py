"""Nesting depth of client JSON, bounded without recursion."""

from __future__ import annotations

import pytest

from common.errors import INVALID_REQUEST
from services.gateway.json_body import nesting_depth, parse_json
from services.gateway.protocol import GatewayError


@pytest.mark.parametrize("value, depth", [(1, 0), ("[[", 0), ([], 1), ({}, 1), ({"a": [1, {"b": []}]}, 4),
                                          ([[1], [[2]], 3], 3)])
def test_nesting_depth(value, depth):
    assert nesting_depth(value) == depth


def test_very_deep_values_are_measured_without_recursion():
    value: list = []
    for _ in range(100_000):
        value = [value]
    assert nesting_depth(value) == 100_001


@pytest.mark.parametrize("raw", ["[" * 8 + "]" * 8, b'{"a": ' + b"[" * 7 + b"]" * 7 + b"}", "[" * 3000 + "]" * 3000])
def test_too_deep_is_a_client_error_naming_the_limit(raw):
    with pytest.raises(GatewayError) as caught:
        parse_json(raw, 7, "the body")
    assert caught.value.code == INVALID_REQUEST
    assert caught.value.message == "the body nests JSON arrays and objects deeper than 7 levels (limits.max_json_depth)"


def test_at_the_limit_and_brackets_in_strings_pass():
    assert parse_json("[" * 7 + "]" * 7, 7, "x") == eval("[" * 6 + "[]" + "]" * 6)
    assert parse_json('{"s": "' + "{" * 50 + '"}', 7, "x") == {"s": "{" * 50}


@pytest.mark.parametrize("raw", ['{"a": "\\ud800"}', '{"\\udc00": 1}', b'{"a": "\xed\xa0\x80"}', '["x\\uDBFF"]'])
def test_lone_surrogates_are_not_unicode(raw):
    with pytest.raises(GatewayError) as caught:
        parse_json(raw, 7, "the body")
    assert caught.value.code == INVALID_REQUEST and caught.value.message.startswith("the body is not valid JSON")


def test_escaped_surrogate_pairs_and_backslashes_pass():
    assert parse_json('{"e": "\\ud83d\\ude00", "b": "\\\\ud800"}', 7, "x") == {"e": "😀", "b": "\\ud800"}
