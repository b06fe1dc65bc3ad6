"""Turning a trainer's RolloutRequest into scheduler state, or a precise refusal.

Pure: given the request, the tokenizer, the limits and the engines' capabilities, it
returns a ``Rollout`` or raises ``RequestRejected`` whose message names the offending
prompt or field and the fix. Nothing is partially accepted: a rollout is all or none.

Intake fails fast and works in batches: every prompt is checked (tokenized, ids and
lengths against the limits) before a single ``Request`` is built, so a bad last prompt
is refused without first allocating millions of requests; and ``intake_steps`` yields
between batches so the server's event loop keeps answering heartbeats and status while
a maximum-size rollout is taken in (``build_rollout`` runs the same steps at once).
The oracle policies (``ORACLE_POLICIES``) order by true output lengths. A simulation
knows them from its trace; a daemon takes them from ``RolloutRequest.true_lengths``,
recorded by an earlier run with the same seed (``check_true_lengths`` refuses an oracle
rollout without them, and lengths that cannot be the truth).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from seer.controlplane.policies import POLICIES
from seer.controlplane.state import Group, Request, RequestState, Rollout, derive_sample_seed
from seer.controlplane.tokenizer import Tokenizer
from seer.controlplane.turns import new_trajectory
from seer.protocol import Prompt, RolloutRequest

# Samples (requests) built or enqueued, or prompts checked, between two yields of
# ``intake_steps``: a few milliseconds of work each on this machine (2,048 held the loop
# for 100-200 ms under the soak, enqueueing into ``context``'s queues on a busy machine).
INTAKE_BATCH = 256

# Policies that order by every sample's true output length (``Request.oracle_length``).
ORACLE_POLICIES = frozenset({"oracle", "oracle-full", "oracle-order", "oracle-group"})


class RequestRejected(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    max_group_size: int
    max_prompts: int
    max_model_len: int
    vocab_size: int
    # The daemon's speculative.method: whether a rollout may ask for no drafts
    # (``RolloutRequest.speculative = False``; ``check_speculative``).
    speculative_method: str = "off"


def build_rollout(req: RolloutRequest, tokenizer: Tokenizer, limits: Limits, policy: str, now_s: float) -> Rollout:
    """The rollout of ``req`` in one go (``intake_steps`` without the yields)."""
    return run_steps(intake_steps(req, tokenizer, limits, policy, now_s))[1]


Y = TypeVar("Y")
R = TypeVar("R")


def run_steps(steps: Generator[Y, None, R]) -> tuple[list[Y], R]:
    """Run a stepped generator (``intake_steps``, ``ClientSessions.intake``) to its end
    without pausing: what it yielded, in order, and what it returned."""
    yielded: list[Y] = []
    while True:
        try:
            yielded.append(next(steps))
        except StopIteration as done:
            return yielded, done.value


def intake_steps(req: RolloutRequest, tokenizer: Tokenizer, limits: Limits, policy: str, now_s: float,
                 batch: int = INTAKE_BATCH) -> Generator[None, None, Rollout]:
    """Check the request, then every prompt, then build the rollout, yielding every
    ``batch`` prompts checked or samples built; returns the rollout (raises
    ``RequestRejected`` at the first problem, before any request is built)."""
    checked = yield from check_steps(req, tokenizer, limits, policy, batch)
    return (yield from build_steps(req, checked, policy, now_s, batch))


@dataclass(frozen=True)
class Checked:
    """A request's prompts, checked: their ids and token ids (what ``build_steps`` needs;
    what an accepted rollout holds while it waits to be admitted, ``backlog.py``)."""

    prompt_ids: list[str]
    token_lists: list[list[int]]
    max_context_tokens: int = 0  # a trajectory's context budget (``turns.new_trajectory``)


def check_steps(req: RolloutRequest, tokenizer: Tokenizer, limits: Limits, policy: str,
                batch: int = INTAKE_BATCH) -> Generator[None, None, Checked]:
    """Check the request, then every prompt, yielding every ``batch`` prompts; returns the
    checked prompts (raises ``RequestRejected`` at the first problem). Builds no request."""
    check_request(req, limits, policy)
    max_tokens = req.sampling.max_tokens
    if req.trajectory is not None and req.trajectory.max_total_tokens is not None:
        # A trajectory's prompt and first turn must fit its context budget too.
        limits = dataclasses.replace(limits, max_model_len=min(limits.max_model_len, req.trajectory.max_total_tokens))
    prompt_ids: list[str] = []
    token_lists: list[list[int]] = []
    for index, prompt in enumerate(req.prompts):
        prompt_ids.append(prompt.id if prompt.id is not None else str(index))
        token_lists.append(check_prompt(prompt, index, tokenizer, limits, max_tokens))
        if (index + 1) % batch == 0:
            yield
    return Checked(prompt_ids, token_lists, limits.max_model_len)


def build_steps(req: RolloutRequest, checked: Checked, policy: str, now_s: float,
                batch: int = INTAKE_BATCH) -> Generator[None, None, Rollout]:
    """The rollout of a checked request (``check_steps``), yielding every ``batch`` samples built."""
    sampling = req.sampling
    rollout = Rollout(rollout_id=req.rollout_id, policy=policy, accepted_s=now_s, speculative=req.speculative,
                      agent=req.agent_keys is not None)
    # Without a seed every sample shares the request's sampling parameters (one object, not
    # one copy per sample); with one, each sample gets its own derived seed.
    shared = sampling if sampling.seed is None else None
    truth = req.true_lengths if req.true_lengths is not None else req.replay_lengths  # a replay's lengths are true
    built = 0
    for index, (prompt_id, token_ids) in enumerate(zip(checked.prompt_ids, checked.token_lists)):
        group = Group(group_id=f"{req.rollout_id}/{index}", rollout=rollout, group_index=index, prompt_id=prompt_id)
        for j in range(req.group_size):
            group.requests.append(
                Request(
                    request_id=f"{req.rollout_id}/{index}/{j}",
                    group=group,
                    sample_index=j,
                    prompt_token_ids=token_ids,
                    sampling=shared or msgspec.structs.replace(sampling, seed=derive_sample_seed(sampling.seed, index, j)),
                    oracle_length=None if truth is None else truth[index][j],
                    forced_length=(req.replay_lengths[index][j] if req.replay_lengths is not None else
                                   req.replay_turns[index][j][0] if req.replay_turns is not None else None),
                    trajectory=None if req.trajectory is None else new_trajectory(
                        req.trajectory, checked.max_context_tokens,
                        None if req.replay_turns is None else req.replay_turns[index][j]),
                )
            )
        if rollout.agent:  # each waits for its first call (``agent_calls.py``)
            for request in group.requests:
                request.state = RequestState.TOOL_WAIT
        rollout.groups.append(group)
        built += req.group_size
        if built >= batch:
            built = 0
            yield
    return rollout


def check_prompt(prompt: Prompt, index: int, tokenizer: Tokenizer, limits: Limits, max_tokens: int) -> list[int]:
    """The token ids of prompt ``index``, checked (exactly one form, token ids in the
    vocabulary, room for ``max_tokens`` within ``model.max_model_len``); the daemon's intake
    and ``seerctl rollout``'s check before an embedded daemon starts run this same code."""
    prompt_id = prompt.id if prompt.id is not None else str(index)
    token_ids = _tokenize(prompt, index, prompt_id, tokenizer, limits)
    budget = limits.max_model_len - len(token_ids)
    if budget < 1:
        raise RequestRejected(
            "prompt_too_long",
            f"prompt {index} (id {prompt_id!r}) has {len(token_ids)} tokens; the model allows "
            f"{limits.max_model_len} in all (model.max_model_len), leaving no room to generate. "
            "Shorten the prompt or raise model.max_model_len",
        )
    if max_tokens > budget:
        raise RequestRejected(
            "prompt_too_long",
            f"prompt {index} (id {prompt_id!r}) has {len(token_ids)} tokens and max_tokens is "
            f"{max_tokens}: {len(token_ids) + max_tokens} > model.max_model_len "
            f"{limits.max_model_len}. Lower max_tokens to at most {budget} or shorten the prompt",
        )
    return token_ids


