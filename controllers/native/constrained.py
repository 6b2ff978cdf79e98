"""Example native controller: optional fixed prefix, then generation under a constraint, up to
``max_tokens``.

module_arg (JSON): {"prefix": str?, one of "regex" | "json_schema" | "lark" | "yacc": grammar,
"max_tokens": int?, "budget": int?, "store_var": str?, "fast_forward": bool?}. The generated text goes to variable
``store_var`` when done. ``budget`` is the request's own token limit, for a grammar of items in a row (tool calls): at
a point where the grammar may end, generation ends there when fewer tokens are left than the longest item so far
took (the stretch between two such points), so the reply ends with whole items instead of one cut by the limit.
With ``fast_forward``, where the grammar forces two tokens or more (llguidance's forced tokens), mid_process splices
them instead of sampling them one step each.
"""

from __future__ import annotations

import json

from controllers.native.base import FF_MIN, Host, NativeController

_KINDS = {"regex": 0, "json_schema": 1, "lark": 2, "yacc": 3}
_KEYS = {*_KINDS, "prefix", "max_tokens", "budget", "store_var", "fast_forward"}


class ConstrainedController(NativeController):
    def __init__(self, host: Host, module_arg: bytes) -> None:
        super().__init__(host, module_arg)
        arg = json.loads(module_arg or b"{}")
        if not isinstance(arg, dict):
            raise ValueError("module_arg must be a JSON object")
        unknown = sorted(set(arg) - _KEYS)
        if unknown:  # a typo must never generate unconstrained
            raise ValueError(f"unknown key {unknown[0]!r}; the keys are {', '.join(sorted(_KEYS))}")
        kinds = [k for k in _KINDS if k in arg]
        if len(kinds) > 1:
            raise ValueError(f"give at most one of {sorted(_KINDS)}")
        self.handle = 0
        if kinds:
            source = arg[kinds[0]]
            source = source if isinstance(source, str) else json.dumps(source)
            self.handle = host.constraint_new(_KINDS[kinds[0]], source)
            if self.handle < 0:
                raise ValueError(f"invalid {kinds[0]} constraint")
        self.prefix = host.tokenize(arg.get("prefix", "").encode()) if arg.get("prefix") else []
        self.max_tokens = int(arg.get("max_tokens", 256))
        self.store_var = arg.get("store_var")
        self.fast_forward = arg.get("fast_forward", False)
        if not isinstance(self.fast_forward, bool):
            raise ValueError("fast_forward must be true or false")
        self.budget = arg.get("budget")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError("budget must be a positive integer")
        self.item_tokens = 0  # tokens since the grammar could last end
        self.longest_item = 0
        self.generated: list[int] = []
        self.skip = 0  # our own prefix tokens, fed back to post_process by the runtime
        self.done = False

    def pre_process(self) -> dict:
        if self.done:
            return {"num_forks": 0, "suspend": False, "ff_tokens": []}
        ff, self.prefix = self.prefix, []
        self.skip = len(ff)
        return {"num_forks": 1, "suspend": False, "ff_tokens": ff}

    def pre_is_default(self) -> bool:
        return not self.done and not self.prefix  # post_process has reset skip already

    def mid_process(self, fork_group: list[int]) -> str | dict:
        if self.done:
            return "Stop"
        if self.handle and self.fast_forward:
            forced = self.host.constraint(self.handle).ff_tokens(self.max_tokens - len(self.generated))
            if len(forced) >= FF_MIN:
                return {"Splice": {"backtrack": 0, "ff_tokens": forced}}
        if self.handle:
            if self.host.constraint_return_bias(self.handle) == 1:
                self.done = True
        else:
            self.host.return_logit_bias(b"\xff" * (4 * ((self.host.vocab_size + 31) // 32)))
        return {"SampleWithBias": {}}

    def post_process(self, tokens: list[int], backtrack: int) -> dict:
        tokens, self.skip = tokens[self.skip:], 0
        if backtrack:
            del self.generated[len(self.generated) - backtrack:]
            if self.handle:
                self.host.constraint(self.handle).rollback(backtrack)
        self.generated += tokens
        if self.handle and tokens and self.host.constraint(self.handle).commit(tokens) != 0:
            self.done = True
        if self.budget and self.handle and tokens and not self.done:
            self.done = self._no_room_for_another(len(tokens))
        if self.host.eos_token in tokens or len(self.generated) >= self.max_tokens:
            self.done = True
        if self.done and self.store_var:
            self.host.set_var(self.store_var, json.dumps(self.generated).encode())
        return {"stop": self.done}

    def _no_room_for_another(self, new_tokens: int) -> bool:
        """At a point where the grammar may end: whether the tokens left in the budget are fewer than the longest
        item so far took (the next one would likely be cut). At the budget itself the request's own limit ends it."""
        self.item_tokens += new_tokens
        if not self.host.constraint(self.handle).is_accepting():
            return False
        self.longest_item = max(self.longest_item, self.item_tokens)
        self.item_tokens = 0
        return 0 < self.budget - len(self.generated) < self.longest_item
