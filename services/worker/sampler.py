"""Token sampling with per-sequence parameters, vectorised over the rows of one step.

Order and semantics follow transformers' ``generate``: mask, repetition penalty, then greedy
argmax (temperature 0) or temperature, top-k, top-p and a random draw. Logprobs come from the raw
model logits, before any of that.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from common.wire import SampledToken, SamplingParams, TokenLogprob
from services.worker.transfer import to_device

SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's rule: dividing by it overflows)
TOP_P_CANDIDATES = (64, 1024)  # how many tokens top-p ranks, in turn, before sorting a whole row


def validate_params(params: SamplingParams, vocab_size: int) -> str | None:
    """Why ``params`` cannot be used, or None."""
    if not 0 <= params.temperature < math.inf:
        return f"temperature must be finite and >= 0, got {params.temperature}"
    if not 0 < params.top_p <= 1:
        return f"top_p must be in (0, 1], got {params.top_p}"
    if not 0 <= params.min_p <= 1:
        return f"min_p must be in [0, 1], got {params.min_p}"
    if params.top_k < 0:
        return f"top_k must be >= 0, got {params.top_k}"
    if not 0 < params.repetition_penalty < math.inf:
        return f"repetition_penalty must be finite and > 0, got {params.repetition_penalty}"
    if params.logprobs is not None and not 0 <= params.logprobs <= vocab_size:
        return f"logprobs must be in [0, {vocab_size}], got {params.logprobs}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(params, name) <= 2:
            return f"{name} must be in [-2, 2], got {getattr(params, name)}"
    if any(not 0 <= t < vocab_size or not -100 <= b <= 100 for t, b in params.logit_bias.items()):
        return f"logit_bias: token ids must be in [0, {vocab_size}) and biases in [-100, 100]"
    if params.min_tokens < 0 or params.output_start < 0:
        return f"min_tokens and output_start must be >= 0, got {params.min_tokens} and {params.output_start}"
    if any(not 0 <= t < vocab_size for t in params.suppress):
        return f"suppress: token ids must be in [0, {vocab_size})"
    return None


class SeqSampler:
    """A sequence's sampling parameters and its random generator (seeded when ``seed`` is set, so
    the same seed and parameters give the same tokens). The generator lives on the host whatever
    the device: a seeded draw is one cheap host call, the same on every device, and the draws of a
    whole step reach the device in one copy."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = self._generator(params.seed)

    @staticmethod
    def _generator(seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator()
        generator.manual_seed(seed)
        return generator

    def fork(self, index: int) -> SeqSampler:
        """A sampler for the ``index``-th fork of this sequence: the same parameters, and when this
        one has a generator, a new one seeded with the first 63 bits of BLAKE2b(this generator's
        state, ``index``). Deterministic, different for every fork, and this generator's own
        stream is left as it is."""
        child = SeqSampler.__new__(SeqSampler)
        child.params, child.generator = self.params, None
        if self.generator is not None:
            state = self.generator.get_state().numpy().tobytes()
            digest = hashlib.blake2b(state + index.to_bytes(8, "little"), digest_size=8).digest()
            child.generator = self._generator(int.from_bytes(digest, "little") >> 1)
        return child

    def update(self, params: SamplingParams) -> None:
        """Replace the parameters; the generator restarts only when the seed changes."""
        if params.seed != self.params.seed:
            self.generator = self._generator(params.seed)
        self.params = params


_NEG_INF_BITS = -8388608  # 0xFF800000: float32 -inf as an int32
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    """``[32]`` int32 ``31 - i``: shifting a word left by it puts bit i on the sign bit."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = (31 - torch.arange(32, dtype=torch.int32)).to(device)
    return shifts


def mask_bias(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed bitsets ``[rows, ceil(vocab/32)]`` (32-bit words, little-endian bit order: bit t%32 of
    word t/32 = token t allowed) -> additive bias float32 ``[rows, vocab]``: 0 where allowed, -inf
    where not, on the bitsets' device.

    Branch-free integer arithmetic over whole rows (a table lookup or a select per token costs
    milliseconds a step on a CPU): token t's bit is shifted onto the sign bit, an arithmetic shift
    spreads it over the word (-1 allowed, 0 not), and its complement masked with -inf's bit
    pattern is the bias, read as float32."""
    spread = (words.unsqueeze(-1) << _shifts(words.device)).bitwise_right_shift_(31)
    bias = spread.bitwise_not_().bitwise_and_(_NEG_INF_BITS)
    return bias.view(torch.float32).view(words.shape[0], -1)[:, :vocab_size]


def masked_scores(logits: torch.Tensor, words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``logits`` ``[rows, vocab_size]`` with -inf for every token its row's packed bitset in ``words`` does not
    allow (the layout of :func:`mask_bias`), as a new tensor: in one pass by the kernel library's
    ``masked_scores`` where it is loaded and the logits are float32 on the CPU (``kernel_build``), else as
    ``logits`` plus :func:`mask_bias` (several passes over rows of the vocabulary's size; a NaN logit of a
    token not allowed stays NaN there, where the kernel writes -inf)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        op = getattr(torch.ops.tiller_gguf, "masked_scores", None)
        if op is not None:
            return op(logits, words)
    return logits + mask_bias(words, vocab_size)


def mask_allows_any(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """For packed bitset rows ``[rows, ceil(vocab/32)]`` (host memory): whether each allows at least
    one token below ``vocab_size`` (bits past the vocabulary do not count). No device sync."""
    full, tail = divmod(vocab_size, 32)
    allows = (words[:, :full] != 0).any(axis=1)
    if tail:
        allows |= (words[:, full] & np.int32((1 << tail) - 1)) != 0
    return allows


def sample(
    logits: torch.Tensor,
    samplers: list[SeqSampler],
    histories: list[list[int]],
    masked: torch.Tensor | None = None,
) -> list[SampledToken]:
    """One token per row of ``logits`` ``[n, vocab]`` (float32).

    ``histories[i]`` are row i's tokens so far (for the penalties and min_tokens); ``masked``, when
    the rows sample under masks, is ``logits`` with -inf for the tokens they may not sample (see
    masked_scores): sampling reads it, the logprobs the raw logits.
    On a GPU nothing here waits for the device but the final copy of the results to the host.
    """
    n = logits.shape[0]
    device = logits.device
    params = [s.params for s in samplers]
    scores = logits if masked is None else masked
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalised = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and histories[i]]
    shaped = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty)
              and len(histories[i]) > p.output_start]
    held = [i for i, p in enumerate(params) if p.suppress and len(histories[i]) - p.output_start < p.min_tokens]
    if (biased or penalised or shaped or held) and scores is logits:
        scores = logits.clone()  # changed in place below; logprobs come from the raw logits
    if biased:
        _add_logit_bias(scores, biased, params)
    if penalised:
        _penalise(scores, penalised, params, histories)
    if shaped:
        _penalise_output(scores, shaped, params, histories)
    if held:
        _suppress(scores, held, params)

    greedy = [i for i, p in enumerate(params) if p.temperature < SAMPLING_EPS]
    if len(greedy) == n:
        tokens = _argmax(scores)
    else:
        tokens = torch.empty(n, dtype=torch.long, device=device)
        if greedy:
            index = to_device(greedy, device)
            tokens[index] = _argmax(scores[index])
        drawn = [i for i, p in enumerate(params) if p.temperature >= SAMPLING_EPS]
        index = to_device(drawn, device)
        probs = _warp([params[i] for i in drawn], scores[index] if len(drawn) < n else scores).softmax(-1)
        tokens[index] = _draw(probs, [samplers[i].generator for i in drawn])
    return _with_logprobs(logits, tokens, params)


