"""TextStream: deltas concatenate to the tokenizer's decode, stop strings never leak."""

import random

import pytest

from common.config import Settings
from common import textstream
from common.model_source import load_tokenizer
from common.textstream import REPLACEMENT_CHAR, TextStream, byte_table, decoder, text_table


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Settings())


def stream_all(tokenizer, ids, stop=()):
    stream = TextStream(tokenizer, stop=list(stop))
    deltas = [stream.push([i]) for i in ids]
    if stream.stopped_by is None:
        deltas.append(stream.flush())
    return stream, deltas


@pytest.mark.parametrize("text", ["Hello, world! Ünïcödé ✓ 日本語 🙂 done.", "a\n\nb  c\t", "   "])
def test_deltas_join_to_full_decode(tokenizer, text):
    ids = tokenizer(text).input_ids
    stream, deltas = stream_all(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_text_and_never_streams_a_partial_stop(tokenizer):
    ids = tokenizer("Once upon a time THE END and more words").input_ids
    stream, deltas = stream_all(tokenizer, ids, stop=["THE END"])
    assert stream.stopped_by == "THE END"
    assert "".join(deltas) == "Once upon a time "
    for i in range(1, len(deltas)):
        assert "TH" not in "".join(deltas[:i]).split("time")[-1]


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer("alpha beta gamma delta").input_ids
    stream, deltas = stream_all(tokenizer, ids, stop=["delta", "beta"])
    assert stream.stopped_by == "beta"
    assert "".join(deltas) == "alpha "


def test_held_back_prefix_released_when_it_does_not_complete(tokenizer):
    ids = tokenizer("the THE ENDING? no: THE EN").input_ids
    stream, deltas = stream_all(tokenizer, ids, stop=["THE END."])
    assert stream.stopped_by is None
    assert "".join(deltas) == "the THE ENDING? no: THE EN"


def test_fast_decoder_is_the_tokenizers_decode(tokenizer):
    """The stream decodes with the Rust backend directly: same text as transformers' decode, specials skipped."""
    ids = tokenizer("<|im_start|>user\nHéllo 🙂 wörld<|im_end|>").input_ids + [tokenizer.eos_token_id]
    decode = decoder(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode
    for end in range(len(ids) + 1):
        assert decode(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True,
                                                     clean_up_tokenization_spaces=False)


def test_text_table_is_the_byte_tables_whole_characters(tokenizer):
    """Each token's text, decoded once: its bytes' UTF-8 text, None where its last character goes on
    in the next token (a stream holds those bytes back)."""
    table, texts = byte_table(tokenizer), text_table(tokenizer)
    assert table is not None and texts is not None and len(texts) == len(table)
    for token_bytes, text in zip(table, texts):
        decoded = token_bytes.decode("utf-8", "replace")
        assert text == (None if decoded.endswith(REPLACEMENT_CHAR) else decoded)
    assert None in texts and "" in texts  # stray UTF-8 bytes; special tokens


@pytest.mark.parametrize("skip_special", [True, False])
def test_byte_table_decodes_as_the_tokenizer(tokenizer, skip_special):
    """The byte-level fast path: every token's bytes decode to the tokenizer's text of it (specials
    empty where they are skipped, their own text where not: vLLM's skip_special_tokens), and random streams,
    half of them stray UTF-8 bytes, give the same deltas as the stream that decodes with the tokenizer."""
    table = byte_table(tokenizer, skip_special)
    assert table is not None
    backend = tokenizer.backend_tokenizer
    assert [t.decode("utf-8", "replace") for t in table] == [
        backend.decode([i], skip_special_tokens=skip_special) for i in range(len(table))]
    assert (table[tokenizer.eos_token_id] == b"") == skip_special
    rng = random.Random(0)
    stray = [i for i, t in enumerate(table) if len(t) == 1 and t[0] >= 0x80]
    past = range(len(table), len(table) + 64)  # ids of a padded embedding, which the tokenizer has not
    for _ in range(500):
        ids = [rng.choice(stray) if rng.random() < 0.5 else rng.randrange(len(table)) for _ in range(rng.randint(1, 40))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(past))
        fast, slow = TextStream(tokenizer, skip_special=skip_special), TextStream(tokenizer, skip_special=skip_special)
        slow._bytes = slow._texts = None
        assert [fast.push([i]) for i in ids] + [fast.flush()] == [slow.push([i]) for i in ids] + [slow.flush()]
        assert fast.text == slow.text


@pytest.mark.parametrize("kept_tail", [textstream.KEPT_TAIL, 0, 3])
def test_streamed_text_is_the_decode_cut_at_the_first_stop_string(tokenizer, monkeypatch, kept_tail):
    """Random texts and stop strings (multi-byte characters, stops that straddle tokens, repeat, or never
    come), some stops set mid-stream as a Modify does: what streams is the whole decode cut before the
    earliest stop in the text decoded when the first stop completes (searched from where the stops were set),
    and never more of it at any point. Also with the released text moved out of the stream's tail at once
    (``kept_tail`` 0 and 3: the test's texts are shorter than the default)."""
    monkeypatch.setattr(textstream, "KEPT_TAIL", kept_tail)
    rng = random.Random(7)
    alphabet = list("ab c\n.,") + ["é", "日本", "🙂", "the", " END"]
    for case in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tokenizer(text).input_ids
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(0, 3)):
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 5)] if rng.random() < 0.7 else rng.choice(alphabet) + "x")
        set_at = rng.choice([0, 0, rng.randrange(len(ids))])  # stops from the start, or from this token on
        stream = TextStream(tokenizer, stop=[] if set_at else list(stops))
        deltas, released_before = [], 0  # the characters streamed before the stops were set
        for n, token in enumerate(ids):
            if n == set_at and set_at:
                stream.stop, released_before = list(stops), len("".join(deltas))
            deltas.append(stream.push([token]))
            assert full.startswith("".join(deltas)), case
        if stream.stopped_by is None:
            deltas.append(stream.flush())
        streamed = "".join(deltas)
        expected = full  # cut before the earliest stop in the text decoded when the first one completes
        for n in range(max(set_at, 1), len(ids) + 1):
            so_far = tokenizer.decode(ids[:n], skip_special_tokens=True).rstrip("\ufffd")
            found = [i for i in (so_far.find(s, max(0, released_before - len(s) + 1)) for s in stops) if i != -1]
            if found:
                expected = full[: max(min(found), released_before)]
                break
        assert streamed == expected, (case, text, stops, set_at)
        assert stream.text == expected, case


