"""`splatflow view`: the viser viewer of a tiny reconstructed scene, seen by headless Chromium.

The command is started as a user would (``splatflow view tiny --port P`` in the project), the page is loaded in
headless Chromium, and the screenshot must show the splat (the middle of the view is not uniform) and change with
the camera (a second start at another camera); SIGINT must stop the server, leaving the port free.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from splatflow.pipeline.errors import UserError
from tests import _chromium
from tests._project import REPO, project_env

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start(root: Path, *args: str) -> tuple[subprocess.Popen, str, list[str]]:
    env = project_env()
    env["PYTHONPATH"] = str(REPO)  # this checkout's splatflow (the project links it too)
    proc = subprocess.Popen([sys.executable, "-m", "splatflow.cli", "view", *args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "splatflow view: open http://" in line:
            return proc, line.split("open ")[1].split()[0], lines
    proc.kill()
    raise AssertionError("splatflow view did not print its URL:\n" + "".join(lines))


def _stop(proc: subprocess.Popen, port: int, lines: list[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("splatflow view did not stop on SIGINT") from None
    assert proc.returncode == 0, "".join(lines) + out
    assert "stopping" in out
    deadline = time.monotonic() + 10
    while _port_open(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _port_open(port), f"port {port} still serves after SIGINT"


def _middle(img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    view_w = w - 340  # viser's control panel sits on the right
    return img[h // 4: 3 * h // 4, view_w // 4: 3 * view_w // 4]


def _drawn(img: np.ndarray) -> bool:
    return float(_middle(img).astype(float).reshape(-1, 3).std(0).mean()) > 12


def test_view_serves_the_splat_and_stops_on_sigint(reconstructed, tmp_path):
    if _chromium.find() is None:
        pytest.skip(_chromium.SKIP_REASON)
    shots = []
    for extra in ([], ["--camera", "0005"]):  # the first test camera, then a training camera
        port = _free_port()
        proc, url, lines = _start(reconstructed, "tiny", "--port", str(port), *extra)
        try:
            assert url == f"http://127.0.0.1:{port}"
            # viser streams the splat over a websocket: look at the page in real time until something is drawn.
            shots.append(_chromium.screenshot_until(url, tmp_path / f"view{len(shots)}.png", _drawn,
                                                    size=(1000, 700)))
        finally:
            _stop(proc, port, lines)
    for shot in shots:
        assert _drawn(shot), "the middle of the view is uniform: no splat drawn"
    a, b = (_middle(s).astype(float) for s in shots)
    assert np.abs(a - b).mean() > 10, "two camera poses gave the same picture"


def test_view_without_a_model_names_the_stage(tmp_path):
    from splatflow.present.viewer import load_target

    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (tmp_path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    with pytest.raises(UserError, match=r"no model yet: run the train stage .*splatflow run demo"):
        load_target("demo", tmp_path)
    with pytest.raises(UserError, match=r"no prune model yet: run the prune stage .*dvc repro prune@demo"):
        load_target("demo", tmp_path, stage="prune")
    with pytest.raises(UserError, match="neither a scene"):
        load_target("nosuch", tmp_path)
    with pytest.raises(UserError, match="no such splat file"):
        load_target(str(tmp_path / "x.ply"), tmp_path)


def test_view_cli_reports_the_error_and_exits_2(tmp_path):
    env = project_env()
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, "-m", "splatflow.cli", "view", str(tmp_path / "missing.spz")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no such splat file" in p.stderr


def test_sh_colors_follow_the_view_direction():
    from splatflow.present.viewer import sh_colors

    n = 4
    s = {"means": np.zeros((n, 3), np.float32), "sh0": np.zeros((n, 1, 3), np.float32),
         "shN": np.zeros((n, 3, 3), np.float32)}
    s["shN"][:, 2, :] = 0.5  # the degree-1 basis along -x: colour depends on where the eye is on the x axis
    left = sh_colors(s, 1, np.array([-1.0, 0, 0]))
    right = sh_colors(s, 1, np.array([1.0, 0, 0]))
    flat = sh_colors(s, 0, np.array([1.0, 0, 0]))
    assert np.allclose(flat, 0.5)
    assert left.mean() != pytest.approx(right.mean())
    assert np.all((left >= 0) & (left <= 1))


def _ply_splats(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    q = rng.normal(size=(n, 4)).astype(np.float32)
    return {"means": rng.normal(size=(n, 3)).astype(np.float32), "quats": q,
            "scales": np.full((n, 3), -3.0, np.float32), "opacities": np.zeros(n, np.float32),
            "sh0": rng.normal(size=(n, 1, 3)).astype(np.float32), "shN": np.zeros((n, 3, 3), np.float32)}


def test_view_of_a_ply_with_zero_gaussians_names_the_file(tmp_path):
    from splatflow.formats.ply import write_ply
    from splatflow.present.viewer import load_target

    ply = write_ply(tmp_path / "empty.ply", _ply_splats(0))
    assert b"element vertex 0" in ply.read_bytes()  # a valid Inria PLY, just empty
    with pytest.raises(UserError, match=r"empty\.ply: holds no Gaussians.*splatflow view <scene>"):
        load_target(str(ply), tmp_path)
    # the command line: exit 2 with the message, not an IndexError traceback from the viewer
    env = project_env()
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, "-m", "splatflow.cli", "view", str(ply), "--port", str(_free_port())],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "holds no Gaussians" in p.stderr and "Traceback" not in p.stderr


def test_view_of_a_ply_with_nan_gaussians_counts_them(tmp_path):
    from splatflow.formats.ply import write_ply
    from splatflow.present.viewer import load_target

    s = _ply_splats(10)
    s["means"][2, 0] = np.nan
    s["scales"][5, 1] = np.inf
    s["opacities"][5] = np.nan  # the same Gaussian twice: counted once
    ply = write_ply(tmp_path / "bad.ply", s)
    with pytest.raises(UserError, match=r"bad\.ply: 2 of 10 Gaussians hold NaN/Inf values \(in means, scales, "
                                        r"opacities\)"):
        load_target(str(ply), tmp_path)
    s = _ply_splats(10)
    ok = load_target(str(write_ply(tmp_path / "ok.ply", s)), tmp_path)  # a finite model loads unchanged
    assert len(ok.splats["means"]) == 10 and np.allclose(ok.splats["means"], s["means"])
