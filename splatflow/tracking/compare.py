"""Runs side by side: finding runs from what a user types, the headline numbers first, and the params that differ.

A user names runs the way ``splatflow runs list`` prints them (a short id), by a longer or full id, or by run name;
:func:`resolve_run_ids` turns each into one run id or a :class:`~splatflow.pipeline.errors.UserError` that says what
matched. :func:`compare` orders what it returns by what a reader wants first: the headline metrics
(:data:`HEADLINE_METRICS`) with their deltas, then the params whose values truly differ (the same number or list written
two ways is equal), then the other final metrics. Provenance (commit, status, scene) is :func:`describe_run`'s, not a
table row.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from splatflow.pipeline.errors import UserError
from splatflow.tracking.store import HEADLINE_METRICS, client, tracking_uri

#: How many characters of a run id ``splatflow runs list`` prints (any unique prefix is accepted).
SHORT_ID = 8

_HEX = re.compile(r"[0-9a-f]+")


def short_id(run_id: str) -> str:
    return run_id[:SHORT_ID]


def resolve_run_ids(refs: list[str], uri: str | None = None) -> list[str]:
    """The run id each of ``refs`` names: a full id, a unique prefix of one (what ``runs list`` prints), or an exact
    run name. Anything else is a ``UserError`` naming the reference, what it matched and where to look."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():  # not create an empty store
        raise UserError(f"no MLflow runs yet: {uri[len('sqlite:///'):]} does not exist (run the pipeline first: "
                        "`splatflow run SCENE`; or set MLFLOW_TRACKING_URI to the store your runs went to)")
    cl = client(uri)
    try:
        exps = [e.experiment_id for e in cl.search_experiments()]
        runs = cl.search_runs(exps, max_results=50000) if exps else []
    except Exception as e:  # noqa: BLE001 - an unreadable store: say which one
        raise UserError(f"cannot read MLflow runs from {uri}: {type(e).__name__}: {e} (set MLFLOW_TRACKING_URI to "
                        "the store your runs went to)") from None
    out = []
    for ref in refs:
        key = ref.strip()
        matches = []
        if key and _HEX.fullmatch(key.lower()):
            matches = [r for r in runs if r.info.run_id.startswith(key.lower())]
        if not matches:
            matches = [r for r in runs if r.info.run_name == key]
        if not matches:
            raise UserError(f"no MLflow run matches {ref!r} in {uri}: give a run id (or a unique start of one) or a "
                            "run name that `splatflow runs list` prints")
        ids = sorted({r.info.run_id for r in matches})
        if len(ids) > 1:
            shown = ", ".join(short_id(i) for i in ids[:6]) + (", ..." if len(ids) > 6 else "")
            raise UserError(f"{ref!r} matches {len(ids)} MLflow runs ({shown}): give more characters of the run id "
                            "(`splatflow runs list` prints them)")
        out.append(ids[0])
    return out


def _same(a: str | None, b: str | None) -> bool:
    """Whether two logged param values mean the same (``1`` and ``1.0``, JSON lists spaced differently)."""
    if a == b:
        return True
    if a is None or b is None:
        return False
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def describe_run(run) -> str:
    """One line saying which run this is: name, short id, scene, commit, status."""
    t = run.data.tags
    commit = (t.get("git.commit") or "")[:10] + (" (uncommitted edits)" if t.get("git.dirty") == "true" else "")
    return (f"{run.info.run_name or ''} [{short_id(run.info.run_id)}]  scene {t.get('splatflow.scene', '-')}  "
            f"commit {commit or '-'}  {run.info.status}")


def compare(run_ids: list[str], uri: str | None = None, *, all_params: bool = False, all_metrics: bool = True):
    """Runs side by side, as a ``pandas.DataFrame`` indexed by ``(kind, key)`` with one column per run (its name
    and short id) and, for two runs, a ``delta`` column (second minus first, metrics only).

    Rows come in reading order: ``headline`` (:data:`HEADLINE_METRICS`, labelled), ``param`` (the params whose
    values differ; every param with ``all_params``), then ``metric`` (the other final metrics; with
    ``all_metrics=False`` only those that differ). Live step curves (``train/psnr``) are left out.
    """
    import pandas as pd

    cl = client(uri)
    runs = [cl.get_run(r) for r in run_ids]
    cols = [f"{r.info.run_name or ''} [{short_id(r.info.run_id)}]" for r in runs]
    rows: dict[tuple[str, str], list] = {}
    for key, label in HEADLINE_METRICS.items():
        rows[("headline", label)] = [r.data.metrics.get(key) for r in runs]
    for k in sorted(set().union(*(r.data.params for r in runs))):
        vals = [r.data.params.get(k) for r in runs]
        if all_params or not all(_same(vals[0], v) for v in vals[1:]):
            rows[("param", k)] = vals
    finals = sorted(k for k in set().union(*(r.data.metrics for r in runs)) if "/" not in k
                    and k not in HEADLINE_METRICS)
    for k in finals:
        vals = [r.data.metrics.get(k) for r in runs]
        if all_metrics or len({v for v in vals}) > 1:
            rows[("metric", k)] = vals
    df = pd.DataFrame.from_dict(rows, orient="index", columns=cols) if rows else pd.DataFrame(columns=cols)
    df.index = pd.MultiIndex.from_tuples(list(rows), names=["kind", "key"])
    if len(runs) == 2:
        delta = []
        for (kind, _), a, b in zip(df.index, df.iloc[:, 0], df.iloc[:, 1]):
            ok = kind != "param" and isinstance(a, (int, float)) and isinstance(b, (int, float))
            delta.append(b - a if ok and not (math.isnan(a) or math.isnan(b)) else None)
        df["delta"] = delta
    return df


def curve_note(cl, run, key: str = "train/psnr") -> str | None:
    """Why ``run`` has no live training curve (None when it has one): what a reader needs in place of the plot."""
    if cl.get_metric_history(run.info.run_id, key):
        return None
    t = run.data.tags
    if t.get("splatflow.skipped"):
        same = t.get("splatflow.same_as")
        return (f"trained nothing: its stages were {t['splatflow.skipped']}"
                + (f" (its results are those of run {short_id(same)}, which has the curve)" if same else ""))
    state = t.get("splatflow.stage.train")
    if state is None:
        return ("its train stage did not run in it: DVC found training up to date and reran only later stages, "
                "so the run holds the earlier final metrics but no curve")
    if state in ("failed", "stopped"):
        return f"its train stage {state} before logging any step"
    return "it logged no training steps"
