"""The engine's step records (engines/vllm_stats.py ``LoadRecorder``): one per step,
with speculative decoding's part of it — the draft lengths chosen for the step (rows
that drafted, draft tokens) and the tokens accepted."""

from __future__ import annotations

from types import SimpleNamespace

from structlog.testing import capture_logs

from seer.engines.vllm_stats import LoadRecorder


def _scheduler(drafts: tuple[int, int, int] | None) -> SimpleNamespace:
    sd = None if drafts is None else SimpleNamespace(num_drafts=drafts[0], num_draft_tokens=drafts[1],
                                                    num_accepted_tokens=drafts[2])
    return SimpleNamespace(num_running_reqs=3, num_waiting_reqs=0, num_skipped_waiting_reqs=0, kv_cache_usage=0.25,
                           spec_decoding_stats=sd)


def _iteration(t: float, generated: int, prefilled: int = 0) -> SimpleNamespace:
    return SimpleNamespace(num_preempted_reqs=0, iteration_timestamp=t, num_generation_tokens=generated,
                           prompt_token_stats=SimpleNamespace(computed=prefilled))


def test_step_records_carry_each_steps_drafts_and_acceptances():
    """A drafting step records its rows, draft tokens and accepted tokens; a plain step zeros."""
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=16))
    recorder = LoadRecorder(config)  # type: ignore[arg-type]
    recorder.record(_scheduler(None), _iteration(1.0, 3, prefilled=40))
    recorder.record(_scheduler((2, 12, 5)), _iteration(1.2, 10))
    with capture_logs() as logs:
        recorder.flush_steps()
    assert logs[0]["event"] == "engine_steps" and logs[0]["kv_capacity_tokens"] == 160
    assert logs[0]["steps"] == [(1.0, 3, 0.25, 3, 40, 0, 0, 0), (1.2, 3, 0.25, 10, 0, 2, 12, 5)]
    assert recorder.spec_counts == [2, 12, 5]
    assert (recorder.num_steps, recorder.num_generated_tokens) == (2, 13)
