"""Who may join a run (`run.mode` of the signed run config): everyone, the listed peer ids, or token holders.

    open       every peer (the default)
    allowlist  the peer ids of `run.allowlist` (a peer id is the hash of the peer's key, `--key-file`)
    token      peers whose record carries a join token the coordinator signed for their id and this
               run, not expired (transport.join_token; `lowcomm coordinator token`)

Every peer, and the coordinator, builds one Admission from the config and the coordinator key of the
join command, and hands ``admits`` to the collectives (a manifest never names a peer it refuses) and to
the state sync and stage guard (no state or stage call from such a peer). The coordinator's own id is
always admitted. Tokens are read from the peers' DHT records: a verified token is kept until it
expires, and an unknown id triggers a re-read at most every MISS_REFRESH_S, so a flood of strangers
costs one DHT read per interval, not one per question.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lowcomm.config import PEER_ID, ConfigError, RunSection
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.identity import Identity, owner_marker_from_text, peer_id_of
from lowcomm.transport.join_token import TokenRefused, check_token, coordinator_public_key, issue_token

logger = logging.getLogger(__name__)
MISS_REFRESH_S = 0.25
MAX_CHECKED = 4096  # (peer, token) verdicts kept, so a re-read verifies only new tokens


class NotAdmitted(ConfigError):
    """This peer may not join the run: the message says what to ask the run owner for."""


def load_key(path: Path) -> Identity:
    """The peer's key at ``path``, made there (owner-only) if missing; one-line ConfigError if unusable."""
    try:
        return Identity.load_or_create(Path(path).expanduser())
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--key-file {path}: not a key lowcomm can use ({type(e).__name__}); pass a key file "
                          "made by `lowcomm peer id --key-file PATH`, or a path where none exists yet") from None


class Admission:
    def __init__(self, run: RunSection, run_key: str, records: Callable[[], dict[str, PeerRecord]]):
        """``run``: the signed config's [run]; ``run_key``: the coordinator's public key as in the join
        command; ``records()``: the run's live peer records (token mode reads the tokens there)."""
        self.mode, self.run = run.mode, run.name
        self.allowlist = frozenset(run.allowlist)
        self.coordinator = peer_id_of(owner_marker_from_text(run_key))
        self.key = coordinator_public_key(run_key) if self.mode == "token" else None
        self.records = records
        self._valid: dict[str, int] = {}  # peer id -> expiry of its verified token
        self._checked: dict[tuple[str, str], int | None] = {}
        self._read_at = -float("inf")
        self._lock = threading.Lock()

    @classmethod
    def everyone(cls, run_key: str) -> "Admission":
        return cls(RunSection(mode="open"), run_key, dict)

    def admits(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may be a round member, a state source or a stage caller of this run."""
        if self.mode == "open" or peer_id == self.coordinator:
            return True
        if self.mode == "allowlist":
            return peer_id in self.allowlist
        if self._valid.get(peer_id, 0) > time.time():
            return True
        with self._lock:
            if time.monotonic() - self._read_at < MISS_REFRESH_S:
                return False
            self._read_at = time.monotonic()
        try:
            records = self.records()
        except Exception as e:  # the DHT did not answer: what is known stands
            logger.info("could not read the peer records for their tokens: %s", e)
            return False
        self.admitted(records)
        return self._valid.get(peer_id, 0) > time.time()

    def admitted(self, records: dict[str, PeerRecord]) -> set[str]:
        """The ids among ``records`` this run admits (their tokens checked, once per token)."""
        if self.mode != "token":
            return {p for p in records if self.admits(p)}
        now, out = time.time(), set()
        for peer_id, record in records.items():
            if peer_id == self.coordinator:
                out.add(peer_id)
                continue
            key = (peer_id, record.token)
            if key not in self._checked:
                try:
                    expires = check_token(record.token, self.key, self.run, peer_id, now)
                except TokenRefused:
                    expires = None
                with self._lock:
                    if len(self._checked) >= MAX_CHECKED:
                        self._checked.clear()
                    self._checked[key] = expires
            expires = self._checked[key]
            if expires is not None and expires > now:
                with self._lock:
                    self._valid[peer_id] = max(expires, self._valid.get(peer_id, 0))
                out.add(peer_id)
        return out

    def refusal(self, peer_id: str, token: str | None, key_file: Path | None) -> str | None:
        """Why this run does not admit the joining peer, as one line saying what to do; None if it does."""
        if self.mode == "open":
            return None
        if self.mode == "allowlist":
            if peer_id in self.allowlist:
                return None
            where = (f"`lowcomm peer id --key-file {key_file}` prints it" if key_file is not None else
                     "this peer has no --key-file, so its id is new at every start: pass --key-file PATH and "
                     "send `lowcomm peer id --key-file PATH`'s output")
            return (f"this peer's id {peer_id} is not in the allowlist of run {self.run!r}: send it to the run owner "
                    f"({where}) and join again with the same --key-file once it is listed")
        ask = (f"ask the run owner for one (`lowcomm coordinator token --peer-id {peer_id}`, for this peer's "
               f"--key-file{'' if key_file is not None else ' (pass one: without it the id changes at every start)'}) "
               "and pass it with --token")
        try:
            check_token(token, self.key, self.run, peer_id, time.time())
        except TokenRefused as e:
            return f"run {self.run!r} admits peers with a join token, and this peer has {e}: {ask}"
        return None

    def check_joiner(self, peer_id: str, token: str | None, key_file: Path | None) -> None:
        """NotAdmitted (one line) unless this run admits the joining peer."""
        problem = self.refusal(peer_id, token, key_file)
        if problem is not None:
            raise NotAdmitted(problem)


def coordinator_token(run_dir: Path, run: RunSection, peer_id: str, valid_days: float) -> str:
    """A join token for ``peer_id`` signed by the coordinator key kept in ``run_dir`` (`coordinator token`)."""
    if not PEER_ID.match(peer_id):
        raise ConfigError(f"--peer-id {peer_id[:60]!r} is not a peer id (20 hex digits, as the peer's "
                          "`lowcomm peer id --key-file PATH` prints)")
    if not 0 < valid_days <= 3650:
        raise ConfigError(f"--valid-days {valid_days}: must be in (0, 3650]")
    key_path = Path(run_dir) / "coordinator.key"
    if not key_path.exists():
        raise ConfigError(f"no coordinator key at {key_path}: pass the --run-dir the coordinator was started with "
                          "(default runs/coordinator)")
    try:
        coordinator = Identity.load_or_create(key_path)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{key_path} is not a coordinator key lowcomm can use ({type(e).__name__})") from None
    return issue_token(coordinator, run.name, peer_id, int(time.time() + valid_days * 86400))
