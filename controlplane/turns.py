"""Multi-turn trajectories (``RolloutRequest.trajectory``): the turn records, the limits,
and the environment's answer turned into appended token ids.

A trajectory is one ``Request`` whose ``generated_token_ids`` hold every token after
the prompt: what the model sampled and what its environment's answers appended
(rendered by the chat template, ``Tokenizer.encode_turn_suffix``; earlier tokens are
never re-tokenized). A turn ends where a single-turn sample would finish (EOS, a stop
string, the turn's ``max_tokens``): the scheduler parks it in ``TOOL_WAIT``
(``Scheduler._turn_ended``), its client gets a ``TurnEnded``, runs the environment and
answers with a ``TurnInput``; ``answer`` decides whether the trajectory goes on (tokens
appended, ``Scheduler.resume``) or ends, and with which finish reason. Pure: no sockets,
no clock of its own.
"""

from __future__ import annotations

from seer.controlplane.decisions import SchedulerError
from seer.controlplane.state import Request, RequestState, Rollout, Trajectory
from seer.controlplane.tokenizer import Tokenizer
from seer.protocol import ChunkFinished, Segment, TrajectorySpec, TurnEnded, TurnInput, TurnRecord

# Outcomes that end a trajectory, and the finish reason each gives.
_ENDS = {"tool_timeout": "tool_timeout", "tool_error": "tool_error"}


def new_trajectory(spec: TrajectorySpec, max_model_len: int, replay: list[int] | None = None) -> Trajectory:
    """``replay``: a trace's decode length per turn (its turns are all it may run)."""
    limit = max_model_len if spec.max_total_tokens is None else min(spec.max_total_tokens, max_model_len)
    max_turns = spec.max_turns if replay is None else min(spec.max_turns, len(replay))
    return Trajectory(max_turns=max_turns, max_context_tokens=limit, replay=replay,
                      turns=[TurnRecord(start=0, end=0, engine_ids=[])])


def recomputed_tokens(request: Request, msg: ChunkFinished) -> int:
    """Context tokens a finished chunk computed that had been computed before: what it
    prefilled beyond what was new to it. New: the prompt for a sample's (or a segment's) first chunk; the
    previous turn's appended tokens and its last sampled token for a turn's first chunk;
    else the previous chunk's last sampled token (never fed to the model)."""
    prefilled = max(0, msg.num_prompt_tokens - msg.num_cached_tokens)
    t = request.trajectory
    turn = t.turns[-1] if t is not None and t.turns else None
    if request.num_chunks <= 1 or (turn is not None and turn.segment and turn.start == 0 and turn.num_chunks == 0):
        # a sample's first chunk, or a new segment's (``new_segment``)
        new = len(request.prompt_token_ids)
    elif t is not None and len(t.turns) > 1 and t.turns[-1].num_chunks == 0:
        new = t.turns[-2].appended_tokens + 1
    else:
        new = 1
    return max(0, prefilled - new)


def chunk_done(request: Request, msg: ChunkFinished, recomputed: int) -> None:
    """Count a finished chunk of a trajectory in its current turn's record."""
    turn = request.trajectory.turns[-1]  # type: ignore[union-attr] - callers check
    if not turn.engine_ids or turn.engine_ids[-1] != msg.engine_id:
        turn.engine_ids.append(msg.engine_id)
    turn.prefilled_tokens += max(0, msg.num_prompt_tokens - msg.num_cached_tokens)
    turn.reused_tokens += msg.num_cached_tokens
    turn.recomputed_tokens += recomputed
    turn.num_chunks += 1


def waiting(request: Request) -> Request:
    """``request``, which must wait for its environment (else a ``SchedulerError``)."""
    if request.state is not RequestState.TOOL_WAIT:
        raise SchedulerError(f"{request.request_id} is not waiting for its environment")
    return request


def turn_ended(request: Request, reason: str, now_s: float) -> None:
    """The model's turn ended with ``reason`` ("stop" or "length"): record its span."""
    t = request.trajectory
    assert t is not None
    turn = t.turns[-1]
    turn.end = len(request.generated_token_ids)
    turn.finish_reason = reason
    t.waiting_since_s = now_s


def limit_reached(request: Request) -> str | None:
    """The limit that ends the trajectory whatever its environment answers, if any."""
    t = request.trajectory
    assert t is not None
    if len(t.turns) >= t.max_turns:
        return "max_turns"
    if t.max_context_tokens - request.context_tokens < 2:  # no room for an answer and a token
        return "context_budget"
    return None


def turn_ended_message(request: Request, call_id: str, decode) -> TurnEnded:  # noqa: ANN001 - a Decode
    t = request.trajectory
    assert t is not None
    turn = t.turns[-1]
    ids = request.generated_token_ids[turn.start:turn.end]
    return TurnEnded(call_id=call_id, rollout_id=request.group.rollout.rollout_id,
                     group_index=request.group.group_index, sample_index=request.sample_index,
                     turn=len(t.turns) - 1, token_ids=list(ids), text=decode(ids), finish_reason=turn.finish_reason,
                     num_context_tokens=request.context_tokens, final=limit_reached(request) is not None,
                     logprobs=list(request.logprobs[turn.start:turn.end]))