def _argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's first highest score (a NaN counts as the highest, as in torch). On the CPU through
    numpy: torch's reduction takes ~40 µs a row of the default model's vocabulary on one thread, numpy's
    ~4 µs."""
    if scores.device.type != "cpu":
        return scores.argmax(-1)
    return torch.from_numpy(scores.numpy().argmax(-1))


def _penalise(
    scores: torch.Tensor, rows: list[int], params: list[SamplingParams], histories: list[list[int]]
) -> None:
    """transformers' repetition penalty on ``rows`` of ``scores`` (in place), all rows at once:
    each row's history is padded with its own first token, and a repeated token changes nothing."""
    device = scores.device
    ids = np.empty((len(rows), max(len(histories[i]) for i in rows)), dtype=np.int64)
    for j, i in enumerate(rows):
        history = histories[i]
        ids[j, : len(history)] = history
        ids[j, len(history) :] = history[0]
    seen = to_device(ids, device)
    penalty = to_device([params[i].repetition_penalty for i in rows], device, scores.dtype).unsqueeze(-1)
    index = to_device(rows, device)
    penalised = scores[index]
    picked = penalised.gather(-1, seen)
    penalised.scatter_(-1, seen, torch.where(picked < 0, picked * penalty, picked / penalty))
    scores[index] = penalised


