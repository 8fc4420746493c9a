"""Pruning inside training (train.prune_during): cut steps, kept fractions, the early stop (its model surgery:
tests/test_state.py), resume, and the prune stage's verify-and-copy on such a model.

The scene is the synthetic room at 96x72 with its true cameras (as tests/test_train.py), so no SfM is needed.
"""

import json
import math
from dataclasses import replace

import pytest
import torch

from splatflow.pipeline.config import ConfigError, PruneDuringConfig, TrainConfig, params_from_dict
from splatflow.pipeline.errors import UserError
from splatflow.gaussians.model import SPLAT_KEYS, load_checkpoint
from splatflow.render import configure_threads
from splatflow.train import Trainer
from splatflow.train import prune_during as pd


# --------------------------------------------------------------------------------------------- pure policy


def test_cut_steps_evenly_spaced_between_start_and_end():
    cfg = PruneDuringConfig(enabled=True, start_fraction=0.6, end_fraction=0.8, phases=3)
    assert pd.cut_steps(cfg, 4000) == [2400, 2800, 3200]
    assert pd.cut_steps(replace(cfg, phases=1), 4000) == [2400]
    assert pd.cut_steps(replace(cfg, phases=5, end_fraction=0.9), 1000) == [600, 675, 750, 825, 900]


def test_judge_steps_one_interval_after_each_cut():
    cfg = PruneDuringConfig(enabled=True, start_fraction=0.6, end_fraction=0.75, phases=3)
    assert pd.cut_steps(cfg, 4000) == [2400, 2700, 3000]
    assert pd.judge_steps(cfg, 4000) == [2700, 3000, 3300]
    assert pd.judge_steps(replace(cfg, phases=1), 4000) == [3200]  # half the remaining steps
    assert pd.judge_steps(replace(cfg, end_fraction=0.95), 1000) == [775, 950, 1000]  # never past max_steps


def test_cut_steps_refuse_phases_that_do_not_fit():
    cfg = PruneDuringConfig(enabled=True, start_fraction=0.6, end_fraction=0.61, phases=5)
    with pytest.raises(UserError, match="train.prune_during"):
        pd.cut_steps(cfg, 100)  # 60, 60.25, ... round onto the same steps


def test_keep_fractions_geometric_down_to_keep_final():
    fr = pd.keep_fractions(PruneDuringConfig(phases=3, keep_final=0.1))
    assert fr == pytest.approx([0.1 ** (1 / 3), 0.1 ** (2 / 3), 0.1])
    assert all(a > b for a, b in zip(fr, fr[1:]))
    assert pd.keep_fractions(PruneDuringConfig(phases=1, keep_final=0.25)) == [0.25]


def test_sub_cut_sizes_end_at_the_target():
    assert pd.sub_cut_sizes(1000, 100, 1) == [100]
    sizes = pd.sub_cut_sizes(1000, 100, 4)
    assert sizes[-1] == 100 and all(a > b for a, b in zip([1000] + sizes, sizes))
    assert sizes[1] == round(1000 * 0.1 ** 0.5)


def test_acceptance_threshold():
    assert pd.accepted(28.0, 30.0, 2.0)
    assert not pd.accepted(27.99, 30.0, 2.0)
    assert not pd.accepted(29.9, 30.0, 0.0)


