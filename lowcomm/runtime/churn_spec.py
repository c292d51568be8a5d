"""The churn spec of `simulate --churn SPEC` (and `[churn] spec`): its parser and typed plan.

The grammar is documented in runtime.churn, which executes the plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ACTIONS = ("kill", "leave", "join", "killstage", "slow", "linkdown")
SLOW_FACTOR = 4.0  # `slow:N@...` without a factor
DOWN_S = 10.0  # `linkdown:N@...` without a duration
ACCEPTED_FORMS = ("a schedule of ACTION:N@rROUND or ACTION:N@tSECONDSs, comma-separated, ACTION one of "
                  "kill, leave, join, killstage (N: a stage index), slow (ACTION:N:Kx@..., K times slower, "
                  f"default {SLOW_FACTOR:g}x) or linkdown (ACTION:N:Ds@..., --netns only, default {DOWN_S:g}s), "
                  "or kill:all (every peer and the coordinator); e.g. 'kill:1@r3,leave:1@r4,join:2@t30s,"
                  "slow:1:4x@r5,linkdown:1:15s@r6,kill:all@r9'; or a rate F/round with 0 < F <= 1 (e.g. "
                  "'0.25/round'), or 'none'")
_NUMBER = r"\d+(?:\.\d+)?"
_ACTION = re.compile(rf"^(?P<action>[a-z]+):(?P<count>\d+|all)(?::(?P<arg>{_NUMBER})(?P<unit>[xs]))?"
                     rf"@(?:r(?P<round>\d+)|t(?P<seconds>{_NUMBER})s)$")
_RATE = re.compile(r"^(?P<fraction>\d*\.?\d+)/rounds?$")
_UNIT = {"slow": "x", "linkdown": "s"}  # the actions that take an argument, and its unit


@dataclass
class ChurnConfig:
    """The [churn] section: injected churn for `simulate` (`simulate --churn` overrides it).

        [churn]
        spec = "kill:1@r3,leave:1@r4,join:2@t30s"   # or a rate: "0.25/round"; "" = none
    """

    spec: str = ""


class ChurnSpecError(ValueError):
    """A --churn spec (or [churn] spec) does not parse; the message lists the accepted forms."""


@dataclass(frozen=True)
class ChurnAction:
    action: str  # kill | leave | join | killstage | slow | linkdown | killall
    count: int  # peers (killstage: the stage; killall: 0)
    round: int | None = None  # fires once the swarm reaches this round ...
    seconds: float | None = None  # ... or this many seconds after training started
    factor: float | None = None  # slow: how many times slower the peers become
    down_s: float | None = None  # linkdown: how long the peers' links stay down

    def due(self, swarm_round: int, elapsed_s: float) -> bool:
        if self.round is not None:
            return swarm_round >= self.round
        return elapsed_s >= self.seconds

    def __str__(self) -> str:
        at = f"r{self.round}" if self.round is not None else f"t{self.seconds:g}s"
        if self.action == "killall":
            return f"kill:all@{at}"
        arg = f":{self.factor:g}x" if self.factor is not None else f":{self.down_s:g}s" if self.down_s is not None else ""
        return f"{self.action}:{self.count}{arg}@{at}"


@dataclass(frozen=True)
class ChurnPlan:
    actions: tuple[ChurnAction, ...] = ()
    rate: float | None = None  # fraction of live peers replaced each round

    @property
    def scheduled_joiners(self) -> int:
        return sum(a.count for a in self.actions if a.action == "join")

    @property
    def uses(self) -> set[str]:
        """The actions the plan holds (the rate form: kill and join)."""
        return {"kill", "join"} if self.rate is not None else {a.action for a in self.actions}

    def __str__(self) -> str:
        return f"{self.rate:g}/round" if self.rate is not None else ",".join(map(str, self.actions))


def parse_churn(spec: str | None) -> ChurnPlan | None:
    """The plan a spec describes; None for no churn ("", "none", "off")."""
    text = (spec or "").strip().lower()
    if text in ("", "none", "off"):
        return None
    rate = _RATE.match(text)
    if rate:
        fraction = float(rate["fraction"])
        if not 0 < fraction <= 1:
            raise ChurnSpecError(f"churn rate {fraction:g}/round is outside (0, 1]; use {ACCEPTED_FORMS}")
        return ChurnPlan(rate=fraction)
    return ChurnPlan(actions=tuple(_action(part.strip(), spec) for part in text.split(",")))


def _action(part: str, spec: str) -> ChurnAction:
    match = _ACTION.match(part)
    if not match:
        raise ChurnSpecError(f"cannot read {part!r} in churn spec {spec!r}; use {ACCEPTED_FORMS}")
    action, count, arg, unit = match["action"], match["count"], match["arg"], match["unit"]
    if action not in ACTIONS:
        raise ChurnSpecError(f"unknown churn action {action!r} in {part!r}; use {ACCEPTED_FORMS}")
    if count == "all" and action != "kill":
        raise ChurnSpecError(f"{part!r}: only kill takes 'all' (every peer and the coordinator); use {ACCEPTED_FORMS}")
    if count != "all" and int(count) < 1 and action != "killstage":
        raise ChurnSpecError(f"{part!r}: the count of peers must be at least 1; use {ACCEPTED_FORMS}")
    if arg is not None and _UNIT.get(action) != unit:
        want = {"slow": "takes a factor ':Kx'", "linkdown": "takes a duration ':Ds'"}.get(action, "takes no ':' argument")
        raise ChurnSpecError(f"{part!r}: {action} {want}; use {ACCEPTED_FORMS}")
    factor = down_s = None
    if action == "slow":
        factor = float(arg) if arg is not None else SLOW_FACTOR
        if factor <= 1:
            raise ChurnSpecError(f"{part!r}: a slow peer's factor must be above 1 (e.g. slow:1:4x@r5)")
    if action == "linkdown":
        down_s = float(arg) if arg is not None else DOWN_S
        if down_s <= 0:
            raise ChurnSpecError(f"{part!r}: a link is down for more than 0 s (e.g. linkdown:1:15s@r6)")
    when = {"round": int(match["round"]) if match["round"] is not None else None,
            "seconds": float(match["seconds"]) if match["seconds"] is not None else None}
    if count == "all":
        return ChurnAction("killall", 0, **when)
    return ChurnAction(action, int(count), **when, factor=factor, down_s=down_s)
