"""`--tokenizer` / `LLM(tokenizer=...)`: a tokenizer folder for a model that has none (a preset),
so text prompts, stop strings and detokenized output work on it; a folder without tokenizer files
is refused when the config is built."""

from __future__ import annotations

import pytest
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.errors import EngineConfigError
from tiny_tokenizers import byte_level_bpe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    byte_level_bpe(vocab_size=320).save_pretrained(folder)  # tiny-llama's vocabulary is 512
    return folder


def test_a_preset_takes_text_prompts_with_a_tokenizer_folder(tokenizer_folder):
    llm = LLM("tiny-llama", tokenizer=str(tokenizer_folder), kv_cache_memory="4MiB")
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate("the cat sat", params, use_tqdm=False)
    assert output.prompt_token_ids == tokenizer.encode("the cat sat")
    (by_ids,) = llm.generate({"prompt_token_ids": output.prompt_token_ids}, params, use_tqdm=False)
    assert output.token_ids == by_ids.token_ids
    assert output.text is not None


def test_a_folder_without_tokenizer_files_is_refused(tmp_path):
    with pytest.raises(EngineConfigError, match="--tokenizer .* is not a folder with tokenizer"):
        EngineConfig("tiny-llama", tokenizer=str(tmp_path))
    assert EngineConfig("tiny-llama").tokenizer_source == "tiny-llama"
