"""The policy interface: which waiting requests run where, and for how many tokens.

A policy owns the queue of its waiting requests (the request buffer, in whatever
order it needs) and returns assignments for live engines. It never changes request
state (the scheduler applies assignments and checks them) and never does I/O. Policies
are chosen by name (``seer.toml`` ``scheduler.policy`` or per rollout); the scheduler
keeps one instance per name and routes each rollout's requests to its policy.

``Policy`` below is the whole seam, as vLLM's ``SchedulerInterface`` is for its scheduler:
every member the scheduler, the KV tiers and the status read is declared on it, the
required ones abstract, the optional ones with defaults that say "this policy does not
do that". Nothing probes a policy for features (no ``getattr``/``hasattr``): a policy
written to this class alone runs (tests/unit/test_policy_interface.py registers one).

Adding a policy is one edit: a module in this package whose class subclasses ``Policy``,
declares ``name`` and is decorated with ``register``. The package imports every module
in it, ``register`` puts the class in ``REGISTRY`` and its name in the config layer's
list of policy names (``seer.config.register_policy_name``), against which
``seer.toml`` is validated at load.
"""

from __future__ import annotations

import abc
import inspect
import sys
from typing import TYPE_CHECKING, ClassVar

import msgspec

from seer.config import SchedulerConfig, register_policy_name
from seer.controlplane.buffer import RequestBuffer
from seer.controlplane.state import EngineView, Request

if TYPE_CHECKING:
    from seer.controlplane.prior import LengthPrior
    from seer.stepcost import StepCostFit

REGISTRY: dict[str, type[Policy]] = {}  # policy name -> class, filled by ``register``


class Assignment(msgspec.Struct, frozen=True):
    """One chunk a policy assigned (a Struct, not a dataclass: one is made per decision,
    and a frozen dataclass costs ~0.7 us to build against ~0.08 us)."""

    request: Request
    engine_id: int
    max_tokens: int  # this chunk's budget


