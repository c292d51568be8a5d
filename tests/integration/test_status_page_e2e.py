"""The status page in a real browser: `lowcomm simulate --dashboard-port` runs 4 peers, churn kills one,
and headless Chromium (Debian's package; .ci/run installs it) loads the page while the run goes on.
The DOM must list the 4 peers with the killed one shown as gone, and draw the held-out loss chart;
a screenshot is taken. The launcher runs in its own process group, is stopped with SIGTERM (it stops
its peers) and, whatever happens, its group is killed at the end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from children import free_port, page_status as status, small_diloco_toml, wait_until

PEERS = 4
TOKENS_PER_ROUND = 4 * 1024 * PEERS  # inner_steps 4, batch 16 x context 64, 4 peers: an evaluation each round
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def browser() -> str:
    found = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if found is None:
        message = "no headless Chromium: apt-get install chromium (Debian), as .ci/run does"
        if os.environ.get("LOWCOMM_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    return found


class Dom(HTMLParser):
    """The rendered DOM's peer rows (data-peer, class, state text) and charts (id -> data-points, polyline)."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, dict] = {}
        self.charts: dict[str, dict] = {}
        self._row: dict | None = None
        self._cell: str | None = None
        self._chart: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-peer" in a:
            self._row = self.rows[a["data-peer"]] = {"class": a.get("class", ""), "state": ""}
        elif tag == "td" and self._row is not None and "state" in (a.get("class") or "").split():
            self._cell = "state"
        elif tag == "svg" and (a.get("id") or "").startswith("chart-"):
            self._chart = a["id"]
            self.charts[a["id"]] = {"points": int(a.get("data-points", 0)), "polyline": 0}
        elif tag == "polyline" and self._chart is not None:
            self.charts[self._chart]["polyline"] = len((a.get("points") or "").split())

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._cell = None
        elif tag == "svg":
            self._chart = None

    def handle_data(self, data):
        if self._row is not None and self._cell == "state":
            self._row["state"] += data


@pytest.mark.timeout(600)
def test_the_status_page_in_chromium_shows_peers_the_loss_chart_and_a_killed_peer(tmp_path):
    chromium = browser()
    config = tmp_path / "run.toml"
    config.write_text(small_diloco_toml(inner_steps=4, rounds=400, eval_every_tokens=TOKENS_PER_ROUND,
                                        checkpoint_every_rounds=0))
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    log = open(tmp_path / "simulate.log", "w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lowcomm.cli", "simulate", "--config", str(config), "--peers", str(PEERS),
         "--churn", "kill:1@r2", "--dashboard-port", str(port), "--report", str(tmp_path / "report.json")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready():
            if launcher.poll() is not None:
                raise AssertionError(f"simulate exited {launcher.returncode}: "
                                     f"{(tmp_path / 'simulate.log').read_text()[-2000:]}")
            s = status(url)
            return s if s and len(s["peers"]) == PEERS and s["totals"]["peers_gone"] == 1 \
                and len(s["evals"]) >= 2 else None
        s = wait_until(ready, 420, "4 peers, one killed, two evaluations on /api/status", poll_s=1.0)
        assert [e for e in s["events"] if e["kind"] == "kill"], s["events"]

        profile = ["--user-data-dir=" + str(tmp_path / "chromium"), "--virtual-time-budget=5000"]
        dom_text = subprocess.run([chromium, *BROWSER_FLAGS, *profile, "--dump-dom", url], capture_output=True,
                                  text=True, timeout=120, check=True).stdout
        shot = tmp_path / "status.png"
        subprocess.run([chromium, *BROWSER_FLAGS, *profile, "--window-size=1300,1500", f"--screenshot={shot}", url],
                       capture_output=True, timeout=120, check=True)
        dom = Dom()
        dom.feed(dom_text)
        assert len(dom.rows) == PEERS, dom_text[:3000]
        gone = [peer for peer, row in dom.rows.items() if "gone" in row["class"].split()]
        assert len(gone) == 1 and dom.rows[gone[0]]["state"].startswith("gone (killed)"), dom.rows
        assert all(row["state"] == "training" for peer, row in dom.rows.items() if peer not in gone), dom.rows
        chart = dom.charts["chart-tokens"]
        assert chart["points"] >= 2 and chart["polyline"] == chart["points"], dom.charts
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        if os.environ.get("LOWCOMM_SCREENSHOT"):  # where a person wants to look at it
            shutil.copy(shot, os.environ["LOWCOMM_SCREENSHOT"])
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)  # the launcher stops its peers' groups itself
            try:
                launcher.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait(timeout=30)
        log.close()
