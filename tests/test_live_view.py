"""The live view (`splatflow run SCENE --view`): the splat being trained, served in the viewer, seen by headless
Chromium, and a watched run that ends with exactly the parameters of the same run unwatched."""

from __future__ import annotations

import socket
from dataclasses import replace

import numpy as np
import pytest
import torch

from splatflow.pipeline.config import TrainConfig
from splatflow.pipeline.errors import UserError
from splatflow.present.live_view import LiveView, parse_address, parse_every
from splatflow.gaussians.model import SPLAT_KEYS
from splatflow.present.report import CameraInfo
from splatflow.train import train
from tests import _chromium
from tests._tiny import write_tiny_scene


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cameras(scene) -> list[CameraInfo]:
    return [CameraInfo(v.name, split, np.asarray(v.world_to_cam, np.float64), int(v.width), int(v.height),
                       float(v.K[1, 1]), float(v.K[0, 0]))
            for split, views in (("test", scene.test_views), ("train", scene.train_views)) for v in views]


def _drawn(img: np.ndarray) -> bool:
    h, w = img.shape[:2]
    view_w = w - 340  # viser's control panel sits on the right
    middle = img[h // 4: 3 * h // 4, view_w // 4: 3 * view_w // 4]
    return float(middle.astype(float).reshape(-1, 3).std(0).mean()) > 12


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from splatflow.scene.dataset import load_scene

    d = write_tiny_scene(tmp_path_factory.mktemp("live_scene"))
    return load_scene(d, d / "split.json")


def test_a_watched_run_serves_its_splat_and_ends_with_the_same_parameters(scene, tmp_path):
    if _chromium.find() is None:
        pytest.skip(_chromium.SKIP_REASON)
    steps = 120
    cfg = TrainConfig(max_steps=steps, backend="cpu", progress=False, sh_degree_interval=30, log_every=10)
    # densification and the sparse step (deferred rows) on: the live view must read without flushing them
    cfg = replace(cfg, densify=replace(cfg.densify, refine_every=25, reset_every=0),
                  early_stop=replace(cfg.early_stop, enabled=False))
    plain = train(scene, cfg, seed=0)

    said: list[str] = []
    live = LiveView(_cameras(scene), title="tiny", port=_free_port(), every_s=0.0, log=said.append)
    try:
        watched = train(scene, cfg, seed=0, watchers=[live])  # every_s=0: a refresh whenever the last one is shown
        assert live.wait_idle(60), "the live view did not show the last step"
        assert live.refreshes >= 2 and live.shown_step == steps, (live.refreshes, live.shown_step)
        assert any(line.startswith(f"live view: open {live.url}") for line in said), said
        for k in SPLAT_KEYS:
            assert torch.equal(plain.splats[k], watched.splats[k]), f"{k} differs with the live view on"
        assert [e for e in plain.events if "gaussians" in e], "no refine: the comparison would miss its rows"

        shot = _chromium.screenshot_until(live.url, tmp_path / "live.png", _drawn, size=(1000, 700))
        assert _drawn(shot), "the middle of the live view is uniform: no splat drawn"
        dom = _chromium.dump_dom_until(live.url, lambda d: f"step {steps:,}" in d, size=(1000, 700))
        assert f"tiny: training, step {steps:,} / {steps:,}, PSNR" in dom
        assert f"{plain.splats.n:,} Gaussians" in dom
    finally:
        live.close()


def test_live_view_settings_name_the_bad_value():
    assert parse_address("9000") == ("127.0.0.1", 9000)
    assert parse_address("0.0.0.0:9001") == ("0.0.0.0", 9001)
    with pytest.raises(UserError, match="--view-port='x'"):
        parse_address("x", "--view-port")
    with pytest.raises(UserError, match="SPLATFLOW_LIVE_VIEW_EVERY_S='-1'"):
        parse_every("-1")


def test_wait_idle_waits_for_the_last_step_handed_over_while_another_was_shown():
    """The last step's model, handed over while the one before was being shown, is shown before ``wait_idle``
    returns: the viewer's thread is busy with it from the moment it takes it (the thread's end of the earlier job
    cleared the flag the training side had set)."""
    import threading
    from types import SimpleNamespace

    started = {1: threading.Event(), 2: threading.Event()}
    release = {1: threading.Event(), 2: threading.Event()}

    class Recording(LiveView):
        def _show(self, snapshot, step, max_steps, psnr, degree):  # no server: record the step, when released
            started[step].set()
            assert release[step].wait(10)
            self.shown_step = step
            self.refreshes += 1

    def trainer(step: int):
        state = SimpleNamespace(splats=lambda: SimpleNamespace(stored=lambda: {"step": step}))
        return SimpleNamespace(step=step, cfg=SimpleNamespace(max_steps=2), state=state,
                               sched=SimpleNamespace(sh=SimpleNamespace(degree=lambda s: 0)))

    live = Recording([], title="t", every_s=0.0, log=lambda _: None)
    try:
        live.after_step(trainer(1), {})
        assert started[1].wait(10)
        live.after_step(trainer(2), {})  # the last step: always handed over, here while step 1 is being shown
        release[1].set()
        assert started[2].wait(10)  # the thread took step 2; it is being shown
        done = threading.Event()
        threading.Thread(target=lambda: (live.wait_idle(10), done.set()), daemon=True).start()
        assert not done.wait(0.5), "wait_idle returned while the last step was still being shown"
        release[2].set()
        assert done.wait(10) and live.shown_step == 2 and live.refreshes == 2
    finally:
        release[1].set(), release[2].set()
        live.close()
