"""Tokenizer.encode_turn_suffix: the ids that continue a conversation after an assistant turn.

Checked three ways: the simulated backend's ByteTokenizer; HFTokenizer's algorithm on a
fake transformers tokenizer (jinja templates, bytes as ids), for the closer, the EOS rule,
the cache and the refusals; and SmolLM2-135M-Instruct's real tokenizer, where the prompt's,
the assistant's and the suffix's ids must equal the whole rendered conversation's ids.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import transformers
from jinja2.exceptions import TemplateError

from seer.controlplane.tokenizer import ByteTokenizer, HFTokenizer
from seer.protocol import ChatMessage
from seer.tool_calls import HermesParser, ToolCall

SMOLLM = Path.home() / ".cache" / "seer" / "models" / "SmolLM2-135M-Instruct"
TOOL = ChatMessage(role="tool", content='{"temperature_c": 21}')
CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# --------------------------------------------------------------------------- ByteTokenizer


def test_byte_suffix_continues_the_chat_format_without_a_bos():
    tok = ByteTokenizer()
    suffix = tok.encode_turn_suffix([TOOL, ChatMessage(role="user", content="ok?")], ended_with_eos=False)
    assert tok.BOS not in suffix
    assert tok.decode(suffix) == '\n<tool>{"temperature_c": 21}\n<user>ok?\n<assistant>'
    assert tok.encode_turn_suffix([TOOL], ended_with_eos=True) == tok.encode_turn_suffix([TOOL], False)
    assert tok.eos_token_id == tok.EOS == 2


def test_byte_prompt_assistant_and_suffix_spell_the_whole_conversation():
    tok = ByteTokenizer()
    user = ChatMessage(role="user", content="weather?")
    ids = tok.encode_chat([user]) + tok.encode("sunny")[1:] + tok.encode_turn_suffix([TOOL], False)
    whole = [user, ChatMessage(role="assistant", content="sunny"), TOOL]
    assert ids == tok.encode_chat(whole)


# --------------------------------------------------------------------------- fake HF tokenizer

CHATML = (
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}<E>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
REVERSED = (
    "{% for m in messages|reverse %}<s>{{ m.role }}\n{{ m.content }}<E>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
NO_TOOL_ROLE = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
    "[{{ m.role }}]{{ m.content }}<E>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
# The closer "\n<E>" does not start with the EOS text: it is kept whole even after an EOS.
NEWLINE_THEN_EOS = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n<E>{% endfor %}"


def _raise(message: str) -> None:
    raise TemplateError(message)


class FakeHF:
    """What HFTokenizer uses of a transformers tokenizer; ids are the text's bytes."""

    eos_token = "<E>"
    eos_token_id = 9

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.renders: list[list[dict]] = []
        env = jinja2.Environment()
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)

    def __len__(self) -> int:
        return 256

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
        assert tokenize is False
        self.renders.append(conversation)
        return self._template.render(messages=conversation, add_generation_prompt=add_generation_prompt)

    def __call__(self, text, add_special_tokens):
        assert add_special_tokens is False
        return {"input_ids": list(text.encode())}


def fake_hf(monkeypatch, template: str) -> tuple[HFTokenizer, FakeHF]:
    fake = FakeHF(template)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: fake)
    return HFTokenizer("fake"), fake


def text(ids: list[int]) -> str:
    return bytes(ids).decode()


def test_suffix_is_the_closer_then_the_template_diff(monkeypatch):
    tok, _ = fake_hf(monkeypatch, CHATML)
    assert text(tok.encode_turn_suffix([TOOL], ended_with_eos=False)) == (
        '<E>\n<s>tool\n{"temperature_c": 21}<E>\n<s>assistant\n'
    )
    assert tok.eos_token_id == 9


def test_after_an_eos_the_closer_loses_its_eos_text(monkeypatch):
    tok, _ = fake_hf(monkeypatch, CHATML)
    feedback = ChatMessage(role="user", content="try again")
    assert (
        text(tok.encode_turn_suffix([feedback], ended_with_eos=True))
        == "\n<s>user\ntry again<E>\n<s>assistant\n"
    )


def test_an_eos_is_kept_when_the_closer_does_not_start_with_it(monkeypatch):
    tok, _ = fake_hf(monkeypatch, NEWLINE_THEN_EOS)
    assert (
        text(tok.encode_turn_suffix([TOOL], ended_with_eos=True)) == '\n<E><tool>{"temperature_c": 21}\n<E>'
    )


def test_a_template_that_changes_the_content_is_refused(monkeypatch):
    tok, _ = fake_hf(monkeypatch, CHATML.replace("m.content", "m.content|lower"))
    with pytest.raises(ValueError, match="does not render an assistant message's content as is"):
        tok.encode_turn_suffix([TOOL], ended_with_eos=False)