def _penalise_output(
    scores: torch.Tensor, rows: list[int], params: list[SamplingParams], histories: list[list[int]]
) -> None:
    """OpenAI's presence and frequency penalties on ``rows`` (in place), as vLLM applies them: a
    token's logit drops by ``frequency_penalty`` for every time it was generated, and by
    ``presence_penalty`` once if it was. Only generated tokens count (from ``output_start``)."""
    device = scores.device
    outputs = [histories[i][params[i].output_start :] for i in rows]
    ids = np.zeros((len(rows), max(len(o) for o in outputs)), dtype=np.int64)
    seen = np.zeros(ids.shape, dtype=np.float32)  # 1 where ``ids`` holds a generated token, 0 on padding
    for j, output in enumerate(outputs):
        ids[j, : len(output)] = output
        seen[j, : len(output)] = 1
    counts = torch.zeros(len(rows), scores.shape[-1], device=device, dtype=scores.dtype)
    counts.scatter_add_(-1, to_device(ids, device), to_device(seen, device, scores.dtype))
    frequency = to_device([params[i].frequency_penalty for i in rows], device, scores.dtype).unsqueeze(-1)
    presence = to_device([params[i].presence_penalty for i in rows], device, scores.dtype).unsqueeze(-1)
    index = to_device(rows, device)
    scores[index] = scores[index] - frequency * counts - presence * (counts > 0)


