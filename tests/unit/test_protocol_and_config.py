"""Wire codec and schema, array packing, seer.toml loading, tail-time statistic, CPU sets."""

from __future__ import annotations

import math
import struct
import typing
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer import protocol as p
from seer.config import ConfigError, EnginesConfig, SeerConfig, load_config
from seer.controlplane.stats import tail_time_s
from seer.controlplane.supervisor import cpu_sets
from seer.wire import VERSION_FRAME, Codec, FrameError

REPO_ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------- samples of every variant

CAPS = p.EngineCapabilities(
    backend="sim", model="m", dtype="float32", max_model_len=2048, vocab_size=259, kv_capacity_tokens=4096,
    block_size=16,
)
LOAD = p.EngineLoad(num_running=3, num_waiting=1, kv_usage=0.25, num_preemptions=7)
SAMPLING = p.SamplingParams(
    max_tokens=12, temperature=0.5, top_p=0.75, top_k=20, min_tokens=1, seed=3, stop=["x"], stop_token_ids=[2],
    ignore_eos=True,
)
SAMPLE = p.SampleResult(
    sample_index=1, token_ids=[4, 5], logprobs=[-0.5, -1.25], text="ab", finish_reason="stop", num_prompt_tokens=3,
    first_scheduled_s=0.5, finished_s=1.5, engine_ids=[0, 1],
)
STATS = p.RolloutStats(
    policy="group", num_groups=1, num_samples=2, num_output_tokens=4, wall_time_s=2.0, throughput_tokens_per_s=2.0,
    tail_time_s=0.5, num_preemptions=0, num_chunks=2, per_engine_output_tokens={"0": 4},
)
STATUS = p.ServiceStatus(
    pid=10, policy="group", weights_version=2,
    engines=[p.EngineStatus(engine_id=0, pid=11, state="ready", load=LOAD, capabilities=CAPS, weights_version=2),
             p.EngineStatus(engine_id=1, pid=12, state="starting", load=p.EngineLoad(), capabilities=None,
                            weights_version=0)],
    rollouts=[p.RolloutProgress(rollout_id="r", policy="group", num_groups=2, num_groups_done=1, num_samples=4,
                                num_samples_done=2, num_output_tokens=9, elapsed_s=1.5)],
    run_dir="/tmp/run", client_address="ipc:///tmp/run/client.sock",
)

CLIENT_MESSAGES = [
    p.RolloutRequest(
        call_id="c1", rollout_id="r1", group_size=4, sampling=SAMPLING, policy="group",
        prompts=[p.Prompt(id="a", prompt="hi"), p.Prompt(messages=[p.ChatMessage("user", "q")]),
                 p.Prompt(prompt_token_ids=[1, 2, 3])],
    ),
    p.RolloutRequest(call_id="c1b", rollout_id="r1b", group_size=1, prompts=[p.Prompt(prompt="x")]),
    p.CancelRollout(call_id="c2", rollout_id="r1"),
    p.ClientHeartbeat(call_id="c3", rollout_ids=["r1", "r2"]),
    p.StatusRequest(call_id="c4"),
    p.UpdateWeightsRequest(call_id="c5", path="/models/v2"),
    p.ShutdownRequest(call_id="c6"),
    p.TurnInput(call_id="c1", rollout_id="r1", group_index=0, sample_index=1, turn=2,
                messages=[p.ChatMessage(role="tool", content="42")], tool_name="python", tool_s=0.25),
]
SERVER_MESSAGES = [
    p.RolloutAccepted(call_id="c1", rollout_id="r1", num_groups=3, policy="group", weights_version=1),
    p.GroupCompleted(call_id="c1", rollout_id="r1", group=p.GroupResult(group_index=0, prompt_id="a",
                                                                         samples=[SAMPLE])),
    p.RolloutCompleted(call_id="c1", rollout_id="r1", stats=STATS, weights_version=1),
    p.StatusReply(call_id="c4", status=STATUS),
    p.WeightsUpdated(call_id="c5", weights_version=2),
    p.Ack(call_id="c2"),
    p.ErrorReply(call_id="c1", code="bad_prompt", message="prompt 0 ..."),
    p.TurnEnded(call_id="c1", rollout_id="r1", group_index=0, sample_index=1, turn=2, token_ids=[5, 6],
                text="<tool_call>", finish_reason="stop", num_context_tokens=40, final=True),
]
ENGINE_MESSAGES = [
    p.EngineHello(engine_id=0, protocol_version=p.PROTOCOL_VERSION, pid=99, capabilities=CAPS, weights_version=0),
    p.EngineHeartbeat(engine_id=0, load=LOAD),
    p.ChunkFinished(engine_id=0, task_id=5, token_ids=p.pack_token_ids([7, 8]), logprobs=p.pack_logprobs([-0.5, -2.0]),
                    finish_reason="length", num_prompt_tokens=3, num_cached_tokens=2, elapsed_ms=12.5),
    p.ChunkFailed(engine_id=0, task_id=6, error="boom"),
    p.WeightsLoaded(engine_id=0, weights_version=2),
    p.WeightsLoaded(engine_id=1, weights_version=2, error="disk full"),
]
CONTROL_MESSAGES = [
    p.HelloAccepted(engine_id=0),
    p.HelloRejected(reason="version"),
    p.ChunkTask(task_id=5, request_id="r1/0/0", group_id="r1/0", prompt_token_ids=p.pack_token_ids([1, 2, 3]),
                sampling=p.EngineSampling(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, min_tokens=0, seed=None,
                                          stop=[], stop_token_ids=[], ignore_eos=False)),
    p.AbortTasks(task_ids=[5, 6]),
    p.LoadWeights(path="/models/v2", weights_version=2),
    p.Ping(),
    p.Shutdown(),
]