def test_keep_stop_streams_each_token_and_ends_with_the_stop_string(tokenizer):
    """``keep_stop`` (vLLM's include_stop_str_in_output): nothing is held back (after each token the stream has
    released the text of the tokens so far, up to the last that ends a character), and the text ends with the
    earliest stop string in it, kept whole, at the token that completes it."""
    rng = random.Random(11)
    alphabet = list("ab c\n.,") + ["é", "日本", "🙂", "the", " END"]
    stopped = 0
    for case in range(300):
        ids = tokenizer("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))).input_ids
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 5)] if rng.random() < 0.7 else rng.choice(alphabet) + "x")
        stream = TextStream(tokenizer, stop=list(stops), keep_stop=True)
        streamed = so_far = ""
        for n, token in enumerate(ids):
            streamed += stream.push([token])
            decoded = tokenizer.decode(ids[: n + 1], skip_special_tokens=True)
            so_far = so_far if decoded.endswith(REPLACEMENT_CHAR) else decoded  # a character goes on in the next token
            found = sorted((i, k) for k, s in enumerate(stops) if (i := so_far.find(s)) != -1)
            if found:
                index, k = found[0]
                assert stream.stopped_by == stops[k], case
                assert streamed == stream.text == so_far[: index + len(stops[k])], (case, stops)
                stopped += 1
                break
            assert stream.stopped_by is None and streamed == so_far, (case, stops)
    assert stopped > 150  # most cases end on a stop string
