"""Run modes (docs/round-protocol.md, Decision 26): the config's run.mode and run.allowlist, join tokens
signed by the coordinator's key, and the `admits` predicate every peer's manifest agreement applies."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from lowcomm.collectives.manifest import Manifest, ManifestAgreement
from lowcomm.config import ConfigError, RunConfig, RunSection, default_config
from lowcomm.runtime.admission import Admission, NotAdmitted, coordinator_token
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.identity import Identity
from lowcomm.transport.join_token import MAX_TOKEN_CHARS, TokenRefused, check_token, coordinator_public_key, issue_token
from unit.test_who_counts import SYNC, MemoryControl

COORDINATOR = Identity.generate()
RUN_KEY = COORDINATOR.public_key_text
PEER = Identity.generate().peer_id
WAIT_S = 30


# ---- the config --------------------------------------------------------------------------------


def test_the_default_run_is_open_and_the_mode_is_not_part_of_the_config_hash():
    config = default_config()
    assert config.run.mode == "open" and config.run.allowlist == []
    listed = config.override({"run.mode": "allowlist", "run.allowlist": [PEER]})
    assert listed.config_hash() == config.config_hash()  # a run may admit more peers and resume
    assert RunConfig.from_json(listed.to_json()).run.allowlist == [PEER]


@pytest.mark.parametrize("run, message", [
    ({"mode": "closed"}, "run.mode = 'closed': use one of open, allowlist, token"),
    ({"mode": "allowlist"}, "empty run.allowlist"),
    ({"mode": "allowlist", "allowlist": ["not-an-id"]}, "'not-an-id' is not a peer id"),
    ({"mode": "allowlist", "allowlist": [PEER.upper()]}, "is not a peer id"),
    ({"mode": "allowlist", "allowlist": [PEER + "0"]}, "is not a peer id"),
    ({"mode": "allowlist", "allowlist": PEER}, "expected a list of strings"),
    ({"mode": "allowlist", "allowlist": [1]}, "expected a list of strings"),
    ({"allowlist": [PEER]}, "set run.mode = \"allowlist\""),
    ({"mode": "token", "allowlist": [PEER]}, "run.mode = 'token'"),
])
def test_a_bad_run_mode_or_allowlist_is_one_line_naming_the_key(run, message):
    with pytest.raises(ConfigError) as error:
        RunConfig.from_dict({"run": run})
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- tokens ------------------------------------------------------------------------------------


def check(token, peer=PEER, run="run", now=None, key=RUN_KEY):
    return check_token(token, coordinator_public_key(key), run, peer, time.time() if now is None else now)


def test_a_token_admits_its_peer_in_its_run_until_it_expires():
    expires = int(time.time()) + 60
    token = issue_token(COORDINATOR, "run", PEER, expires)
    assert len(token) <= MAX_TOKEN_CHARS and token.startswith("lct1.")
    assert check(token) == expires


@pytest.mark.parametrize("case, reason", [
    ("wrong peer", "for peer"),
    ("wrong run", "for run 'other'"),
    ("expired", "expired at"),
    ("forged signer", "not signed by this run's coordinator"),
    ("edited payload", "not signed by this run's coordinator"),
])
def test_a_token_for_another_peer_or_run_expired_or_forged_is_refused(case, reason):
    expires = int(time.time()) + 60
    other = Identity.generate()
    token = {"wrong peer": issue_token(COORDINATOR, "run", other.peer_id, expires),
             "wrong run": issue_token(COORDINATOR, "other", PEER, expires),
             "expired": issue_token(COORDINATOR, "run", PEER, int(time.time()) - 1),
             "forged signer": issue_token(other, "run", PEER, expires)}.get(case)
    if case == "edited payload":  # another peer's genuine signature under this peer's payload
        genuine = issue_token(COORDINATOR, "run", other.peer_id, expires).split(".")
        mine = issue_token(other, "run", PEER, expires).split(".")
        token = ".".join([genuine[0], mine[1], genuine[2]])
    with pytest.raises(TokenRefused, match=reason):
        check(token)


@pytest.mark.parametrize("garbage", [
    None, 7, b"lct1.x.y", "", "lct1", "lct1..", "lct2.e30.AA", "lct1.%%%.AA", "lct1.e30.AA",
    "lct1." + "A" * MAX_TOKEN_CHARS, "lct1.WyJhIl0.AA",  # a JSON list
    "lct1.eyJleHAiOnRydWUsInBlZXIiOiJhIiwicnVuIjoiYiJ9.AA",  # exp: true
])
def test_garbage_tokens_are_refused_before_any_signature_check(garbage):
    with pytest.raises(TokenRefused):
        check(garbage)


def test_the_token_command_signs_with_the_coordinators_kept_key_and_refuses_a_wrong_run_dir(tmp_path):
    key = Identity.load_or_create(tmp_path / "coordinator.key")
    token = coordinator_token(tmp_path, RunSection(name="run"), PEER, valid_days=1)
    assert check(token, key=key.public_key_text) > time.time() + 3600
    with pytest.raises(ConfigError, match="no coordinator key at"):
        coordinator_token(tmp_path / "elsewhere", RunSection(name="run"), PEER, valid_days=1)
    with pytest.raises(ConfigError, match="is not a peer id"):
        coordinator_token(tmp_path, RunSection(name="run"), "peer-1", valid_days=1)


# ---- who is admitted ---------------------------------------------------------------------------


def test_an_allowlist_admits_its_ids_and_the_coordinator_and_tells_an_outsider_what_to_do():
    admission = Admission(RunSection(name="run", mode="allowlist", allowlist=[PEER]), RUN_KEY, dict)
    assert admission.admits(PEER) and admission.admits(COORDINATOR.peer_id)
    stranger = Identity.generate().peer_id
    assert not admission.admits(stranger)
    admission.check_joiner(PEER, None, None)
    with pytest.raises(NotAdmitted, match=f"this peer's id {stranger} is not in the allowlist of run 'run'.*--key-file"):
        admission.check_joiner(stranger, None, None)


def test_token_mode_admits_the_records_whose_token_is_their_own():
    expires = int(time.time()) + 60
    honest, thief = Identity.generate().peer_id, Identity.generate().peer_id
    token = issue_token(COORDINATOR, "run", honest, expires)
    records = {honest: PeerRecord(honest, "h:1", token=token), thief: PeerRecord(thief, "t:1", token=token)}
    admission = Admission(RunSection(name="run", mode="token"), RUN_KEY, lambda: records)
    assert admission.admits(honest) and not admission.admits(thief)  # a copied token admits nobody else
    assert admission.admitted(records) == {honest}
    admission.check_joiner(honest, token, None)
    for token_given, reason in ((None, "has no join token"), (token, "for peer")):
        with pytest.raises(NotAdmitted, match=f"{reason}.*coordinator token --peer-id {thief}"):
            admission.check_joiner(thief, token_given, None)


# ---- the manifest predicate --------------------------------------------------------------------


def test_the_leader_leaves_a_non_admitted_announcer_out_and_every_peer_refuses_a_manifest_naming_it():
    store, ids, outsider = {}, ["b", "c"], "a"  # the outsider holds the lowest id
    live = {p: PeerRecord(p, f"{p}:1", state="training") for p in [*ids, outsider]}
    admits = lambda peer: peer in ids  # noqa: E731
    events = []
    agreements = [ManifestAgreement(MemoryControl(p, store, live), SYNC, f"{p}:1", admits=admits,
                                    on_event=lambda kind, **f: events.append((kind, f))) for p in ids]
    MemoryControl(outsider, store, live).announce("0-0", 0, {"endpoint": "a:1", "client_mode": False}, 60)
    results = [None] * 2
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, agreements[i].agree("0-0", 0, 1, "fp32")))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert all(m is not None and m.leader == "b" and m.members == ids for m in results)
    assert ("reject", {"round": 0, "sender": outsider,
                       "reason": "an announcement from a peer the run does not admit"}) in events

    # a manifest of round 1 naming the outsider (from a member), and one the outsider wrote itself
    naming = Manifest("run", "0-0", 1, 1, "b", ["a", "b", "c"], {p: f"{p}:1" for p in "abc"}, ["b"], "fp32")
    MemoryControl("b", store, live).publish_manifest("0-0", 1, naming.to_dict(), 60)
    own = Manifest("run", "0-0", 1, 1, outsider, ["a"], {"a": "a:1"}, ["a"], "fp32")
    MemoryControl(outsider, store, live).publish_manifest("0-0", 1, own.to_dict(), 60)
    assert agreements[1].read("0-0", 1) is None
    reasons = {(f["sender"], f["reason"]) for kind, f in events if kind == "reject" and f["round"] == 1}
    assert reasons == {("b", "a manifest naming a, a peer the run does not admit"),
                       (outsider, "a manifest written by a peer the run does not admit")}


# ---- the peer's options and commands -----------------------------------------------------------


def test_a_profile_and_the_flags_carry_the_key_file_and_the_token(tmp_path):
    from lowcomm.runtime.options import peer_options, read_profile

    profile = tmp_path / "peer.toml"
    profile.write_text('[peer]\nkey_file = "me.key"\ntoken = "lct1.a.b"\n')
    base = {"coordinator": ["/ip4/127.0.0.1/tcp/1/p2p/x"], "run_key": "key"}
    o = peer_options(read_profile(profile), base)
    assert (o.key_file, o.token, o.join_unadmitted) == (Path("me.key"), "lct1.a.b", False)
    with pytest.raises(ConfigError, match="token = .*at most"):
        peer_options({}, {**base, "token": "x" * (MAX_TOKEN_CHARS + 1)})


def test_peer_id_prints_the_same_id_of_a_kept_key_and_refuses_a_file_that_is_no_key(tmp_path, capsys):
    from lowcomm.cli import main

    key = tmp_path / "me.key"
    assert main(["peer", "id", "--key-file", str(key)]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["peer", "id", "--key-file", str(key)]) == 0
    assert capsys.readouterr().out.strip() == first == Identity.load_or_create(key).peer_id
    (tmp_path / "bad.key").write_text("not a key")
    assert main(["peer", "id", "--key-file", str(tmp_path / "bad.key")]) == 2
    err = capsys.readouterr().err
    assert "not a key lowcomm can use" in err and err.count("\n") == 1