def sample_of(rollout: Rollout, msg: TurnInput) -> Request | None:
    if not 0 <= msg.group_index < len(rollout.groups):
        return None
    requests = rollout.groups[msg.group_index].requests
    return requests[msg.sample_index] if 0 <= msg.sample_index < len(requests) else None


def waiting_request(rollout: Rollout, msg: TurnInput) -> Request | None:
    """The trajectory ``msg`` answers, if it waits for exactly that turn's answer (turn -1:
    whichever turn; an agent function that returned)."""
    request = sample_of(rollout, msg)
    t = request.trajectory if request is not None else None
    if t is None or request.state is not RequestState.TOOL_WAIT or msg.turn not in (-1, len(t.turns) - 1):
        return None
    return request


def answer(request: Request, msg: TurnInput, tokenizer: Tokenizer, vocab_size: int) -> str | None:
    """Apply the environment's answer to a waiting trajectory: the finish reason that ends
    it, or None when its answer was appended and it goes on (the caller resumes it)."""
    t = request.trajectory
    assert t is not None
    turn = t.turns[-1]
    turn.tool_name, turn.tool_s, turn.error = msg.tool_name, max(0.0, msg.tool_s), msg.error
    if msg.reward is not None:
        t.reward = msg.reward
    if msg.agent_return is not None:
        t.agent_return = msg.agent_return
    if t.num_calls == 0 and request.group.rollout.agent:  # an agent that made no call: no turn
        t.turns.clear()
        return "stop" if msg.outcome == "done" else _ENDS.get(msg.outcome, "stop")
    if msg.outcome in _ENDS:
        turn.outcome = msg.outcome
        return _ENDS[msg.outcome]
    if msg.outcome == "done" or not msg.messages:
        turn.outcome = "done"
        return turn.finish_reason or "stop"
    limit = limit_reached(request)
    if limit is not None:
        turn.outcome = limit
        return limit
    ended_with_eos = turn.end > turn.start and request.generated_token_ids[turn.end - 1] == tokenizer.eos_token_id
    try:
        ids = tokenizer.encode_turn_suffix(msg.messages, ended_with_eos)
    except ValueError as exc:
        turn.outcome, turn.error = "bad_tool_output", str(exc)
        return "bad_tool_output"
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        turn.outcome, turn.error = "bad_tool_output", f"the rendered answer has token id {bad}, outside the vocabulary"
        return "bad_tool_output"
    if request.context_tokens + len(ids) + 1 > t.max_context_tokens:
        turn.outcome = "context_budget"
        turn.error = (f"the answer is {len(ids)} tokens; the trajectory has {request.context_tokens} of its "
                      f"{t.max_context_tokens}-token budget: shorten tool outputs or raise max_total_tokens")
        return "context_budget"
    _append(request, ids)
    turn.outcome, turn.appended_tokens = "continue", len(ids)
    t.turn_start = len(request.generated_token_ids)
    t.turns.append(TurnRecord(start=t.turn_start, end=t.turn_start, engine_ids=[], segment=turn.segment))
    if t.replay is not None:  # the trace's next turn decodes exactly its length
        request.forced_length = t.turn_start + t.replay[len(t.turns) - 1]
    return None


def _append(request: Request, ids: list[int]) -> None:
    t = request.trajectory
    assert t is not None
    start = len(request.generated_token_ids)
    request.generated_token_ids.extend(ids)
    request.logprobs.extend([0.0] * len(ids))
    t.appended.append((start, start + len(ids)))


def new_segment(request: Request, prompt_token_ids: list[int]) -> None:
    """An agent rewrote earlier messages: the trajectory's tokens so far become a
    ``Segment`` and it goes on from ``prompt_token_ids`` (the call's whole conversation,
    rendered), nothing mixed with what came before. Its current turn ends as "continue"
    with nothing appended; the next turn is the new segment's first. The caller drops the
    KV saved for the old tokens (``Scheduler.resume(new_segment=True)``)."""
    t = request.trajectory
    assert t is not None
    t.segments.append(Segment(prompt_token_ids=request.prompt_token_ids, token_ids=request.generated_token_ids,
                              logprobs=request.logprobs, loss_mask=loss_mask(request)))
    t.turns[-1].outcome = "continue"
    request.prompt_token_ids, request.generated_token_ids, request.logprobs = prompt_token_ids, [], []
    request.packed_generated = None  # packed for the old tokens
    t.appended, t.turn_start = [], 0
    t.turns.append(TurnRecord(start=0, end=0, engine_ids=[], segment=len(t.segments)))


def loss_mask(request: Request) -> list[int]:
    """1 per sampled token, 0 per appended one."""
    mask = [1] * len(request.generated_token_ids)
    t = request.trajectory
    if t is not None:
        for start, end in t.appended:
            mask[start:end] = [0] * (end - start)
    return mask
