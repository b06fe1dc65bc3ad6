"""SamplingParams refuses non-finite temperatures at decode, like every other bad value."""

from __future__ import annotations

import math

import msgspec
import pytest

from seer import protocol as p
from seer.wire import VERSION_FRAME, Codec, FrameError


def _rollout_frames(**sampling: object) -> list[bytes]:
    request = {"type": "rollout", "call_id": "c", "rollout_id": "r", "group_size": 2,
               "prompts": [{"prompt": "hi"}], "sampling": sampling}
    return [VERSION_FRAME, msgspec.msgpack.encode(request)]


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan])
def test_non_finite_temperature_is_refused_naming_the_field(temperature):
    """temperature = inf, -inf or NaN is refused with invalid_message naming $.sampling.temperature."""
    with pytest.raises(FrameError) as info:
        Codec(p.ClientMessage).decode(_rollout_frames(temperature=temperature))
    assert info.value.code == "invalid_message"
    assert "$.sampling.temperature" in str(info.value)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 50.0])
def test_ordinary_temperatures_still_decode(temperature):
    """Greedy (0) and ordinary finite temperatures decode unchanged."""
    msg = Codec(p.ClientMessage).decode(_rollout_frames(temperature=temperature))
    assert isinstance(msg, p.RolloutRequest) and msg.sampling.temperature == temperature
