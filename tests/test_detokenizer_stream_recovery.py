"""A SentencePiece byte-fallback tokenizer (Llama-2, Mistral, Gemma style) can make `tokenizers`'
stream decoder raise "Invalid prefix encountered": byte tokens that decoded to a character
("é" from <0xC3> <0xA9>) turn into U+FFFDs once a third byte joins their run and a word ends it.
A random-weight model samples such runs often, a real one rarely. The request must go on (its
detokenizer switches to window decodes), never fail, and read on correctly after the run."""

from __future__ import annotations

import random

import pytest
from hybrid_cache.engine.detokenizer import IncrementalDetokenizer
from hybrid_cache.engine.request import Request
from hybrid_cache.engine.sampling_params import SamplingParams
from tiny_tokenizers import BYTE_FALLBACK_WORDS, byte_fallback_bpe


@pytest.fixture(scope="module")
def tokenizer():
    return byte_fallback_bpe()


def ids(tokenizer, pieces):
    return tokenizer.convert_tokens_to_ids(pieces)


BREAKING = ["<0xC3>", "<0xA9>", "<0xC3>", "x", "▁cat", "▁sat"]


@pytest.mark.parametrize("how", ["one by one", "at once", "with a stop string"])
def test_a_run_that_breaks_the_stream_decoder_is_read_on(tokenizer, how):
    prompt = ids(tokenizer, ["▁the", "▁cat"])
    output = ids(tokenizer, BREAKING)
    stop = ["zz"] if how == "with a stop string" else []
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=stop))
    assert detokenizer.stream is not None  # the stream decoder, until it breaks
    if how == "at once":
        detokenizer.add_tokens(output, final=True)
    else:
        for token in output:
            if stop:
                assert detokenizer.add_token_and_match(token, check_stop=True) is None
            else:
                detokenizer.add_tokens([token])
    assert not detokenizer.streamed  # switched to the window decodes
    # "é" was shown before the run turned invalid; what follows reads as a full decode does.
    full = tokenizer.decode(prompt + output)
    assert detokenizer.text.startswith("é") and detokenizer.text.endswith("x cat sat")
    assert full.endswith("\ufffd\ufffd\ufffdx cat sat")


@pytest.mark.parametrize("seed", range(8))
def test_random_byte_runs_never_fail_a_request(tokenizer, seed):
    rng = random.Random(seed)
    pieces = [f"<0x{byte:02X}>" for byte in (0xC3, 0xA9, 0xE2, 0x80, 0x94, 0x41, 0xF0, 0x9F)]
    pieces += BYTE_FALLBACK_WORDS
    output = ids(tokenizer, [rng.choice(pieces) for _ in range(300)])
    prompt = ids(tokenizer, ["▁the", "▁cat"])
    params = SamplingParams(stop=["▁never", "zz"], max_tokens=400, ignore_eos=True)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
    request = Request("r", prompt, params, 0, 1000, detokenizer=detokenizer)
    assert all(request.append_output_token(token) is None for token in output)
    request.finish_text()
    # The last words, after the last byte token, read as a full decode reads them.
    last_byte = max(i for i, t in enumerate(output) if tokenizer.convert_ids_to_tokens(t)[0] == "<")
    tail = output[last_byte + 1 :]
    if len(tail) >= 2:
        words = tokenizer.decode(output[last_byte + 1 :][1:])
        assert request.output_text.endswith(words)


def test_an_engine_with_such_a_tokenizer_finishes_every_request(tokenizer, tmp_path):
    # A random-weight model sampling over the whole vocabulary with a stop string: byte runs
    # break the stream decoder in most requests; before the fix the first one raised out of
    # `generate` and every request of the batch was lost.
    from hybrid_cache.engine.llm import LLM

    tokenizer.save_pretrained(tmp_path)
    llm = LLM(
        "tiny-llama",
        load_format="dummy",
        kv_cache_memory="16MiB",
        tokenizer=str(tmp_path),
        max_model_len=512,
    )
    params = SamplingParams(max_tokens=120, stop=["zz"], ignore_eos=True, temperature=1.0, seed=1)
    outputs = llm.generate([[5, 6, 7, 8 + i] for i in range(8)], params)
    assert [len(output.outputs[0].token_ids) for output in outputs] == [120] * 8
    assert all(isinstance(output.outputs[0].text, str) for output in outputs)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks - 1


def test_a_request_whose_text_fails_fails_alone(tokenizer, tmp_path, monkeypatch):
    # Whatever else a request's own text or stop check may raise: that request ends with
    # finish_reason "error" and a typed error naming it, the others finish, every block comes
    # back (the step goes on).
    from hybrid_cache.engine import detokenizer as detokenizer_module
    from hybrid_cache.engine.llm import LLM
    from hybrid_cache.errors import OutputProcessingError

    tokenizer.save_pretrained(tmp_path)
    llm = LLM("tiny-llama", load_format="dummy", kv_cache_memory="16MiB", tokenizer=str(tmp_path))
    real = detokenizer_module.IncrementalDetokenizer.catch_up_and_match

    def flaky(self, output_token_ids, check_stop):
        # The request whose prompt ends in 99 breaks at its third output token.
        if self.token_ids[self.num_context_tokens - 1] == 99 and len(output_token_ids) == 3:
            raise ValueError("a broken decoder")
        return real(self, output_token_ids, check_stop)

    monkeypatch.setattr(detokenizer_module.IncrementalDetokenizer, "catch_up_and_match", flaky)
    params = SamplingParams(max_tokens=6, stop=["zz"], ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], [5, 6, 99], [5, 6, 8]], params)
    assert [output.outputs[0].finish_reason for output in outputs] == ["length", "error", "length"]
    error = outputs[1].error
    assert isinstance(error, OutputProcessingError) and isinstance(error.__cause__, ValueError)
    assert "sampled token" in str(error) and "a broken decoder" in str(error)
    assert [len(outputs[index].outputs[0].token_ids) for index in (0, 2)] == [6, 6]
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks - 1
