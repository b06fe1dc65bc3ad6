"""Hypothesis strategies for wire frames: random bytes, random msgpack values, messages
with real tags and random fields, and byte-level mutations of valid messages. Shared by
the codec fuzz test (unit) and the daemon fuzz test (integration)."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from seer import protocol as p
from seer.wire import VERSION_FRAME

CLIENT_TAGS = ["rollout", "cancel", "heartbeat", "status", "update_weights", "shutdown"]

# Integers msgpack can carry, plus the edges where typed fields overflow.
wire_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1]))
scalars = st.one_of(st.none(), st.booleans(), wire_ints, st.floats(), st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=20)

FIELDS = ["call_id", "rollout_id", "prompts", "group_size", "sampling", "policy", "rollout_ids", "path",
          "prompt", "prompt_token_ids", "messages", "id", "max_tokens", "temperature", "stop", "seed"]


@st.composite
def tagged_dicts(draw) -> dict:
    """A dict with a real message tag and random (often plausible) fields."""
    fields = draw(st.dictionaries(st.sampled_from(FIELDS), values, max_size=6))
    fields["type"] = draw(st.sampled_from(CLIENT_TAGS + ["ack", "hello", "nope", ""]))
    return fields


def valid_client_messages() -> list[bytes]:
    """Encoded payloads of one valid message of each client type (shutdown excluded)."""
    enc = msgspec.msgpack.encode
    return [
        enc(p.RolloutRequest(call_id="c1", rollout_id="r1", group_size=2,
                             prompts=[p.Prompt(id="a", prompt="hello"), p.Prompt(prompt_token_ids=[5, 6, 7])],
                             sampling=p.SamplingParams(max_tokens=4, stop=["x"], seed=3))),
        enc(p.CancelRollout(call_id="c2", rollout_id="r1")),
        enc(p.ClientHeartbeat(call_id="c3", rollout_ids=["r1"])),
        enc(p.StatusRequest(call_id="c4")),
        enc(p.UpdateWeightsRequest(call_id="c5", path="/nonexistent/weights")),
    ]


@st.composite
def mutated(draw, payload: bytes) -> bytes:
    """``payload`` with a few bytes flipped, inserted or removed, or cut short."""
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and data:
            del data[pos]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


def _msgpack(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


prompts = st.one_of(
    st.builds(p.Prompt, id=st.one_of(st.none(), st.text(max_size=8)), prompt=st.text(max_size=40)),
    st.builds(p.Prompt, prompt_token_ids=st.lists(st.one_of(st.integers(0, 258), st.integers(-5, 70_000)), max_size=12)),
    st.builds(p.Prompt, messages=st.lists(st.builds(p.ChatMessage, role=st.sampled_from(["user", "system", "x"]),
                                                    content=st.text(max_size=20)), max_size=3)),
    st.builds(p.Prompt),  # none of the three
    st.builds(p.Prompt, prompt=st.just("a"), prompt_token_ids=st.just([1])),  # two of them
)


@st.composite
def plausible_requests(draw) -> bytes:
    """Well-formed client messages with values in and out of range (they reach intake)."""
    kind = draw(st.sampled_from(["rollout", "cancel", "heartbeat", "status", "update_weights"]))
    ids = st.text(min_size=0, max_size=12)
    if kind == "rollout":
        sampling = {k: v for k, v in draw(st.fixed_dictionaries({}, optional={
            "max_tokens": st.one_of(st.integers(1, 48), st.integers(-1, 1000)), "temperature": st.floats(-0.5, 3),
            "top_k": st.integers(-2, 50), "min_tokens": st.integers(0, 8), "stop": st.lists(st.text(max_size=3), max_size=3),
            "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "ignore_eos": st.booleans(),
            "seed": st.one_of(st.none(), st.integers(0, 2**63))})).items()}
        msg = {"type": "rollout", "call_id": draw(ids), "rollout_id": draw(ids),
               "prompts": [msgspec.to_builtins(x) for x in draw(st.lists(prompts, max_size=4))],
               "group_size": draw(st.one_of(st.integers(1, 4), st.integers(-1, 20))), "sampling": sampling,
               "policy": draw(st.sampled_from([None, "group", "request", "divided", "context", "oracle",
                                               "nope"]))}
    elif kind == "cancel":
        msg = {"type": "cancel", "call_id": draw(ids), "rollout_id": draw(ids)}
    elif kind == "heartbeat":
        msg = {"type": "heartbeat", "call_id": draw(ids), "rollout_ids": draw(st.lists(ids, max_size=3))}
    elif kind == "status":
        msg = {"type": "status", "call_id": draw(ids)}
    else:
        msg = {"type": "update_weights", "call_id": draw(ids), "path": "/nonexistent/" + draw(ids)}
    return _msgpack(msg)


payloads = st.one_of(
    plausible_requests(),
    st.binary(max_size=64),
    values.map(_msgpack),
    tagged_dicts().map(_msgpack),
    st.sampled_from(valid_client_messages()).flatmap(mutated),
)

frames = st.one_of(
    st.tuples(st.just(VERSION_FRAME), payloads).map(list),  # the right envelope, bad contents
    st.lists(st.binary(max_size=32), min_size=1, max_size=4),  # wrong frame counts and versions
    st.tuples(st.binary(max_size=16), payloads).map(list),
    st.tuples(st.just(VERSION_FRAME), payloads, st.binary(max_size=8)).map(list),
)

# Well-formed requests in the right envelope: they get past the codec into intake.
plausible_frames = plausible_requests().map(lambda payload: [VERSION_FRAME, payload])
