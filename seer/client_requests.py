"""What the client checks and builds before anything is sent, and where it finds the
daemon: prompts from what a trainer passes (``to_prompt``), the encodability and size
checks (``check_encodable``, ``check_request``, ``check_request_size``; the size message
is the one ``seerctl rollout`` prints), the weights source on the wire, the daemon's
address and ``daemon.json`` (``resolve_address``, ``daemon_info``), and the check that a
reply is the kind the call expects. No sockets, no event loop (``seer.client_async``
sends); ``seer.client`` re-exports the public names."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import msgspec

from seer.client_errors import SeerError, SeerInputError, SeerProtocolError
from seer.protocol import Prompt, RolloutRequest, ServerMessage
from seer.weights_segment import SegmentSource, WeightsSegmentError, parse_source

__all__ = [
    "DEFAULT_RUN_DIR",
    "PromptLike",
    "check_encodable",
    "check_request",
    "check_request_size",
    "daemon_info",
    "expect_reply",
    "new_id",
    "resolve_address",
    "to_prompt",
    "weights_source",
]

DEFAULT_RUN_DIR = Path.home() / ".seer" / "run"

T = TypeVar("T")

PromptLike = Prompt | str | dict | Sequence[int]


def check_encodable(msg: object, what: str) -> bytes:
    """Encode ``msg`` as it would go on the wire, or raise ``SeerInputError`` naming ``what``
    and the problem (integers must fit 64 bits; text must be valid Unicode)."""
    try:
        return msgspec.msgpack.encode(msg)
    except OverflowError as exc:
        raise SeerInputError(f"{what}: an integer does not fit in 64 bits ({exc}); token ids, seeds and "
                             "counts must be between -2**63 and 2**64 - 1") from None
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end] if isinstance(exc.object, str) else ""
        raise SeerInputError(f"{what}: text is not valid Unicode ({bad!r} at position {exc.start}: "
                             f"{exc.reason}); remove lone surrogates or decode the text properly") from None
    except (TypeError, ValueError) as exc:
        raise SeerInputError(f"{what}: cannot be encoded ({exc})") from None


def check_request(request: RolloutRequest, max_request_bytes: int | None) -> None:
    """SeerInputError naming the first prompt (or the sampling) that cannot be sent, or the
    size of a request the daemon would refuse (``check_request_size``)."""
    try:
        encoded = check_encodable(request, "rollout request")
    except SeerInputError:
        for index, prompt in enumerate(request.prompts):
            check_encodable(prompt, f"prompt {index}")
        check_encodable(request.sampling, "sampling")
        raise
    if max_request_bytes is not None:
        check_request_size(len(encoded), max_request_bytes)


def check_request_size(num_bytes: int, max_request_bytes: int) -> None:
    """SeerInputError if a rollout request of ``num_bytes`` (its msgpack payload) is over
    the daemon's ``server.max_request_bytes``: the client and ``seerctl rollout`` refuse it
    with this one message before sending (a daemon drops a frame far beyond its limit
    unread, and the caller would only see a timeout)."""
    if num_bytes > max_request_bytes:
        raise SeerInputError(f"the rollout request takes {num_bytes} bytes, more than server.max_request_bytes = "
                             f"{max_request_bytes} of the daemon; split the prompts into smaller rollouts or raise "
                             "server.max_request_bytes in the daemon's seer.toml")


def daemon_info(address: str, run_dir: str | Path | None = None) -> dict | None:
    """The ``daemon.json`` of the daemon serving ``address``: the run dir's (explicit, or
    the folder of an ``ipc://`` socket), if it names this address; None otherwise (a
    ``tcp://`` daemon on another host, or no daemon.json)."""
    folders = [Path(run_dir)] if run_dir else []
    if address.startswith("ipc://"):
        folders.append(Path(address[len("ipc://"):]).parent)
    for folder in folders:
        try:
            info = json.loads((folder / "daemon.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("client_address") == address:
            return info
    return None


def expect_reply(reply: ServerMessage, kind: type[T], call: str) -> T:
    """``reply`` if it is a ``kind``, else SeerProtocolError naming both (``call`` says which)."""
    if not isinstance(reply, kind):
        raise SeerProtocolError(f"{call}: the daemon answered {type(reply).__name__}, expected {kind.__name__}; "
                                "run the same Seer version on the client and the daemon")
    return reply


def resolve_address(address: str | None, run_dir: str | Path | None = None) -> str:
    """An explicit address, or the one the daemon of ``run_dir`` (default ~/.seer/run) wrote."""
    if address:
        return address
    folder = Path(run_dir) if run_dir else DEFAULT_RUN_DIR
    info = folder / "daemon.json"
    try:
        return json.loads(info.read_text())["client_address"]
    except FileNotFoundError:
        raise SeerError(f"no Seer daemon found in {folder} (no daemon.json); start one with `seerctl start` "
                        "or pass address=") from None
    except (KeyError, ValueError) as exc:
        raise SeerError(f"{info} is unreadable ({exc}); restart the daemon with `seerctl start`") from None


def to_prompt(item: PromptLike, index: int) -> Prompt:
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(prompt=item)
    if isinstance(item, dict):
        try:
            return msgspec.convert(item, Prompt)
        except msgspec.ValidationError as exc:
            raise SeerInputError(f"prompt {index}: {exc}") from None
    if isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
        return Prompt(prompt_token_ids=list(item))
    raise SeerInputError(f"prompt {index}: expected str, dict, Prompt or a list of token ids, "
                         f"got {type(item).__name__}")


def weights_source(path: str | Path | SegmentSource) -> str:
    """The source string on the wire: a segment's ``shm://`` name as it is, a path absolute."""
    try:
        segment = path if isinstance(path, SegmentSource) else parse_source(str(path))
    except WeightsSegmentError as exc:
        raise SeerInputError(str(exc)) from None
    return str(segment) if segment is not None else str(Path(path).resolve())


def new_id() -> str:
    return uuid.uuid4().hex
