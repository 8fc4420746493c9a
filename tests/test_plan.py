"""The training plan (``train.max_steps: auto``, ``train.densify.max_gaussians: auto``): sized from the scene and
the device, scaled by ``train.quality``, pinned by numbers, recorded so a rerun is exact."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from splatflow.pipeline.config import ConfigError, TrainConfig, load_params, params_from_dict
from splatflow.train import Trainer, plan
from splatflow.train.strategies import BudgetedDefaultStrategy
from tests._tiny import write_tiny_scene

ROOT = Path(__file__).resolve().parents[1]
ROOM = [800 * 600] * 32  # the benchmark room the CPU defaults were tuned on
BONSAI = [800 * 533] * 220  # a 252-photo 360-degree capture (every 8th view held out)


def test_the_defaults_are_auto_and_the_repository_params_agree():
    cfg = TrainConfig()
    assert cfg.max_steps == "auto" and cfg.densify.max_gaussians == "auto" and cfg.quality == "standard"
    repo = load_params(ROOT / "params.yaml").train
    assert (repo.max_steps, repo.densify.max_gaussians, repo.quality) == ("auto", "auto", "standard")


def test_cpu_plan_keeps_the_room_plan_and_grows_with_content_up_to_its_ceiling():
    cfg = TrainConfig()
    room = plan.resolve(cfg, None, "cpu", pixels=ROOM)
    assert (room.max_steps, room.max_gaussians) == (6600, 120_000)
    tiny = plan.resolve(cfg, None, "cpu", pixels=[96 * 72] * 8)
    assert (tiny.max_steps, tiny.max_gaussians) == (6600, 120_000)  # the floor: small scenes keep the room's plan
    big = plan.resolve(cfg, None, "cpu", pixels=BONSAI)
    assert 6600 < big.max_steps <= 12_000 and 120_000 < big.max_gaussians <= 400_000
    huge = plan.resolve(cfg, None, "cpu", pixels=[4000 * 3000] * 1000)
    assert (huge.max_steps, huge.max_gaussians) == (12_000, 400_000)  # the 2-core ceiling
    sizes = [plan.resolve(cfg, None, "cpu", pixels=[800 * 533] * n) for n in (10, 40, 80, 160, 320)]
    assert [p.max_steps for p in sizes] == sorted(p.max_steps for p in sizes)
    assert [p.max_gaussians for p in sizes] == sorted(p.max_gaussians for p in sizes)
    # the torch CPU backend is a CPU plan too
    assert plan.resolve(cfg, None, "torch", pixels=BONSAI).max_steps == big.max_steps


def test_steps_follow_the_training_views_and_the_budget_the_pixels():
    """Views set the steps (each needs its visits, whatever its size: 84 phone photos at 1000x750 keep the room's
    6,600 where the square root of their content gave 13,200 that bought nothing on the test views), pixels the
    budget; past REFERENCE_VIEWS the steps grow in proportion to the views."""
    cfg = TrainConfig()
    plush = plan.resolve(cfg, None, "cpu", pixels=[1000 * 750] * 84)
    assert plush.max_steps == 6600 and plush.max_gaussians > 120_000
    small, large = (plan.resolve(cfg, None, "cpu", pixels=[side * side] * 150) for side in (400, 1600))
    assert small.max_steps == large.max_steps == 10_300  # 150 / 96 x 6,600
    assert small.max_gaussians < large.max_gaussians
    at, past, top = (plan.resolve(cfg, None, "cpu", pixels=[800 * 533] * n) for n in (plan.REFERENCE_VIEWS, 144, 220))
    assert (at.max_steps, past.max_steps, top.max_steps) == (6600, 9900, 12_000)  # 1.5x; a 220-view capture: the ceiling


def test_gpu_plan_is_larger_and_its_budget_fits_the_card():
    cfg = TrainConfig()
    cpu = plan.resolve(cfg, None, "cpu", pixels=BONSAI)
    gpu = plan.resolve(cfg, None, "cuda", 80.0, pixels=BONSAI)
    assert gpu.max_steps == 30_000 and gpu.max_gaussians > cpu.max_gaussians
    small_card = plan.resolve(cfg, None, "cuda", 4.0, pixels=BONSAI)  # a 4 GiB card holds ~1M
    assert small_card.max_gaussians == plan.GAUSSIANS_PER_GIB * 4 < gpu.max_gaussians
    assert gpu.record()["gpu_memory_gib"] == 80.0 and cpu.record()["gpu_memory_gib"] is None


def test_quality_is_one_knob_that_orders_steps_and_budget():
    for kind in ("cpu", "cuda"):
        plans = [plan.resolve(TrainConfig(quality=q), None, kind, 80.0, pixels=BONSAI)
                 for q in ("draft", "standard", "max")]
        assert plans[0].max_steps < plans[1].max_steps < plans[2].max_steps
        assert plans[0].max_gaussians < plans[1].max_gaussians < plans[2].max_gaussians
    with pytest.raises(ConfigError, match="train.quality"):
        params_from_dict({"train": {"quality": "best"}})


def test_numbers_pin_the_plan_and_bad_values_name_the_key():
    cfg = TrainConfig(max_steps=1234, coarse_to_fine=False, early_stop=replace(TrainConfig().early_stop, enabled=True),
                      densify=replace(TrainConfig().densify, max_gaussians=5678))
    p = plan.resolve(cfg, None, "cuda", 80.0, pixels=BONSAI)
    assert (p.max_steps, p.max_gaussians, p.steps_auto, p.gaussians_auto) == (1234, 5678, False, False)
    assert "as set in params.yaml" in p.describe()
    half = plan.resolve(TrainConfig(max_steps=1234), None, "cpu", pixels=BONSAI)
    assert half.max_steps == 1234 and half.gaussians_auto and "train.densify.max_gaussians:" in half.describe()
    for key, bad in (("max_steps", "many"), ("max_steps", 0)):
        with pytest.raises(ConfigError, match=f"train.{key}"):
            params_from_dict({"train": {key: bad}})
    with pytest.raises(ConfigError, match="train.densify.max_gaussians"):
        params_from_dict({"train": {"densify": {"max_gaussians": "lots"}}})


def test_the_same_scene_and_device_give_the_same_plan_and_pasting_it_pins_it():
    """A rerun resolves the same numbers (no timing or randomness goes in), and the lines the plan prints,
    pasted into params.yaml, give the identical configuration."""
    a = plan.resolve(TrainConfig(), None, "cpu", pixels=BONSAI)
    b = plan.resolve(TrainConfig(), None, "cpu", pixels=list(BONSAI))
    assert a == b
    pinned = params_from_dict({"train": {"max_steps": a.max_steps,
                                         "densify": {"max_gaussians": a.max_gaussians}}}).train
    assert plan.apply(TrainConfig(), a) == plan.apply(pinned, plan.resolve(pinned, None, "cpu", pixels=BONSAI))


def test_the_trainer_trains_with_the_resolved_plan(tmp_path):
    """The trainer's config, its densification cap and its result carry the plan's numbers."""
    from splatflow.scene.dataset import load_scene

    d = write_tiny_scene(tmp_path / "tiny")
    scene = load_scene(d, d / "split.json")
    cfg = TrainConfig(backend="cpu", progress=False)
    tr = Trainer(scene, cfg, seed=0)
    expected = plan.resolve(cfg, scene.train_views, "cpu")
    assert tr.plan == expected and tr.cfg.max_steps == expected.max_steps == 6600
    assert tr.cfg.densify.max_gaussians == expected.max_gaussians
    assert isinstance(tr.strategy, BudgetedDefaultStrategy)
    assert tr.strategy.cap == min(expected.max_gaussians, int(cfg.densify.budget_multiplier * tr.initial_count))
    short = Trainer(scene, replace(cfg, max_steps=20, early_stop=replace(cfg.early_stop, enabled=False)), seed=0)
    res = short.run()
    assert res.steps == 20 and res.plan["max_steps"] == 20 and res.plan["steps_auto"] == 0
    assert res.plan["gaussians_auto"] == 1 and res.plan["max_gaussians"] == expected.max_gaussians
    assert res.plan["train_views"] == len(scene.train_views)


def test_a_cuda_run_reads_its_card_memory_for_the_plan(monkeypatch):
    """On CUDA the trainer sizes the budget by the card's memory (the device properties, read once); no CUDA call
    is made for a CPU run."""
    import types

    import torch

    from splatflow.pipeline.device import gpu_memory_gib as _gpu_memory_gib

    calls = []

    def props(dev):
        calls.append(dev)
        return types.SimpleNamespace(total_memory=16 * 2**30, name="a 16 GiB card")

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert _gpu_memory_gib(torch.device("cpu")) is None and not calls
    gib = _gpu_memory_gib(torch.device("cuda", 0))
    assert gib == 16.0 and len(calls) == 1
    p = plan.resolve(TrainConfig(), None, "cuda", gib, pixels=BONSAI)
    assert p.max_gaussians == min(plan.resolve(TrainConfig(), None, "cuda", 1000.0, pixels=BONSAI).max_gaussians,
                                  plan.GAUSSIANS_PER_GIB * 16)


def test_coarse_to_fine_is_the_cpus_and_whole_images_from_the_start_the_gpus():
    """auto: the CPU keeps the resolution and blur schedules (cheap early steps); CUDA trains whole resolution,
    unblurred, from the first step (a GPU step costs about the same at any size). A pinned value holds on either."""
    cpu = plan.apply(TrainConfig(), plan.resolve(TrainConfig(), None, "cpu", pixels=BONSAI))
    assert cpu.coarse_to_fine is True
    assert cpu.resolution == TrainConfig().resolution and cpu.blur == TrainConfig().blur
    gpu_plan = plan.resolve(TrainConfig(), None, "cuda", 80.0, pixels=BONSAI)
    gpu = plan.apply(TrainConfig(), gpu_plan)
    assert gpu.coarse_to_fine is False
    assert [(p.factor, p.start_fraction) for p in gpu.resolution] == [(1.0, 0.0)]
    assert gpu.blur.sigma_start_px == 0.0
    assert gpu_plan.record()["coarse_to_fine"] == 0 and "train.coarse_to_fine: false" in gpu_plan.describe()
    pinned = TrainConfig(coarse_to_fine=True)
    kept = plan.apply(pinned, plan.resolve(pinned, None, "cuda", 80.0, pixels=BONSAI))
    assert kept.resolution == TrainConfig().resolution and kept.blur == TrainConfig().blur
    with pytest.raises(ConfigError, match="train.coarse_to_fine"):
        params_from_dict({"train": {"coarse_to_fine": "sometimes"}})


def test_whole_resolution_densifies_from_step_500_and_the_strategy_gets_that_step():
    """Without coarse to fine densification begins once the SfM points have settled (500 steps, as 3DGS), not at a
    fraction of a long GPU plan; coarse to fine keeps the fraction (its second level's start); a shorter run keeps
    its earlier fraction; and the strategy the trainer builds starts at exactly that step."""
    from splatflow.train.strategies import make_strategy

    gpu_plan = plan.resolve(TrainConfig(), None, "cuda", 80.0, pixels=BONSAI)
    gpu = plan.apply(TrainConfig(), gpu_plan)
    assert gpu_plan.max_steps * TrainConfig().densify.refine_start_fraction > 500
    assert gpu_plan.refine_start_step == 500 and gpu_plan.record()["refine_start_step"] == 500
    strat = make_strategy(gpu.densify, max_steps=gpu.max_steps, initial_count=50_000)
    assert strat.refine_start_iter == 500
    cpu_plan = plan.resolve(TrainConfig(), None, "cpu", pixels=BONSAI)
    cpu = plan.apply(TrainConfig(), cpu_plan)
    assert cpu_plan.refine_start_step is None and cpu.densify == replace(TrainConfig().densify,
                                                                          max_gaussians=cpu_plan.max_gaussians)
    short = TrainConfig(max_steps=4000, coarse_to_fine=False)
    short_plan = plan.resolve(short, None, "cpu", pixels=BONSAI)
    assert short_plan.refine_start_step == 200  # 0.05 x 4000: before 500 already
    for steps in (10_001, 17_777, 23_700, 40_000):  # the step comes back exactly through the fraction
        c = plan.apply(TrainConfig(max_steps=steps, coarse_to_fine=False),
                       plan.resolve(TrainConfig(max_steps=steps, coarse_to_fine=False), None, "cpu", pixels=BONSAI))
        assert make_strategy(c.densify, max_steps=steps, initial_count=1000).refine_start_iter == 500


def test_checkpoints_are_sparser_on_a_gpu_and_a_number_pins_them():
    cpu = plan.resolve(TrainConfig(), None, "cpu", pixels=BONSAI)
    gpu = plan.resolve(TrainConfig(), None, "cuda", 80.0, pixels=BONSAI)
    assert (cpu.checkpoint_every, gpu.checkpoint_every) == (1000, 5000)
    assert plan.apply(TrainConfig(), gpu).checkpoint_every == 5000 and plan.apply(TrainConfig(), gpu).planned
    pinned = TrainConfig(checkpoint_every=250)
    assert plan.resolve(pinned, None, "cuda", 80.0, pixels=BONSAI).checkpoint_every == 250
    with pytest.raises(ConfigError, match="train.checkpoint_every"):
        params_from_dict({"train": {"checkpoint_every": "often"}})


def test_the_plateau_stop_is_the_cpus_and_the_gpu_runs_its_fixed_schedule():
    """early_stop.enabled auto: on for a CPU plan (a plateau saves minutes of costly steps), off for CUDA (the
    field's 30K steps, which a plateau on three training views cut short); a pinned value holds on either, and the
    plan records the choice with the line that pins it."""
    cpu_plan = plan.resolve(TrainConfig(), None, "cpu", pixels=BONSAI)
    gpu_plan = plan.resolve(TrainConfig(), None, "cuda", 80.0, pixels=BONSAI)
    assert plan.apply(TrainConfig(), cpu_plan).early_stop.enabled is True
    gpu = plan.apply(TrainConfig(), gpu_plan)
    assert gpu.early_stop.enabled is False and gpu.planned and not TrainConfig().planned
    assert gpu_plan.record()["early_stop"] == 0 and gpu_plan.record()["early_stop_auto"] == 1
    assert "train.early_stop.enabled: false" in gpu_plan.describe() and "no plateau stop" in gpu_plan.describe()
    pinned = TrainConfig(early_stop=replace(TrainConfig().early_stop, enabled=True))
    assert plan.apply(pinned, plan.resolve(pinned, None, "cuda", 80.0, pixels=BONSAI)).early_stop.enabled is True
    with pytest.raises(ConfigError, match="train.early_stop.enabled"):
        params_from_dict({"train": {"early_stop": {"enabled": "maybe"}}})
