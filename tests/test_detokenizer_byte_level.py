"""Byte-level detokenization from token bytes (`engine/byte_level.py`) against `tokenizers`'
stream decoder and full decodes: the same text piece by piece, whatever the tokens (characters
split over byte tokens, invalid bytes, special tokens, ids past the vocabulary), and a prompt
cut inside a character."""

from __future__ import annotations

import random

import pytest
from hybrid_cache.engine import byte_level
from hybrid_cache.engine.byte_level import byte_level_vocab, gpt2_byte_table
from hybrid_cache.engine.detokenizer import IncrementalDetokenizer
from hybrid_cache.engine.sampling_params import SamplingParams
from tiny_tokenizers import byte_level_bpe, metaspace_bpe

TEXT = " héllo wörld, naïve café — über straße ñandú the quick brown fox"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe()


def stream_only(tokenizer, prompt, params, monkeypatch):
    """A detokenizer that steps `tokenizers`' stream decoder (no byte-level vocabulary)."""
    with monkeypatch.context() as patch:
        patch.setattr(
            "hybrid_cache.engine.detokenizer.byte_level_vocab", lambda *args, **kwargs: None
        )
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
    assert detokenizer.vocab is None and detokenizer.stream is not None
    return detokenizer


def random_tokens(tokenizer, rng, count):
    """Tokens a random-weight model may sample: any id (specials and ids past the
    vocabulary too), byte tokens of split characters, the text's own tokens."""
    vocab_size = len(tokenizer)
    text_tokens = tokenizer.encode(TEXT)
    tokens = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.3:
            tokens.append(rng.randrange(vocab_size + 40))
        elif kind < 0.6:
            tokens.append(rng.choice(text_tokens))
        else:  # a byte token, often of a character's lead or continuation byte
            byte = rng.choice([rng.randrange(256), rng.randrange(0x80, 0x100)])
            tokens.append(tokenizer.convert_tokens_to_ids(_byte_char(byte)))
    return tokens


def _byte_char(byte):
    return next(char for char, value in gpt2_byte_table().items() if value == byte)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_token_bytes_give_the_stream_decoders_pieces(
    tokenizer, skip_special_tokens, seed, monkeypatch
):
    rng = random.Random(seed)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    prompt = tokenizer.encode("the old barn")
    output = random_tokens(tokenizer, rng, 300)
    fast = IncrementalDetokenizer(tokenizer, prompt, params)
    slow = stream_only(tokenizer, prompt, params, monkeypatch)
    assert fast.vocab is not None and fast.stream is None
    for token in output:
        assert fast.add_tokens([token]) == slow.add_tokens([token])
        # Held back alike (a token that decodes to nothing is not held back from bytes).
        assert bool(fast.pending) == (slow.num_unflushed > 0 and bool(fast.num_unflushed))
    assert fast.add_tokens([], final=True) == slow.add_tokens([], final=True)
    assert fast.text == slow.text
    decoded_prompt = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    assert fast.text == full[len(decoded_prompt) :]


@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_match_alike_from_token_bytes(tokenizer, seed, monkeypatch):
    rng = random.Random(seed)
    output = random_tokens(tokenizer, rng, 200)
    full = tokenizer.decode(output)
    stops = [full[40:43], full[90:91], "never there"]
    for include in (False, True):
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        fast = IncrementalDetokenizer(tokenizer, [], params)
        slow = stream_only(tokenizer, [], params, monkeypatch)
        for count, token in enumerate(output, 1):
            got = fast.add_token_and_match(token, check_stop=count > 3)
            assert got == slow.add_token_and_match(token, check_stop=count > 3)
            if got is not None:
                break
        assert got is not None and fast.text == slow.text and fast.truncate_at == slow.truncate_at


