"""Every sub-command meets a user mistake with one line naming what is wrong, and exit status 2 -- never a traceback
or a box of usage text. Run ids are taken the way `splatflow runs list` prints them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from splatflow.cli import app

REPO = Path(__file__).resolve().parents[1]

#: One bad command line per sub-command (a new command must add its own: the walk below checks that every
#: command is here). Each is a mistake a user makes: an unknown scene, run id or commit, a value out of range,
#: a missing argument, an option that does not exist.
BAD = {
    ("demo-scene",): [["demo-scene", "--views", "0"], ["demo-scene", "--arc", "400"]],
    ("add-scene",): [["add-scene", "garden", "no/such/folder"], ["add-scene"]],
    ("run",): [["run", "nosuchscene"], ["run", "demo", "--fast"]],
    ("ui",): [["ui", "--mlflow-port", "70000"]],
    ("serve",): [["serve", "--workers", "-1"]],
    ("worker",): [["worker", "--server", "http://127.0.0.1:9", "--clone", "no/such/folder"], ["worker"]],
    ("flow",): [["flow", "nosuchscene"], ["flow", "demo", "-S", "train.no_such_key=1"]],
    ("batch",): [["batch", "nosuchscene", "--local"], ["batch", "--local", "-c", "train.max_steps=-5"]],
    ("runs", "reap"): [["runs", "reap", "--older-than-hours", "-1"]],
    ("runs", "list"): [["runs", "list", "-n", "0"]],
    ("compare",): [["compare", "abc123", "def456"], ["compare", "abc123"]],
    ("rerun",): [["rerun", "nosuchcommit"]],
    ("plots",): [["plots", "nosuchscene"]],
    ("view",): [["view", "nosuchscene"]],
    ("report",): [["report", "nosuchscene"]],
    ("build-web",): [["build-web", "--no-such-option"]],
    ("metrics",): [["metrics", "nosuchscene"]],
    ("weights", "fetch"): [["weights", "fetch", "--net", "resnet"]],
}


def _commands(group, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    out = set()
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a group (typer carries its own copy of click's classes)
            out |= _commands(cmd, (*prefix, name))
        else:
            out.add((*prefix, name))
    return out


@pytest.fixture
def project(tmp_path, monkeypatch):
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPLATFLOW_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may start a Prefect server
    return tmp_path


def _one_line_error(args: list[str]) -> str:
    r = CliRunner().invoke(app, args, prog_name="splatflow")
    text = r.output.strip()
    assert r.exit_code == 2, (args, r.exit_code, text, r.exception)
    assert "Traceback" not in text and (r.exception is None or isinstance(r.exception, SystemExit)), (args, text)
    assert len(text.splitlines()) == 1 and text.startswith("error: "), (args, text)
    return text


def test_every_sub_command_answers_bad_arguments_with_one_line_and_exit_2(project):
    commands = _commands(typer.main.get_command(app))
    assert commands == set(BAD), f"commands without a bad-argument case: {commands - set(BAD)}"
    for cmd, cases in BAD.items():
        for args in cases:
            _one_line_error(args)
    # the lines say what to do
    assert "add-scene nosuchscene" in _one_line_error(["flow", "nosuchscene"])
    assert "train.no_such_key" in _one_line_error(["flow", "demo", "-S", "train.no_such_key=1"])
    assert "`splatflow ui --help`" in _one_line_error(["ui", "--mlflow-port", "70000"])
    assert "Missing argument" in _one_line_error(["add-scene"])
    assert "no MLflow runs yet" in _one_line_error(["compare", "abc123", "def456"])  # and no store was made
    assert not (project / "mlflow.db").exists()
    from splatflow import tracking

    uri = f"sqlite:///{project / 'mlflow.db'}"
    tracking.experiment_id(tracking.client(uri), uri=uri)
    assert "`splatflow runs list`" in _one_line_error(["compare", "abc123", "def456"])


def test_compare_takes_the_ids_runs_list_prints_and_says_when_one_is_ambiguous(project):
    from splatflow import tracking

    uri = f"sqlite:///{project / 'mlflow.db'}"
    cl = tracking.client(uri)
    exp = tracking.experiment_id(cl, uri=uri)
    # 17 runs: two of them share a first hex digit (pigeonhole), so that digit alone is ambiguous
    ids = []
    for i in range(17):
        r = cl.create_run(exp, run_name=f"demo-{i}", tags={"splatflow.scene": "demo"})
        cl.log_metric(r.info.run_id, "evaluate.psnr", 20.0 + i)
        cl.set_terminated(r.info.run_id, "FINISHED")
        ids.append(r.info.run_id)
    listed = CliRunner().invoke(app, ["runs", "list", "-n", "17"])
    assert listed.exit_code == 0, listed.output
    shown = [line.split()[0] for line in listed.output.splitlines()[1:]]
    assert sorted(shown) == sorted(i[:tracking.SHORT_ID] for i in ids)
    assert "PSNR" in listed.output.splitlines()[0] and "36.00" in listed.output  # run 16's headline metric

    r = CliRunner().invoke(app, ["compare", shown[0], shown[1]])
    assert r.exit_code == 0, r.output
    first = next(c for c in "0123456789abcdef" if sum(i.startswith(c) for i in ids) > 1)
    text = _one_line_error(["compare", first, shown[0]])
    assert "matches" in text and "more characters" in text
    by_name = tracking.resolve_run_ids(["demo-3", ids[4][:12]], uri)
    assert by_name == [ids[3], ids[4]]
