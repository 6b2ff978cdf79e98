"""``POST /v1/embeddings`` through the official ``openai`` client, on the real stack: each vector is the pooled
final hidden state (after the final norm) transformers computes on the same weights, in either encoding, for
every input form, by the last token (the default, normalized) and by the mean over prefill chunks (a stack of
its own, unnormalized); bad requests get a specific 400 in OpenAI's error shape."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from common.model_source import load_tokenizer
from tests.stack import Stack, start_stack

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "A cat sat on the mat, purring."]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


def pooled(stack, hf_model, texts: list[str]) -> list[np.ndarray]:
    """transformers' vectors of ``texts``: the final hidden states (after the final norm) pooled and normalized
    as the stack's settings say."""
    settings = stack.settings.embeddings
    out = []
    for text in texts:
        with torch.inference_mode():
            states = hf_model.model(torch.tensor([stack.tokenizer(text).input_ids])).last_hidden_state[0].double()
        vector = states[-1] if settings.pooling == "last" else states.mean(0)
        out.append((vector / vector.norm() if settings.normalize else vector).numpy())
    return out


@pytest.fixture(scope="module")
def expected(stack, hf_model) -> list[np.ndarray]:
    return pooled(stack, hf_model, TEXTS)


@pytest.fixture(scope="module")
def mean_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """A stack pooling by the mean, unnormalized, its prompts fed in chunks of 16 tokens."""
    started = start_stack(tmp_path_factory.mktemp("mean"), TILLER_EMBEDDINGS__POOLING="mean",
                          TILLER_EMBEDDINGS__NORMALIZE="false", TILLER_LIMITS__PREFILL_CHUNK_TOKENS="16")
    started.tokenizer = load_tokenizer(started.settings)
    yield started
    started.down()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_a_batch_matches_transformers(stack, client, expected):
    model = stack.settings.served_model_name
    reply = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    assert reply.object == "list" and reply.model == model
    assert [d.index for d in reply.data] == [0, 1, 2] and all(d.object == "embedding" for d in reply.data)
    for got, want in zip(reply.data, expected, strict=True):
        assert len(got.embedding) == len(want)
        assert cosine(got.embedding, want) >= 0.9999
        assert np.linalg.norm(got.embedding) == pytest.approx(1.0, abs=1e-5)
    tokens = sum(len(stack.tokenizer(t).input_ids) for t in TEXTS)
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (tokens, tokens)

    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    for got, want in zip(floats.data, expected, strict=True):
        assert cosine(got.embedding, want) >= 0.9999


def test_base64_and_token_id_inputs_give_the_same_vectors(stack, client, expected):
    body = {"model": stack.settings.served_model_name, "input": TEXTS[0], "encoding_format": "base64"}
    reply = httpx.post(f"{stack.http_url}/v1/embeddings", json=body, timeout=60).json()
    raw = base64.b64decode(reply["data"][0]["embedding"])
    assert cosine(np.frombuffer(raw, dtype="<f4"), expected[0]) >= 0.9999  # little-endian float32, as OpenAI's

    ids = [stack.tokenizer(t).input_ids for t in TEXTS]
    one = client.embeddings.create(model=stack.settings.served_model_name, input=ids[1], encoding_format="float")
    assert len(one.data) == 1 and cosine(one.data[0].embedding, expected[1]) >= 0.9999
    lists = client.embeddings.create(model=stack.settings.served_model_name, input=ids, encoding_format="float")
    assert [cosine(d.embedding, e) >= 0.9999 for d, e in zip(lists.data, expected, strict=True)] == [True] * 3
    assert lists.usage.prompt_tokens == sum(map(len, ids))


def test_dimensions_only_as_the_model_has_them(stack, client, hf_model):
    hidden = hf_model.config.hidden_size
    same = client.embeddings.create(model=stack.settings.served_model_name, input="x", dimensions=hidden)
    assert len(same.data[0].embedding) == hidden
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=stack.settings.served_model_name, input="x", dimensions=64)
    assert caught.value.body["param"] == "dimensions" and f"model's {hidden} dimensions" in caught.value.body["message"]


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"input": ""}, "input", "the input must be a non-empty string"),
        ({"input": []}, "input", "must be a non-empty string"),
        ({"input": ["ok", ""]}, "input", "input 1 must be a non-empty string"),
        ({"input": 7}, "input", "must be a non-empty string"),
        ({"input": [1.5, 2]}, "input", "list of token ids"),
        ({"input": [{"text": "a"}]}, "input", "the input must be a non-empty string"),
        ({"input": [[1, 2], [10**9]]}, "input", "token id 1000000000 is outside the vocabulary"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": ["ok", " hi" * 3000]}, "input", "input 1: the prompt has 3000 tokens"),
    ],
)
def test_bad_requests_get_a_specific_400(stack, extra, param, fragment):
    body = {"model": stack.settings.served_model_name, **extra}
    reply = httpx.post(f"{stack.http_url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert fragment in error["message"], error["message"]


def test_too_long_and_unknown_model_through_the_client(stack, client):
    limit = stack.settings.limits.max_model_len
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=stack.settings.served_model_name, input=" hi" * (limit + 1))
    assert caught.value.body["code"] == "context_length_exceeded"
    assert f"context of {limit} tokens cannot hold it" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


def test_mean_pooling_across_prefill_chunks_unnormalized(mean_stack, hf_model):
    texts = [TEXTS[1], " ".join(TEXTS * 2)]  # one chunk; four (about 60 tokens)
    client = openai.OpenAI(base_url=f"{mean_stack.http_url}/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model=mean_stack.settings.served_model_name, input=texts)
    for got, want in zip(reply.data, pooled(mean_stack, hf_model, texts), strict=True):
        assert cosine(got.embedding, want) >= 0.9999
        assert np.linalg.norm(got.embedding) == pytest.approx(np.linalg.norm(want), rel=1e-3)
