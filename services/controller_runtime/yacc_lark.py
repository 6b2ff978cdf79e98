"""Translate the AICI ABI's yacc-style grammars into llguidance's Lark syntax.

The AICI ABI's grammar format: optional declarations (``%start name``, other ``%...`` lines ignored),
``%%``, then rules ``name : alt | alt ;`` where an alternative is a sequence of rule names, keywords (``"kw"`` or ``'kw'``)
and regexes (``"/re/"`` or ``'/re/'``); the special rule ``SKIP`` lists lexemes to skip between tokens;
``//`` and ``/* */`` comments; an optional second ``%%`` ends the rules. A rule whose alternatives are
each one keyword or regex becomes a Lark terminal (UPPER name); every other rule a Lark rule (lower name).
Keywords are reserved as the AICI ABI's lexer does ("it prefers keywords over regexps"): a regex that matches
a keyword of the grammar exactly becomes ``(/re/ & ~("kw" | ...))``, so ``return = 3;`` is rejected where
``IDENTIFIER "=" ...`` is the only rule that could take it (llguidance has no lexeme priorities).
"""

from __future__ import annotations

import json
import re


class YaccError(ValueError):
    pass


_TOKEN = re.compile(
    r"""\s+|//[^\n]*|/\*.*?\*/|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|%%|%[A-Za-z_]+|[A-Za-z_][A-Za-z0-9_.]*|[:|;]|\{""",
    re.S,
)


def _tokens(src: str) -> list[str]:
    out, pos = [], 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m:
            line = src.count("\n", 0, pos) + 1
            raise YaccError(f"unexpected character {src[pos]!r} on line {line}")
        tok = m.group(0)
        pos = m.end()
        if tok == "{":  # a semantic action: skip to the matching brace
            depth = 1
            while pos < len(src) and depth:
                depth += {"{": 1, "}": -1}.get(src[pos], 0)
                pos += 1
            continue
        if tok.isspace() or tok.startswith("//") or tok.startswith("/*"):
            continue
        out.append(tok)
    return out


def _lexeme(tok: str) -> str | None:
    """Lark text for a quoted keyword or regex, None if ``tok`` is not quoted."""
    if tok[0] not in "\"'":
        return None
    body = tok[1:-1]
    if len(body) >= 2 and body[0] == "/" and body[-1] == "/":
        rx = body[1:-1]
        if not rx:
            raise YaccError(f"empty regex {tok}")
        return "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", rx) + "/"
    if not body:
        raise YaccError("empty keyword \"\"")
    return json.dumps(body, ensure_ascii=False)


def _keywords(rules: list[tuple[str, list[list[str]]]]) -> list[str]:
    """Every keyword of the grammar outside SKIP, in order of appearance."""
    found = [t[1:-1] for name, alts in rules if name != "SKIP" for a in alts for t in a if _lexeme(t) is not None
             and not _is_regex(t)]
    return list(dict.fromkeys(found))


def _is_regex(tok: str) -> bool:
    body = tok[1:-1]
    return len(body) >= 2 and body[0] == "/" and body[-1] == "/"


def _reserving(tok: str, keywords: list[str]) -> str:
    """Lark text for a quoted lexeme; a regex that matches keywords exactly excludes them."""
    lex = _lexeme(tok)
    assert lex is not None
    if not _is_regex(tok) or not keywords:
        return lex
    try:
        rx = re.compile(tok[2:-2])
        clash = [k for k in keywords if rx.fullmatch(k)]
    except re.error:  # a Rust-only construct: exclude them all (a keyword never lexes as the regex)
        clash = keywords
    if not clash:
        return lex
    return f"({lex} & ~({' | '.join(json.dumps(k, ensure_ascii=False) for k in clash)}))"


def _parse(src: str) -> tuple[str | None, list[tuple[str, list[list[str]]]]]:
    toks = _tokens(src)
    start = None
    i = 0
    if "%%" in toks:
        while toks[i] != "%%":
            if toks[i] == "%start":
                if i + 1 >= len(toks):
                    raise YaccError("%start needs a rule name")
                start = toks[i + 1]
            i += 1
        i += 1
    rules: list[tuple[str, list[list[str]]]] = []
    while i < len(toks) and toks[i] != "%%":
        name = toks[i]
        if _lexeme(name) is not None or name in ":|;" or name.startswith("%"):
            raise YaccError(f"expected a rule name, got {name!r}")
        if i + 1 >= len(toks) or toks[i + 1] != ":":
            raise YaccError(f"expected ':' after rule name {name!r}")
        i += 2
        alts: list[list[str]] = [[]]
        while i < len(toks) and toks[i] != ";":
            if toks[i] == "|":
                alts.append([])
            elif toks[i] == ":" or toks[i].startswith("%"):
                raise YaccError(f"missing ';' before {toks[i]!r} in rule {name!r}")
            else:
                alts[-1].append(toks[i])
            i += 1
        if i >= len(toks):
            raise YaccError(f"rule {name!r} is not terminated by ';'")
        i += 1
        rules.append((name, alts))
    if not rules:
        raise YaccError("grammar has no rules")
    return start, rules


def yacc_to_lark(src: str) -> str:
    """The Lark grammar equivalent to the yacc-style ``src``; raises YaccError on malformed input."""
    start, rules = _parse(src)
    defined: dict[str, list[list[str]]] = {}
    for name, alts in rules:
        defined.setdefault(name, []).extend(alts)
    terminals = {n for n, alts in defined.items()
                 if n != "SKIP" and all(len(a) == 1 and _lexeme(a[0]) is not None for a in alts)}
    names: dict[str, str] = {}
    for n in defined:
        lark = n.upper().replace(".", "_") if n in terminals else "r_" + n.lower().replace(".", "_")
        base, k = lark, 1
        while lark in names.values():  # names differing only in case: keep them apart
            k += 1
            lark = f"{base}_{k}"
        names[n] = lark

    keywords = _keywords(rules)

    def item(tok: str, rule: str) -> str:
        if _lexeme(tok) is not None:
            return _reserving(tok, keywords)
        if tok not in names or tok == "SKIP":
            raise YaccError(f"rule {rule!r} refers to undefined rule {tok!r}")
        return names[tok]

    start = start or next(n for n, _ in rules if n != "SKIP")
    if start not in names or start == "SKIP":
        raise YaccError(f"start rule {start!r} is not defined")
    out = [f"start: {names[start]}"]
    for n, alts in defined.items():
        if n == "SKIP":
            for a in alts:
                if len(a) != 1 or _lexeme(a[0]) is None:
                    raise YaccError("SKIP alternatives must be single keywords or regexes")
                out.append(f"%ignore {_lexeme(a[0])}")
            continue
        body = " | ".join(" ".join(item(t, n) for t in a) if a else '""' for a in alts)
        out.append(f"{names[n]}: {body}")
    return "\n".join(out) + "\n"
