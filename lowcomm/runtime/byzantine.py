"""Byzantine members, for measuring robustness (`peer join --byzantine KIND`, `simulate --byzantine KIND:N`).

A Byzantine member trains like any other and keeps its own state honest: it applies the rounds'
aggregates, evaluates and serves state as usual. Only what it contributes on the wire differs.
`ByzantineCollective` wraps the peer's collective: each `start(key, round, payload, weight)` goes
through `Attack.tamper`, which returns what is sent instead, and each round it changed is logged as
a `byzantine` event (round, kind, the honest and the sent norm and weight). Δ is the honest payload.

    sign-flip       −10Δ: reversed and tenfold (a plain −Δ only slows the mean of the honest
                    members down; tenfold, two of eight turn it around)
    scale           Δ × 1e6
    noise           pure noise: a Gaussian vector rescaled to norm 10‖Δ‖, no Δ in it (drawn from
                    the member's id and the round)
    constant        one fixed unit direction × 10‖Δ‖; the direction comes from a fixed seed and the
                    payload's length, so every Byzantine member of a run pushes the same way (colluding)
    nan             every value NaN
    inflate-weight  Δ itself, claiming 1e3 × its true weight (tokens)
    copy            a free-rider: instead of its own Δ, the last aggregate this member received for a
                    payload of the same length (the previous round's agreed mean Δ̄, stale and no work
                    of its own), with its true weight; zeros until it has received one
    replay          its own honest part of the latest earlier round with a payload of the same length
                    (DiLoCo: round r − 1's Δ in round r), sent again; honest in its first round

10‖Δ‖ is "large" without being absurd: a tenfold outlier that norm clipping must catch, where
scale's 1e6 is one nothing may let through. A ‖Δ‖ of 0 counts as 1 for noise and constant.

sign-flip, scale, noise, constant, nan and copy change values, so they need a dense payload (one
flat tensor: ddp, diloco, streaming-diloco); inflate-weight and replay do not look inside the
payload and apply to every algorithm. `check_supported` refuses the other combinations with one line,
and pipelined runs (stage peers) have no Byzantine members.
"""

from __future__ import annotations

import enum
import zlib
from typing import Any

import torch

from lowcomm.collectives.base import Collective, GroupKey, Handle
from lowcomm.config import ConfigError

SCALE = 1e6
LARGE = 10.0  # sign-flip, noise and constant: this many times ‖Δ‖
WEIGHT_FACTOR = 1e3
CONSTANT_SEED = 0xB12A  # the colluders' shared direction
DENSE_ALGOS = ("ddp", "diloco", "streaming-diloco")


class Kind(enum.Enum):
    SIGN_FLIP = "sign-flip"
    SCALE = "scale"
    NOISE = "noise"
    CONSTANT = "constant"
    NAN = "nan"
    INFLATE_WEIGHT = "inflate-weight"
    COPY = "copy"
    REPLAY = "replay"

    @classmethod
    def parse(cls, text: str) -> Kind:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(f"unknown Byzantine kind {text!r}: use one of {', '.join(k.value for k in cls)}") from None


PAYLOAD_AGNOSTIC = (Kind.INFLATE_WEIGHT, Kind.REPLAY)


def check_supported(kind: Kind, algo: str, pipelined: bool = False) -> None:
    """ConfigError when Byzantine members of ``kind`` cannot run in a run of ``algo``."""
    if pipelined:
        raise ConfigError("Byzantine members are not available in pipelined runs (pipeline.stages > 1)")
    if kind not in PAYLOAD_AGNOSTIC and algo not in DENSE_ALGOS:
        raise ConfigError(f"Byzantine kind {kind.value} changes a dense payload's values; {algo} sends encoded "
                          f"parts: use it with {', '.join(DENSE_ALGOS)}, or inflate-weight or replay")


def parse_byzantine(spec: str | None, peers: int) -> dict[int, Kind]:
    """``KIND:N[,KIND:N]`` → Byzantine kind by peer index, taken from the last index down (peer 0 stays honest)."""
    if not spec or spec == "none":
        return {}
    kinds: list[Kind] = []
    for item in spec.split(","):
        name, sep, count = item.strip().partition(":")
        if not sep or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--byzantine {spec!r}: write KIND:N[,KIND:N], N >= 1 (e.g. scale:1,sign-flip:2)")
        kinds += [Kind.parse(name)] * int(count)
    if len(kinds) >= peers:
        raise ConfigError(f"--byzantine {spec!r}: {len(kinds)} Byzantine members of {peers} peers leaves no honest one")
    return {peers - 1 - i: kind for i, kind in enumerate(kinds)}


def _length(payload: Any) -> tuple:
    return ("tensor", payload.numel()) if isinstance(payload, torch.Tensor) else ("parts", len(payload))


def _norm(values: torch.Tensor) -> float:
    return float(values.detach().to(torch.float32).norm())


