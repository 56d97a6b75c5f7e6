"""`LLM.generate`'s prompt forms and `LLM.chat`, on a tiny chat model folder (`chat_model.py`):
every form gives the same tokens as its token ids; text gets the tokenizer's BOS once; a chat is
the tokenizer's chat template, tokenized as transformers tokenizes it (no second BOS), and
generates what transformers generates from it; bad conversations are listed before anything
runs; `hybrid-cache generate --chat` does the same from the shell."""

from __future__ import annotations

import json

import pytest
import torch
from chat_model import BOS, CHAT_TEMPLATE, hf_greedy, save_chat_model
from hybrid_cache import _core
from hybrid_cache.engine.errors import (
    InvalidRequestError,
    InvalidRequestsError,
    NoTokenizerError,
)
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

NUM_NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "the dog"},
    {"role": "user", "content": "the cat sat on the mat"},
]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-model")
    hf = save_chat_model(folder)
    llm = LLM(str(folder), kv_cache_memory="1MiB", max_model_len=128, block_size=4)
    return folder, hf, llm


def assert_quiescent(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks - 1


def test_every_prompt_form_gives_the_tokens_of_its_ids(chat):
    _, _, llm = chat
    text = "the cat sat on the mat"
    ids = llm.get_tokenizer()(text)["input_ids"]
    assert ids[0] == BOS and ids.count(BOS) == 1, "text is tokenized with one BOS"
    forms = [
        text,
        {"prompt": text},
        ids,
        {"prompt_token_ids": ids},
        {"prompt_token_ids": torch.tensor(ids)},
        {"prompt": text, "prompt_token_ids": ids},
    ]
    outputs = [llm.generate(form, GREEDY, use_tqdm=False) for form in forms]
    assert all(len(batch) == 1 for batch in outputs)
    reference = outputs[2][0]
    for batch in outputs:
        assert batch[0].prompt_token_ids == ids and batch[0].token_ids == reference.token_ids
    assert [batch[0].prompt for batch in outputs] == [text, text, None, None, None, text]
    # Lists of them: a list of texts, of id lists, a 2-D tensor, a mixed list.
    for batch in ([text, text], [ids, ids], torch.tensor([ids, ids]), [text, ids]):
        both = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [output.token_ids for output in both] == [reference.token_ids] * 2
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert_quiescent(llm)


def test_a_bad_call_raises_before_anything_runs(chat):
    _, _, llm = chat
    steps = llm.stats.num_steps
    with pytest.raises(InvalidRequestError, match="prompts must be a prompt or a list"):
        llm.generate(5, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestsError) as caught:
        llm.generate(
            ["the cat", {"prompt": 3}, {"multi_modal_data": {}}, {"prompt_token_ids": [1.5]}],
            GREEDY,
            use_tqdm=False,
        )
    assert [index for index, _ in caught.value.errors] == [1, 2, 3]
    assert "multi_modal_data" in str(caught.value)
    assert llm.stats.num_steps == steps
    assert_quiescent(llm)


def test_chat_applies_the_template_once_and_generates_what_transformers_does(chat):
    _, hf, llm = chat
    tokenizer = llm.get_tokenizer()
    expected_ids = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    expected_text = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False
    )
    (output,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == expected_ids
    assert output.prompt_token_ids.count(BOS) == 1 and output.prompt_token_ids[0] == BOS
    assert output.prompt == expected_text
    assert output.token_ids == hf_greedy(hf, expected_ids, NUM_NEW_TOKENS)
    # The text is decoded in the prompt's context (as vLLM's detokenizer does), so a
    # SentencePiece-style first token keeps the space its piece starts with.
    alone = tokenizer.decode(output.token_ids, skip_special_tokens=True)
    assert output.text in (alone, " " + alone)
    assert_quiescent(llm)


def test_chat_options_reach_the_template(chat):
    _, _, llm = chat
    tokenizer = llm.get_tokenizer()
    no_prompt = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert (
        no_prompt.prompt_token_ids
        == tokenizer.apply_chat_template(
            CONVERSATION, add_generation_prompt=False, tokenize=True, return_dict=True
        )["input_ids"]
    )
    opened = [*CONVERSATION, {"role": "assistant", "content": "the dog"}]
    continued = llm.chat(
        opened, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert continued.prompt.endswith("assistant the dog")
    # Content as a list of text parts is the same conversation.
    parts = [
        CONVERSATION[0],
        {"role": "user", "content": [{"type": "text", "text": "the cat sat on the mat"}]},
    ]
    as_parts = llm.chat(parts, GREEDY, use_tqdm=False)[0]
    as_text = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)[0]
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids
    # A template given to the call replaces the tokenizer's.
    plain = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    custom = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=plain)[0]
    assert custom.prompt == "<s>the dog the cat sat on the mat "
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        llm.chat(CONVERSATION, GREEDY, continue_final_message=True, use_tqdm=False)
    assert_quiescent(llm)


def test_a_list_of_conversations_runs_each_and_lists_the_bad_ones(chat):
    _, _, llm = chat
    second = [{"role": "user", "content": "a dog ran far"}]
    together = llm.chat([CONVERSATION, second], GREEDY, use_tqdm=False)
    alone = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in (CONVERSATION, second)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.prompt_token_ids for o in together] == [o.prompt_token_ids for o in alone]
    steps = llm.stats.num_steps
    bad = [CONVERSATION, [], [{"content": "no role"}], [{"role": "user", "content": 7}]]
    with pytest.raises(InvalidRequestsError) as caught:
        llm.chat(bad, GREEDY, use_tqdm=False)
    assert [index for index, _ in caught.value.errors] == [1, 2, 3]
    assert llm.stats.num_steps == steps, "nothing ran"
    assert_quiescent(llm)


def test_chat_without_a_tokenizer_or_a_template_is_a_typed_error(chat, tmp_path):
    preset = LLM("tiny-llama", kv_cache_memory="256KiB", max_model_len=64)
    with pytest.raises(NoTokenizerError):
        preset.chat(CONVERSATION, use_tqdm=False)
    with pytest.raises(NoTokenizerError):
        preset.get_tokenizer()
    save_chat_model(tmp_path, chat_template=None)
    untemplated = LLM(str(tmp_path), kv_cache_memory="1MiB", max_model_len=128, block_size=4)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        untemplated.chat(CONVERSATION, GREEDY, use_tqdm=False)
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    (output,) = untemplated.chat(
        CONVERSATION, GREEDY, use_tqdm=False, chat_template=str(template_file)
    )
    _, _, llm = chat
    assert (
        output.prompt_token_ids
        == llm.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].prompt_token_ids
    )


def test_generate_command_chat(chat, capsys):
    from hybrid_cache.cli import main

    folder, hf, llm = chat
    argv = ["generate", f"--model={folder}", "--kv-cache-memory=1MiB", "--max-model-len=128"]
    argv += ["--block-size=4", "--chat", "--prompt=the cat sat", "--max-tokens=4", "--json"]
    assert main([*argv, "--ignore-eos"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["outputs"]
    conversation = [{"role": "user", "content": "the cat sat"}]
    expected = llm.get_tokenizer().apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert result["prompt_token_ids"] == expected
    assert result["token_ids"] == hf_greedy(hf, expected, 4)
