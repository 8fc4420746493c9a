"""The first-run compile on two cores (splatflow.train.precompile): when it runs and when it stays out of the way.

Its real work (about a minute of compiling into an empty numba cache) runs in CI anyway: a fresh clone's first
CPU training test finds the cache empty. These tests check the decision around it.
"""

from __future__ import annotations

from splatflow.train import precompile as P


def _touch_index(folder, names):
    d = folder / "splatflow_render"
    d.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        (d / f"{name}-{100 + i}.py311.nbi").write_bytes(b"")


def test_cached_means_precompile_finished_here_not_that_kernels_exist(tmp_path):
    """Index files of every kernel do not make a cache complete: a test or a bench may have cached the training
    variant of the rasterizer's backward and not the removal-cost variant that train.prune_during calls. Only the
    marker precompile writes after its helpers succeeded, for this machine's code target, counts."""
    assert not P.cached(tmp_path)  # an empty cache
    _touch_index(tmp_path, ("_kernels.rasterize_bwd_rgb", "_filter_kernels.ssim_fused"))
    assert not P.cached(tmp_path)  # some kernels, some variants: not known to be complete
    other = P.marker(tmp_path).with_name("precompiled-000000000000")
    other.write_text("")
    assert not P.cached(tmp_path)  # another machine's kernels in a shared cache folder
    P.marker(tmp_path).write_text("")
    assert P.cached(tmp_path)


class _FakeHelper:
    def __init__(self, args, rc=0, **kwargs):
        self.code = args[-1]  # the `python -c` program
        self.rc = rc

    def wait(self):
        return self.rc

    def poll(self):
        return self.rc


def test_helpers_compile_only_until_they_have_succeeded(tmp_path, monkeypatch):
    """The kernels compile in helper processes, never in the training process (kernels it compiled itself computed
    slightly different gradients from the cached ones, so a first run differed from its reruns): two at once on
    two threads, one doing both halves on one thread. A failed helper leaves no marker, so the next run tries
    again; once they succeed nothing runs, nor with numba's own default cache."""
    spawned, rc = [], [1]
    monkeypatch.setattr(P.subprocess, "Popen",
                        lambda *a, **k: spawned.append(_FakeHelper(*a, rc=rc[0], **k)) or spawned[-1])
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert P.precompile(1) is not None and len(spawned) == 1
    assert "compile_loss_kernels()" in spawned[0].code and "compile_step_kernels()" in spawned[0].code
    assert not P.cached()  # it failed: no marker
    spawned.clear()
    rc[0] = 0
    assert P.precompile(2) is not None and len(spawned) == 2
    assert "compile_loss_kernels()" in spawned[0].code and "compile_step_kernels()" in spawned[1].code
    assert P.cached()
    spawned.clear()
    assert P.precompile(2) is None and P.precompile(1) is None  # done
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert P.precompile(2) is None  # numba's default cache location: left to numba
    assert spawned == []


_TRAIN_AND_COUNT = """
import json, sys
from dataclasses import replace
from pathlib import Path
import numba
from splatflow.pipeline.config import PruneDuringConfig, TrainConfig
from splatflow.scene.dataset import load_scene
from splatflow.train import Trainer
from tests._tiny import write_tiny_scene

d = write_tiny_scene(Path(sys.argv[1]), width=96, height=72, n_points=1500)
cfg = TrainConfig(max_steps=60, backend="cpu", progress=False, patch_max_pixels=2048, sh_degree_interval=20)
cfg = replace(cfg, densify=replace(cfg.densify, refine_every=10, reset_every=0),
              blur=replace(cfg.blur, sigma_start_px=2.0, end_fraction=0.5),
              early_stop=replace(cfg.early_stop, eval_every=20, val_views=2),
              prune_during=PruneDuringConfig(enabled=True, start_fraction=0.6, end_fraction=0.8, phases=2,
                                             keep_final=0.3, score_rounds=2, score_views=2, max_psnr_drop_db=50.0))
res = Trainer(load_scene(d, d / "split.json"), cfg, seed=0).run()
misses = {}
for mod in [m for name, m in list(sys.modules.items()) if name.startswith("splatflow.render.")]:
    for name, obj in vars(mod).items():
        if isinstance(obj, numba.core.registry.CPUDispatcher) and sum(obj.stats.cache_misses.values()):
            misses[f"{mod.__name__}.{name}"] = [str(k) for k in obj.stats.cache_misses]
print(json.dumps({"misses": misses, "cuts": len(res.prune_during["phases"]), "steps": res.steps}))
"""


def test_a_training_run_after_precompile_compiles_nothing_itself(tmp_path):
    """The guarantee precompile exists for: a CPU training run (windows, the training blur, every SH degree, the
    sparse step, and train.prune_during's removal-cost cuts) finds every kernel variant it calls in numba's cache,
    so a first run computes what its reruns compute. The run goes in its own process, as a user's would (this
    test process compiles float64 and other variants for the gradient checks); when the cache is not yet filled,
    the run's own precompile fills it first."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _TRAIN_AND_COUNT, str(tmp_path / "scene")], cwd=root,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["steps"] == 60 and res["cuts"] == 2  # the removal-cost scoring ran
    assert res["misses"] == {}, f"compiled in the training process: {res['misses']}"


def test_a_cpu_run_compiles_first_and_reports_the_seconds(monkeypatch, tmp_path):
    from splatflow.pipeline.config import PruneDuringConfig, TrainConfig
    from splatflow.scene.dataset import load_scene
    from splatflow.train import Trainer
    from tests._tiny import write_tiny_scene

    calls = []
    monkeypatch.setattr(P, "precompile", lambda threads: calls.append(threads) or 12.5)
    d = write_tiny_scene(tmp_path / "s", width=32, height=24, n_points=200)
    cfg = TrainConfig(max_steps=3, backend="cpu", progress=False, prune_during=PruneDuringConfig(enabled=False))
    res = Trainer(load_scene(d, d / "split.json"), cfg).run()
    assert len(calls) == 1 and calls[0] >= 1  # once, before the first step, with the run's thread count
    assert res.compile_seconds == 12.5 and res.steps == 3