def test_recovery_lr_boost_falls_from_each_cut_to_the_next():
    cfg = PruneDuringConfig(enabled=True, start_fraction=0.6, end_fraction=0.75, phases=3, recovery_lr_boost=5.0)
    pol = pd.PruneDuring.from_config(cfg, 4000)  # cuts at 2400, 2700, 3000
    assert pol.lr_factor(2500) == 1.0  # no cut made yet
    pol.done = 1
    assert pol.lr_factor(2399) == 1.0 and pol.lr_factor(2400) == pytest.approx(5.0)
    assert pol.lr_factor(2550) == pytest.approx(3.0) and pol.lr_factor(2700) == 1.0
    pol.done = 3  # after the last cut the boost falls until the end of training
    assert pol.lr_factor(3000) == pytest.approx(5.0) and pol.lr_factor(3500) == pytest.approx(3.0)
    pol.stop_reason = "phase 3 undone"
    assert pol.lr_factor(3000) == 1.0  # a restored model trains on the schedule's rate
    assert pd.PruneDuring.from_config(replace(cfg, recovery_lr_boost=1.0), 4000).lr_factor(2400) == 1.0
    with pytest.raises(ConfigError, match="recovery_lr_boost"):
        PruneDuringConfig(recovery_lr_boost=0.5)


def test_config_refuses_cuts_during_densification():
    raw = {"train": {"prune_during": {"enabled": True, "start_fraction": 0.5},
                     "densify": {"refine_stop_fraction": 0.6}}}
    with pytest.raises(ConfigError, match="train.prune_during.start_fraction"):
        params_from_dict(raw)
    with pytest.raises(ConfigError, match="train.prune_during.keep_final"):
        params_from_dict({"train": {"prune_during": {"keep_final": 1.0}}})
    with pytest.raises(ConfigError, match="train.prune_during.end_fraction"):
        params_from_dict({"train": {"prune_during": {"start_fraction": 0.8, "end_fraction": 0.7}}})


# --------------------------------------------------------------------------------------------- in training


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    from splatflow.scene.dataset import load_scene
    from splatflow.scene.synthetic import write_scene

    configure_threads(2)
    d = tmp_path_factory.mktemp("tiny_scene")
    write_scene(d, progress=False, n_views=10, width=96, height=72, arc_deg=60, n_points=3000, supersample=1)
    names = sorted(p.name for p in (d / "images").iterdir())
    (d / "split.json").write_text(json.dumps({"train": [n for i, n in enumerate(names) if i not in (3, 7)],
                                              "test": [names[3], names[7]], "rule": "interior"}))
    return load_scene(d, d / "split.json")


def _cfg(max_steps=200, **pdkw) -> TrainConfig:
    cfg = TrainConfig(max_steps=max_steps, backend="cpu", progress=False, sh_degree_interval=50)
    pdc = PruneDuringConfig(enabled=True, start_fraction=0.6, end_fraction=0.8, phases=3, keep_final=0.2,
                            score_rounds=2, score_views=4, max_psnr_drop_db=50.0)
    return replace(cfg, densify=replace(cfg.densify, refine_every=25, reset_every=0),
                   early_stop=replace(cfg.early_stop, eval_every=50, val_views=2),
                   prune_during=replace(pdc, **pdkw))


def test_training_cuts_at_the_scheduled_steps_to_the_kept_fractions(scene):
    counts = {}
    tr = Trainer(scene, _cfg(), seed=0)
    orig = tr.pruner.after_step

    def spy(gs, step, ctx):
        counts[step] = gs.params["means"].shape[0]
        orig(gs, step, ctx)

    tr.pruner.after_step = spy
    res = tr.run()
    rep = res.prune_during
    assert rep["cut_steps"] == [120, 140, 160]
    n_ref = rep["gaussians_before"]
    assert n_ref == counts[120]  # the count at the first cut
    fr = pd.keep_fractions(tr.cfg.prune_during)
    assert [r["gaussians"] for r in rep["phases"]] == [round(f * n_ref) for f in fr]
    assert [r["step"] for r in rep["phases"]] == [120, 140, 160]
    assert counts[121] == rep["phases"][0]["gaussians"] and counts[141] == rep["phases"][1]["gaussians"]
    assert all(r["accepted"] for r in rep["phases"]) and not rep["stopped_early"]
    assert res.splats["means"].shape[0] == round(0.2 * n_ref) == rep["gaussians_after"]
    assert res.steps == 200 and math.isfinite(res.val_psnr)