@pytest.mark.parametrize("byte_path", [True, False])
def test_a_prompt_cut_inside_a_character_is_read_before_the_output(
    tokenizer, byte_path, monkeypatch
):
    # "é" is two byte tokens here; the prompt ends after the first. The output reads after
    # the prompt's text, as a full decode reads it (a stream primed on the whole prompt once
    # handed the prompt's text out with the first output token).
    prompt = tokenizer.encode("the caf") + [tokenizer.convert_tokens_to_ids(_byte_char(0xC3))]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    output = tokenizer.encode(" and the dog")
    params = SamplingParams()
    if byte_path:
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
    else:
        detokenizer = stream_only(tokenizer, prompt, params, monkeypatch)
    for token in output:
        detokenizer.add_tokens([token])
    detokenizer.add_tokens([], final=True)
    assert detokenizer.text == " and the dog"
    full = tokenizer.decode(prompt + output)
    assert detokenizer.text == full[len(tokenizer.decode(prompt)) :]


def test_python_decodes_invalid_bytes_as_tokenizers_does(tokenizer):
    # The premise of the byte path: U+FFFD for the same invalid sequences.
    rng = random.Random(0)
    byte_ids = {byte: tokenizer.convert_tokens_to_ids(_byte_char(byte)) for byte in range(256)}
    for _ in range(3000):
        data = bytes(
            rng.choice([rng.randrange(256), rng.randrange(0x80, 0xC0), rng.randrange(0xC0, 0x100)])
            for _ in range(rng.randint(1, 10))
        )
        tokens = [byte_ids[byte] for byte in data]
        assert data.decode("utf-8", "replace") == tokenizer.backend_tokenizer.decode(tokens)


def test_the_vocabulary_is_built_once_and_only_for_a_byte_level_decoder(tokenizer, monkeypatch):
    first = byte_level_vocab(tokenizer, tokenizer.backend_tokenizer, True)
    assert first is byte_level_vocab(tokenizer, tokenizer.backend_tokenizer, True)
    assert first.texts[len(tokenizer) + 5] == ""  # past the vocabulary: nothing
    assert first.texts[tokenizer.eos_token_id] == ""  # skipped
    eos = byte_level_vocab(tokenizer, tokenizer.backend_tokenizer, False).texts[
        tokenizer.eos_token_id
    ]
    assert eos == "</s>"
    metaspace = metaspace_bpe()
    assert byte_level_vocab(metaspace, metaspace.backend_tokenizer, True) is None
    # A token that does not decode as its bytes leaves the tokenizer to the stream decoder.
    other = byte_level_bpe()
    backend = other.backend_tokenizer
    real = backend.decode_batch
    monkeypatch.setattr(byte_level, "_is_byte_level", lambda decoder: True)

    class Backend:
        decoder = backend.decoder
        get_vocab_size = backend.get_vocab_size
        get_vocab = backend.get_vocab
        get_added_tokens_decoder = backend.get_added_tokens_decoder

        @staticmethod
        def decode_batch(batch, skip_special_tokens):
            texts = real(batch, skip_special_tokens=skip_special_tokens)
            texts[100] += "x"
            return texts

    assert byte_level_vocab(other, Backend(), True) is None


def test_an_engine_builds_the_vocabulary_before_its_first_request(tmp_path, monkeypatch):
    # The table costs ~0.3 s for a 128k vocabulary: built with the engine, not in the first
    # request's time to first token.
    from hybrid_cache.engine.llm import LLM

    byte_level_bpe().save_pretrained(tmp_path)
    builds = []
    real_build = byte_level._build
    monkeypatch.setattr(
        byte_level, "_build", lambda *args: builds.append(args[1]) or real_build(*args)
    )
    llm = LLM("tiny-llama", load_format="dummy", kv_cache_memory="4MiB", tokenizer=str(tmp_path))
    assert builds == [True]  # skip_special_tokens=True, the default
    (output,) = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, stop=["zz"], ignore_eos=True)
    )
    assert builds == [True] and isinstance(output.outputs[0].text, str)
