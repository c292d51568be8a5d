"""`simulate` in allowlist and token runs: the launcher makes each peer's key, and lists it or signs its token.

    config, flags = admit_simulated(config, "allowlist", run_dir, count=4)
    Simulation(config, 4, run_dir, peer_flags=flags).run()

Keys go to RUN_DIR/keys/peer-I.key (kept: a rerun in the same folder keeps its ids). An allowlist run
lists the ids of peers 0..count-1 in run.allowlist before the coordinator starts, so the signed config
carries them. A token run makes the coordinator's key (RUN_DIR/coordinator.key, which the coordinator
loads) and signs a token for each of those peers. An index in ``outsiders`` (tests) gets a key the
run does not admit, in token runs a copy of another peer's token, and the join_unadmitted test hook:
it joins as a hostile peer would, and the others refuse it.
"""

from __future__ import annotations

import time
from pathlib import Path

from lowcomm.config import RunConfig
from lowcomm.runtime.admission import load_key
from lowcomm.transport.identity import Identity
from lowcomm.transport.join_token import issue_token

TOKEN_DAYS = 1


def admit_simulated(config: RunConfig, mode: str | None, run_dir: Path, count: int,
                    outsiders: tuple[int, ...] = ()) -> tuple[RunConfig, dict[int, list[str]]]:
    """The config with ``mode`` (None: its run.mode) and the `peer join` flags of each peer index."""
    mode = mode or config.run.mode
    if mode == "open":
        return config.override({"run.mode": "open", "run.allowlist": []}), {}
    keys_dir = Path(run_dir) / "keys"
    keys = {i: load_key(keys_dir / f"peer-{i}.key") for i in range(count)}
    keys.update({i: load_key(keys_dir / f"outsider-{i}.key") for i in outsiders})
    flags = {i: ["--key-file", str(keys_dir / f"{'outsider' if i in outsiders else 'peer'}-{i}.key")] for i in keys}
    admitted = sorted(keys[i].peer_id for i in range(count) if i not in outsiders)
    if mode == "allowlist":
        config = config.override({"run.mode": "allowlist",
                                  "run.allowlist": sorted(set(config.run.allowlist) | set(admitted))})
    else:
        config = config.override({"run.mode": mode, "run.allowlist": []})
        coordinator = Identity.load_or_create(Path(run_dir) / "coordinator.key")
        expires = int(time.time()) + TOKEN_DAYS * 86400
        tokens = {i: issue_token(coordinator, config.run.name, keys[i].peer_id, expires)
                  for i in range(count) if i not in outsiders}
        for i in keys:  # an outsider holds a token copied from the DHT: another peer's
            token = tokens.get(i) or next(iter(tokens.values()), None)
            flags[i] += ["--token", token] if token else []
    for i in outsiders:
        flags[i].append("--join-unadmitted")
    return config, flags
