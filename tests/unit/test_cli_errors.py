"""Mistakes a person makes at the command line: one line saying what to do, a non-zero exit, nothing
joined or written first (runtime.preflight)."""

from __future__ import annotations

import socket

import pytest
import torch

from lowcomm.cli import main
from lowcomm.transport.identity import Identity

MADDR = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.fixture(scope="module")
def run_key() -> str:
    return Identity.generate().public_key_text


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def join(run_key: str, *extra: str) -> int:
    return main(["peer", "join", "--coordinator", MADDR, "--run-key", run_key, *extra])


def test_a_coordinator_address_that_is_not_a_multiaddr(capsys, run_key):
    assert main(["peer", "join", "--coordinator", "127.0.0.1:31337", "--run-key", run_key]) == 2
    assert "--coordinator '127.0.0.1:31337' is not a multiaddr" in one_line_error(capsys)
    assert main(["peer", "join", "--coordinator", "/ip4/127.0.0.1/tcp/9", "--run-key", run_key]) == 2
    assert "names no peer" in one_line_error(capsys)
    assert main(["status", "--coordinator", "nowhere"]) == 2
    assert "is not a multiaddr" in one_line_error(capsys)


def test_a_run_key_that_is_not_a_public_key(capsys):
    assert join("hunter2") == 2
    assert "--run-key is not the coordinator's public key" in one_line_error(capsys)


def test_a_device_torch_does_not_see(capsys, run_key):
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    assert join(run_key, "--device", device) == 2
    assert one_line_error(capsys).startswith(f"lowcomm: --device {device}: torch sees")


def test_a_port_already_in_use(capsys, run_key, busy_port):
    assert join(run_key, "--port", str(busy_port)) == 2
    assert f"--port {busy_port} on 0.0.0.0 is not free" in one_line_error(capsys)
    assert main(["coordinator", "start", "--port", str(busy_port)]) == 2
    assert "is not free" in one_line_error(capsys)


def test_resuming_from_a_missing_folder_writes_nothing(capsys, tmp_path):
    run_dir = tmp_path / "coordinator"
    assert main(["coordinator", "start", "--run-dir", str(run_dir), "--resume", str(tmp_path / "nope")]) == 2
    assert one_line_error(capsys).startswith("lowcomm: --resume: no complete checkpoint")
    assert not run_dir.exists()  # no key, no folder


def test_a_simulation_of_no_peers_writes_nothing(capsys, tmp_path):
    report = tmp_path / "report.json"
    assert main(["simulate", "--peers", "0", "--report", str(report)]) == 2
    assert "--peers 0" in one_line_error(capsys)
    assert not report.exists() and not (tmp_path / "report-run").exists()


def test_an_unexpected_failure_is_one_line_unless_verbose(capsys, monkeypatch):
    import lowcomm.runtime.export as export

    def broken(*_args, **_kwargs):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(export, "export_checkpoint", broken)
    assert main(["export", "a", "b"]) == 1
    line = one_line_error(capsys)
    assert line.startswith("lowcomm export: RuntimeError: disk on fire") and "-v" in line
    with pytest.raises(RuntimeError):
        main(["-v", "export", "a", "b"])


def test_version(capsys):
    from lowcomm.version import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"lowcomm {__version__}"


def test_a_status_page_or_metrics_port_in_use_is_one_line_before_anything_starts(capsys, tmp_path, busy_port,
                                                                                  run_key):
    assert join(run_key, "--metrics-port", str(busy_port)) == 2
    assert f"--metrics-port {busy_port} on 127.0.0.1 is not free" in one_line_error(capsys)
    assert main(["coordinator", "start", "--dashboard-port", str(busy_port)]) == 2
    assert f"--dashboard-port {busy_port} on 127.0.0.1 is not free" in one_line_error(capsys)
    assert main(["observe", "--coordinator", MADDR, "--dashboard-port", str(busy_port)]) == 2
    assert f"--dashboard-port {busy_port} on 127.0.0.1 is not free" in one_line_error(capsys)
    report = tmp_path / "report.json"
    assert main(["simulate", "--dashboard-port", str(busy_port), "--report", str(report)]) == 2
    line = one_line_error(capsys)
    assert line.startswith(f"lowcomm: --dashboard-port {busy_port} on 127.0.0.1 is not free")
    assert not report.exists() and not (tmp_path / "report-run" / "peers").exists()
