"""The simulation report of DESIGN.md, assembled from the peers' JSONL records.

Beyond DESIGN.md's fields: `links` (each peer's emulated link, None when unshaped, from its start
event), NoLoCo's `rounds[].groups` and `rounds[].paired` (see `_gossip_round`), for Streaming
DiLoCo `rounds[].fragment` and `rounds[].blocked_s` (the longest any peer's training waited for the
round at its apply step; its `sync_s` is the reduce's own time, which overlaps τ inner steps), for
the overlap applied on arrival `rounds[].arrived_after_steps` (per peer, the inner steps it ran
from the estimated start before the round's aggregate came; H where it waited for the boundary),
`sync_wait_s` and `eval_s` (the seconds the peers' training loops spent in their syncs and in
held-out evaluations, summed; `*_share` divides them by peers × wall, like `compute_utilization`),
and `rounds[].link_bound_s`, the least time the round's bytes needed on the links: the
largest bytes / upload rate over the round's shaped peers. Every peer's sync starts before the
round's manifest and every byte of the round is sent after it and awaited by some member, so the
round's `sync_s` (the slowest peer's) is not below it (up to the shaper's 10 ms burst) unless a
member timed out; their ratio is how well the sync used the links. Under `simulate --netns` the
caller passes `links_override` (each peer's kernel cap with the latency its application shaper
adds), as the peers' own start events then hold only the latency (`unlimited:40ms`).

Byzantine members (`simulate --byzantine`, from their start events) are listed in `byzantine`
(peer id, kind, simulate index) and left out of `final_loss` and its spread, which are the honest
peers' final evaluations; `final_loss_honest` says so by name, and `final_loss_byzantine` is the
Byzantine members' own (None without them). Their `byzantine` events stay in `events`.
"""

from __future__ import annotations

import math
from collections import defaultdict

from lowcomm.transport.shaper import parse_link_option


def build_report(records: list[dict], *, algo: str, peers: int, seed: int, model_params: int,
                 started_at: float, extra: dict | None = None,
                 links_override: dict[str, str | None] | None = None) -> dict:
    compute = _last_per_peer(r for r in records if r["type"] == "compute")
    first_t = min((r["first_step_t"] for r in compute.values() if r.get("first_step_t")), default=started_at)
    last_t = max((r["last_step_t"] for r in compute.values()), default=first_t)
    exits = {r["peer"]: r for r in records if r["type"] == "event" and r.get("kind") == "exit"}
    bytes_sent = sum(max(exits.get(p, {}).get("bytes_sent", 0), c.get("bytes_sent", 0)) for p, c in compute.items())
    bytes_sent += sum(e.get("bytes_sent", 0) for p, e in exits.items() if p not in compute)
    checkpoint_bytes = sum(max(exits.get(p, {}).get("checkpoint_bytes", 0), c.get("checkpoint_bytes", 0))
                           for p, c in compute.items())
    checkpoint_bytes += sum(e.get("checkpoint_bytes", 0) for p, e in exits.items() if p not in compute)

    links = {r["peer"]: r.get("link") for r in records if r["type"] == "event" and r.get("kind") == "start"}
    links.update(links_override or {})
    rounds = _rounds(records, first_t, links)
    cumulative, running = {}, 0
    for row in rounds:
        running += row["bytes"]
        cumulative[row["round"]] = running
    evals = _evals(records, first_t, cumulative)
    byzantine = [{"peer": r["peer"], "kind": r["byzantine"], "index": r.get("data_shard")} for r in records
                 if r["type"] == "event" and r.get("kind") == "start" and r.get("byzantine")]
    liars = {b["peer"] for b in byzantine}
    final = [r["loss"] for r in records if r["type"] == "eval" and r.get("final") and r["peer"] not in liars]
    final_byzantine = [r["loss"] for r in records if r["type"] == "eval" and r.get("final") and r["peer"] in liars]
    honest_evals = _evals([r for r in records if r["type"] != "eval" or r["peer"] not in liars], first_t, cumulative)
    report = {
        "algo": algo, "peers": peers, "stages": 1, "seed": seed, "model_params": model_params,
        "tokens": sum(c.get("tokens", 0) for c in compute.values()),
        "final_loss": (sum(final) / len(final)) if final else (honest_evals[-1]["loss"] if honest_evals else None),
        "final_loss_spread": (max(final) - min(final)) if final else None,
        "byzantine": byzantine,
        "final_loss_byzantine": (sum(final_byzantine) / len(final_byzantine)) if final_byzantine else None,
        "bytes_sent": bytes_sent,
        "control_bytes": None,  # netns mode: the DHT's bytes, from the kernel's counters (sim.py)
        "wire_bytes": None,  # netns mode: every frame every node sent, headers and all
        "netns": False,
        "checkpoint_bytes": checkpoint_bytes,  # state served to the coordinator's checkpoints, not in bytes_sent
        "control_calls": _summed(e.get("control_calls") or {} for e in exits.values()),  # DHT calls by kind
        # the stores among them that searched the key's nodes first (transport.dht_stores), by kind
        "control_searches": _summed(e.get("control_searches") or {} for e in exits.values()),
        "wall_s": last_t - first_t,
        "startup_s": first_t - started_at,
        "compute_s": sum(c.get("compute_s", 0.0) for c in compute.values()),
        "links": links,
        "rounds": rounds,
        "evals": evals,
        "events": sorted(({**{k: v for k, v in r.items() if k not in ("type",)}, "t": r["t"] - first_t}
                          for r in records if r["type"] == "event"), key=lambda e: e["t"]),
    }
    report["final_loss_honest"] = report["final_loss"]
    report["bytes_per_token"] = report["bytes_sent"] / report["tokens"] if report["tokens"] else None
    report["compute_utilization"] = (report["compute_s"] / (peers * report["wall_s"])) if report["wall_s"] > 0 else None
    for what in ("sync_wait", "eval"):  # the training loop's other time, as a share of the peers' wall time
        seconds = [c[f"{what}_s"] for c in compute.values() if f"{what}_s" in c]
        report[f"{what}_s"] = sum(seconds) if seconds else None
        report[f"{what}_share"] = (sum(seconds) / (peers * report["wall_s"])) if seconds and report["wall_s"] > 0 else None
    report.update(extra or {})
    return report