class Attack:
    """What one Byzantine member sends instead of (payload, weight); remembers what replay and copy need."""

    def __init__(self, kind: Kind, member: str = ""):
        self.kind = kind
        self.member_seed = zlib.crc32(member.encode())
        self.sent: dict[tuple, tuple[int, Any]] = {}  # payload length -> (round, honest payload): replay
        self.aggregates: dict[tuple, torch.Tensor] = {}  # payload length -> last aggregate received: copy
        self._directions: dict[int, torch.Tensor] = {}

    def tamper(self, round_: int, payload: Any, weight: float) -> tuple[Any, float, bool]:
        """(payload to send, weight to claim, whether it differs from the honest one)."""
        k, length = self.kind, _length(payload)
        if k is Kind.INFLATE_WEIGHT:
            return payload, weight * WEIGHT_FACTOR, True
        if k is Kind.REPLAY:
            earlier = self.sent.get(length)
            self.sent[length] = (round_, payload)
            if earlier is None or earlier[0] >= round_:
                return payload, weight, False
            return earlier[1], weight, True
        if not isinstance(payload, torch.Tensor):
            raise ConfigError(f"Byzantine kind {k.value} needs a dense payload (one tensor), not {type(payload).__name__}")
        delta = payload.detach().reshape(-1).to(torch.float32)
        if k is Kind.SIGN_FLIP:
            return delta * -LARGE, weight, True
        if k is Kind.SCALE:
            return delta * SCALE, weight, True
        if k is Kind.NAN:
            return torch.full_like(delta, float("nan")), weight, True
        if k is Kind.COPY:
            copied = self.aggregates.get(length)
            return (copied.clone() if copied is not None else torch.zeros_like(delta)), weight, True
        size = LARGE * (_norm(delta) or 1.0)
        if k is Kind.NOISE:
            generator = torch.Generator().manual_seed((self.member_seed * 1_000_003 + round_) % (1 << 63))
            noise = torch.randn(delta.numel(), generator=generator)
            return noise * (size / max(_norm(noise), 1e-30)), weight, True
        if k is Kind.CONSTANT:
            return self.direction(delta.numel()) * size, weight, True
        raise AssertionError(k)

    def direction(self, numel: int) -> torch.Tensor:
        """The colluders' unit vector for payloads of ``numel`` values (the same on every member)."""
        if numel not in self._directions:
            generator = torch.Generator().manual_seed(CONSTANT_SEED + numel)
            u = torch.randn(numel, generator=generator)
            self._directions[numel] = u / max(_norm(u), 1e-30)
        return self._directions[numel]

    def received(self, aggregate: Any) -> None:
        """An aggregate this member's round produced (copy sends it next time)."""
        if isinstance(aggregate, torch.Tensor):
            self.aggregates[_length(aggregate)] = aggregate.detach().reshape(-1).to(torch.float32).clone()


class ByzantineCollective(Collective):
    """``inner`` with every contribution passed through ``attack``; all else is ``inner``'s."""

    def __init__(self, inner: Collective, attack: Attack, on_event=None):
        self.__dict__.update(inner=inner, attack=attack, on_event=on_event or (lambda kind, **fields: None))

    def __getattr__(self, name: str):  # me, combiner, codec, slots, ... of the wrapped collective
        return getattr(self.inner, name)

    @property
    def before_send(self):  # Collective's class attribute would shadow the wrapped one's
        return self.inner.before_send

    def __setattr__(self, name: str, value) -> None:  # before_send and the like land on the wrapped one
        setattr(self.inner, name, value)

    def start(self, key: GroupKey, round_: int, payload: Any, weight: float = 1.0, donate: bool = False) -> Handle:
        sent, claimed, tampered = self.attack.tamper(round_, payload, weight)
        if tampered:
            honest = _norm(payload) if isinstance(payload, torch.Tensor) else None
            lied = _norm(sent) if isinstance(sent, torch.Tensor) else None
            self.on_event("byzantine", round=int(round_), byzantine=self.attack.kind.value, weight=float(weight),
                          sent_weight=float(claimed), norm=honest, sent_norm=lied)
        # not donated: a replaying attack keeps the payload it was given
        return _Watched(self.inner.start(key, round_, sent, claimed), self.attack)

    def catch_up(self, key: GroupKey, round_: int, numel: int, manifest):
        return self.inner.catch_up(key, round_, numel, manifest)

    def announce_ahead(self, key: GroupKey, round_: int) -> None:
        self.inner.announce_ahead(key, round_)

    def withdraw_ahead(self, key: GroupKey, round_: int) -> None:
        self.inner.withdraw_ahead(key, round_)

    def end_epoch(self, key: GroupKey, round_: int | None = None) -> None:
        self.inner.end_epoch(key, round_)


class _Watched:
    """A round's handle that shows its aggregate to the attack (copy) on the way back."""

    def __init__(self, handle: Handle, attack: Attack):
        self.handle, self.attack = handle, attack

    def result(self, deadline: float | None = None):
        result = self.handle.result(deadline)
        self.attack.received(getattr(result, "aggregate", None))
        return result

    def done(self) -> bool:
        return self.handle.done()

    def __getattr__(self, name: str):
        return getattr(self.handle, name)
