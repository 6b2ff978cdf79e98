"""The speed guard: this tree against a base revision on the real default model, on its default
weights (``auto``: the GGUF's blocks on Tiller's kernel) and on dense ``fp32`` (what a safetensors
model gets), at one stream and at each ``--streams`` count (default 16; the journal's guard: ``--streams 16
64``), alternated round by round in one run (``ab_stack.py``). Run it
before resolving any change to the worker or the step loop and quote what it prints: a ratio below
1 on tokens/s (or above 1 on CPU per token) beyond the rounds' spread is a regression.

    python deploy/loadtest/guard.py --base main [--rounds 3] [--tokens 128] [--streams 16 64]
"""

from __future__ import annotations

import argparse

from ab_stack import add_round_arguments, compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare this checkout against")
    add_round_arguments(parser, rounds=3, tokens=128, streams=16)
    parser.add_argument("--weights", nargs="+", default=["auto", "fp32"])
    parser.set_defaults(cpu_proxy=False)  # the real model, the worker's own threads
    args = parser.parse_args()
    compare(args, args.weights)


if __name__ == "__main__":
    main()
