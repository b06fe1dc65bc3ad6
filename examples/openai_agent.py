"""An unmodified OpenAI Agents SDK agent with a Python tool, rolled out through Seer.

Each sample runs the agent function below once. It talks to the daemon's OpenAI-compatible
endpoint (``[openai] enabled = true``) with the sample's own key, so every chat-completions
call the SDK makes is the next turn of that sample's trajectory: the trainer gets the token
ids the engines sampled, the loss mask (tool outputs and template tokens are 0), the
logprobs and one ``TurnRecord`` per call, plus what the agent function returned.

    .venv/bin/python examples/openai_agent.py --start-daemon          # its own daemon, 2 vLLM engines
    .venv/bin/python examples/openai_agent.py --address ipc://RUN/client.sock --plain --stream

``--plain``: the same task with plain ``openai`` client calls instead of the SDK (with
``--stream``: streamed). ``--out FILE`` writes the samples as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).parent))

import arithmetic  # noqa: E402 - the task, next to this file

from seer.agentic import AgentContext  # noqa: E402
from seer.client import SamplingParams, SeerClient  # noqa: E402
from seer.protocol import TrajectorySpec  # noqa: E402

INSTRUCTIONS = ("You solve arithmetic. You may call the tool run_python with Python code that prints the answer. "
                "Finish with the number.")
DAEMON_CONFIG = """
[model]
dtype = "float32"
max_model_len = 2048

[engines]
backend = "vllm"
count = 2
kv_cache_gib = 1.0

[openai]
enabled = true
"""


async def python_tool(code: str) -> str:
    """Run Python code in a sandbox (no network, 5 s, 256 MiB) and return what it printed."""
    from seer.tools.python_sandbox import run_python

    return (await run_python(code, timeout_s=5.0)).text


def sdk_agent(max_tokens: int):
    """The agent as an Agents SDK user writes it; only the client's base_url/api_key are Seer's."""
    async def run(ctx: AgentContext) -> dict:
        from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                            set_tracing_disabled)
        from agents.exceptions import AgentsException
        from openai import AsyncOpenAI

        set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers

        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[function_tool(python_tool)],
                      model=OpenAIChatCompletionsModel(model=ctx.model, openai_client=client),
                      model_settings=ModelSettings(max_tokens=max_tokens, temperature=1.0))
        question = ctx.prompt.messages[-1].content if ctx.prompt.messages else ctx.prompt.prompt
        try:
            result = await Runner.run(agent, question, max_turns=3)
            answer = str(result.final_output)
        except AgentsException as exc:  # e.g. MaxTurnsExceeded: no final answer
            answer = f"[{type(exc).__name__}]"
        return {"answer": answer}
    return run


def plain_agent(max_tokens: int, stream: bool):
    """Plain ``openai`` calls: ask, then ask again with the first answer checked by the tool."""
    def run(ctx: AgentContext) -> dict:
        from openai import OpenAI

        client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "system", "content": INSTRUCTIONS}, *[{"role": m.role, "content": m.content}
                                                                   for m in ctx.prompt.messages or []]]
        text = ""
        for _ in range(2):
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model=ctx.model, messages=messages, max_tokens=max_tokens, stream=True) if c.choices)
            else:
                reply = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=max_tokens)
                text = reply.choices[0].message.content or ""
            number = arithmetic.last_number(text)
            check = asyncio.run(python_tool(f"print({number} == {number})")) if number else "no number"
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": check}]
        return {"answer": text}
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address")
    p.add_argument("--start-daemon", action="store_true")
    p.add_argument("--problems", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48, help="per call")
    p.add_argument("--plain", action="store_true", help="plain openai calls instead of the Agents SDK")
    p.add_argument("--stream", action="store_true", help="with --plain: streamed calls")
    p.add_argument("--policy", default=None)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    rows = arithmetic.load(arithmetic.EVAL_FILE)[:a.problems]
    run_dir = None
    if a.start_daemon:
        root = Path(tempfile.mkdtemp(prefix="seer-agent-"))
        (root / "seer.toml").write_text(DAEMON_CONFIG)
        run_dir = root / "run"
        subprocess.run([sys.executable, "-m", "seer.cli.main", "start", "--config", str(root / "seer.toml"),
                        "--run-dir", str(run_dir), "--owner-pid", str(os.getpid())], check=True, timeout=900)
    agent = plain_agent(a.max_tokens, a.stream) if a.plain else sdk_agent(a.max_tokens)
    try:
        with SeerClient(a.address, run_dir=run_dir, timeout_s=600) as client:
            t0 = time.perf_counter()
            result = client.rollout([{"id": r["id"], "messages": r["messages"]} for r in rows], a.group_size,
                                    SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=0), agent=agent,
                                    policy=a.policy, trajectory=TrajectorySpec(max_turns=4))
            wall = time.perf_counter() - t0
    finally:
        if run_dir is not None:
            subprocess.run([sys.executable, "-m", "seer.cli.main", "stop", "--run-dir", str(run_dir)], timeout=300)
    samples = [(g, r, s) for g, r in zip(result.groups, rows, strict=True) for s in g.samples]
    solved = sum(1 for _, r, s in samples if s.agent_return and arithmetic.correct(s.agent_return["answer"],
                                                                                   r["answer"]))
    context = sum(s.num_prompt_tokens + len(s.token_ids) for _, _, s in samples)
    recomputed = sum(t.recomputed_tokens for _, _, s in samples for t in s.turns)
    turns = [len(s.turns) for _, _, s in samples]
    print(f"{len(samples)} trajectories in {wall:.1f} s: {solved} solved; calls per trajectory "
          f"{min(turns)}-{max(turns)} (mean {sum(turns) / len(turns):.1f}); sampled {sum(sum(s.loss_mask) for *_, s in samples)} "
          f"tokens, appended {sum(len(s.loss_mask) - sum(s.loss_mask) for *_, s in samples)}; recomputed "
          f"{recomputed} of {context} context tokens ({recomputed / max(1, context):.1%})")
    if a.out:
        a.out.write_bytes(msgspec.json.encode([{"prompt_id": g.prompt_id, **msgspec.to_builtins(s)}
                                               for g, _, s in samples]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
