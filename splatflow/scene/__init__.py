"""Scenes: image ingest, the synthetic generator, COLMAP SfM, ground-truth cameras, train/test split, and the
``load_scene`` loader that training and evaluation read (docs/CONTRACTS.md).

Submodules are imported explicitly (``from splatflow.scene.sfm import run_sfm``); nothing heavy loads here.
"""
