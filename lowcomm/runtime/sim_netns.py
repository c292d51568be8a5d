"""Namespace mode of `lowcomm simulate` (runtime.sim): the lab, the nodes the processes run in, and
the lab's byte counters in the report.

Simulation holds the state (`lab`, `node_indices`, `wire_samples`, `released_bytes`) and takes these
methods from NamespaceMode; they do nothing where the run is not in namespace mode.
"""

from __future__ import annotations

import time

from lowcomm.transport.netns import NetnsLab, Node


class NamespaceMode:
    def open_lab(self) -> NetnsLab | None:
        """Namespace mode: the lab (NetnsUnavailable, saying what to do, where it cannot be made)."""
        if self.use_netns and self.lab is None:
            self.lab = NetnsLab().open()
        return self.lab

    def node(self, name: str, index: int | None, rate_bits: float | None) -> Node | None:
        """The namespace node a process called `name` runs in (made on first use); None without netns."""
        lab = self.open_lab()
        if lab is None:
            return None
        existing = next((n for n in lab.nodes if n.name == name), None)  # a restarted process reuses its node
        if existing is not None:
            return existing
        self.node_indices[name] = index
        return lab.add_node(name, rate=rate_bits)

    def set_link(self, name: str, up: bool) -> None:
        """Namespace mode: the link of the process called `name` down (a cable pulled) or up again."""
        self.lab.set_link(next(node for node in self.lab.nodes if node.name == name), up)

    def close_lab(self) -> None:
        """Kills whatever is left in the lab, snapshots its counters and removes it (NetnsError if it cannot)."""
        if self.lab is not None:
            self.lab.close()

    def netns_figures(self, ids: dict[int, str]) -> dict:
        """The lab's counters (final once it is closed) for the report."""
        nodes, caps = {}, {}
        for node in self.lab.nodes:
            counters, classes = node.counters(), node.class_bytes()
            index = self.node_indices.get(node.name)
            nodes[node.name] = {
                "peer": ids.get(index) if index is not None else "coordinator", "index": index,
                "address": node.address, "control_address": node.control_address, "cap_bits": node.rate_bits,
                "tx": counters["tx"], "rx": counters["rx"],
                "data_tx": classes["data"]["tx"], "data_rx": classes["data"]["rx"],
                "control_tx": classes["control"]["tx"], "control_rx": classes["control"]["rx"]}
            caps[node.name] = node.rate_bits
        return {"netns": True, "wire_bytes": sum(n["tx"] for n in nodes.values()),
                "control_bytes": sum(n["control_tx"] for n in nodes.values()),
                **self._training_bytes(nodes),
                "wire_bytes_peers": sum(n["tx"] for name, n in nodes.items() if n["index"] is not None),
                "caps": caps, "netns_nodes": nodes, "netns_lab": self.lab.tag}

    def sample_wire(self) -> None:
        """Namespace mode: notes what the peers' nodes have sent so far (the report's `wire_timeline`)."""
        if self.lab is None or self.lab.closed:
            return
        sent = sum(node.counters()["tx"] for node in self.lab.nodes if self.node_indices.get(node.name) is not None)
        self.wire_samples.append((time.time(), sent))

    def _training_bytes(self, nodes: dict) -> dict:
        """What the nodes sent from the peers' release on: in all and the DHT's (None: not released)."""
        if self.released_bytes is None:
            return {"wire_bytes_training": None, "control_bytes_training": None}
        return {"wire_bytes_training": sum(n["tx"] for n in nodes.values()) - self.released_bytes["total"],
                "control_bytes_training": sum(n["control_tx"] for n in nodes.values()) - self.released_bytes["control"]}
