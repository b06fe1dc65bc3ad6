"""Prompt tokenisation and output detokenisation for the control plane.

The control plane turns text and chat prompts into token ids (the engines take token
ids only) and decodes finished samples. ``HFTokenizer`` loads the model folder's
tokenizer through ``transformers`` lazily, without torch (transformers' tokenizers do
not need it). ``ByteTokenizer`` is the simulated backend's: UTF-8 bytes shifted past
three special ids, so tests and paper-scale simulations need no model files.
"""

from __future__ import annotations

from typing import Protocol

from seer.protocol import ChatMessage


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


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

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send `prompt` or `prompt_token_ids`")
        rendered = self._tok.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=False,
        )
        return list(self._tok(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


class ByteTokenizer:
    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 256 + OFFSET

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [b + self.OFFSET for b in text.encode()]

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        text = "".join(f"<{m.role}>{m.content}\n" for m in messages) + "<assistant>"
        return self.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self.OFFSET for t in token_ids if self.OFFSET <= t < self.vocab_size)
        return data.decode(errors="replace")
