"""The OpenAI-compatible endpoint on a real daemon with simulated engines: an agent written
against the plain ``openai`` client runs unchanged, each of its calls is the next turn of
its trajectory (token-exact: what the endpoint answered is what the sample holds, the
appended messages are the chat template's diff), streaming on and off; and every refusal,
with a real HTTP client."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from seer.agentic import AgentContext
from seer.client import AsyncSeerClient, SamplingParams, SeerClient, SeerServiceError
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import ChatMessage, TrajectorySpec
from tests.daemon_helpers import Daemon, write_sim_config

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def openai_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("openai")
    # Room for a tool schema in the system prompt: the byte tokenizer spends a token per byte.
    config = write_sim_config(root / "sim.toml", max_model_len=4096)
    config.write_text(config.read_text() + '\n[openai]\nenabled = true\nport = 0\napi_key = "operator-key"\n'
                      "max_request_bytes = 20000\n")
    daemon = Daemon(root / "run", config)
    daemon.start()
    yield daemon
    daemon.stop()


def three_calls(stream: bool):
    """An agent as users write them: plain openai client calls, a tool output appended each time."""
    def agent(ctx: AgentContext) -> dict:
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages: list[dict] = [{"role": "system", "content": "You add numbers."},
                                {"role": "user", "content": f"add {ctx.group_index} and {ctx.sample_index}"}]
        answers = []
        for k in range(3):
            if stream:
                chunks = list(client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8,
                                                             stream=True))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                ids = next(c.choices[0].model_extra["token_ids"] for c in chunks if c.choices and
                           c.choices[0].model_extra.get("token_ids") is not None)
            else:
                reply = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8)
                text, ids = reply.choices[0].message.content or "", reply.choices[0].model_extra["token_ids"]
            answers.append(ids)
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": f"result {k}"}]
        return {"ids": answers}
    return agent


@pytest.mark.parametrize("stream", [False, True])
def test_an_unmodified_openai_agent_runs_token_exact_trajectories(openai_daemon, stream):
    with SeerClient(openai_daemon.address, timeout_s=120) as client:
        result = client.rollout(["a", "b"], group_size=2, sampling=SamplingParams(max_tokens=16, seed=1),
                                agent=three_calls(stream), policy="divided")
    for group in result.groups:
        for s in group.samples:
            assert s.finish_reason in ("stop", "length") and len(s.turns) == 3
            # What each call answered is the span the turn sampled, token for token.
            assert [s.token_ids[t.start:t.end] for t in s.turns] == s.agent_return["ids"]
            for k, (turn, nxt) in enumerate(zip(s.turns, s.turns[1:])):
                eos = s.token_ids[turn.end - 1] == TOK.EOS
                expected = TOK.encode_turn_suffix([ChatMessage(role="tool", content=f"result {k}")], eos)
                assert s.token_ids[turn.end:nxt.start] == expected
                assert s.loss_mask[turn.end:nxt.start] == [0] * len(expected)
            assert sum(s.loss_mask) == sum(t.end - t.start for t in s.turns)
            assert s.num_prompt_tokens == len(TOK.encode_chat([
                ChatMessage(role="system", content="You add numbers."),
                ChatMessage(role="user", content=f"add {group.group_index} and {s.sample_index}")]))


def test_refusals_are_openai_style_with_their_status_codes(openai_daemon):
    """No key, an unknown key, the operator key starting a turn, bad JSON, an unknown model,
    n > 1, an oversize body, a second call while one is in flight and a call after the
    trajectory ended: each refused with its status and an error body."""
    seen: dict[str, tuple[int, str]] = {}
    base = {}
    address = openai_daemon.address

    def agent(ctx: AgentContext) -> None:
        base["url"] = ctx.base_url
        headers = {"Authorization": f"Bearer {ctx.api_key}"}
        body = {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(base_url=ctx.base_url, timeout=60) as http:
            def record(name: str, response: httpx.Response) -> None:
                error = response.json()["error"]
                assert set(error) >= {"message", "type", "code"}
                seen[name] = (response.status_code, error["code"])
            record("no_key", http.post("/chat/completions", json=body))
            record("unknown_key", http.post("/chat/completions", json=body, headers={"Authorization": "Bearer x" * 3}))
            record("operator_key", http.post("/chat/completions", json=body,
                                             headers={"Authorization": "Bearer operator-key"}))
            record("bad_json", http.post("/chat/completions", content=b"{not json", headers=headers))
            record("unknown_model", http.post("/chat/completions", json={**body, "model": "gpt-9"}, headers=headers))
            record("n", http.post("/chat/completions", json={**body, "n": 2}, headers=headers))
            record("oversize", http.post("/chat/completions", headers=headers, json={
                **body, "messages": [{"role": "user", "content": "x" * 30000}]}))
            assert http.get("/models", headers={"Authorization": "Bearer operator-key"}).json()["data"][0]["id"]
            # A second call while the first one's turn runs (the status shows it no longer
            # waits for its agent) is refused; the first is answered.
            slow = {**body, "max_tokens": 400}
            answers: list[httpx.Response] = []

            def post() -> None:
                with httpx.Client(base_url=ctx.base_url, timeout=60) as other:
                    answers.append(other.post("/chat/completions", json=slow, headers=headers))
            first = threading.Thread(target=post)
            first.start()
            with SeerClient(address) as watcher:
                while not answers and watcher.status().rollouts[0].num_waiting_for_env != 0:
                    pass
            record("in_flight", http.post("/chat/completions", json=slow, headers=headers))
            first.join()
            assert answers[0].status_code == 200, answers[0].text

    with SeerClient(openai_daemon.address, timeout_s=120) as client:
        result = client.rollout(["r"], group_size=1, sampling=SamplingParams(max_tokens=16), agent=agent)
        after = httpx.post(f"{base['url']}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                           headers={"Authorization": f"Bearer {client_key(result)}"})
    assert after.status_code == 401 and after.json()["error"]["code"] == "invalid_api_key"
    assert seen["no_key"] == (401, "missing_api_key")
    assert seen["unknown_key"] == (401, "invalid_api_key")
    assert seen["operator_key"] == (401, "invalid_api_key")
    assert seen["bad_json"] == (400, "invalid_json")
    assert seen["unknown_model"] == (404, "model_not_found")
    assert seen["n"] == (400, "unsupported_n")
    assert seen["oversize"] == (413, "request_too_large")
    assert seen["in_flight"] == (429, "call_in_flight")
    assert result.groups[0].samples[0].finish_reason in ("stop", "length")


def test_a_call_waiting_for_its_turn_gets_503_when_its_rollout_is_cancelled(openai_daemon):
    """The rollout is cancelled (by another client, as an operator would) while a call's turn
    is being sampled: the call is answered 503 ``rollout_cancelled`` within the endpoint's
    sweep, not left hanging until its timeout, and the rollout ends as cancelled."""
    seen: dict[str, object] = {}
    answered = threading.Event()

    def agent(ctx: AgentContext) -> None:
        with httpx.Client(base_url=ctx.base_url, timeout=60) as http:
            response = http.post("/chat/completions", headers={"Authorization": f"Bearer {ctx.api_key}"},
                                 json={"model": ctx.model, "messages": [{"role": "user", "content": "go"}]})
        seen["status"], seen["error"] = response.status_code, response.json().get("error", {})
        answered.set()

    def cancel_when_running() -> None:
        with SeerClient(openai_daemon.address) as operator:
            while True:  # the call's turn is sampled: its sample no longer waits for its agent
                rollouts = operator.status().rollouts
                if rollouts and rollouts[0].num_waiting_for_env == 0:
                    break
            operator.cancel(rollouts[0].rollout_id)

    canceller = threading.Thread(target=cancel_when_running)
    canceller.start()
    # ~3,000 decode steps of 2 ms: the turn is still running when the cancel arrives.
    with SeerClient(openai_daemon.address, timeout_s=120) as client, pytest.raises(SeerServiceError) as ended:
        client.rollout(["p"], group_size=1, agent=agent, timeout_s=60,
                       sampling=SamplingParams(max_tokens=3000, ignore_eos=True))
    assert ended.value.code == "rollout_cancelled" and "cancelled by another client" in str(ended.value)
    canceller.join()
    # The owner's call ended at once (``rollout_cancelled`` to the client); the agent's HTTP
    # call is answered by the endpoint's next sweep (1 s).
    assert answered.wait(30), "the call waiting for its turn was never answered"
    assert seen["status"] == 503 and seen["error"]["code"] == "rollout_cancelled", seen


def test_a_rewritten_history_starts_a_new_segment_never_mixed(openai_daemon):
    """An agent that truncates its conversation (a retry with another question, then a tool
    output appended as usual): the second call starts a new segment from its own messages,
    the first call's tokens are kept apart in ``SampleResult.segments``, and every call's
    answer is the span its turn sampled, token for token, in its own segment."""
    first = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "add 1 and 2"}]
    second = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "add 3 and 4"}]

    def agent(ctx: AgentContext) -> dict:
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        ids, segments = [], []
        for messages in (first, second):
            reply = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8)
            ids.append(reply.choices[0].model_extra["token_ids"])
            segments.append(reply.choices[0].model_extra["seer"]["segment"])
        messages = [*second, {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "tool", "content": "7"}]
        reply = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8)
        ids.append(reply.choices[0].model_extra["token_ids"])
        segments.append(reply.choices[0].model_extra["seer"]["segment"])
        return {"ids": ids, "segments": segments}

    with SeerClient(openai_daemon.address, timeout_s=120) as client:
        result = client.rollout(["a"], group_size=2, sampling=SamplingParams(max_tokens=16, seed=3), agent=agent)
    for s in result.groups[0].samples:
        assert s.agent_return["segments"] == [0, 1, 1]
        assert [t.segment for t in s.turns] == [0, 1, 1]
        (old,) = s.segments
        assert old.prompt_token_ids == TOK.encode_chat([ChatMessage(**m) for m in first])
        assert old.token_ids[s.turns[0].start:s.turns[0].end] == s.agent_return["ids"][0]
        assert old.loss_mask == [1] * len(old.token_ids) and len(old.logprobs) == len(old.token_ids)
        assert s.turns[0].outcome == "continue" and s.turns[0].appended_tokens == 0
        # The last segment is the sample's own: its prompt is the second call's messages.
        assert s.prompt_token_ids == TOK.encode_chat([ChatMessage(**m) for m in second])
        assert s.num_prompt_tokens == len(s.prompt_token_ids) and s.turns[1].start == 0
        assert [s.token_ids[t.start:t.end] for t in s.turns[1:]] == s.agent_return["ids"][1:]
        eos = s.token_ids[s.turns[1].end - 1] == TOK.EOS
        tool = TOK.encode_turn_suffix([ChatMessage(role="tool", content="7")], eos)
        assert s.token_ids[s.turns[1].end:s.turns[2].start] == tool
        assert sum(s.loss_mask) == sum(t.end - t.start for t in s.turns[1:])
        # A new segment's prompt is new context, not recomputed (the sim engines cache nothing,
        # so the later turn's recomputation is the real engines' test's to check).
        assert s.turns[1].recomputed_tokens == 0 and s.turns[1].prefilled_tokens >= len(s.prompt_token_ids)


def client_key(result) -> str:
    return "a" * 32  # any key of an ended trajectory is unknown: the daemon dropped them all


def test_an_agent_that_raises_ends_only_its_trajectory_and_agent_rollouts_need_the_endpoint(openai_daemon, tmp_path):
    def agent(ctx: AgentContext) -> float:
        if ctx.sample_index == 0:
            raise RuntimeError("agent crashed")
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "go"}], max_tokens=4)
        return 0.5

    with SeerClient(openai_daemon.address, timeout_s=120) as client:
        result = client.rollout(["p"], group_size=2, agent=agent, trajectory=TrajectorySpec(max_turns=4))
    bad, good = sorted(result.groups[0].samples, key=lambda s: s.sample_index)
    assert bad.finish_reason == "tool_error" and bad.turns == [] and bad.token_ids == []
    assert good.agent_return == 0.5 and good.reward == 0.5 and len(good.turns) == 1

    root = tmp_path / "off"
    root.mkdir()
    plain = Daemon(root / "run", write_sim_config(root / "sim.toml"))
    plain.start()
    try:
        with SeerClient(plain.address) as client, pytest.raises(Exception, match="openai_off|OpenAI endpoint"):
            client.rollout(["p"], group_size=1, agent=agent)
    finally:
        plain.stop()


def test_the_status_names_the_endpoint(openai_daemon):
    async def go():
        async with AsyncSeerClient(openai_daemon.address) as client:
            return await client.status()
    status = asyncio.run(go())
    assert status.openai_url.startswith("http://127.0.0.1:") and status.openai_url.endswith("/v1")
    info = json.loads((openai_daemon.run_dir / "daemon.json").read_text())
    assert info["openai_url"] == status.openai_url


@pytest.mark.parametrize("kind", ["sdk", "plain-stream"])
def test_the_example_agents_run_through_the_endpoint(openai_daemon, kind):
    """examples/openai_agent.py's agents (the OpenAI Agents SDK with a Python tool, and plain
    streamed calls) complete on the simulated engines; each call is a recorded turn."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    import openai_agent

    agent = openai_agent.sdk_agent(12) if kind == "sdk" else openai_agent.plain_agent(12, stream=True)
    with SeerClient(openai_daemon.address, timeout_s=120) as client:
        result = client.rollout([{"messages": [{"role": "user", "content": "What is 2 + 3?"}]}], group_size=4,
                                sampling=SamplingParams(max_tokens=12, seed=0), agent=agent,
                                trajectory=TrajectorySpec(max_turns=4))
    for s in result.groups[0].samples:
        assert s.finish_reason in ("stop", "length", "max_turns"), (s.finish_reason, s.turns)
        assert "answer" in s.agent_return and len(s.turns) >= 1
        assert len(s.turns) == 2 if kind != "sdk" else True
        assert sum(s.loss_mask) == sum(t.end - t.start for t in s.turns)
