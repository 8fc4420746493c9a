"""Check that a change to the training code is a refactor: the same runs end with the same bits.

Trains the demo scene (``splatflow demo-scene``'s defaults: 36 views at 320x240 on a full orbit, its TRUE cameras,
so no SfM run varies between versions; every 8th view held out) with the demo's effective train params
(``params.yaml``'s ``base.scenes.demo.params.train``: a 40K budget, pruning during training; 300 of its 2,000
steps, so that a check takes minutes on a loaded machine) on the CPU backend, and shorter variants that take the
loop's other paths (3DGS-MCMC, the dense step, no spatial order, a run stopped mid-pruning and resumed). Writes
each run's final parameters (``<run>.pt``), its result (steps, stop reason, validation PSNRs, refine events, the
prune_during report) and its training CSV without the seconds column (``<run>.json``) to ``OUT``. ``compare``
then says, run by run, whether two such folders hold the same bits (``torch.equal`` on every tensor, equality of
the JSON but for timings).

    python bench/refactor_check.py run OUT [--work DIR] [--only demo,mcmc,...] [--code CHECKOUT]
    python bench/refactor_check.py compare OUT_A OUT_B

Run ``run`` once on the code before the change (``git worktree add --detach /tmp/base main``, then this script
with ``--code /tmp/base``) and once after, on the same machine, then ``compare``. Start it from a folder outside
both checkouts (e.g. ``cd /tmp``): the kernel precompile's helper processes import ``splatflow`` from the current
folder first. Timings are not compared: they depend on the machine's load.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("SPLATFLOW_TRACKING", "off")

ROOT = Path(__file__).resolve().parents[1]


def _code_root(argv: list[str]) -> Path:
    """The checkout whose ``splatflow`` runs: ``--code DIR`` or the one this script is in."""
    if "--code" in argv:
        return Path(argv[argv.index("--code") + 1]).resolve()
    return ROOT


sys.path.insert(0, str(_code_root(sys.argv)))

import splatflow  # noqa: E402,F401  (first: its process defaults for OpenMP and numba's cache)
import torch  # noqa: E402

# run name -> (steps, train overrides, stop_after); every run starts from seed 0
VARIANTS = {
    "demo": (300, {}, None),  # refines at step 100, cuts at 180, 202 and 225, judges at 202, 225 and 248
    "resumed": (300, {}, 190),  # stopped after the first cut, before its judgement, then resumed
    "mcmc": (120, {"densify.strategy": "mcmc", "densify.refine_every": 50, "prune_during.enabled": False}, None),
    "dense": (120, {"sparse_step": False, "densify.refine_every": 50, "prune_during.enabled": False}, None),
    "unordered": (120, {"spatial_order": False, "densify.refine_every": 50, "prune_during.enabled": False}, None),
}


def prepare(work: Path):
    """The demo scene with its true cameras and the every-8th split, written once into ``work``."""
    from splatflow.pipeline.config import SplitConfig
    from splatflow.scene.dataset import load_scene
    from splatflow.scene.split import split_names
    from splatflow.scene.synthetic import DEMO_DEFAULTS, write_scene

    if not (work / "split.json").exists():
        write_scene(work, progress=False, **DEMO_DEFAULTS)
        names = sorted(p.name for p in (work / "images").iterdir())
        (work / "split.json").write_text(json.dumps(split_names(names, SplitConfig())))
    return load_scene(work, work / "split.json")


def _override(cfg, key: str, value):
    head, _, rest = key.partition(".")
    if not rest:
        return replace(cfg, **{head: value})
    return replace(cfg, **{head: _override(getattr(cfg, head), rest, value)})


def demo_cfg(steps: int | None, overrides: dict):
    from splatflow.pipeline.config import load_params

    cfg = load_params(ROOT / "params.yaml").for_scene("demo").train
    cfg = replace(cfg, backend="cpu", progress=False, checkpoint_every=100_000)
    if steps is not None:
        cfg = replace(cfg, max_steps=steps)
    for k, v in overrides.items():
        cfg = _override(cfg, k, v)
    return cfg


def run(out: Path, work: Path, only: list[str] | None) -> None:
    from splatflow.render import configure_threads
    from splatflow.train import Trainer

    configure_threads(2)
    scene = prepare(work)
    out.mkdir(parents=True, exist_ok=True)
    for name, (steps, overrides, stop_after) in VARIANTS.items():
        if only and name not in only:
            continue
        cfg = demo_cfg(steps, overrides)
        ckpt, csv_path = out / f"{name}.ckpt.pt", out / f"{name}.csv"
        for p in (ckpt, csv_path):
            p.unlink(missing_ok=True)
        if stop_after is not None:
            Trainer(scene, cfg, seed=0, ckpt_path=ckpt, csv_path=csv_path, stop_after=stop_after).run()
        tr = Trainer(scene, cfg, seed=0, ckpt_path=ckpt, csv_path=csv_path)
        res = tr.run()
        rows = [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(csv_path))]
        record = {"steps": res.steps, "stopped": res.stopped, "sh_degree": res.sh_degree, "val_psnr": res.val_psnr,
                  "initial_psnr": res.initial_psnr, "resumed_from": res.resumed_from, "events": res.events,
                  "prune_during": res.prune_during, "gaussians": int(res.splats["means"].shape[0]), "csv": rows}
        torch.save({k: res.splats[k] for k in res.splats.keys()}, out / f"{name}.pt")
        (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        print(f"{name}: {res.steps} steps, {record['gaussians']} Gaussians, val PSNR {res.val_psnr}, "
              f"{res.train_seconds:.1f} s", flush=True)


def _untimed(obj):
    """``obj`` without its timings (keys ending in ``seconds``, e.g. a prune phase's ``score_seconds``)."""
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if not k.endswith("seconds")}
    if isinstance(obj, list):
        return [_untimed(v) for v in obj]
    return obj


def compare(a: Path, b: Path) -> int:
    bad = 0
    names = sorted(p.stem for p in a.glob("*.json"))
    if not names:
        print(f"{a}: no runs found (run `bench/refactor_check.py run {a}` first)")
        return 2
    for name in names:
        if not (b / f"{name}.json").exists():
            print(f"{name}: missing in {b}")
            bad += 1
            continue
        ja, jb = (_untimed(json.loads((d / f"{name}.json").read_text())) for d in (a, b))
        pa, pb = (torch.load(d / f"{name}.pt", weights_only=False) for d in (a, b))
        diff = [k for k in pa if k not in pb or pa[k].shape != pb[k].shape or not torch.equal(pa[k], pb[k])]
        jdiff = sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))
        same = not diff and not jdiff
        bad += not same
        print(f"{name}: {'same bits' if same else 'DIFFERENT'}"
              + (f"; tensors differ: {diff}" if diff else "") + (f"; results differ: {jdiff}" if jdiff else ""))
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the runs and write them to OUT")
    r.add_argument("out", type=Path)
    r.add_argument("--work", type=Path, default=Path("/tmp/splatflow_refactor_check"),
                   help="where the demo scene is written (kept between runs)")
    r.add_argument("--only", default="", help="comma-separated run names (default: all)")
    r.add_argument("--code", type=Path, help="the checkout whose splatflow to run (default: this one)")
    c = sub.add_parser("compare", help="compare two OUT folders bit for bit")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args.out, args.work, [s for s in args.only.split(",") if s] or None)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
