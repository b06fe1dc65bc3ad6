"""Stop strings across chunk edges (controlplane/stops.py) and their use by the scheduler."""

from __future__ import annotations

from seer.config import SchedulerConfig
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import Group, Request, Rollout
from seer.protocol import EngineCapabilities, SamplingParams
from seer.controlplane.stops import straddling_stop
from seer.controlplane.tokenizer import ByteTokenizer
from tests.unit.chunks import finished

TOK = ByteTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)[1:]  # no BOS: these stand for generated tokens


def test_stop_string_across_the_edge_keeps_tokens_up_to_the_completing_one():
    """"END" split as "E" | "ND..." is found; the chunk keeps "ND" (the token completing it)."""
    assert straddling_stop(TOK.decode, ids("abc E"), ids("ND more"), ["END"]) == 2


def test_no_stop_string_across_the_edge():
    """Text that never forms the stop string across the edge gives None."""
    assert straddling_stop(TOK.decode, ids("abc E"), ids("nd more"), ["END"]) is None


def test_stop_string_entirely_in_earlier_chunks_is_not_reported_again():
    """An occurrence that ended before the new chunk belongs to the engine's own check."""
    assert straddling_stop(TOK.decode, ids("xx END yy"), ids("zz"), ["END"]) is None


def test_earliest_completing_stop_string_wins():
    """With several stop strings, the one completed first decides how much is kept."""
    assert straddling_stop(TOK.decode, ids("..AB"), ids("CDE"), ["ABCDE", "BC"]) == 1


def test_nothing_before_means_nothing_straddles():
    """A first chunk has nothing earlier to straddle: the engine matched inside it."""
    assert straddling_stop(TOK.decode, [], ids("END"), ["END"]) is None


def _divided(decode) -> tuple[Scheduler, Rollout]:
    config = SchedulerConfig(policy="divided", chunk_size_tokens=4, kv_admission_fraction=1.0)
    sched = Scheduler(config, lambda: 0.0, decode=decode)
    sched.engine_joined(0, EngineCapabilities(backend="sim", model="m", dtype="none", max_model_len=512,
                                              vocab_size=259, kv_capacity_tokens=10_000, block_size=16))
    r = Rollout(rollout_id="r", policy="divided", accepted_s=0.0)
    g = Group(group_id="r/0", rollout=r, group_index=0, prompt_id="0")
    g.requests.append(Request(request_id="r/0/0", group=g, sample_index=0, prompt_token_ids=ids("Q:"),
                              sampling=SamplingParams(max_tokens=12, stop=["STOP"])))
    r.groups.append(g)
    sched.submit(r)
    return sched, r


def _run(sched: Scheduler, text: str) -> list[str]:
    """Feed ``text`` to the request 4 tokens per chunk, as an engine that cannot see
    across chunks would; return the finish reasons."""
    reasons, pos = [], 0
    while (ds := sched.schedule()):
        (d,) = ds
        n = d.task.sampling.max_tokens
        piece = ids(text[pos:pos + n])
        pos += n
        done = sched.chunk_finished(finished(d.engine_id, d.task.task_id, piece, [-0.5] * len(piece), "length"))
        reasons.append(done.request.finish_reason or "requeued")
    return reasons


def test_scheduler_finishes_a_chunked_request_on_a_straddling_stop_string():
    """A divided-policy request whose stop string spans two chunks ("..ST" | "OP..")
    finishes with reason "stop" right after the completing token, with as many logprobs."""
    sched, r = _divided(TOK.decode)
    reasons = _run(sched, "abST" + "OPcd" + "efgh")
    req = r.groups[0].requests[0]
    assert reasons == ["requeued", "stop"]
    assert TOK.decode(req.generated_token_ids) == "abSTOP"
    assert len(req.logprobs) == len(req.generated_token_ids) == 6


def test_without_a_decoder_only_the_engine_matches_stop_strings():
    """A scheduler built without ``decode`` (simulator) leaves stop strings to the engines."""
    sched, r = _divided(None)
    assert _run(sched, "abST" + "OPcd" + "efgh") == ["requeued", "requeued", "length"]


def test_a_straddling_stop_string_wins_over_a_later_one_the_engine_stopped_at():
    """The engine stopped the second chunk at a later stop string (reason "stop"), but
    "STOP" straddled the edge earlier: the sample ends at the earlier one."""
    sched, r = _divided(TOK.decode)
    (d,) = sched.schedule()
    sched.chunk_finished(finished(d.engine_id, d.task.task_id, ids("abST"), [-0.5] * 4, "length"))
    (d,) = sched.schedule()
    # "X" is a stop string too: the engine stopped on it, 3 tokens into this chunk.
    r.groups[0].requests[0].sampling = SamplingParams(max_tokens=12, stop=["STOP", "X"])
    done = sched.chunk_finished(finished(d.engine_id, d.task.task_id, ids("OPX"), [-0.5] * 3, "stop"))
    req = r.groups[0].requests[0]
    assert done.request.finish_reason == "stop"
    assert TOK.decode(req.generated_token_ids) == "abSTOP"
