"""A request's token ids as the engine will see them, and its salt (kvtier/router/prompts.py).

The tokenizer is the project's word-level one (``t<i>`` is id i) with a chat template, written
locally; that vLLM's own tokenization agrees is tested against ``vllm serve``'s /tokenize in
tests/engines/vllm_engine/test_router_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.engine.checkpoint import write_tokenizer
from kvtier.errors import ConfigError
from kvtier.router.prompts import CHAT, COMPLETIONS, NO_TOKENIZER, PromptTokenizer, RequestPrompt, request_prompt

TEMPLATE = ("{% for m in messages %}{{ {'system': 't3', 'user': 't4', 'assistant': 't5'}[m['role']] }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t5{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 2048)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return PromptTokenizer(d)


def test_completion_prompts(tok: PromptTokenizer) -> None:
    assert request_prompt(COMPLETIONS, {"prompt": "t10 t11 t12", "cache_salt": "s", "stream": True}, tok) == \
        RequestPrompt((10, 11, 12), "s", True)
    assert request_prompt(COMPLETIONS, {"prompt": [7, 8, 9]}, tok) == RequestPrompt((7, 8, 9), "", False)
    assert request_prompt(COMPLETIONS, {"prompt": [0, 2**32 - 1]}, tok).tokens == (0, 2**32 - 1)  # the range's ends
    assert request_prompt(COMPLETIONS, {"prompt": ["t11 t12"]}, tok).tokens == (11, 12)  # a batch of one
    assert request_prompt(COMPLETIONS, {"prompt": [[4, 5]]}, tok).tokens == (4, 5)


def test_chat_prompts_render_the_template(tok: PromptTokenizer) -> None:
    msgs = [{"role": "system", "content": "t100 t101"}, {"role": "user", "content": "t200"}]
    assert request_prompt(CHAT, {"messages": msgs}, tok).tokens == (3, 100, 101, 4, 200, 5)
    assert request_prompt(CHAT, {"messages": msgs, "add_generation_prompt": False}, tok).tokens == (3, 100, 101, 4, 200)
    parts = [{"role": "user", "content": [{"type": "text", "text": "t7"}, {"type": "text", "text": "t8"}]}]
    assert request_prompt(CHAT, {"messages": parts}, tok).tokens == (4, 7, 8, 5)


UNTOKENIZED = [
    (COMPLETIONS, {"prompt": ["t1", "t2"]}, "batch"),
    (COMPLETIONS, {"prompt": [[1], [2]]}, "batch"),
    (COMPLETIONS, {"prompt": [1, "x"]}, "bad_prompt"),
    (COMPLETIONS, {"prompt": [1, -1]}, "bad_prompt"),
    (COMPLETIONS, {"prompt": [True]}, "bad_prompt"),
    (COMPLETIONS, {"prompt": [5, False]}, "bad_prompt"),
    (COMPLETIONS, {"prompt": [5, 6.0]}, "bad_prompt"),
    (COMPLETIONS, {"prompt": [5, 2**32]}, "bad_prompt"),
    (COMPLETIONS, {}, "bad_prompt"),
    (COMPLETIONS, {"prompt": ""}, "empty"),
    (COMPLETIONS, {"prompt": "t1", "add_special_tokens": "yes"}, "bad_prompt"),
    (COMPLETIONS, {"prompt": "t1", "cache_salt": 5}, "salt_not_text"),
    (CHAT, {"messages": []}, "bad_prompt"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "not_text"),
    (CHAT, {"messages": [{"role": "user", "content": "t1"}], "chat_template": "{{ 1 }}"}, "request_template"),
    (CHAT, {"messages": [{"role": "user", "content": "t1"}], "chat_template_kwargs": {"tools": 5}},
     "tokenizer_refused"),
]


@pytest.mark.parametrize(("kind", "body", "why"), UNTOKENIZED)
def test_what_cannot_be_tokenized_is_routed_by_load_with_a_reason(tok: PromptTokenizer, kind: str, body: dict,
                                                                  why: str) -> None:
    got = request_prompt(kind, body, tok)
    assert got.tokens is None and got.why == why


TOKENIZED = [(COMPLETIONS, {"prompt": "t10 t11", "cache_salt": "s", "stream": True}),
             (COMPLETIONS, {"prompt": [7, 8, 9]}), (COMPLETIONS, {"prompt": ["t11"]}), (COMPLETIONS, {"prompt": [[4]]}),
             (CHAT, {"messages": [{"role": "user", "content": "t200"}]})]


@pytest.mark.parametrize(("kind", "body"), TOKENIZED + [(k, b) for k, b, _ in UNTOKENIZED])
def test_the_routers_first_pass_without_a_tokenizer_is_final_except_for_text(tok: PromptTokenizer, kind: str,
                                                                             body: dict) -> None:
    """kvtier route parses without the tokenizer first (no thread hop for token ids) and tokenizes
    only what that pass left to a tokenizer: the two passes give what one pass with it gives."""
    first = request_prompt(kind, body, None)
    two_pass = request_prompt(kind, body, tok) if first.why == NO_TOKENIZER else first
    assert two_pass == request_prompt(kind, body, tok)


def test_without_a_tokenizer_only_token_ids_are_known() -> None:
    assert request_prompt(COMPLETIONS, {"prompt": [1, 2]}, None).tokens == (1, 2)
    assert request_prompt(COMPLETIONS, {"prompt": "t1"}, None).why == "no_tokenizer"
    assert request_prompt(CHAT, {"messages": [{"role": "user", "content": "t1"}]}, None).why == "no_tokenizer"


def test_a_directory_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tokenizer"):
        PromptTokenizer(tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        PromptTokenizer(tmp_path)
