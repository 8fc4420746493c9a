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


def test_cached_needs_every_kernel_of_the_list(tmp_path):
    assert not P.cached(P.LOSS_KERNELS, tmp_path)  # an empty cache
    _touch_index(tmp_path, P.LOSS_KERNELS[:1])
    assert not P.cached(P.LOSS_KERNELS, tmp_path)  # one of two
    _touch_index(tmp_path, P.LOSS_KERNELS)
    assert P.cached(P.LOSS_KERNELS, tmp_path)
    assert not P.cached(P.STEP_KERNELS, tmp_path)


class _FakeHelper:
    def __init__(self, args, **kwargs):
        self.code = args[-1]  # the `python -c` program

    def wait(self):
        return 0

    def poll(self):
        return 0


def test_helpers_compile_only_when_the_cache_lacks_kernels(tmp_path, monkeypatch):
    """Nothing runs when every kernel is cached or numba keeps its own default cache; otherwise the kernels compile
    in helper processes, never in the training process (kernels it compiled itself computed slightly different
    gradients from the cached ones, so a first run differed from its reruns): two at once on two threads, one
    doing both halves on one thread."""
    spawned = []
    monkeypatch.setattr(P.subprocess, "Popen", lambda *a, **k: spawned.append(_FakeHelper(*a, **k)) or spawned[-1])
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert P.precompile(2) is not None and len(spawned) == 2
    assert "compile_loss_kernels()" in spawned[0].code and "compile_step_kernels()" in spawned[1].code
    spawned.clear()
    assert P.precompile(1) is not None and len(spawned) == 1
    assert "compile_loss_kernels()" in spawned[0].code and "compile_step_kernels()" in spawned[0].code
    spawned.clear()
    _touch_index(tmp_path, P.LOSS_KERNELS + P.STEP_KERNELS)
    assert P.precompile(2) is None and P.precompile(1) is None  # all cached
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert P.precompile(2) is None  # numba's default cache location: left to numba
    assert spawned == []


def test_the_training_kernels_are_the_ones_a_cpu_step_compiles():
    """Every kernel named in the lists exists in the modules (a renamed kernel would make the check always false,
    and every run would start a compile process for nothing)."""
    import importlib

    for name in P.LOSS_KERNELS + P.STEP_KERNELS:
        module, func = name.split(".")
        assert hasattr(importlib.import_module(f"splatflow.render.{module}"), func), name


def test_a_cpu_run_compiles_first_and_reports_the_seconds(monkeypatch, tmp_path):
    from splatflow.config import TrainConfig
    from splatflow.scene.dataset import load_scene
    from splatflow.train import Trainer
    from tests._tiny import write_tiny_scene

    calls = []
    monkeypatch.setattr(P, "precompile", lambda threads: calls.append(threads) or 12.5)
    d = write_tiny_scene(tmp_path / "s", width=32, height=24, n_points=200)
    res = Trainer(load_scene(d, d / "split.json"), TrainConfig(max_steps=3, backend="cpu", progress=False)).run()
    assert len(calls) == 1 and calls[0] >= 1  # once, before the first step, with the run's thread count
    assert res.compile_seconds == 12.5 and res.steps == 3
