"""The note an output folder holds when it has nothing else.

DVC warned "'data/S/images_2' is empty." four times per stage for every output folder left empty by design (the
``images_N`` levels of a capture that has none, the masks of a scene without masks): 36 warnings in a demo run.
Such a folder now holds only :data:`EMPTY_NOTE`, saying why, and its readers skip the note (:func:`folder_files`).
"""

from __future__ import annotations

from pathlib import Path

EMPTY_NOTE = "README.txt"


def write_empty_note(folder: str | Path, why: str) -> None:
    """Make ``folder`` an output holding only :data:`EMPTY_NOTE`, which says ``why`` it has nothing else."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EMPTY_NOTE).write_text(f"Nothing here: {why}\n(splatflow writes this note so that the folder, a DVC "
                                     "output, is not empty.)\n")


def folder_files(folder: str | Path) -> list[Path]:
    """The files of an output folder other than its :data:`EMPTY_NOTE` (none when the folder is missing)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(f for f in folder.iterdir() if f.name != EMPTY_NOTE)
