"""An allowlist run of real peer processes (docs/round-protocol.md, Decision 26): two listed peers train
and finish; an outsider with a valid key that is not listed joins anyway (the join_unadmitted test
hook: it behaves as an open-run peer) and is never a member of any round, each of its attempts a
`reject` event of the listed peers; a second unlisted peer without the hook is told at join what to
do and exits 2 without joining a round. Every process runs in its own process group and every wait
has a deadline."""

from __future__ import annotations

import pytest

from children import events, wait_until

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation
from lowcomm.runtime.sim_admission import admit_simulated

PEERS, H, ROUNDS = 2, 3, 3
OUTSIDER, REFUSED = PEERS, PEERS + 1  # simulate indices


@pytest.mark.timeout(420)
def test_an_allowlist_run_never_counts_an_outsider_and_refuses_an_unlisted_joiner(tmp_path):
    config = default_config().override({
        "run.steps": H * ROUNDS, "diloco.inner_steps": H, "model.d_model": 32, "model.n_layers": 1,
        "model.n_heads": 2, "model.context": 32, "inner.batch_size": 4, "inner.warmup_steps": 0,
        "data.eval_batches": 2, "data.eval_every_tokens": 10 ** 9, "sync.announce_s": 2.0, "sync.manifest_s": 3.0,
        "sync.reduce_timeout_s": 8.0, "checkpoint.every_rounds": 0})
    run_dir = tmp_path / "run"
    config, flags = admit_simulated(config, "allowlist", run_dir, PEERS, outsiders=(OUTSIDER, REFUSED))
    flags[REFUSED].remove("--join-unadmitted")  # an unlisted peer as a user would start it
    assert len(config.run.allowlist) == PEERS
    sim = Simulation(config, PEERS, run_dir, progress=False, peer_flags=flags)
    try:
        sim.start_coordinator()
        peers = [sim.start_peer(i) for i in range(PEERS)]
        outsider = sim.start_peer(OUTSIDER)
        refused = sim.start_peer(REFUSED)
        sim.release(peers + [outsider])
        sim.wait_peers(peers, timeout=300)
        wait_until(lambda: refused.popen.poll() is not None, 60, "the unlisted peer's exit")
        exit_codes = [p.popen.returncode for p in peers]
    finally:
        leftovers = sim.stop_all()
    assert exit_codes == [0] * PEERS and leftovers == []
    assert refused.popen.returncode == 2
    told = refused.log_path.read_text()
    assert "is not in the allowlist of run" in told and "lowcomm peer id --key-file" in told, told[-2000:]

    records = sim.records()
    ids = sim.peer_ids(records)
    outsider_id, listed = ids[OUTSIDER], {ids[i] for i in range(PEERS)}
    assert listed == set(config.run.allowlist) and REFUSED not in ids  # the refused peer never started training
    rounds = [r for r in records if r["type"] == "round" and r["peer"] in listed]
    assert sorted({r["round"] for r in rounds}) == list(range(ROUNDS))
    for r in rounds:
        assert outsider_id not in r["participants"] and outsider_id not in r["contributors"], r
        assert set(r["contributors"]) <= listed, r
    rejects = [e for e in events(records, "reject") if e["peer"] in listed]
    # the outsider's announcement refused by the leader, or its posts refused at the door (they name it)
    refusals = [e for e in rejects if e.get("sender") == outsider_id
                or outsider_id in e.get("reason", "") + e.get("error", "")]
    assert refusals, rejects
    assert any("does not admit" in e.get("reason", "") + e.get("error", "") for e in refusals), refusals
