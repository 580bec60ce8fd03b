"""A request's prompt as token ids, the ones the engine will see, and its ``cache_salt``.

So that ``Locate`` looks up the blocks the engine will compute, the router tokenizes as vLLM's
OpenAI server does, with the model's own tokenizer (``transformers.AutoTokenizer`` from a local
directory, nothing fetched):

- ``/v1/completions``: ``prompt`` as token ids (a list of integers) is taken as it is; as text,
  ``tokenizer(prompt, add_special_tokens=...)`` with the request's ``add_special_tokens``
  (vLLM's default: true). A batch of several prompts is routed by load (no single prefix).
- ``/v1/chat/completions``: the chat template (the tokenizer's, or ``--chat-template``) rendered
  with the request's ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` (default
  true), ``continue_final_message`` and ``chat_template_kwargs``, then tokenized with
  ``add_special_tokens`` (vLLM's default here: false). A message's content given as parts is
  their texts joined by newlines, as vLLM joins them; a part that is not text (an image) leaves
  the request to be routed by load.

What cannot be tokenized here is not refused: the engine is the judge of its requests, and the
router sends such a request on, routed by load, with the reason counted. Nothing of a prompt or
salt is logged or kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

COMPLETIONS, CHAT = "completions", "chat"
UINT32_MAX = 0xFFFFFFFF


@dataclass(slots=True, frozen=True)
class RequestPrompt:
    """What routing needs of a request: ``tokens`` (None: not known, ``why`` says why), ``salt``
    (empty: none) and whether the answer is streamed."""

    tokens: tuple[int, ...] | None
    salt: str
    streaming: bool
    why: str = ""


class PromptTokenizer:
    """The model's tokenizer and chat template, loaded once from a local directory.

    Thread-safe for concurrent calls (the router calls it from worker threads).
    """

    def __init__(self, directory: str | Path, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        d = Path(directory)
        if not d.is_dir():
            raise ConfigError(f"--tokenizer: {d} is not a directory (a model directory with its tokenizer files)")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tokenizer: cannot load a tokenizer from {d}: {exc}") from None
        self._template = chat_template

    def text(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool, **template: Any) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, chat_template=self._template, **template)
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])


#: ``RequestPrompt.why`` when only a tokenizer could give the token ids.
NO_TOKENIZER = "no_tokenizer"


def request_prompt(kind: str, body: dict[str, Any], tokenizer: PromptTokenizer | None) -> RequestPrompt:
    """The routing facts of a decoded request body of endpoint ``kind`` (COMPLETIONS or CHAT).
    Without a tokenizer it does no tokenizer work (a caller may try that first, on its event loop,
    and hand only the text prompts, ``why == NO_TOKENIZER``, to a thread with the tokenizer)."""
    salt = body.get("cache_salt")
    streaming = body.get("stream") is True
    if salt is not None and not isinstance(salt, str):
        return RequestPrompt(None, "", streaming, "salt_not_text")
    salt = salt or ""
    try:
        tokens = _completion_tokens(body, tokenizer) if kind == COMPLETIONS else _chat_tokens(body, tokenizer)
    except _Untokenized as why:
        return RequestPrompt(None, salt, streaming, str(why))
    except Exception:  # the tokenizer or template refused the input: the engine will say why
        return RequestPrompt(None, salt, streaming, "tokenizer_refused")
    if not tokens:
        return RequestPrompt(None, salt, streaming, "empty")
    return RequestPrompt(tuple(tokens), salt, streaming)


class _Untokenized(Exception):
    """A reason, not an error: the request goes on, routed by load."""


def _ids(value: list[Any]) -> list[int] | None:
    # Whole-list checks in C (``type`` is ``int`` exactly: a JSON ``true`` is a bool, not an id):
    # one Python test per id took 14 ms for a 131,072-token prompt, this 7.
    if value and set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= UINT32_MAX:
        return value
    return None


def _completion_tokens(body: dict[str, Any], tokenizer: PromptTokenizer | None) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        ids = _ids(prompt)
        if ids is None:
            raise _Untokenized("batch" if prompt and all(isinstance(p, str | list) for p in prompt) else "bad_prompt")
        return ids
    if not isinstance(prompt, str):
        raise _Untokenized("bad_prompt")
    if tokenizer is None:
        raise _Untokenized(NO_TOKENIZER)
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise _Untokenized("bad_prompt")
    return tokenizer.text(prompt, special)


_TEMPLATE_FIELDS = ("tools", "documents")


def _chat_tokens(body: dict[str, Any], tokenizer: PromptTokenizer | None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Untokenized("bad_prompt")
    if body.get("chat_template") is not None:
        raise _Untokenized("request_template")  # the engine decides whether it trusts one
    if tokenizer is None:
        raise _Untokenized(NO_TOKENIZER)
    flat = []
    for m in messages:
        if not isinstance(m, dict):
            raise _Untokenized("bad_prompt")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _Untokenized("not_text")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        flat.append(m)
    options = {k: body[k] for k in _TEMPLATE_FIELDS if body.get(k) is not None}
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _Untokenized("bad_prompt")
    flags = {"add_generation_prompt": body.get("add_generation_prompt", True),
             "continue_final_message": body.get("continue_final_message", False),
             "add_special_tokens": body.get("add_special_tokens", False)}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise _Untokenized("bad_prompt")
    special = flags.pop("add_special_tokens")
    return tokenizer.chat(flat, add_special_tokens=special, **{**kwargs, **options, **flags})