def _last_per_peer(records) -> dict[str, dict]:
    last = {}
    for r in records:
        last[r["peer"]] = r
    return last


def _link_bound_s(rows: list[dict], links: dict[str, str | None]) -> float | None:
    """The longest any shaped peer's upload needed for the bytes it sent in the round."""
    bounds = []
    for r in rows:
        spec = parse_link_option(links.get(r["peer"]))
        if spec is not None and not math.isinf(spec.rate_bits):
            bounds.append(r["bytes"] / spec.bytes_per_s)
    return max(bounds) if bounds else None


def _rounds(records: list[dict], first_t: float, links: dict[str, str | None]) -> list[dict]:
    by_round = defaultdict(list)  # pipelines: one row per (round, stage), each stage's replicas apart
    for r in records:
        if r["type"] == "round":
            by_round[(r["round"], r.get("stage", -1))].append(r)
    rows = []
    for (round_, stage), rs in sorted(by_round.items()):
        leader = next((r for r in rs if r.get("leader") == r["peer"]), rs[0])
        row = {"round": round_, "t": min(r["t0"] for r in rs) - first_t, "tokens": leader["tokens"],
               "bytes": sum(r["bytes"] for r in rs), "sync_s": max(r["sync_s"] for r in rs),
               "link_bound_s": _link_bound_s(rs, links),
               "participants": leader["participants"], "contributors": leader["contributors"],
               "phi_hashes": sorted({r["phi_hash"] for r in rs})}
        if stage >= 0:
            row["stage"] = stage
        if any("group" in r for r in rs):
            row.update(_gossip_round(rs))
        arrived = [r["arrived_after_steps"] for r in rs if "arrived_after_steps" in r]
        if arrived:  # the overlap, applied on arrival: inner steps each peer ran before the aggregate came
            row["arrived_after_steps"] = arrived
        if "fragment" in leader:  # Streaming DiLoCo: which fragment, and how long training waited for it
            row.update(fragment=leader["fragment"], blocked_s=max(r.get("blocked_s", 0.0) for r in rs))
        rows.append(row)
    return rows


def _gossip_round(rs: list[dict]) -> dict:
    """NoLoCo: no round-wide aggregate, one group per member. Contributors: every replica that took the
    round (its own contribution is always in its update); paired: those that averaged with a mate."""
    return {"contributors": sorted({p for r in rs for p in r["contributors"]}),
            "groups": sorted({tuple(r["group"]) for r in rs if r.get("group")}),
            "paired": sorted(r["peer"] for r in rs if len(r["contributors"]) > 1)}


def _evals(records: list[dict], first_t: float, cumulative_bytes: dict[int, int]) -> list[dict]:
    seen, out = set(), []
    for r in sorted((r for r in records if r["type"] == "eval"), key=lambda r: (r["round"], r["t"])):
        if r["round"] in seen:
            continue
        seen.add(r["round"])
        done = [b for rnd, b in cumulative_bytes.items() if rnd < r["round"]]
        out.append({"t": r["t"] - first_t, "step": r["step"], "tokens": r["tokens"],
                    "bytes": max(done) if done else 0, "loss": r["loss"]})
    return out


def _summed(counts) -> dict[str, int]:
    """The per-peer call counts added up, by kind."""
    out: dict[str, int] = defaultdict(int)
    for one in counts:
        for kind, n in one.items():
            out[kind] += int(n)
    return dict(sorted(out.items()))