UNIONS = [
    ("client", p.ClientMessage, CLIENT_MESSAGES),
    ("server", p.ServerMessage, SERVER_MESSAGES),
    ("engine", p.EngineMessage, ENGINE_MESSAGES),
    ("control", p.ControlMessage, CONTROL_MESSAGES),
]


@pytest.mark.parametrize(("union", "samples"), [(u, s) for _, u, s in UNIONS], ids=[n for n, _, _ in UNIONS])
def test_codec_round_trips_every_variant_of_each_union(union, samples):
    """Every variant of each message union survives encode -> decode unchanged, as the same type."""
    assert {type(m) for m in samples} == set(typing.get_args(union))  # the samples cover the whole union
    codec = Codec(union)
    for msg in samples:
        frames = codec.encode(msg)
        assert len(frames) == 2 and frames[0] == VERSION_FRAME == b"seer/%d" % p.PROTOCOL_VERSION
        back = codec.decode(frames)
        assert type(back) is type(msg)
        assert back == msg


def _payload(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def _rollout_dict(**sampling) -> dict:
    return {"type": "rollout", "call_id": "c", "rollout_id": "r", "group_size": 2,
            "prompts": [{"prompt": "hi"}], "sampling": sampling}


def test_decode_refuses_a_wrong_protocol_version():
    """A frame with another version frame is refused with protocol_mismatch naming both versions."""
    codec = Codec(p.ClientMessage)
    payload = codec.encode(p.StatusRequest(call_id="c"))[1]
    with pytest.raises(FrameError) as info:
        codec.decode([b"seer/999", payload])
    assert info.value.code == "protocol_mismatch"
    assert "seer/999" in str(info.value) and "seer/1" in str(info.value)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_decode_refuses_a_wrong_frame_count(count):
    """A message of other than two frames is refused with malformed_frame naming the count."""
    payload = Codec(p.ClientMessage).encode(p.StatusRequest(call_id="c"))[1]
    frames = [VERSION_FRAME, payload, payload][:count]
    with pytest.raises(FrameError) as info:
        Codec(p.ClientMessage).decode(frames)
    assert info.value.code == "malformed_frame"
    assert f"got {count}" in str(info.value)


def test_decode_refuses_a_frame_above_the_size_limit():
    """A payload above max_frame_bytes is refused with frame_too_large; one at the limit decodes."""
    msg = p.UpdateWeightsRequest(call_id="c", path="x" * 200)
    payload = Codec(p.ClientMessage).encode(msg)[1]
    at_limit = Codec(p.ClientMessage, max_frame_bytes=len(payload))
    assert at_limit.decode([VERSION_FRAME, payload]) == msg
    below = Codec(p.ClientMessage, max_frame_bytes=len(payload) - 1)
    with pytest.raises(FrameError) as info:
        below.decode([VERSION_FRAME, payload])
    assert info.value.code == "frame_too_large"
    assert f"{len(payload)} bytes" in str(info.value) and str(len(payload) - 1) in str(info.value)
    assert "server.max_request_bytes" in str(info.value)


@pytest.mark.parametrize("garbage", [b"", b"\xc1\xff\x00", b"not msgpack at all", _payload([1, 2, 3]),
                                     _payload({"type": "nope", "call_id": "c"})])
def test_decode_refuses_garbage_bytes(garbage):
    """Bytes that are not a known message are refused with invalid_message."""
    with pytest.raises(FrameError) as info:
        Codec(p.ClientMessage).decode([VERSION_FRAME, garbage])
    assert info.value.code == "invalid_message"
    assert str(info.value).startswith("invalid message: ")


def test_decode_refuses_an_unknown_sampling_field_naming_it():
    """An unknown field in SamplingParams is refused with invalid_message naming the field."""
    with pytest.raises(FrameError) as info:
        Codec(p.ClientMessage).decode([VERSION_FRAME, _payload(_rollout_dict(presence_penalty=0.5))])
    assert info.value.code == "invalid_message"
    assert "presence_penalty" in str(info.value) and "sampling" in str(info.value)


@pytest.mark.parametrize(
    ("sampling", "where"),
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"stop_token_ids": [-1]}, "stop_token_ids")],
)
def test_decode_refuses_out_of_range_sampling_values(sampling, where):
    """Out-of-range sampling values (negative temperature, ...) are refused with invalid_message naming the field."""
    with pytest.raises(FrameError) as info:
        Codec(p.ClientMessage).decode([VERSION_FRAME, _payload(_rollout_dict(**sampling))])
    assert info.value.code == "invalid_message"
    assert f"$.sampling.{where}" in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("num_bytes", -1), ("seconds", -0.5), ("seconds", math.nan)])
