"""The model folder's `generation_config.json`: its EOS ids join the model's EOS set (and stop
generation), its sampling values become `LLM.get_default_sampling_params()` under
`generation_config="auto"`, not under "vllm", and are read from another folder when one is
named; what is applied is logged; a bad file or value is a typed error."""

from __future__ import annotations

import inspect
import logging

import pytest
from chat_model import EOS, IM_END, save_chat_model, write_generation_config
from hybrid_cache import _core
from hybrid_cache.engine.engine_config import EngineConfig
from hybrid_cache.engine.generation_config import read_generation_defaults
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.errors import ConfigError, EngineConfigError

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

SAMPLING_FIELDS = set(inspect.signature(SamplingParams).parameters)
# A Qwen2.5-Instruct-like file: the end-of-turn token only here, recommended sampling values.
QWEN_LIKE = dict(
    eos_token_id=[IM_END, EOS],
    do_sample=True,
    temperature=0.7,
    top_k=20,
    top_p=0.8,
    repetition_penalty=1.05,
    min_p=0.05,
    max_new_tokens=12,
)
OPTIONS = dict(kv_cache_memory="1MiB", max_model_len=128, block_size=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("generation-config")
    save_chat_model(path)
    return path


@pytest.fixture
def qwen_like(folder):
    path = write_generation_config(folder, **QWEN_LIKE)
    yield folder
    path.unlink()


def expected_defaults() -> SamplingParams:
    values = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_tokens": 12}
    values.update(
        {
            name: QWEN_LIKE[name]
            for name in ("repetition_penalty", "min_p")
            if name in SAMPLING_FIELDS
        }
    )
    return SamplingParams(**values)


def test_auto_applies_the_eos_ids_and_the_sampling_defaults(qwen_like, caplog):
    with caplog.at_level(logging.INFO, logger="hybrid_cache.engine"):
        llm = LLM(str(qwen_like), **OPTIONS)
    assert IM_END in llm.engine.eos_token_ids and EOS in llm.engine.eos_token_ids
    defaults = llm.get_default_sampling_params()
    assert defaults == expected_defaults()
    assert defaults != SamplingParams()
    # A field this engine's SamplingParams lacks is left out and said so, not dropped silently.
    ignored = {key for key in ("repetition_penalty", "min_p") if key not in SAMPLING_FIELDS}
    assert set(llm.generation_defaults.ignored) == ignored
    assert f"eos_token_id [{IM_END}, {EOS}] joins the EOS set" in caplog.text
    assert "default sampling params temperature=0.7, top_k=20, top_p=0.8" in caplog.text
    for key in ignored:
        assert key in caplog.text and "not applied" in caplog.text


def test_vllm_keeps_the_engine_defaults_but_the_eos_ids(qwen_like, caplog):
    with caplog.at_level(logging.INFO, logger="hybrid_cache.engine"):
        llm = LLM(str(qwen_like), generation_config="vllm", **OPTIONS)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert IM_END in llm.engine.eos_token_ids
    assert "default sampling params temperature" not in caplog.text
    assert "generation_config='vllm': the engine's default sampling params" in caplog.text


def test_a_folder_path_is_read_instead(folder, tmp_path):
    write_generation_config(tmp_path, **QWEN_LIKE)
    llm = LLM(str(folder), generation_config=str(tmp_path), **OPTIONS)
    assert llm.get_default_sampling_params() == expected_defaults()
    assert IM_END in llm.engine.eos_token_ids
    assert llm.generation_defaults.source == str(tmp_path / "generation_config.json")
    # A preset has no folder of its own, but a named folder applies to it too.
    preset = read_generation_defaults("tiny-llama", str(tmp_path))
    assert preset.sampling_params() == expected_defaults()
    assert read_generation_defaults("tiny-llama").source is None


def test_no_file_means_the_engine_defaults(folder):
    llm = LLM(str(folder), **OPTIONS)
    assert llm.generation_defaults.source is None
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.engine.eos_token_ids == (EOS,)


def test_the_defaults_apply_to_a_call_without_params(folder):
    path = write_generation_config(folder, temperature=0.0, max_new_tokens=3)
    try:
        llm = LLM(str(folder), **OPTIONS)
    finally:
        path.unlink()
    prompt = {"prompt_token_ids": [5, 7, 9, 11]}
    (implicit,) = llm.generate(prompt, use_tqdm=False)
    (explicit,) = llm.generate(
        prompt, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False
    )
    (engine_default,) = llm.generate(prompt, SamplingParams(), use_tqdm=False)
    assert implicit.token_ids == explicit.token_ids and len(implicit.token_ids) == 3
    assert len(engine_default.token_ids) > 3  # SamplingParams() alone: 16 tokens
    (chat_implicit,) = llm.chat([{"role": "user", "content": "the cat"}], use_tqdm=False)
    assert len(chat_implicit.token_ids) == 3


def test_an_eos_id_listed_only_in_the_generation_config_stops_generation(folder):
    free = LLM(str(folder), **OPTIONS)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    (run,) = free.generate({"prompt_token_ids": [5, 7, 9, 11]}, params, use_tqdm=False)
    tokens = run.token_ids
    # The first token not seen before: stopping there cuts the output at that point.
    cut = next(i for i, t in enumerate(tokens) if t != EOS and tokens.index(t) == i and i > 0)
    path = write_generation_config(folder, eos_token_id=tokens[cut])  # an int, not a list
    try:
        stopping = LLM(str(folder), **OPTIONS)
        (stopped,) = stopping.generate({"prompt_token_ids": [5, 7, 9, 11]}, params, use_tqdm=False)
    finally:
        path.unlink()
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == tokens[: cut + 1]


@pytest.mark.parametrize(
    ("contents", "fragment"),
    [
        ("{ not json", "cannot read"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"eos_token_id": "end"}', "eos_token_id must be a token id"),
        ('{"top_p": 0}', "top_p"),
        ('{"temperature": -1}', "temperature"),
    ],
)
def test_a_bad_file_is_a_typed_error_naming_it(tmp_path, contents, fragment):
    (tmp_path / "generation_config.json").write_text(contents)
    with pytest.raises(ConfigError, match=fragment) as caught:
        read_generation_defaults(str(tmp_path))
    assert "generation_config.json" in str(caught.value)


@pytest.mark.parametrize("value", ["/no/such/folder", 3])
def test_a_bad_generation_config_argument_is_an_engine_config_error(value, tmp_path):
    with pytest.raises(EngineConfigError, match="--generation-config") as caught:
        EngineConfig("tiny-llama", generation_config=value)
    assert "LLM argument generation_config" in str(caught.value)
    with pytest.raises(EngineConfigError, match="has no generation_config.json"):
        EngineConfig("tiny-llama", generation_config=str(tmp_path))
