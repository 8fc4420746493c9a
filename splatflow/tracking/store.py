"""Where runs go: the tracking switch, the store's URI (a sqlite file at the repo root unless set), the client,
the experiment, links to the UI, and the one batched write every other part of the package uses."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from splatflow.orchestrate.servers import MLFLOW_PORT
from splatflow.pipeline.errors import UserError

DEFAULT_EXPERIMENT = "splatflow"


#: MLflow 3's UI opens an experiment in its GenAI view unless this tag marks it for model training.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"

#: The numbers a user looks at first, as MLflow final-metric keys with the label shown beside them: the first
#: rows of ``splatflow compare``, the columns of ``splatflow runs list`` and of the MLflow runs table.
HEADLINE_METRICS = {
    "evaluate.psnr": "PSNR (dB)",
    "evaluate.ssim": "SSIM",
    "evaluate.lpips_alex": "LPIPS (AlexNet)",
    "evaluate.gaussians": "Gaussians",
    "train.train_seconds": "train time (s)",
}

#: MLflow 3.17's UI reads a view of the runs table from the experiment tag ``mlflow.sharedViewState.<key>`` when
#: an address carries ``viewStateShareKey=<key>`` (what its "Share" button makes). splatflow stores one: the scene
#: and the headline metrics as columns, newest run first. In headless Chromium against MLflow 3.17.2 the runs table
#: still showed the default columns (docs/CONTRACTS.md, Dashboards).
VIEW_KEY = "splatflow-runs"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"


def runs_view_state() -> str:
    """The JSON of splatflow's runs-table view (column ids as MLflow's UI spells them: ``metrics.`key```)."""
    import json

    columns = ["tags.`splatflow.scene`", *(f"metrics.`{k}`" for k in HEADLINE_METRICS)]
    return json.dumps({"selectedColumns": columns, "orderByKey": "attributes.start_time", "orderByAsc": False,
                       "searchFilter": "", "lifecycleFilter": "Active"}, separators=(",", ":"))


def _ensure_experiment_tags(cl, exp) -> None:
    """Mark an existing experiment for model training and give it splatflow's runs view (older stores lack both)."""
    tags = exp.tags or {}
    for key, value in ((EXPERIMENT_KIND_TAG, EXPERIMENT_KIND), (VIEW_TAG, runs_view_state())):
        if tags.get(key) != value:
            with contextlib.suppress(Exception):
                cl.set_experiment_tag(exp.experiment_id, key, value)
#: Where ``splatflow ui`` serves the MLflow UI (used for links when the tracking URI is a local database).
DEFAULT_UI_URL = f"http://127.0.0.1:{MLFLOW_PORT}"


def enabled() -> bool:
    """False when ``SPLATFLOW_TRACKING`` is ``off``/``0``/``false`` (unit tests)."""
    return os.environ.get("SPLATFLOW_TRACKING", "on").strip().lower() not in {"off", "0", "false", "no"}


# One way to find the project root (seen through DVC's temporary experiment workspaces): splatflow.pipeline.paths.
from splatflow.pipeline.paths import repo_root  # noqa: E402,F401