def check_request(req: RolloutRequest, limits: Limits, policy: str) -> None:
    """The request-wide checks (sizes, policy, sampling), before any prompt is looked at."""
    if not req.prompts:
        raise RequestRejected("empty_rollout", "the rollout has no prompts; send at least one prompt")
    if len(req.prompts) > limits.max_prompts:
        raise RequestRejected(
            "too_many_prompts",
            f"the rollout has {len(req.prompts)} prompts, the limit is {limits.max_prompts} "
            "(server.max_prompts_per_rollout); split it into several rollouts",
        )
    if not 1 <= req.group_size <= limits.max_group_size:
        raise RequestRejected(
            "bad_group_size",
            f"group_size must be between 1 and {limits.max_group_size} (server.max_group_size), "
            f"got {req.group_size}",
        )
    if policy not in POLICIES:
        raise RequestRejected("unknown_policy", f"unknown policy {policy!r}; available: {', '.join(sorted(POLICIES))}")
    check_true_lengths(req, policy)
    check_speculative(req, limits.speculative_method)
    check_trajectory(req)
    sampling = req.sampling
    if sampling.min_tokens > sampling.max_tokens:
        raise RequestRejected(
            "bad_sampling",
            f"sampling.min_tokens ({sampling.min_tokens}) exceeds sampling.max_tokens ({sampling.max_tokens})",
        )
    for token_id in sampling.stop_token_ids:
        if token_id >= limits.vocab_size:
            raise RequestRejected(
                "bad_sampling", f"sampling.stop_token_ids has {token_id}, outside the vocabulary (size {limits.vocab_size})"
            )


