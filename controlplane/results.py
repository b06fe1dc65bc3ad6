"""What dispatched and finished chunks turn into: the trainer's payloads and the event fields.

Owns: the ``GroupResult`` a finished group is delivered as (times relative to the
rollout's acceptance, text decoded by the service's tokenizer), and the fields of the
events ``chunk_dispatched``, ``kv_pool_full``, ``chunk_finished``, ``chunk_migrated``,
``kv_load_fell_back`` and ``rollout_finished`` (the ``RolloutStats`` themselves come from
``stats.py``). Pure functions of scheduler state and the engine's ``ChunkFinished``; the
server sends and logs what they return, so the field names here are the ones tests,
trace tooling (``trace.py``) and docs read.
"""

from __future__ import annotations

from typing import Any

from seer.controlplane.kvpool.table import PoolBinding
from seer.controlplane.scheduler import Dispatch
from seer.controlplane.state import Group, Request, Rollout
from seer.controlplane.stops import Decode
from seer.controlplane.turns import loss_mask
from seer.protocol import ChunkFinished, GroupResult, RolloutStats, SampleResult


def group_result(group: Group, decode: Decode) -> GroupResult:
    t0 = group.rollout.accepted_s
    return GroupResult(group_index=group.group_index, prompt_id=group.prompt_id, samples=[
        SampleResult(
            sample_index=r.sample_index, token_ids=list(r.generated_token_ids), logprobs=list(r.logprobs),
            text=decode(r.generated_token_ids), finish_reason=r.finish_reason,
            num_prompt_tokens=len(r.prompt_token_ids), first_scheduled_s=(r.first_scheduled_s or t0) - t0,
            finished_s=(r.finished_s or t0) - t0, engine_ids=list(r.engine_history), loss_mask=loss_mask(r),
            turns=[] if r.trajectory is None else list(r.trajectory.turns),
            reward=None if r.trajectory is None else r.trajectory.reward,
            agent_return=None if r.trajectory is None else r.trajectory.agent_return,
            prompt_token_ids=list(r.prompt_token_ids) if group.rollout.agent else [],
            segments=[] if r.trajectory is None else list(r.trajectory.segments),
        ) for r in group.requests])


def chunk_dispatched_fields(d: Dispatch) -> dict[str, Any]:
    kv = d.task.kv
    return dict(request_id=d.request.request_id, group_id=d.request.group.group_id,
                rollout_id=d.request.group.rollout.rollout_id, engine_id=d.engine_id, task_id=d.task.task_id,
                max_tokens=d.task.sampling.max_tokens, num_prompt_tokens=len(d.task.prompt_token_ids) // 4,
                kv_valid_tokens=kv.valid_tokens if kv else 0, kv_save=kv.save if kv else False)


def kv_pool_full_fields(d: Dispatch, pool: PoolBinding | None) -> dict[str, Any]:
    """``pool``: the pool of the engine's host, where the chunk found no room."""
    return dict(request_id=d.request.request_id, pool=pool.name if pool else None,
                num_free_blocks=pool.allocator.num_free if pool else 0,
                effect="chunk not saved; its next chunk re-prefills",
                fix="raise kv_pool.pool_gib")


def chunk_finished_fields(msg: ChunkFinished, request: Request, num_tokens: int) -> dict[str, Any]:
    group = request.group
    return dict(request_id=request.request_id, group_id=group.group_id,
                rollout_id=group.rollout.rollout_id, engine_id=msg.engine_id, task_id=msg.task_id,
                num_tokens=num_tokens, num_prompt_tokens=msg.num_prompt_tokens,
                num_cached_tokens=msg.num_cached_tokens, kv_loaded_tokens=msg.kv_loaded_tokens,
                kv_saved_tokens=msg.kv_saved_tokens, finish_reason=msg.finish_reason,
                latency_ms=round(msg.elapsed_ms, 1))


def chunk_migrated_fields(msg: ChunkFinished, request: Request, bytes_per_token: int) -> dict[str, Any]:
    """A chunk that ran on another engine than the request's previous chunk: how its
    context got there (``bytes_per_token``: of the KV geometry of the engine that ran it)."""
    group = request.group
    return dict(request_id=request.request_id, group_id=group.group_id,
                rollout_id=group.rollout.rollout_id, task_id=msg.task_id,
                from_engine_id=request.migrated_from, to_engine_id=msg.engine_id,
                prefix_tokens=msg.num_prompt_tokens, kv_loaded_tokens=msg.kv_loaded_tokens,
                num_bytes=msg.kv_loaded_tokens * bytes_per_token,
                # unknown (None) when the chunk finished in its loading step: vLLM hands
                # the worker's timing to the connector only after finishing requests
                load_ms=round(msg.kv_load_ms, 3) if msg.kv_load_ms or not msg.kv_loaded_tokens else None,
                # prompt tokens this engine computed instead (its own cache covered the rest)
                reprefill_tokens=msg.num_prompt_tokens - msg.num_cached_tokens,
                mode="pool" if msg.kv_loaded_tokens else "reprefill")


def kv_load_fell_back_fields(msg: ChunkFinished, request: Request) -> dict[str, Any]:
    return dict(request_id=request.request_id, engine_id=msg.engine_id,
                task_id=msg.task_id, failed_tokens=msg.kv_load_failed_tokens,
                effect="recomputed by the engine (stale, corrupted or missing pool blocks)")


def rollout_finished_fields(rollout: Rollout, stats: RolloutStats) -> dict[str, Any]:
    return dict(rollout_id=rollout.rollout_id, policy=rollout.policy,
                num_samples=stats.num_samples, num_output_tokens=stats.num_output_tokens,
                wall_time_s=round(stats.wall_time_s, 3), tail_time_s=round(stats.tail_time_s, 3),
                num_preemptions=stats.num_preemptions)