def tracking_uri(root: str | Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<repo root>/mlflow.db`` (MLflow 3 refuses the file store)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    return f"sqlite:///{repo_root(root) / 'mlflow.db'}"


def _quiet_mlflow_env() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    # MLflow's own HTTP defaults (7 retries, exponential backoff, 120 s per request) turned a server that went
    # away into minutes of waiting per call; a few seconds of retries cover a server restarting.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    # MLflow prints its own run and experiment links when a run ends on a server, in its GenAI view; splatflow
    # prints links that open the model-training view (run_ui_url, experiment_ui_url)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


#: How long the reachability check waits for a tracking server's answer (one request, no retries).
REACH_TIMEOUT_S = 3.0


class TrackingUnreachable(UserError):
    """The tracking server does not answer: the pipeline stops before any work, naming the URL and the fix."""


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def check_reachable(uri: str | None = None, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """One quick request to an http(s) tracking server's ``/health`` (no retries): raise
    :class:`TrackingUnreachable` when nothing answers within ``timeout_s``, so a pipeline run stops in seconds
    instead of spending minutes in MLflow's HTTP retries in every stage. Other stores (a local database) pass.

    A SIGTERM while it waits ends the wait at once where the stop handler raises (the stage shell outside its
    cooperative blocks): the socket call is interrupted, not resumed."""
    import http.client
    import urllib.error
    import urllib.request

    uri = uri or tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - the user's own tracking URI
            r.read(64)
        return
    except urllib.error.HTTPError as e:
        if e.code < 500:  # it answers (a proxy or an auth layer in front of it may say no to /health): usable
            return
        why = f"it answers HTTP {e.code}"
    except (OSError, http.client.HTTPException) as e:  # refused, timed out, reset, not HTTP at all
        reason = getattr(e, "reason", e)
        why = "no answer within {:g} s".format(timeout_s) if "timed out" in str(reason) else str(reason)
    raise TrackingUnreachable(
        f"the MLflow tracking server at {uri} is not answering ({why}): start it (`splatflow ui` serves one on "
        f"{DEFAULT_UI_URL}), or record locally with `export MLFLOW_TRACKING_URI=sqlite:///mlflow.db` (or run "
        f"without recording: SPLATFLOW_TRACKING=off). Stopped before any work.")


def store_problem(uri: str | None = None) -> str | None:
    """Why a local tracking database cannot be used, in one line naming the file and the fix, or None.

    A damaged ``mlflow.db`` (a disk that filled up, a copy cut short, another file under that name) made every stage
    print a Python warning with an SQL statement in it; read here first, it is one line per pipeline run and the
    stages run untracked."""
    import sqlite3

    uri = uri or tracking_uri()
    path = _sqlite_path(uri)
    if path is None or not path.exists():
        return None
    # The header and the schema only (milliseconds): a whole-file integrity check would read every page of a
    # database that grows with every logged step. Damage deeper in is met by MLflow, and reported in one line too.
    bad = None
    try:
        with open(path, "rb") as f:
            head = f.read(16)
        if head and head != b"SQLite format 3\x00":
            bad = "it does not start with SQLite's header"
        else:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
            try:
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
            finally:
                con.close()
    except (OSError, sqlite3.Error) as e:
        bad = str(e)
    if bad:
        return (f"tracking is off for this run: {path} is not a readable MLflow database ({bad}); move it aside "
                f"(`mv {path} {path}.damaged`) and the next run starts a new one; the results themselves are in "
                f"metrics/ and DVC, untouched")
    return None


def client(uri: str | None = None):
    """An ``MlflowClient`` on the splatflow tracking URI."""
    _quiet_mlflow_env()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri or tracking_uri())


def experiment_id(cl, name: str | None = None, uri: str | None = None) -> str:
    """Get or create the experiment (``MLFLOW_EXPERIMENT_NAME`` or ``splatflow``).

    With a local sqlite store the artifact root is pinned next to the database (``mlartifacts/``): MLflow's own
    default is ``./mlruns`` relative to whatever the cwd is, which scatters artifacts over worktrees.
    """
    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    exp = cl.get_experiment_by_name(name)
    if exp is not None:
        _ensure_experiment_tags(cl, exp)
        return exp.experiment_id
    uri = uri or getattr(getattr(cl, "_tracking_client", None), "tracking_uri", None)
    location = None
    if uri and uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    try:
        return cl.create_experiment(name, artifact_location=location,
                                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, VIEW_TAG: runs_view_state()})
    except Exception:  # another process created it between our get and create
        exp = cl.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def ui_base_url(uri: str | None = None) -> str:
    """The MLflow UI's address: the tracking server itself, or ``SPLATFLOW_MLFLOW_UI`` (default ``splatflow ui``'s
    address) when runs go to a local database."""
    uri = uri or tracking_uri()
    base = uri if uri.startswith(("http://", "https://")) else os.environ.get("SPLATFLOW_MLFLOW_UI", DEFAULT_UI_URL)
    return base.rstrip("/")


def run_ui_url(experiment: str, run_id: str, uri: str | None = None) -> str:
    """The run's page in the MLflow UI.  ``workflowType=machine_learning`` opens MLflow 3.17's UI in its
    model-training view (its default is the GenAI one, a per-browser setting)."""
    return f"{ui_base_url(uri)}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"


def experiment_ui_url(experiment: str, uri: str | None = None) -> str:
    """The experiment's runs table in the MLflow UI, in the model-training view, naming splatflow's stored view of
    it (:data:`VIEW_TAG`)."""
    return (f"{ui_base_url(uri)}/#/experiments/{experiment}?viewStateShareKey={VIEW_KEY}"
            "&workflowType=machine_learning")


def log_batch(cl, run_id: str, *, params: dict | None = None, metrics: dict | None = None, step: int = 0,
              tags: dict | None = None, timestamp_ms: int | None = None) -> None:
    """Params, metrics (all at ``step``) and tags in as few ``log_batch`` calls as MLflow allows (one costs ~20 ms)."""
    from mlflow.entities import Metric, Param, RunTag

    ts = timestamp_ms or int(time.time() * 1000)
    m = [Metric(k, v, ts, step) for k, v in (metrics or {}).items()]
    p = [Param(k, v[:6000]) for k, v in (params or {}).items()]
    t = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
    # MLflow limits one batch to 1000 metrics, 100 params, 100 tags.
    while m or p or t:
        cl.log_batch(run_id, metrics=m[:1000], params=p[:100], tags=t[:100])
        m, p, t = m[1000:], p[100:], t[100:]