def check_trajectory(req: RolloutRequest) -> None:
    """A trajectory takes no per-sample lengths; its trace replay (``replay_turns``) has one
    list of turn lengths per sample, each in 1..``max_tokens``, and needs a trajectory."""
    if req.trajectory is not None and (req.true_lengths is not None or req.replay_lengths is not None):
        raise RequestRejected("bad_trajectory", "a trajectory rollout takes neither true_lengths nor replay_lengths "
                              "(they are per-sample output lengths, a trajectory's are per turn); drop them")
    keys = req.agent_keys
    if keys is not None:
        if req.trajectory is None:
            raise RequestRejected("bad_trajectory", "agent_keys needs a trajectory (RolloutRequest.trajectory)")
        if len(keys) != len(req.prompts) or any(len(row) != req.group_size for row in keys) \
                or len({k for row in keys for k in row}) != len(req.prompts) * req.group_size \
                or any(len(k) < 16 for row in keys for k in row):
            raise RequestRejected("bad_trajectory", "agent_keys must hold one distinct key of at least 16 "
                                  "characters per sample ([prompt][sample])")
    turns = req.replay_turns
    if turns is None:
        return
    if req.trajectory is None:
        raise RequestRejected("bad_trajectory", "replay_turns needs a trajectory (RolloutRequest.trajectory)")
    if len(turns) != len(req.prompts) or any(len(row) != req.group_size for row in turns):
        raise RequestRejected("bad_trajectory", f"replay_turns must have one row per prompt ({len(req.prompts)}) of "
                              f"group_size ({req.group_size}) lists of turn lengths")
    for i, group in enumerate(turns):
        for j, lengths in enumerate(group):
            if not lengths or not all(1 <= n <= req.sampling.max_tokens for n in lengths):
                raise RequestRejected("bad_trajectory", f"replay_turns[{i}][{j}] must be a non-empty list of turn "
                                      f"lengths in 1..max_tokens ({req.sampling.max_tokens}), got {lengths[:8]}")