def test_no_messages_gives_the_closer_and_the_generation_prompt(monkeypatch):
    tok, _ = fake_hf(monkeypatch, CHATML)
    assert text(tok.encode_turn_suffix([], ended_with_eos=False)) == "<E>\n<s>assistant\n"


def test_a_template_that_reorders_messages_is_refused(monkeypatch):
    tok, _ = fake_hf(monkeypatch, REVERSED)
    with pytest.raises(ValueError, match=r"^this model's chat template is not append-only: "):
        tok.encode_turn_suffix([TOOL], ended_with_eos=False)


def test_a_template_that_rejects_a_role_raises_value_error_naming_the_roles(monkeypatch):
    tok, _ = fake_hf(monkeypatch, NO_TOOL_ROLE)
    with pytest.raises(
        ValueError, match=r"rejects the roles \['user', 'assistant', 'tool'\]: roles must be user"
    ):
        tok.encode_turn_suffix([TOOL], ended_with_eos=False)
    feedback = ChatMessage(role="user", content="no")
    assert text(tok.encode_turn_suffix([feedback], ended_with_eos=True)) == "[user]no<E>[assistant]"


def test_no_chat_template_is_refused(monkeypatch):
    tok, _ = fake_hf(monkeypatch, "")
    with pytest.raises(ValueError, match="has no chat template"):
        tok.encode_turn_suffix([TOOL], ended_with_eos=False)


def test_the_closer_is_rendered_once_per_tokenizer(monkeypatch):
    tok, fake = fake_hf(monkeypatch, CHATML)
    for _ in range(3):
        tok.encode_turn_suffix([TOOL], ended_with_eos=False)
    closer_renders = [c for c in fake.renders if c[-1]["content"] not in ("y", TOOL.content)]
    assert len(closer_renders) == 1


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm() -> HFTokenizer:
    if not (SMOLLM / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2's converted tokenizer is missing at {SMOLLM} (run `seerctl model prepare`)")
    return HFTokenizer(str(SMOLLM))


def render_ids(tok: HFTokenizer, messages: list[ChatMessage]) -> list[int]:
    return tok.encode_chat(messages)  # the whole conversation rendered, then tokenized once


def assistant_ids(tok: HFTokenizer, content: str, ended_with_eos: bool) -> list[int]:
    ids = list(tok._tok(content, add_special_tokens=False)["input_ids"])
    return ids + [tok.eos_token_id] if ended_with_eos else ids


@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_smollm_prompt_assistant_and_suffix_ids_equal_the_whole_conversation(smollm, ended_with_eos):
    user = ChatMessage(role="user", content="What's the weather in Paris?")
    ids = render_ids(smollm, [user]) + assistant_ids(smollm, CALL, ended_with_eos)
    ids += smollm.encode_turn_suffix([TOOL], ended_with_eos)
    assert ids == render_ids(smollm, [user, ChatMessage(role="assistant", content=CALL), TOOL])


@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_smollm_two_turns_of_tools_and_feedback(smollm, ended_with_eos):
    system = ChatMessage(role="system", content="You call tools.")
    user = ChatMessage(role="user", content="Weather?")
    second = "It is 21 °C in Paris. Anything else?"
    feedback = [ChatMessage(role="user", content="Thanks — and Rome? 🌤")]
    ids = render_ids(smollm, [system, user]) + assistant_ids(smollm, CALL, ended_with_eos)
    ids += smollm.encode_turn_suffix([TOOL], ended_with_eos)
    ids += assistant_ids(smollm, second, ended_with_eos) + smollm.encode_turn_suffix(feedback, ended_with_eos)
    whole = [system, user, ChatMessage(role="assistant", content=CALL), TOOL]
    whole += [ChatMessage(role="assistant", content=second), *feedback]
    assert ids == render_ids(smollm, whole)


def test_smollm_eos_is_im_end_and_the_closer_adds_it_only_without_an_eos(smollm):
    assert smollm._tok.eos_token == "<|im_end|>" and smollm.eos_token_id == 2
    with_eos = smollm.encode_turn_suffix([TOOL], ended_with_eos=True)
    assert smollm.encode_turn_suffix([TOOL], ended_with_eos=False) == [smollm.eos_token_id] + with_eos
    decoded = smollm._tok.decode(with_eos, skip_special_tokens=False)
    assert decoded == '\n<|im_start|>tool\n{"temperature_c": 21}<|im_end|>\n<|im_start|>assistant\n'


def test_smollm_turn_parses_into_its_call(smollm):
    ids = assistant_ids(smollm, CALL, ended_with_eos=False)
    turn = HermesParser().parse(smollm.decode(ids))
    assert turn.tool_calls == [ToolCall(name="get_weather", arguments={"city": "Paris"})]
    assert turn.content == "Let me check." and turn.error is None