def _add_logit_bias(scores: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """OpenAI's ``logit_bias`` of ``rows``: each listed token's logit moves by its bias (in place)."""
    entries = [(i, t, b) for i in rows for t, b in params[i].logit_bias.items()]
    device = scores.device
    index = (to_device([e[0] for e in entries], device), to_device([e[1] for e in entries], device))
    scores.index_put_(index, to_device([e[2] for e in entries], device, scores.dtype), accumulate=True)


def _suppress(scores: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """``min_tokens``: the ``suppress`` tokens of ``rows`` may not be sampled (in place)."""
    pairs = [(i, t) for i in rows for t in params[i].suppress]
    device = scores.device
    scores[to_device([i for i, _ in pairs], device), to_device([t for _, t in pairs], device)] = float("-inf")


def _warp(params: list[SamplingParams], scores: torch.Tensor) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p (vLLM's order) over rows of sampled (non-greedy) sequences."""
    device = scores.device
    vocab = scores.shape[-1]
    temperature = to_device([p.temperature for p in params], device, scores.dtype)
    scores = scores / temperature.unsqueeze(-1)
    if any(p.min_p for p in params):
        probs = scores.softmax(-1)
        floor = to_device([p.min_p for p in params], device, scores.dtype).unsqueeze(-1) * probs.amax(-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))  # a row without min_p has a floor of 0
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    if min(ks) < vocab:
        top = scores.topk(max(k for k in ks if k < vocab), dim=-1).values
        k_index = to_device([k - 1 if k < vocab else 0 for k in ks], device).unsqueeze(-1)
        unlimited = to_device([k == vocab for k in ks], device, torch.bool).unsqueeze(-1)
        threshold = top.gather(-1, k_index).masked_fill(unlimited, float("-inf"))
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    nucleus = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        top_p = to_device([params[j].top_p for j in nucleus], device, scores.dtype).unsqueeze(-1)
        if len(nucleus) == len(params):
            scores = _top_p(scores, top_p)
        else:
            rows = to_device(nucleus, device)
            scores[rows] = _top_p(scores[rows], top_p)
    return scores


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities add up to ``top_p`` (transformers' rule:
    a token stays while the mass ranked above it is below ``top_p``, so the best always stays).

    Sorting a whole vocabulary row costs milliseconds on a CPU, and the nucleus nearly always lies
    among the few most likely tokens: there, rows are ranked over ``TOP_P_CANDIDATES`` tokens
    first, and only the rows whose candidates hold less than ``top_p`` go on to a larger ranking.
    A GPU sorts whole rows at once: it is fast there, and learning which rows are settled would
    make the host wait for the device.
    """
    probs = scores.softmax(-1)
    vocab = probs.shape[-1]
    stages = TOP_P_CANDIDATES if scores.device.type == "cpu" else ()
    allowed = torch.zeros_like(scores, dtype=torch.bool)
    rows: torch.Tensor | None = None  # the rows still to settle; None: all of them
    for candidates in (*stages, vocab):
        p = probs if rows is None else probs[rows]
        threshold = top_p if rows is None else top_p[rows]
        if candidates < vocab:
            ranked, order = p.topk(candidates, dim=-1)
            done = ranked.sum(-1) >= threshold.squeeze(-1)
        else:
            ranked, order = p.sort(dim=-1, descending=True)
            done = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
        keep = ((ranked.cumsum(-1) - ranked) < threshold) & done.unsqueeze(-1)
        if rows is None:
            allowed.scatter_(-1, order, keep)
        else:
            allowed[rows] = allowed[rows].scatter(-1, order, keep)
        if candidates == vocab or bool(done.all()):
            break
        left = (~done).nonzero().squeeze(-1)
        rows = left if rows is None else rows[left]
    return scores.masked_fill(~allowed, float("-inf"))


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by inverse-CDF sampling: a uniform number from the row's own generator
    (so a seed fixes the draws whatever the batch and the device) and the first token whose
    cumulative probability passes it. torch.multinomial costs ~1 ms per row on a CPU for this."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    uniform = to_device(_uniforms(generators), probs.device, torch.float64)
    # Strictly below the total, so the token found has a non-zero probability (masks hold).
    target = torch.minimum(uniform.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row whose parameters overflowed into NaNs finds no token: it gets the last one rather than
    # an index past the vocabulary, which would fail every sequence of the step.
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _uniforms(generators: list[torch.Generator | None]) -> np.ndarray:
    """One uniform number in [0, 1) per row, on the host: a seeded row's from its own generator,
    the others' from torch's default generator in one call."""
    values = torch.rand(len(generators), dtype=torch.float64).numpy()
    for j, generator in enumerate(generators):
        if generator is not None:
            values[j] = torch.rand(1, generator=generator, dtype=torch.float64).item()
    return values


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[SampledToken]:
    """The sampled tokens with their logprobs (always) and top alternatives (when requested),
    brought to the host in one copy."""
    n = len(params)
    logprobs = logits.log_softmax(-1)
    parts = [tokens.double(), logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()]
    ks = [p.logprobs or 0 for p in params]
    k = max(ks)
    rows = [i for i, want in enumerate(ks) if want > 0]
    if k > 0:
        top = logprobs[to_device(rows, logits.device)].topk(k, dim=-1)
        parts += [top.indices.double().flatten(), top.values.double().flatten()]
    host = torch.cat(parts).tolist()  # token ids and logprobs alike are exact in float64
    alternatives: list[list[TokenLogprob]] = [[] for _ in params]
    ids_at, values_at = 2 * n, 2 * n + len(rows) * k
    for j, i in enumerate(rows):
        ids = host[ids_at + j * k : ids_at + j * k + ks[i]]
        values = host[values_at + j * k : values_at + j * k + ks[i]]
        alternatives[i] = [TokenLogprob(token_id=int(a), logprob=b) for a, b in zip(ids, values)]
    return [
        SampledToken(token_id=int(host[i]), logprob=host[n + i], top=alternatives[i])
        for i in range(n)
    ]
