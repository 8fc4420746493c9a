"""`splatflow weights fetch` against a local HTTP server: a file whose name carries its checksum is saved into the
torch hub cache; a file whose bytes do not match its name is refused and leaves nothing behind; no server at all
is a clear message."""

from __future__ import annotations

import functools
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splatflow.evaluation import weights
from splatflow.cli import app
from splatflow.pipeline.errors import UserError
from splatflow.evaluation.lpips import BACKBONE_FILES, LpipsSet


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def test_a_file_of_known_checksum_is_saved_and_a_wrong_one_refused(server, tmp_path):
    root, url = server
    payload = b"splatflow weights test " * 5000
    good = f"trunk-{hashlib.sha256(payload).hexdigest()[:8]}.pth"
    (root / good).write_bytes(payload)
    dest = tmp_path / "hub" / "checkpoints"
    lines = []
    path = weights.fetch_file(url + good, dest, log=lines.append)
    assert path == dest / good and path.read_bytes() == payload
    assert any("checked, saved to" in line for line in lines), lines
    assert any("(100 %)" in line for line in lines), lines  # progress, as lines: the log is not a terminal
    again = []
    weights.fetch_file(url + good, dest, log=again.append)  # already there: kept, not downloaded again
    assert "already in" in again[0] and len(again) == 1

    bad = "trunk-00000000.pth"
    (root / bad).write_bytes(payload)
    with pytest.raises(UserError, match="refused, nothing was written"):
        weights.fetch_file(url + bad, dest, log=lambda _: None)
    assert sorted(p.name for p in dest.iterdir()) == [good]  # no partial file, no bad file


def test_the_command_fills_the_torch_hub_cache_and_refuses_bad_bytes(server, tmp_path, monkeypatch):
    root, url = server
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    for name in BACKBONE_FILES.values():  # the official names, with bytes that are not torchvision's
        (root / name).write_bytes(b"not the weights")
    r = CliRunner().invoke(app, ["weights", "fetch", "--mirror", url, "--net", "alex"])
    assert r.exit_code == 2 and "refused" in r.output and "Traceback" not in r.output, r.output
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    assert not cache.exists() or not any(cache.iterdir())
    # evaluation still says what to run
    reason = LpipsSet(["lpips_alex"]).reason("lpips_alex")
    assert "splatflow weights fetch" in reason and BACKBONE_FILES["alex"] in reason


def test_offline_is_one_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    r = CliRunner().invoke(app, ["weights", "fetch", "--mirror", f"http://127.0.0.1:{dead}/models"])
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert "offline" in line and "without LPIPS" in line and BACKBONE_FILES["alex"] in line
    assert not (tmp_path / "torch" / "hub" / "checkpoints" / BACKBONE_FILES["alex"]).exists()


def test_expected_hash_is_the_name_torchvision_publishes():
    assert weights.expected_hash_prefix(BACKBONE_FILES["alex"]) == "7be5be79"
    assert weights.expected_hash_prefix(BACKBONE_FILES["vgg"]) == "397923af"
    assert weights.OFFICIAL_BASE_URL + BACKBONE_FILES["vgg"] == "https://download.pytorch.org/models/vgg16-397923af.pth"
    with pytest.raises(ValueError):
        weights.expected_hash_prefix("weights.pth")