def test_early_stop_restores_the_model_before_the_rejected_cut(scene):
    # the first phase keeps 1% of the Gaussians: no recovery brings that within 1 dB, so it is undone and the
    # second cut is never made
    res = Trainer(scene, _cfg(phases=2, keep_final=1e-4, max_psnr_drop_db=1.0), seed=0).run()
    rep = res.prune_during
    assert rep["stopped_early"] and len(rep["phases"]) == 1 and rep["phases"][0]["accepted"] is False
    assert rep["phases"][0]["judged_at_step"] == 160 and res.steps == 200  # the restored model trained on
    assert "restored" in rep["stop_reason"]
    assert res.splats["means"].shape[0] == rep["gaussians_before"] == rep["gaussians_after"]


def test_resume_mid_pruning_matches_an_uninterrupted_run(scene, tmp_path):
    full = Trainer(scene, _cfg(), seed=0).run()
    ck = tmp_path / "ckpt.pt"
    first = Trainer(scene, _cfg(), seed=0, ckpt_path=ck, stop_after=130).run()
    assert first.steps == 130
    saved = load_checkpoint(ck)["prune_during"]
    assert saved["done"] == 1 and saved["snap"] is not None  # the first phase is not judged yet
    rest = Trainer(scene, _cfg(), seed=0, ckpt_path=ck).run()
    assert rest.resumed_from == 130
    assert [r["gaussians"] for r in rest.prune_during["phases"]] == \
        [r["gaussians"] for r in full.prune_during["phases"]]
    assert rest.splats["means"].shape == full.splats["means"].shape


def test_prune_stage_verifies_and_copies_a_model_pruned_in_training(scene, tmp_path):
    from splatflow.pipeline.config import PruneConfig
    from splatflow.compress.prune import run_prune

    ck = tmp_path / "train.pt"
    res = Trainer(scene, _cfg(), seed=0, ckpt_path=ck).run()
    m = run_prune(PruneConfig(backend="cpu", progress=False, val_views=2), _cfg(), train_ckpt=ck,
                  out_ckpt=tmp_path / "prune.pt", scene=scene)
    n = res.splats["means"].shape[0]
    assert m["gaussians_after"] == n and m["gaussians_before"] == res.prune_during["gaussians_before"]
    assert "pruned during training" in m["stop_reason"] and len(m["phases"]) == 3
    out = load_checkpoint(tmp_path / "prune.pt")["splats"]
    assert all(torch.equal(out[k], res.splats[k]) for k in SPLAT_KEYS)


def test_no_pruner_when_off_and_none_in_finetune(scene):
    # off by default (params.yaml's train.prune_during.enabled, which the dataclass default equals): on real
    # captures its cuts cost 1-2.5 dB; the prune stage prunes the trained model instead
    assert not TrainConfig().prune_during.enabled
    assert Trainer(scene, replace(_cfg(), prune_during=TrainConfig().prune_during), seed=0).pruner is None
    assert Trainer(scene, replace(_cfg(), prune_during=PruneDuringConfig(enabled=False)), seed=0).pruner is None
    assert Trainer(scene, _cfg(), seed=0, densify=False).pruner is None  # recovery fine-tunes never cut


@pytest.mark.parametrize("keep_final, tol", [(0.2, 50.0), (1e-4, 1.0)])  # all phases kept / the first one undone
def test_cuts_and_undo_allocate_only_on_the_run_device(scene, keep_final, tol):
    # any tensor made without an explicit device lands on `meta` and cannot mix with the run's CPU tensors
    torch.set_default_device("meta")
    try:
        res = Trainer(scene, _cfg(max_steps=100, phases=2, keep_final=keep_final, max_psnr_drop_db=tol),
                      seed=0).run()
    finally:
        torch.set_default_device(None)
    assert all(v.device.type == "cpu" for v in res.splats.values())
    assert res.prune_during["cuts"] >= 1 and res.prune_during["stopped_early"] == (tol == 1.0)