class Policy(abc.ABC):
    """What every policy is to the scheduler (``scheduler.py``), the KV tiers
    (``kvpool/tiers.py``) and the status (``Scheduler.scheduling_status``).

    Required: ``name`` and the five abstract methods. Everything else has a default
    that is right for a policy that does not chunk, learn lengths, order its queue
    in a way others may read or keep anything per engine id (``engine_forgotten``)."""

    # ------------------------------------------------------------------ declared by the class
    name: ClassVar[str]
    # True when sample 0 of each group is a probe (served first to learn the group's
    # length); engines then give probes more speculative drafts (the paper's lambda).
    uses_probes: ClassVar[bool] = False
    # True: the policy takes every submitted request at once and sizes chunks itself
    # (divided rollout); False: it deals whole samples, and the scheduler gives it the
    # submitted requests a window at a time (``scheduler.POLICY_WINDOW``), since dealing
    # everything it holds in one ``assign`` would hold the loop for seconds.
    chunked: ClassVar[bool] = False
    # True: ``upcoming`` and ``needed_last`` tell this policy's serve order, and the KV
    # pool's disk tier keeps the requests it needs soonest in DRAM; False: the tier goes
    # by the order requests came back.
    tells_order: ClassVar[bool] = False
    # False: no chunk of this policy's loads from or saves to the host KV pool; a turn or
    # chunk on another engine, or whose KV its engine evicted, computes it again (the
    # baselines, as users run them on engines of their own).
    uses_kv_pool: ClassVar[bool] = True
    # True: ``prior`` may be set to a cross-iteration length prior (``seer.toml``
    # ``scheduler.length_prior``; the simulator's ``--length-prior``).
    takes_length_prior: ClassVar[bool] = False

    # ------------------------------------------------------------------ set by the scheduler
    # The engines' step cost fitted online (``seer/stepcost.py``), set when the scheduler
    # makes the policy; policies that weigh costs read it, the rest ignore it.
    step_cost: StepCostFit | None = None
    prior: LengthPrior | None = None  # only where ``takes_length_prior``

    # ------------------------------------------------------------------ read by the status
    places_by_drain: bool = False  # placement by predicted drain time (else by chunks in flight)
    whole_samples: bool = False  # the latest rollout goes as whole samples, not chunks
    reserve_z: float | None = None  # admission margin, in standard deviations (None: none)
    odds: float | None = None  # the overflow odds that margin stands for

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config  # ``seer.toml``'s [scheduler] section

    # ------------------------------------------------------------------ required
    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of waiting requests held."""

    @abc.abstractmethod
    def enqueue(self, request: Request) -> None:
        """A request became waiting (submitted, back from a chunk, or from a lost engine)."""

    @abc.abstractmethod
    def discard_rollout(self, rollout_id: str) -> None:
        """Forget every waiting request of a cancelled rollout."""

    @abc.abstractmethod
    def assign(self, engines: list[EngineView], limit: int = sys.maxsize) -> list[Assignment]:
        """Pick work for live engines (sorted by id) and drop it from the queue: at most
        ``limit`` assignments (a whole-group policy ends its group), the rest left for the
        next call. A chunked policy's budgets are its own; a whole-sample one gives
        ``remaining_tokens``."""

    # ------------------------------------------------------------------ optional
    def rollout_ended(self, rollout_id: str, engines: list[EngineView]) -> None:
        """A rollout finished (its results delivered) or was cancelled: let go of
        everything kept of it, so its memory can be given back. ``engines``: the live ones.
        Default: nothing outlives a request's stay in the queue."""

    def engine_forgotten(self, engine_id: int) -> None:
        """A lost engine is forgotten for good (``Registry.forget_lost``; its id is never
        given out again): drop whatever is kept under its id. Default: nothing is."""

    def turn_answered(self, request: Request) -> None:
        """A trajectory's environment answered (its previous turn's record holds the tool's
        name and seconds); called just before it is queued again. Default: nothing learned."""

    def trajectory_ended(self, request: Request) -> None:
        """A trajectory ended while it waited for its environment (finished, all its tokens
        in; its last chunk had already come back). Default: nothing learned."""

    def upcoming(self, k: int) -> list[Request]:
        """The next ``k`` waiting requests in the order ``assign`` would take them, without
        taking them (only where ``tells_order``)."""
        return []

    def needed_last(self, requests: list[Request]) -> list[Request]:
        """Those of ``requests`` that wait in this queue, the one served *last* first (only
        where ``tells_order``; the disk tier's eviction order)."""
        return []


def register(cls: type) -> type:
    """Class decorator: make a policy selectable by its ``name`` (checked here, at import,
    so a policy that misses part of the interface fails when it is registered, not mid-rollout)."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"policy class {cls!r} must subclass seer.controlplane.policies.base.Policy "
                        "to be registered")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"policy class {cls.__qualname__} needs a non-empty str `name` to be registered")
    if cls.__abstractmethods__:
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"policy class {cls.__qualname__} does not implement {missing} "
                        "(the Policy interface, controlplane/policies/base.py)")
    if "limit" not in inspect.signature(cls.assign).parameters:
        raise TypeError(f"policy class {cls.__qualname__}: assign must take `limit` (at most that many "
                        "assignments a call; the rest waits for the next): assign(self, engines, limit=sys.maxsize)")
    if REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"policy name {name!r} is taken by {REGISTRY[name].__qualname__}; "
                         f"give {cls.__qualname__} another name")
    REGISTRY[name] = cls
    register_policy_name(name)
    return cls


class WholeRequestPolicy(Policy):
    """Base of the baselines that send every sample as one whole request (no chunking, no
    migration, admission and preemption left to the engine, no host KV pool: a trajectory's
    next turn finds its context in its engine's prefix cache or computes it again, as under
    veRL's or slime's routers): the waiting requests live in a ``RequestBuffer`` in arrival
    order; subclasses decide only the routing (``assign``)."""

    uses_kv_pool = False

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._buffer = RequestBuffer()

    def __len__(self) -> int:
        return len(self._buffer)

    def enqueue(self, request: Request) -> None:
        self._buffer.add(request)

    def discard_rollout(self, rollout_id: str) -> None:
        self._buffer.drop_rollout(rollout_id)
