"""Prompt tokenisation and output detokenisation for the control plane.

The control plane turns text and chat prompts into token ids (the engines take token
ids only) and decodes finished samples. ``HFTokenizer`` loads the model folder's
tokenizer through ``transformers`` lazily, without torch (transformers' tokenizers do
not need it). ``ByteTokenizer`` is the simulated backend's: UTF-8 bytes shifted past
three special ids, so tests and paper-scale simulations need no model files.

``encode_turn_suffix`` serves multi-turn rollouts: after the model's assistant turn, the
ids to append so that the model goes on after further messages (tool outputs, user
feedback). It is the chat template's diff: the assistant turn's closing text plus the
new messages and the generation prompt, encoded alone, so the trajectory's earlier ids
are never re-tokenized.
"""

from __future__ import annotations

from typing import Protocol

from seer.protocol import ChatMessage


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None) -> list[int]:
        """The messages rendered by the chat template with the generation prompt; ``tools``
        (OpenAI's ``tools`` entries) passed to the template, which may ignore them."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def encode_turn_suffix(self, messages: list[ChatMessage], ended_with_eos: bool) -> list[int]:
        """Ids to append after an assistant turn so the model goes on after ``messages``.

        ``ended_with_eos``: the turn's ids end with the EOS token (not cut at a stop
        string or the length limit), so the closing EOS is not added again."""
        ...


_MARKER = "\x00SEER-ASSISTANT-CONTENT\x00"
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class HFTokenizer:
    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer  # lazy: only the daemon needs it

        try:
            self._tok = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError) as exc:
            raise RuntimeError(
                f"cannot load the tokenizer from {model_path!r}: {exc}. "
                "Run `seerctl model prepare` (or set model.path to an HF folder with a tokenizer)."
            ) from None
        self.vocab_size = len(self._tok)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self._closer: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send `prompt` or `prompt_token_ids`")
        rendered = self._render([{"role": m.role, "content": m.content} for m in messages], True, tools)
        return list(self._tok(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def encode_turn_suffix(self, messages: list[ChatMessage], ended_with_eos: bool) -> list[int]:
        """The template's diff: what rendering ``[user, assistant] + messages`` (with the
        generation prompt) adds to ``[user, assistant]``, after the assistant turn's closer
        (less its EOS text when ``ended_with_eos``). Raises ValueError when the template
        has no chat template, rejects the messages, or is not append-only."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; it cannot continue a conversation")
        base = self._render(_BASE, add_generation_prompt=False)
        full = self._render(_BASE + [{"role": m.role, "content": m.content} for m in messages], True)
        if not full.startswith(base):
            raise ValueError(
                "this model's chat template is not append-only: rendering more messages changes the text "
                f"of the earlier ones ({base[-80:]!r} is not a prefix of {full[: len(base) + 80]!r})"
            )
        closer = self._assistant_closer()
        eos = self._tok.eos_token
        if ended_with_eos and isinstance(eos, str) and eos and closer.startswith(eos):
            closer = closer[len(eos) :]
        return list(self._tok(closer + full[len(base) :], add_special_tokens=False)["input_ids"])

    def _render(self, conversation: list[dict[str, str]], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> str:
        from jinja2.exceptions import TemplateError  # a dependency of transformers' chat templates

        try:
            return self._tok.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                **({"tools": tools} if tools else {}),
            )
        except TemplateError as exc:
            roles = [m["role"] for m in conversation]
            what = f"the roles {roles}" + (" with these tools" if tools else "")
            raise ValueError(f"this model's chat template rejects {what}: {exc}") from None

    def _assistant_closer(self) -> str:
        """The text the template puts after an assistant message's content (cached)."""
        if self._closer is None:
            rendered = self._render([_BASE[0], {"role": "assistant", "content": _MARKER}], False)
            if rendered.count(_MARKER) != 1:
                raise ValueError(
                    "this model's chat template does not render an assistant message's content as is"
                )
            self._closer = rendered.split(_MARKER, 1)[1]
        return self._closer


class ByteTokenizer:
    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 256 + OFFSET
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [b + self.OFFSET for b in text.encode()]

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self._chat_text(messages))  # like SmolLM2's template, no tool section

    def encode_turn_suffix(self, messages: list[ChatMessage], ended_with_eos: bool) -> list[int]:
        """The closer ``"\\n"`` (the EOS id has no text, so ``ended_with_eos`` changes
        nothing), ``messages`` in the chat format and ``"<assistant>"``, without the BOS."""
        return self.encode("\n" + self._chat_text(messages))[1:]

    @staticmethod
    def _chat_text(messages: list[ChatMessage]) -> str:
        return "".join(f"<{m.role}>{m.content}\n" for m in messages) + "<assistant>"

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self.OFFSET for t in token_ids if self.OFFSET <= t < self.vocab_size)
        return data.decode(errors="replace")
