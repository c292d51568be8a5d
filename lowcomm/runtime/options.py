"""A peer's own options (`peer join`): where it listens, which device it trains on, how others reach it.

They come from three places, each overriding the one before: the defaults below, the [peer] table
of a profile (`peer join --config peer.toml`; ready ones in the top-level peers/ folder), and the
flags the user actually typed. A profile's keys are PeerOptions' field names:

    [peer]
    device = "cuda:0"
    host = "0.0.0.0"
    port = 31400
    dht_port = 31401
    client_mode = true
    key_file = "~/.lowcomm/peer.key"   # a key kept across starts: a stable peer id (allowlist and token runs)
    token = "lct1...."                 # token runs: the join token the run owner signed for this peer's id

An unknown key or a value of the wrong type is refused with one line naming it (the CLI exits 2).
The run config (model, batch, algorithm) is not a peer option: every peer fetches it, signed,
from the coordinator.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowcomm.config import ConfigError
from lowcomm.transport.addresses import is_host, split_announce
from lowcomm.transport.join_token import MAX_TOKEN_CHARS
from lowcomm.transport.shaper import LinkSpec, parse_link_option

DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
REQUIRED = {"coordinator": "--coordinator MULTIADDR", "run_key": "--run-key KEY"}
FLAG_OF = {"run_name": "--run"}  # the flags not named after their field


@dataclass
class PeerOptions:
    coordinator: list[str]
    run_key: str
    run_name: str = "lowcomm-default"
    host: str = "0.0.0.0"  # every interface; the endpoint others dial is announced (transport.addresses)
    port: int = 0
    announce_addr: str | None = None  # HOST or HOST:PORT others dial, for both planes (behind NAT, a proxy)
    dht_port: int = 0  # the DHT's (p2pd's) port; 0: a free one
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    client_mode: bool | None = None  # None: decided by a dial-back check at join
    data_shard: int | None = None
    num_shards: int = 64
    run_dir: Path | None = None
    fault: str | None = None  # a test hook, KIND@ROUND (runtime.faults)
    byzantine: str | None = None  # robustness experiments: lie on the wire as this kind (runtime.byzantine)
    start_file: Path | None = None  # simulate's start barrier: train once this file exists
    link: LinkSpec | None = None  # emulated access link for all data-plane traffic (None: unshaped)
    dht_host: str | None = None  # address the DHT (p2pd) listens on; None: `host`
    stage: int | None = None  # pipelines: the stage to start serving from φ_0 (simulate's initial placement)
    slowdown: float = 1.0  # emulation: each computation keeps the peer busy this many times as long
    slowdown_file: Path | None = None  # emulation: a file whose number, once it exists, replaces `slowdown`
    key_file: Path | None = None  # this peer's key, made there if missing (None: a fresh key, a new id every start)
    token: str | None = None  # token runs: the coordinator's join token for this peer's id (runtime.admission)
    metrics_port: int | None = None  # serve Prometheus /metrics on this port (None: not served; 0: any free one)
    metrics_host: str = "127.0.0.1"  # where /metrics listens (0.0.0.0 for a scraper on another machine)
    join_unadmitted: bool = False  # a test hook: join a run that does not admit this peer (the others refuse it)


def read_profile(path: str | Path) -> dict[str, Any]:
    """The [peer] table of a profile, each value converted to its field's type."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"peer profile {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"peer profile {path} is not valid TOML: {e}") from None
    extra = sorted(set(raw) - {"peer"})
    if extra:
        raise ConfigError(f"{path}: unknown table or key {extra[0]!r}; a peer profile holds one [peer] table")
    table = raw.get("peer", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: peer must be a [peer] table")
    return {name: convert(name, value, f"{path}: peer.{name}") for name, value in table.items()}


def peer_options(profile: dict[str, Any], flags: dict[str, Any]) -> PeerOptions:
    """Defaults < profile < flags; a flag left out (None) keeps what the profile or default says."""
    given = {name: convert(name, value, FLAG_OF.get(name, f"--{name.replace('_', '-')}"))
             for name, value in flags.items() if value is not None}
    values = {**profile, **given}
    missing = [flag for name, flag in REQUIRED.items() if name not in values]
    if missing:
        raise ConfigError(f"peer join needs {' and '.join(missing)} (a flag, or in the [peer] table of --config)")
    options = PeerOptions(**values)
    check(options)
    return options


def check(o: PeerOptions) -> None:
    """Values of the right type that still cannot work."""
    for name, ok, allowed in (
            ("device", DEVICE.match(o.device), "auto, cpu, cuda or cuda:N"),
            ("host", is_host(o.host), "an IP address or a hostname (no scheme, no port, no spaces)"),
            ("dht_host", o.dht_host is None or is_host(o.dht_host),
             "an IP address or a hostname (no scheme, no port, no spaces)"),
            ("port", 0 <= o.port <= 65535, "in [0, 65535] (0: any free port)"),
            ("dht_port", 0 <= o.dht_port <= 65535, "in [0, 65535] (0: any free port)"),
            ("metrics_port", o.metrics_port is None or 0 <= o.metrics_port <= 65535, "in [0, 65535] (0: any free port)"),
            ("metrics_host", is_host(o.metrics_host), "an IP address or a hostname (no scheme, no port, no spaces)"),
            ("announce_addr", o.announce_addr is None or _announce_ok(o.announce_addr),
             "HOST or HOST:PORT, an address the other machines can dial"),
            ("num_shards", o.num_shards >= 1, ">= 1"),
            ("data_shard", o.data_shard is None or 0 <= o.data_shard < o.num_shards, f"in [0, num_shards = {o.num_shards})"),
            ("stage", o.stage is None or o.stage >= 0, ">= 0"),
            ("slowdown", o.slowdown >= 1, ">= 1"),
            ("token", o.token is None or 0 < len(o.token) <= MAX_TOKEN_CHARS,
             f"a join token as `lowcomm coordinator token` prints it (at most {MAX_TOKEN_CHARS} characters)")):
        if not ok:
            raise ConfigError(f"{name} = {getattr(o, name)!r}: must be {allowed}")


def _announce_ok(text: str) -> bool:
    try:
        split_announce(text)
    except ValueError:
        return False
    return True


def convert(name: str, value: Any, where: str) -> Any:
    """`value` as the type of PeerOptions' field `name`; ConfigError naming `where` otherwise."""
    hints = typing.get_type_hints(PeerOptions)
    if name not in hints:
        raise ConfigError(f"{where}: unknown key; known: {', '.join(f.name for f in dataclasses.fields(PeerOptions))}")
    kind = _without_none(hints[name])
    try:
        return _CONVERTERS[kind](value)
    except (TypeError, ValueError) as e:
        detail = f" ({e})" if str(e) else ""
        raise ConfigError(f"{where} = {value!r}: expected {_EXPECTED[kind]}{detail}") from None


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (kind,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return kind
    return hint


def _exactly(*kinds: type):
    def check(value: Any) -> Any:
        if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
            raise TypeError
        return value
    return check


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise TypeError
    return list(value)


def _link(value: Any) -> LinkSpec | None:
    return parse_link_option(_exactly(str)(value))  # ValueError for a malformed spec; "none": unshaped


_CONVERTERS = {
    str: _exactly(str),
    bool: _exactly(bool),
    int: _exactly(int),
    float: lambda v: float(_exactly(int, float)(v)),
    Path: lambda v: Path(_exactly(str, Path)(v)),
    list[str]: _strings,
    LinkSpec: _link,
}
_EXPECTED = {str: "a string", bool: "true or false", int: "an integer", float: "a number", Path: "a path (string)",
             list[str]: "a non-empty list of strings", LinkSpec: "a link RATE[:LATENCY] such as \"20mbit:80ms\""}