def check_true_lengths(req: RolloutRequest, policy: str) -> None:
    """Oracle policies need ``true_lengths`` of the rollout's exact shape, from a seeded run
    (``needs_true_lengths`` / ``bad_true_lengths``); other policies must not get any."""
    if req.replay_lengths is not None:
        check_lengths_shape(req, req.replay_lengths, "replay_lengths", "bad_replay_lengths",
                            "write one row per prompt of group_size lengths, each in 1..max_tokens")
    lengths = req.true_lengths
    if policy not in ORACLE_POLICIES:
        if lengths is not None:
            raise RequestRejected(
                "bad_true_lengths",
                f"true_lengths is the input of the oracle policies ({', '.join(sorted(ORACLE_POLICIES))}), and "
                f"policy {policy!r} does not use it; drop true_lengths or choose an oracle policy",
            )
        return
    if lengths is None and req.replay_lengths is not None:
        return  # a replay's lengths are the truth
    if lengths is None:
        raise RequestRejected(
            "needs_true_lengths",
            f"policy {policy!r} orders requests by their true output lengths: send true_lengths "
            "([prompt][sample], recorded by an earlier run of the same prompts with the same sampling.seed), "
            "or use a policy that learns lengths online, such as 'context'",
        )
    if req.sampling.seed is None:
        raise RequestRejected(
            "bad_true_lengths",
            "true_lengths can only be the truth for seeded sampling (seeded samples do not depend on the "
            "schedule); set sampling.seed to the seed of the run that recorded them",
        )
    check_lengths_shape(req, lengths, "true_lengths", "bad_true_lengths",
                        "record them from a run of the same prompts, group size and max_tokens")


def check_lengths_shape(req: RolloutRequest, lengths: list[list[int]], name: str, code: str, fix: str) -> None:
    """Per-sample lengths must have one row per prompt of ``group_size`` lengths, each in
    1..max_tokens (``code`` names the refusal, ``fix`` says what to do)."""
    if len(lengths) != len(req.prompts) or any(len(row) != req.group_size for row in lengths):
        raise RequestRejected(
            code,
            f"{name} must have one row per prompt ({len(req.prompts)}) of group_size ({req.group_size}) "
            f"lengths; {fix}",
        )
    for index, row in enumerate(lengths):
        for j, length in enumerate(row):
            if not 1 <= length <= req.sampling.max_tokens:
                raise RequestRejected(
                    code,
                    f"{name}[{index}][{j}] is {length}, outside 1..max_tokens ({req.sampling.max_tokens}); {fix}",
                )


def check_speculative(req: RolloutRequest, method: str) -> None:
    """A rollout may turn drafting off (``speculative=False``) only where Seer decides per
    request what is drafted: grouped SD, or no SD at all (a no-op). vLLM's own drafters
    ("ngram", "suffix") draft for every request (``speculative_unsupported``)."""
    if req.speculative or method in ("off", "grouped"):
        return
    raise RequestRejected(
        "speculative_unsupported",
        f"speculative=False asks for no speculative drafts, but this daemon's engines use speculative.method "
        f"{method!r}, whose vLLM drafter drafts for every request; only speculative.method 'grouped' or 'off' "
        "can run a rollout without drafts. Send speculative=True, or restart the daemon with "
        "[speculative] method = \"grouped\" or \"off\"",
    )


def _tokenize(prompt: Prompt, index: int, prompt_id: str, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if getattr(prompt, k) is not None]
    where = f"prompt {index} (id {prompt_id!r})"
    if len(given) != 1:
        raise RequestRejected(
            "bad_prompt",
            f"{where} must have exactly one of `prompt`, `messages`, `prompt_token_ids`; it has "
            f"{', '.join(given) or 'none'}",
        )
    if prompt.prompt_token_ids is not None:
        ids = prompt.prompt_token_ids
        if ids and (min(ids) < 0 or max(ids) >= limits.vocab_size):  # the common case: one pass each, no list
            bad = [t for t in ids if not 0 <= t < limits.vocab_size]
            raise RequestRejected(
                "bad_token_ids",
                f"{where} has token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})"
                + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""),
            )
    elif prompt.messages is not None:
        if not prompt.messages:
            raise RequestRejected("bad_prompt", f"{where} has an empty `messages` list")
        try:
            ids = tokenizer.encode_chat(prompt.messages)
        except ValueError as exc:
            raise RequestRejected("bad_prompt", f"{where}: {exc}") from None
    else:
        ids = tokenizer.encode(prompt.prompt or "")
    if not ids:
        raise RequestRejected("bad_prompt", f"{where} is empty; it needs at least one token")
    return list(ids)