def test_decode_refuses_a_pull_answer_with_a_negative_size_or_time(field, value):
    """A PullDone with num_bytes < 0 or seconds < 0 (or NaN) is refused at decode, naming the
    field: it never reaches the transfer-bytes counter, which would raise halfway through."""
    fields = {"type": "pull_done", "transfer_id": 1, "ok": True, field: value}
    with pytest.raises(FrameError) as info:
        Codec(p.EngineMessage | p.AgentMessage).decode([VERSION_FRAME, _payload(fields)])
    assert info.value.code == "invalid_message"
    assert f"$.{field}" in str(info.value)
    ok = {"type": "pull_done", "transfer_id": 1, "ok": True, "num_bytes": 0, "seconds": 0.0}
    assert Codec(p.EngineMessage | p.AgentMessage).decode([VERSION_FRAME, _payload(ok)]) == p.PullDone(transfer_id=1,
                                                                                                        ok=True)


def test_decoded_sampling_defaults_are_the_struct_defaults():
    """A rollout without sampling decodes with SamplingParams() defaults (valid minimal request)."""
    msg = Codec(p.ClientMessage).decode([VERSION_FRAME, _payload(
        {"type": "rollout", "call_id": "c", "rollout_id": "r", "group_size": 2, "prompts": [{"prompt": "hi"}]})])
    assert isinstance(msg, p.RolloutRequest)
    assert msg.sampling == p.SamplingParams() and msg.policy is None


# ---------------------------------------------------------------------------- packing


def test_packed_arrays_are_little_endian_int32_and_float32():
    """pack_token_ids/pack_logprobs produce little-endian int32/float32 bytes as documented."""
    assert p.pack_token_ids([1, -1, 2**31 - 1]) == struct.pack("<3i", 1, -1, 2**31 - 1)
    assert p.pack_logprobs([-0.5, 0.0]) == struct.pack("<2f", -0.5, 0.0)
    assert p.pack_token_ids([]) == b"" and p.unpack_token_ids(b"") == []


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300))
def test_token_id_packing_is_lossless(ids):
    """unpack_token_ids(pack_token_ids(x)) == x for every int32 list."""
    packed = p.pack_token_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert p.unpack_token_ids(packed) == ids


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(st.floats(width=32, allow_nan=False), max_size=300))
def test_float32_logprob_packing_is_lossless(logprobs):
    """unpack_logprobs(pack_logprobs(x)) == x for float32 values, including -inf and -0.0."""
    packed = p.pack_logprobs(logprobs)
    assert len(packed) == 4 * len(logprobs)
    back = p.unpack_logprobs(packed)
    assert back == logprobs
    assert [math.copysign(1, v) for v in back] == [math.copysign(1, v) for v in logprobs]


def test_float32_logprob_packing_keeps_special_values():
    """-inf, subnormals, the float32 extremes and a typical logprob survive packing bit-exactly."""
    values = [float("-inf"), -0.0, 0.0, -1.401298464324817e-45, -3.4028234663852886e38,
              struct.unpack("<f", struct.pack("<f", -2.3025851))[0]]
    assert p.unpack_logprobs(p.pack_logprobs(values)) == values
    assert struct.pack("<6f", *p.unpack_logprobs(p.pack_logprobs(values))) == struct.pack("<6f", *values)


# ---------------------------------------------------------------------------- config


