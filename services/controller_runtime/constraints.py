"""Host-side constraints backed by llguidance: a guest (or a native controller) creates one from a
regex, a JSON schema, a Lark grammar or a yacc grammar in the AICI ABI's dialect, commits tokens to it and asks for
the allowed-token bitset, computed straight into the destination memory."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from enum import IntEnum

import llguidance

from services.controller_runtime.tokenizer import TokenizerInfo
from services.controller_runtime.yacc_lark import yacc_to_lark


class ConstraintKind(IntEnum):
    REGEX = 0
    JSON_SCHEMA = 1
    LARK = 2
    YACC = 3


class ConstraintError(ValueError):
    pass


# tiller_constraint_* return codes
OK, FINISHED, REJECTED = 0, 1, -1


def grammar_for(kind: int, source: str) -> str:
    """The llguidance grammar for ``source`` of ``kind``; raises ConstraintError."""
    try:
        match ConstraintKind(kind):
            case ConstraintKind.REGEX:
                return llguidance.LLMatcher.grammar_from_regex(source)
            case ConstraintKind.JSON_SCHEMA:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    json.loads(source), defaults={"whitespace_flexible": False})
            case ConstraintKind.LARK:
                return llguidance.LLMatcher.grammar_from_lark(source)
            case ConstraintKind.YACC:
                return llguidance.LLMatcher.grammar_from_lark(yacc_to_lark(source))
    except ValueError as exc:  # bad kind, JSON, yacc (YaccError is a ValueError)
        raise ConstraintError(f"{type(exc).__name__}: {exc}") from exc
    raise ConstraintError(f"unknown constraint kind {kind}")


MAX_TEMPLATES = 256
_templates: OrderedDict[tuple[int, int, str], llguidance.LLMatcher] = OrderedDict()
_templates_lock = threading.Lock()  # instantiate runs in worker threads


def _compile(tokenizer: TokenizerInfo, kind: int, source: str) -> llguidance.LLMatcher:
    grammar = grammar_for(kind, source)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer.ll)
    if error:
        raise ConstraintError(error)
    matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())
    return matcher


class Constraint:
    """One llguidance matcher; all methods return the ABI's codes instead of raising."""

    __slots__ = ("matcher", "tokenizer", "eos")

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: TokenizerInfo) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token

    @classmethod
    def create(cls, tokenizer: TokenizerInfo, kind: int, source: str) -> Constraint:
        """A fresh matcher: a deep copy of a cached template, so sequences with the same grammar share
        its compiled form and lazily built lexer states (~0.6 µs instead of ~0.3 ms, warm masks)."""
        key = (id(tokenizer.ll), kind, source)
        with _templates_lock:
            template = _templates.get(key)
            if template is not None:
                _templates.move_to_end(key)
        if template is None:
            template = _compile(tokenizer, kind, source)
            with _templates_lock:
                _templates[key] = template
                while len(_templates) > MAX_TEMPLATES:
                    _templates.popitem(last=False)
        return cls(template.deep_copy(), tokenizer)

    def commit(self, tokens: list[int]) -> int:
        """Advance by ``tokens``: OK, FINISHED (nothing but EOS may follow) or REJECTED (state unchanged)."""
        m = self.matcher
        eos = bool(tokens) and tokens[-1] == self.eos
        body = tokens[:-1] if eos else tokens
        consumed = m.try_consume_tokens(body)
        if consumed != len(body):
            if consumed:
                m.rollback(consumed)
            return REJECTED
        if eos:  # EOS ends a constraint only where the grammar may end
            return FINISHED if m.is_accepting() or m.is_stopped() else REJECTED
        return FINISHED if m.is_stopped() else OK

    def commit_going(self, tokens: list[int]) -> bool:
        """Commit ``tokens`` (EOS not among them) if the constraint then goes on (:meth:`commit` would return OK);
        otherwise leave it as it was and return False."""
        result = self.commit(tokens)
        if result == FINISHED:
            self.matcher.rollback(len(tokens))
        return result == OK

    def rollback(self, n: int) -> int:
        return OK if self.matcher.rollback(n) else REJECTED

    def fill_mask(self, address: int, nbytes: int) -> int:
        """Write the allowed-token bitset (``nbytes`` = 4*ceil(vocab/32)) at ``address``."""
        m = self.matcher
        if m.is_error():
            return REJECTED
        m.unsafe_compute_mask_ptr(address, nbytes)
        return FINISHED if m.is_stopped() else OK

    def fill_mask_going(self, address: int, nbytes: int) -> bool:
        """:meth:`fill_mask` when it returns OK; False where it would not (the mask written may then be
        anything): a matcher in error is also stopped, and computing a mask leaves both as they were."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(address, nbytes)
        return not m.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def fork(self) -> Constraint:
        return Constraint(self.matcher.deep_copy(), self.tokenizer)

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def ff_tokens(self, limit: int | None = None) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: the one continuation it allows,
        as the tokenizer would split it, short of a token that later bytes could still extend), at most
        ``limit``; none from EOS on."""
        tokens = self.matcher.compute_ff_tokens()
        if self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos)]
        return tokens if limit is None else tokens[:limit]
