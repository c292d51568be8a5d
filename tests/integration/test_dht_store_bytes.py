"""What a store of a peer record puts on the wire, straight to the key's nodes against searched first
(transport.dht_stores): experiments/dht_call_bytes.py, small, in a network namespace of its own (the
kernel counts its loopback's bytes, so nothing else on the host is counted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm.transport.netns import unavailable_reason

REPO = Path(__file__).resolve().parents[2]
# A signed peer record is ~280 B (its fields, the 88 B Ed25519 owner marker, the 100 B signature);
# stored on 3 nodes with the RPCs' framing it was 2.7-4.2 KB on the wire (experiments/RESULTS.md,
# "Ed25519 identities"). A search first (every node that holds the key answers with all of it) made
# it 10.8-13.7 KB.
STORE_BYTES_MAX = 5_500
# A read of the five nodes' records: ~280 B each from each of the 3 nodes that hold them, ~4 KB, and
# the search's rounds and framing: 8.1-9.6 KB measured. With RSA identities (838 B records) it was
# 13.6-18.0 KB.
READ_BYTES_MAX = 13_000


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"needs root and iproute2: {unavailable_reason()}")
def test_a_store_straight_to_the_keys_nodes_sends_the_record_not_the_key(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "experiments" / "dht_call_bytes.py"), "--replicas", "3",
                          "--cache", "off", "--mode", "searched", "direct", "--calls", "10", "--idle-s", "3", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {row["mode"]: row for row in map(json.loads, (p.read_text() for p in tmp_path.glob("*.json")))}
    direct, searched = rows["direct"]["store peers"], rows["searched"]["store peers"]
    assert 0 < direct <= STORE_BYTES_MAX, rows
    assert direct < searched / 2, rows  # the search's download of the whole key is gone
    assert 0 < rows["direct"]["store announce"] <= STORE_BYTES_MAX, rows
    assert 0 < rows["direct"]["get peers"] <= READ_BYTES_MAX, rows
