"""The control plane without its I/O: its parts, wired, and the decisions that span them.

As vLLM splits ``EngineCore`` (the scheduler and the model; no I/O) from
``EngineCoreProc`` (its process, sockets and busy loop), the control plane's decisions
live here and in the parts this wires, and ``server.py`` is its loop, its sockets and
the dispatch of each message to the method that decides about it.

Owns the wiring (the one engine table, ``registry.py``, held by the scheduler and read
by every other part; the Prometheus metrics with their scrape-time gauges; client
sessions, ``sessions.py``; engine membership, ``membership.py``; health, ``health.py``;
memory release, ``memory.py``; status, ``status.py``; the KV pool's agents and this
host's segment, ``kvpool/``) and the decisions no single part owns:

- an engine's hello: an engine this identity was registered as is lost first
  (``Membership.superseded``), then the hello is answered (``Membership.on_hello``: an id
  belongs to the process that registered it; a live session its process replaced from a
  new connection has its chunks requeued, and their deadlines dropped here);
- a chunk's result: the engine's health first, then what its client gets; an engine's
  heartbeat; a weights answer from a newcomer catching up or for the update in flight;
  a host agent's message (``Agents``; a pull's answer is counted in the metrics);
- the ticker's judgement of engines: chunks past their deadline, stalled, silent and
  exited engines, engines a launcher saw end (``health.py``, ``launcher.match_engine``);
- a weights update as the service runs it (``weights.py`` keeps its state): refused or
  started -- from then on no KV computed with the old weights may load -- each engine's
  answer, its end (events ``weights_update_started``, ``weights_updated``,
  ``weights_update_failed``); a successful update's checkpoint is recorded for engines
  that join later (``Registry.weights_path``);
- an engine's step records refining the scheduler's step-cost fit (events
  ``engine_steps_refused``, ``step_cost_fitted``);
- what a dispatched chunk is logged and counted as (events ``chunk_dispatched``,
  ``kv_pool_full``, ``kv_disk_lost``).

Plain and synchronous: no sockets, no awaits, the clock injected. Each decision returns
the ``Outbox`` (``outbox.py``) the server delivers, in order; scheduling after an event is
the server's (``Scheduler.schedule`` and ``Agents.transfers``, delivered in turn).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from seer.config import SeerConfig
from seer.controlplane.health import Health
from seer.controlplane.kvpool.agents import Agents
from seer.controlplane.kvpool.segment import PoolSegmentOwner
from seer.controlplane.launcher import EngineLauncher, LostEngine, match_engine
from seer.controlplane.membership import Answer, Membership, ModelExpectations
from seer.controlplane.memory import MemoryRelease
from seer.controlplane.metrics import Metrics
from seer.controlplane.metrics_state import StateCollector
from seer.controlplane.outbox import Outbox, ToClient
from seer.controlplane.registry import Registry
from seer.controlplane.results import chunk_dispatched_fields, kv_pool_full_fields
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.controlplane.sessions import ClientSessions
from seer.controlplane.status import Status
from seer.controlplane.tokenizer import Tokenizer
from seer.controlplane.weights import Weights
from seer.protocol import (
    AgentHello,
    ChunkFinished,
    EngineHello,
    EngineLoad,
    ErrorReply,
    PullDone,
    UpdateWeightsRequest,
    WeightsLoaded,
    unpack_steps,
)

log = structlog.get_logger()


class ControlCore:
    """Every part of the control plane, wired as the server drives them, without sockets."""

    def __init__(self, config: SeerConfig, *, tokenizer: Tokenizer, engine_address: str, client_address: str,
                 run_dir: Path, launcher: EngineLauncher | None = None,
                 clock: Callable[[], float] = time.monotonic, local_host_id: str | None = None) -> None:
        self.config = config
        self.clock = clock
        self.registry = Registry(config.engines.heartbeat_timeout_s)  # the one table of engines
        self.scheduler = Scheduler(config.scheduler, clock, decode=tokenizer.decode, registry=self.registry)
        self.weights = Weights()  # the service's version and the update in flight
        self.host_pool = PoolSegmentOwner(config.kv_pool, config)  # this host's KV pool segment and its agent
        self.agents = Agents(config.kv_pool, self.scheduler, clock, local_host_id)
        self.scheduler.kv.transfer_ahead = config.kv_pool.transfer_prefetch
        # Prometheus: counters told of events here and by the parts; gauges read at scrape time.
        self.metrics = Metrics(clock, min_load_tokens=config.kv_pool.min_load_tokens)
        self.metrics.registry.register(StateCollector(self.metrics, self.registry, self.scheduler, self.weights,
                                                      config.speculative.method, clock))
        self.memory = MemoryRelease(self.registry, lambda stall_s: self.health.loop_stalled(stall_s, clock()))
        self.clients = ClientSessions(config, self.scheduler, self.registry, tokenizer, self.weights, clock=clock,
                                      metrics=self.metrics, memory=self.memory)
        self.membership = Membership(config, self.registry, self.scheduler, self.agents, self.host_pool,
                                     engine_address=engine_address, run_dir=run_dir, clock=clock,
                                     expected=ModelExpectations(vocab_size=tokenizer.vocab_size,
                                                                max_model_len=config.model.max_model_len))
        self.health = Health(config.engines, self.registry, self.scheduler, self.clients, self.metrics,
                             run_dir=run_dir, clock=clock)  # deadlines, stalls, failures, losses
        self.status = Status(config, self.registry, self.scheduler, self.weights, self.agents, launcher,
                             run_dir=run_dir, client_address=client_address, pid=os.getpid(), clock=clock)

    # ------------------------------------------------------------------ engines
    def hello(self, identity: bytes, msg: EngineHello) -> Answer:
        """Answer an engine's hello; what this identity was registered as, if another
        process says hello under it, is lost first (its sends go first). A hello that
        replaced its engine's live session (the same process on a new connection, proven by
        its secret: ``Membership.on_hello``) requeued that session's chunks: their clocks go."""
        lost: Outbox = []
        if (gone := self.membership.superseded(identity, msg)) is not None:
            lost = self.health.lose_engine(gone, "another engine process said hello under its identity")
        answer = self.membership.on_hello(identity, msg, self.weights)
        if answer.replaced is not None:
            self.health.deadlines.engine_gone(answer.replaced)
        return Answer(lost + answer.sends, admitted=answer.admitted)

    def heartbeat(self, engine_id: int, load: EngineLoad, steps: bytes, now_s: float) -> bool:
        """An engine is heard, with its load and step records; False if the records were
        malformed (the server counts a bad frame)."""
        self.registry.heard(engine_id, now_s, load)
        return not steps or self.engine_steps(engine_id, steps)

    def engine_steps(self, engine_id: int, steps: bytes) -> bool:
        """An engine's step records refine the scheduler's step-cost fit; malformed ones are
        dropped (False; the fit refuses values outside physical bounds itself)."""
        try:
            records = unpack_steps(steps)
        except ValueError as exc:
            log.warning("engine_steps_refused", engine_id=engine_id, reason=str(exc))
            return False
        fit = self.scheduler.step_cost
        refused, fits = fit.num_refused, fit.num_fits
        self.scheduler.engine_steps(engine_id, records)
        if fit.num_refused > refused:
            log.warning("engine_steps_refused", engine_id=engine_id, num_refused=fit.num_refused - refused,
                        num_records=len(records))
        model = fit.model  # refits once enough new records came
        if fit.num_fits > fits:  # the trace keeps every fit and what the policy chose from it
            status = self.scheduler.scheduling_status()
            log.info("step_cost_fitted", a_s=round(model.a, 6), b_s=round(model.b, 8), c_s=round(model.c, 10),
                     p_s=round(model.p, 8), num_records=fit.num_records, num_refused=fit.num_refused,
                     policy=status.policy, admission_margin_sd=status.admission_margin_sd,
                     overflow_odds=status.overflow_odds)
        return True

    def agent_message(self, identity: bytes, msg: AgentHello | PullDone) -> Outbox:
        """A host agent's hello, or its answer to a pull (counted if one was waited for)."""
        if isinstance(msg, AgentHello):
            return self.agents.on_hello(identity, msg)
        if msg.transfer_id in self.agents.sent:
            self.metrics.pull_done(msg)
        return self.agents.on_pull_done(identity, msg)

    def chunk_finished(self, msg: ChunkFinished, now_s: float) -> Outbox:
        """A chunk's result (one ``Scheduler.refuse_result`` accepted): the engine's health
        first, then what its client gets if it finished a group or the rollout."""
        self.health.chunk_finished(msg, now_s)
        return self.clients.on_chunk_finished(msg)

    def judge_engines(self, now_s: float, exits: list[tuple[int, int, int]], lost: list[LostEngine]) -> Outbox:
        """The ticker's judgements, in order: chunks past their deadline, engines that
        stalled, went silent, whose process exited (``exits``: engine id, pid, exit code)
        or whose launcher saw their process end (``lost``)."""
        out = self.health.expire_chunks(now_s) + self.health.move_stalled(now_s) + self.health.lose_silent(now_s)
        for engine_id, pid, code in exits:
            out += self.health.process_exited(engine_id, pid, code)
        for gone in lost:
            if (engine_id := match_engine(gone.placement, self.status.engine_processes())) is not None:
                out += self.health.lose_engine(engine_id, gone.reason)
        return out

    def dispatching(self, send: Dispatch) -> None:
        """A chunk is about to be sent: logged, counted (a send that fails loses the engine:
        counted failed then), and warned about when its KV could not be kept."""
        log.info("chunk_dispatched", **chunk_dispatched_fields(send))
        self.metrics.chunk_dispatched(send)
        if send.kv_pool_full:
            log.warning("kv_pool_full", **kv_pool_full_fields(send, self.scheduler.kv.pool_of(send.engine_id)))
        if send.kv_lost:
            log.warning("kv_disk_lost", request_id=send.request.request_id,
                        effect="its KV was on the disk tier and neither DRAM nor disk had room to bring it "
                               "back: this chunk re-prefills", fix="raise kv_pool.pool_gib or disk_gib")

    # ------------------------------------------------------------------ weights updates
    def update_weights(self, identity: bytes, req: UpdateWeightsRequest) -> Outbox:
        """Refuse the update (the client's ``ErrorReply``) or start it: every dispatch that
        would load KV computed with the old weights is redone first, then each ready engine
        gets its ``LoadWeights``."""
        ready = self.registry.ready_ids()
        refusal = self.weights.refuse_update(
            req.path, num_sessions=len(self.clients.sessions) + len(self.clients.pending), ready_ids=ready,
            rollouts_running=any(not r.done for r in self.scheduler.rollouts.values()),
            engines_updating=bool(self.registry.updating_ids()))
        if refusal is not None:
            return [ToClient(identity, ErrorReply(call_id=req.call_id, code=refusal.code, message=refusal.message))]
        loads = self.weights.start(identity, req.call_id, req.path, ready,
                                   self.clock() + self.config.engines.startup_timeout_s)
        assert self.weights.update is not None
        log.info("weights_update_started", weights_version=self.weights.update.target_version, path=req.path,
                 engines=ready)
        self.metrics.weights_update_started()
        # From here on no KV computed with the old weights may load, whatever the outcome.
        return [*self.scheduler.weights_changed(), *loads]

    def weights_loaded(self, msg: WeightsLoaded) -> Answer:
        """An engine loaded weights: a newcomer caught up with the last update (admitted, or
        out: ``Membership.on_caught_up``), or an answer to the update in flight (the last
        one ends it)."""
        if self.registry.is_updating(msg.engine_id):
            answer = self.membership.on_caught_up(msg, self.weights.service_version)
            self.health.forget_lost()  # (a failed replay lost the engine)
            return answer
        if not self.weights.loaded(msg.engine_id, msg.error):
            return Answer()
        if not msg.error:
            self.registry.engines[msg.engine_id].loaded_weights_version = msg.weights_version
        return Answer(self._finish_weight_update() if self.weights.answered() else [])

    def expire_weights(self, now_s: float) -> Outbox:
        """The update in flight stops waiting for lost engines and, past its deadline, for
        any; it ends once it waits for none."""
        self.weights.expire(now_s, set(self.registry.ready_ids()))
        return self._finish_weight_update() if self.weights.answered() else []

    def _finish_weight_update(self) -> Outbox:
        update, reply = self.weights.finish()
        self.metrics.weights_update_finished(ok=not update.errors)
        if update.errors:
            log.error("weights_update_failed", path=update.path, errors=update.errors)
        else:
            self.registry.weights_path = update.path  # replayed to engines that join later
            log.info("weights_updated", weights_version=update.target_version, path=update.path)
        return reply

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Give back the memory of rollouts that ended since the last look (``memory.py``)."""
        self.memory.tick(self.scheduler.rollouts.keys() | self.clients.pending)
