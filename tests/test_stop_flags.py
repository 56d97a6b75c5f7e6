"""Stop strings with undecoded tokens (`detokenizer.StopFlags`): a request whose tokens cannot
complete a stop string leaves them undecoded until one that may comes, and must stop where a
decode of every token stops, with the same text, stop reason and cut, whatever the tokens
(characters split over byte tokens, specials, a stop string inside one token, stops spanning
tokens, stops ending in a multi-byte character), `min_tokens` and `include_stop_str_in_output`."""

from __future__ import annotations

import random

import pytest
from hybrid_cache.engine.detokenizer import IncrementalDetokenizer, may_complete
from hybrid_cache.engine.request import Request
from hybrid_cache.engine.sampling_params import SamplingParams
from test_detokenizer_byte_level import TEXT, random_tokens
from tiny_tokenizers import byte_level_bpe


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe()


def run(tokenizer, prompt, output, params, lazy):
    """Appends `output` to a request until it stops; returns (tokens taken, reason, stop
    reason, final text, tokens decoded when it stopped)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
    assert detokenizer.stop_flags is not None
    if not lazy:
        detokenizer.stop_flags = None  # decode every token as it comes
    request = Request("r", prompt, params, 0, 10_000, detokenizer=detokenizer)
    reason, count = None, 0
    while reason is None and count < len(output):
        reason = request.append_output_token(output[count])
        count += 1
    decoded = detokenizer.num_output_tokens
    request.finish_text()
    return count, reason, request.stop_reason, request.output_text, decoded


def stops_from(rng, text):
    """Stop strings cut from `text` (so they occur), short and long, and one that never does."""
    stops = []
    for length in (1, 2, 3, 6):
        start = rng.randrange(max(1, len(text) - length))
        stops.append(text[start : start + length])
    return [stop for stop in stops if stop] + ["never there"]


@pytest.mark.parametrize("seed", range(24))
def test_undecoded_tokens_stop_where_a_decode_per_token_stops(tokenizer, seed):
    rng = random.Random(seed)
    prompt = tokenizer.encode("the old barn")
    output = random_tokens(tokenizer, rng, 240)
    text = tokenizer.decode(output)
    stops = stops_from(rng, text[rng.randrange(20, 200) :])
    rng.shuffle(stops)
    for include in (False, True):
        for min_tokens in (0, 5):
            params = SamplingParams(
                stop=stops[: rng.randint(1, len(stops))],
                include_stop_str_in_output=include,
                min_tokens=min_tokens,
                max_tokens=1000,
                ignore_eos=True,
            )
            lazy = run(tokenizer, prompt, output, params, lazy=True)
            eager = run(tokenizer, prompt, output, params, lazy=False)
            assert lazy[:4] == eager[:4], (params.stop, lazy, eager)


def test_tokens_that_cannot_complete_a_stop_string_are_not_decoded(tokenizer):
    words = tokenizer.encode(" the quick brown fox jumps over the lazy dog" * 4)
    params = SamplingParams(stop=["zz top"], max_tokens=1000)
    detokenizer = IncrementalDetokenizer(tokenizer, [1], params)
    request = Request("r", [1], params, 0, 10_000, detokenizer=detokenizer)
    catch_ups = []
    original = detokenizer.catch_up_and_match

    def counted(output_token_ids, check_stop):
        catch_ups.append(len(output_token_ids))
        return original(output_token_ids, check_stop)

    detokenizer.catch_up_and_match = counted
    assert all(request.append_output_token(token) is None for token in words)
    # Only a token with a "p" may end "zz top" (one per "jumps" here): the other tokens
    # waited undecoded, several at a time.
    assert 0 < len(catch_ups) <= 8
    request.finish_text()
    assert request.output_text == tokenizer.decode(words)


def test_which_token_texts_may_complete_a_stop_string():
    stop = ["@@never"]
    assert may_complete("ver", stop) and may_complete("r", stop) and may_complete("never", stop)
    assert may_complete("x@@never!", stop)  # the whole stop string inside the token
    assert not may_complete("tree", stop)  # its "r" follows "t", not "e"
    assert not may_complete("", stop) and not may_complete("abc", stop)
    assert may_complete(None, stop)  # not whole characters: decided once it decodes
    assert may_complete("b", ["ab", "zz"]) and not may_complete("cb", ["ab", "zz"])
    assert may_complete("é", ["café"]) and not may_complete("eé", ["café"])


def test_text_reads_the_same_before_and_after_the_stop_check(tokenizer):
    # The TEXT tokens, some of which complete "ü", with the request's text read mid-way by a
    # stream (which decodes the tokens waiting): nothing is decoded twice or lost.
    tokens = tokenizer.encode(TEXT)
    params = SamplingParams(stop=["straße"], include_stop_str_in_output=True, max_tokens=1000)
    detokenizer = IncrementalDetokenizer(tokenizer, [1], params)
    request = Request("r", [1], params, 0, 10_000, detokenizer=detokenizer)
    for index, token in enumerate(tokens):
        if index % 3 == 0:
            unseen = request.output_token_ids[detokenizer.num_output_tokens :]
            detokenizer.add_tokens(unseen)
        if request.append_output_token(token) is not None:
            break
    request.finish_text()
    assert request.stop_reason == "straße"
    assert request.output_text == TEXT[: TEXT.index("straße") + len("straße")]


def byte_token(tokenizer, byte):
    """The id of the byte token standing for `byte`."""
    from test_detokenizer_byte_level import _byte_char

    return tokenizer.convert_tokens_to_ids(_byte_char(byte))


def test_split_characters_wait_unless_their_bytes_hold_a_stop_strings_last_byte(tokenizer):
    from hybrid_cache.engine.detokenizer import stop_flags

    vocab = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["x"])).vocab
    lead, continuation = byte_token(tokenizer, 0xC3), byte_token(tokenizer, 0xA9)  # "é"
    never = stop_flags(vocab, ("@@never",))
    assert not never[lead] and not never[continuation]  # neither holds "r"
    cafe = stop_flags(vocab, ("café",))  # ends in 0xA9
    assert cafe[continuation] and not cafe[lead]
    # A stop string ending in U+FFFD: any token may end an invalid sequence.
    replaced = stop_flags(vocab, ("a\ufffd",))
    word = tokenizer.encode(" the")[0]
    assert replaced[lead] and replaced[continuation] and replaced[word]


@pytest.mark.parametrize("stop", ["@@never", "é", "café", "a\ufffd", "\ufffd", "ü", "ße"])
@pytest.mark.parametrize("seed", range(8))
def test_byte_tokens_waiting_stop_where_a_decode_per_token_stops(tokenizer, stop, seed):
    """Outputs dense in byte tokens (characters split and broken): the lazy request stops
    where decoding every token stops, for stop strings ending in an ASCII character, a
    multi-byte one and U+FFFD."""
    rng = random.Random(seed)
    prompt = tokenizer.encode("the old barn")
    text_tokens = tokenizer.encode(TEXT)
    output = []
    for _ in range(300):
        kind = rng.random()
        if kind < 0.55:
            byte = rng.choice([0xC3, 0xA9, 0xBC, 0x9F, rng.randrange(0x80, 0x100), 0x61])
            output.append(byte_token(tokenizer, byte))
        else:
            output.append(rng.choice(text_tokens))
    for include in (False, True):
        params = SamplingParams(
            stop=[stop], include_stop_str_in_output=include, max_tokens=1000, ignore_eos=True
        )
        lazy = run(tokenizer, prompt, output, params, lazy=True)
        eager = run(tokenizer, prompt, output, params, lazy=False)
        assert lazy[:4] == eager[:4], (stop, lazy, eager)
