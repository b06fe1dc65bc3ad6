"""The simulated engine backend: same protocol, no model.

It behaves like a continuously batching engine on a virtual device: every step, each
running task emits one token, and the step takes ``step_s`` of wall time. Like a language
model with a seeded sampler, the next token is a pure function of the whole context so
far and the request's seed (or, unseeded, its request id), so a request produces the
same tokens whether it runs in one chunk or many, on one engine or several — the
property the real engine must also have, here by construction. EOS
arrives with a fixed hazard (geometric lengths with the configured mean). Stop strings
and stop token ids end a chunk as in vLLM: the output keeps the token that completed the
stop string (tokens are bytes, as the control plane's ``ByteTokenizer`` decodes them), and a
stop string is looked for only once ``min_tokens`` tokens were generated; a stop string
that straddles two chunks is the control plane's to find (``controlplane/stops.py``).

Used by the control-plane integration tests and by daemon start/stop tests, where
the real engine's 45 s start-up would buy nothing. The paper-scale simulator with a
calibrated cost model and virtual clock is a separate, later piece.
"""

from __future__ import annotations

import asyncio
import hashlib
import math

from seer.engines.backend import STEPS_KEPT, ChunkOutput
from seer.protocol import ChunkTask, EngineCapabilities, EngineLoad, unpack_token_ids

EOS_TOKEN_ID = 2  # ByteTokenizer.EOS
TOKEN_OFFSET = 3  # ByteTokenizer.OFFSET: token = byte + 3
FIRST_TEXT_TOKEN = 32 + TOKEN_OFFSET  # printable ASCII
NUM_TEXT_TOKENS = 95
VOCAB_SIZE = 259


def _unit(*parts: object) -> float:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def _fold(state: bytes, token: int) -> bytes:
    return hashlib.blake2b(state + token.to_bytes(4, "little"), digest_size=16).digest()


def token_text(token: int) -> str:
    """A simulated token's text: its byte (``ByteTokenizer``: byte + 3); specials are empty."""
    return bytes([token - TOKEN_OFFSET]).decode(errors="replace") if TOKEN_OFFSET <= token < VOCAB_SIZE else ""


def completes_stop(text: str, num_new_chars: int, stops: list[str]) -> bool:
    """True if a stop string ends within the last ``num_new_chars`` characters of ``text``
    (vLLM's ``check_stop_strings`` window: earlier text was searched before)."""
    if not num_new_chars:
        return False
    return any(text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1)) != -1 for stop in stops if stop)


class _Running:
    def __init__(self, task: ChunkTask) -> None:
        self.task = task
        self.context = unpack_token_ids(task.prompt_token_ids)
        self.num_prompt_tokens = len(self.context)
        # Greedy output depends on the context alone (like a real model); sampled output
        # also on the seed, or, unseeded, on the request.
        if task.sampling.temperature == 0.0:
            salt: object = "greedy"
        else:
            salt = task.sampling.seed if task.sampling.seed is not None else task.request_id
        # A fold over the context, so a continuation chunk reaches the same state.
        self.state = hashlib.blake2b(str(salt).encode(), digest_size=16).digest()
        for token in self.context:
            self.state = _fold(self.state, token)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""  # the chunk's generated text, kept only when it has stop strings
        self.done = asyncio.get_running_loop().create_future()