def _write(tmp_path: Path, text: str | bytes, name: str = "seer.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_load_config_none_gives_the_embedded_defaults():
    """load_config(None) equals SeerConfig()."""
    assert load_config(None) == SeerConfig()


def test_repository_seer_toml_spells_out_exactly_the_defaults():
    """The repository's seer.toml decodes to exactly SeerConfig()."""
    path = REPO_ROOT / "seer.toml"
    if not path.exists():
        pytest.skip(f"{path} does not exist (it ships with the repository; nothing to compare)")
    assert load_config(path) == SeerConfig()


def test_empty_file_gives_the_defaults(tmp_path):
    """An empty seer.toml is valid and gives SeerConfig()."""
    assert load_config(_write(tmp_path, "")) == SeerConfig()


def test_values_are_read_from_the_file(tmp_path):
    """Keys set in the file override their defaults and leave the rest alone."""
    config = load_config(_write(tmp_path, '[engines]\nbackend = "sim"\ncount = 3\nkv_cache_gib = 2\n'))
    assert config.engines.backend == "sim" and config.engines.count == 3 and config.engines.kv_cache_gib == 2.0
    assert config.model == SeerConfig().model and config.engines.cpu_binding == "auto"


def test_unknown_key_in_a_section_names_file_key_and_allowed_keys(tmp_path):
    """An unknown key in a section gives ConfigError naming the file, `section.key` and the allowed keys."""
    path = _write(tmp_path, "[engines]\ncount = 2\nnum_gpus = 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "`engines.num_gpus`" in msg
    allowed = [f.name for f in msgspec.structs.fields(EnginesConfig)]
    assert len(allowed) >= 10
    assert ", ".join(allowed) in msg


def test_unknown_top_level_section_names_file_and_allowed_sections(tmp_path):
    """An unknown top-level section gives ConfigError naming the file, the section and the allowed sections."""
    path = _write(tmp_path, "[sampler]\nfoo = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg and "`sampler`" in msg
    assert "model, engines, server, scheduler, kv_pool, rollout, logging" in msg


@pytest.mark.parametrize(
    ("text", "key"),
    [('[engines]\ncount = "two"\n', "engines.count"), ("[model]\nmax_model_len = 8\n", "model.max_model_len"),
     ('[scheduler]\npolicy = "seer"\n', "scheduler.policy"), ("engines = 3\n", "engines")],
)
def test_wrong_type_or_value_names_the_key_path(tmp_path, text, key):
    """A wrong type or out-of-bounds value gives ConfigError naming the file and the key path."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert f"`{key}`" in str(info.value)


def test_invalid_toml_names_the_file(tmp_path):
    """Invalid TOML gives ConfigError naming the file and saying it is not valid TOML."""
    path = _write(tmp_path, "[engines\ncount = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "not valid TOML" in str(info.value)


def test_missing_file_says_so(tmp_path):
    """A missing file gives ConfigError naming the path and saying there is no such file."""
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "no such config file" in str(info.value)


def test_non_utf8_file_names_the_file(tmp_path):
    """A config file that is not UTF-8 gives ConfigError naming the file."""
    path = _write(tmp_path, b"# caf\xe9\n[engines]\ncount = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------------- stats and cpu sets


def test_tail_time_is_last_finish_minus_the_ninth_of_ten():
    """With 10 finish times, tail time = last minus the 9th (ceil(0.9*10)), regardless of input order."""
    times = [4.0, 0.5, 7.5, 1.0, 12.25, 2.0, 6.0, 3.0, 5.0, 7.0]
    assert tail_time_s(times) == 12.25 - 7.5


def test_tail_time_for_twenty_uses_the_eighteenth():
    """With 20 finish times, tail time = last minus the 18th."""
    times = [float(i) for i in range(1, 18)] + [30.0, 31.0, 40.0]
    assert tail_time_s(times) == 40.0 - 30.0


@pytest.mark.parametrize("times", [[], [3.0]])
def test_tail_time_with_fewer_than_two_finishes_is_zero(times):
    """Fewer than two finish times give a tail time of 0."""
    assert tail_time_s(times) == 0.0


def test_tail_time_with_two_finishes():
    """With two finish times, ceil(0.9*2) = 2 so the tail is 0; with fraction 0.5 it is their gap."""
    assert tail_time_s([1.0, 4.0]) == 0.0
    assert tail_time_s([1.0, 4.0], fraction=0.5) == 3.0


def test_cpu_sets():
    """cpu_sets gives one core each, ranges when there are spare cores, round-robin when there are too few."""
    assert cpu_sets(2, 2) == ["0", "1"]
    assert cpu_sets(1, 2) == ["0-1"]
    assert cpu_sets(3, 2) == ["0", "1", "0"]
    assert cpu_sets(5, 2) == ["0", "1", "0", "1", "0"]
    assert cpu_sets(2, 4) == ["0-1", "2-3"]
    assert cpu_sets(2, 5) == ["0-1", "2-3"]