class SimBackend:
    def __init__(self, *, step_s: float, mean_output_tokens: int, max_model_len: int,
                 kv_capacity_tokens: int = 1_000_000, fault_token_id: int = -1,
                 fault_kills_engine: bool = False) -> None:
        self._fault_token_id = fault_token_id
        self._fault_kills_engine = fault_kills_engine
        self._dead = False
        self._step_s = step_s
        self._eos_hazard = 1.0 / max(1, mean_output_tokens)
        self._max_model_len = max_model_len
        self._kv_capacity_tokens = kv_capacity_tokens
        self._running: dict[int, _Running] = {}
        self._stepper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._steps: list[tuple[float, float, float, float]] = []  # since the last ``take_steps``

    async def start(self) -> EngineCapabilities:
        self._stepper = asyncio.create_task(self._step_loop())
        return EngineCapabilities(
            backend="sim",
            model="sim",
            dtype="none",
            max_model_len=self._max_model_len,
            vocab_size=VOCAB_SIZE,
            kv_capacity_tokens=self._kv_capacity_tokens,
            block_size=16,
        )

    async def generate(self, task: ChunkTask) -> ChunkOutput:
        if self._dead:
            raise RuntimeError("simulated engine is dead (injected fault)")
        if self._fault_token_id >= 0 and self._fault_token_id in unpack_token_ids(task.prompt_token_ids):
            self._dead = self._fault_kills_engine
            raise RuntimeError(f"injected fault: prompt contains token {self._fault_token_id}")
        run = _Running(task)
        self._running[task.task_id] = run
        self._wake.set()
        return await run.done

    async def abort(self, task_ids: list[int]) -> None:
        for task_id in task_ids:
            run = self._running.pop(task_id, None)
            if run is not None and not run.done.done():
                run.done.set_result(self._output(run, "abort"))

    def healthy(self) -> bool:
        return self._stepper is not None and not self._stepper.done() and not self._dead

    def load(self) -> EngineLoad:
        used = sum(len(r.context) for r in self._running.values())
        return EngineLoad(num_running=len(self._running), num_waiting=0,
                          kv_usage=min(1.0, used / self._kv_capacity_tokens), num_preemptions=0)

    def take_steps(self) -> list[tuple[float, float, float, float]]:
        steps, self._steps = self._steps[-STEPS_KEPT:], []
        return steps

    def spec_counts(self) -> tuple[int, int, int]:
        return (0, 0, 0)  # the simulated engine does not speculate

    async def load_weights(self, path: str) -> None:
        from seer.weights_segment import SegmentReader, WeightsSegmentError, parse_source, source_exists

        if not source_exists(path):
            raise RuntimeError(f"weights path {path!r} does not exist")
        segment = parse_source(path)
        if segment is not None:  # a trainer's segment: readable, and holding the write it names
            try:
                SegmentReader(segment, populate=False).close()
            except WeightsSegmentError as exc:
                raise RuntimeError(str(exc)) from None

    async def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
        await self.abort(list(self._running))

    # ------------------------------------------------------------------ internals
    async def _step_loop(self) -> None:
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self._step_s)
            self._steps.append((self._step_s, len(self._running), sum(len(r.context) for r in self._running.values()), 0))
            for task_id, run in list(self._running.items()):
                reason = self._advance(run)
                if reason is not None:
                    del self._running[task_id]
                    run.done.set_result(self._output(run, reason))

    def _advance(self, run: _Running) -> str | None:
        s = run.task.sampling
        position = len(run.context)
        key = (run.state.hex(),)
        eos = (not s.ignore_eos and len(run.tokens) >= s.min_tokens
               and _unit(*key, position, "eos") < self._eos_hazard)
        if eos:
            token = EOS_TOKEN_ID
        else:
            token = FIRST_TEXT_TOKEN + int(_unit(*key, position, "tok") * NUM_TEXT_TOKENS)
        run.tokens.append(token)
        run.context.append(token)
        run.state = _fold(run.state, token)
        run.logprobs.append(math.log(max(1e-9, 0.05 + 0.9 * _unit(*key, position, "lp"))))
        if token == EOS_TOKEN_ID or token in s.stop_token_ids:
            return "stop"
        if s.stop:
            piece = token_text(token)
            run.text += piece
            if len(run.tokens) > s.min_tokens and completes_stop(run.text, len(piece), s.stop):
                return "stop"
        if len(run.tokens) >= s.max_tokens or len(run.context) >= self._max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(run: _Running, reason: str) -> ChunkOutput:
        return ChunkOutput(token_ids=list(run.tokens), logprobs=list(run.logprobs), finish_reason=reason,  # type: ignore[arg-type]
                           num_prompt_tokens=run.num_prompt_tokens, num_cached_tokens=0)
