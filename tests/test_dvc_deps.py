"""dvc.yaml cannot drift from the code: every library module a stage imports is one of its deps, and every
params section it reads is declared (and nothing it does not read).

A module missing from a stage's deps means an edit to it reruns nothing while ``dvc.lock`` still claims the old
outputs came from the new code. The imports are read statically (``ast``) from ``stages/<name>.py`` and followed
through the ``splatflow`` package, function-level imports included, since the stages import their heavy modules
lazily. Only the plumbing that cannot change an output is not followed: the stage shell, tracking, paths, errors
the stop flag, the process defaults of ``runtime_env`` and ``records`` (which of a stage's two files a value is
written to) (they decide where files and kernel caches go, what is logged, how idle threads wait and when a stage
stops, never what it computes), and the live view that watches a training run (it reads the model only:
tests/test_live_view.py checks a watched run's parameters are the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PLUMBING = {"splatflow/pipeline/stage.py", "splatflow/tracking.py", "splatflow/pipeline/paths.py",
            "splatflow/pipeline/errors.py", "splatflow/pipeline/records.py", "splatflow/present/live_view.py",
            "splatflow/pipeline/stop.py", "splatflow/pipeline/runtime_env.py", "splatflow/pipeline/progress.py",
            *(f"splatflow/tracking/{p.name}" for p in (REPO / "splatflow" / "tracking").glob("*.py"))}
#: What ``stage_main`` itself reads from params for every stage (seeding), and for stages that pin thread counts.
SHELL_READS = {"base.seed", "base.scenes"}  # seeding, and the scene's own params overrides (Params.for_scene)
THREADS_READ = "base.threads"


def _module_file(name: str) -> Path | None:
    """``splatflow.scene.dataset`` -> ``splatflow/scene/dataset.py`` (or the package's ``__init__.py``)."""
    base = REPO.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imported_modules(path: Path) -> set[str]:
    """Dotted names of every ``splatflow`` module the file imports anywhere (top level or inside functions),
    with the parent packages Python executes on the way (``splatflow.train`` for ``splatflow.train.loop``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = ".".join(path.relative_to(REPO).with_suffix("").parts)
    if path.name != "__init__.py":
        pkg = pkg.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            for a in node.names:  # `from splatflow.scene import dataset` imports a module, not an attribute
                if _module_file(f"{mod}.{a.name}") is not None:
                    names.add(f"{mod}.{a.name}")
    out = set()
    for n in names:
        if n == "splatflow" or n.startswith("splatflow."):
            parts = n.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def transitive_files(stage_file: Path) -> set[str]:
    """Repo-relative files of the splatflow modules ``stage_file`` runs, plumbing excluded (and not followed)."""
    seen: set[str] = set()
    todo = [stage_file]
    while todo:
        f = todo.pop()
        for mod in _imported_modules(f):
            mf = _module_file(mod)
            if mf is None:
                continue
            rel = mf.relative_to(REPO).as_posix()
            if rel in seen or rel in PLUMBING:
                continue
            seen.add(rel)
            todo.append(mf)
    return seen


def _trivial_init(rel: str) -> bool:
    """A package ``__init__`` with nothing but a docstring, imports and assignments of constants/``__all__``:
    its own lines cannot change an output (what it imports is followed separately)."""
    if not rel.endswith("__init__.py"):
        return False
    tree = ast.parse((REPO / rel).read_text())
    return all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr, ast.Assign)) for n in tree.body)


def _covered(rel: str, deps: list[str]) -> bool:
    return any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in deps)


def _stages() -> dict[str, dict]:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _dep_paths(entry: dict) -> list[str]:
    return [d if isinstance(d, str) else next(iter(d)) for d in entry["do"].get("deps", [])]


def _param_keys(entry: dict) -> list[str]:
    out = []
    for p in entry["do"].get("params", []):
        out.extend([p] if isinstance(p, str) else list(p))  # {file: [keys]} form
    return out


STAGES = sorted(_stages())


def test_every_stage_has_a_module():
    assert sorted(p.stem for p in (REPO / "stages").glob("*.py") if p.stem != "__init__") == STAGES


@pytest.mark.parametrize("stage", STAGES)
def test_stage_deps_list_every_imported_library_module(stage):
    entry = _stages()[stage]
    deps = _dep_paths(entry)
    stage_file = f"stages/{stage}.py"
    assert stage_file in deps, f"dvc.yaml: stage {stage} must depend on its own module {stage_file}"
    needed = {f for f in transitive_files(REPO / stage_file) if not _trivial_init(f)}
    missing = sorted(f for f in needed if not _covered(f, deps))
    assert not missing, (f"dvc.yaml: stage {stage} imports {missing} but does not list them (or a folder holding "
                         "them) under deps: editing them would rerun nothing. Add them to the stage's deps.")
    # and the reverse: a library dep the stage never imports reruns it for nothing
    lib_deps = [d for d in deps if d.startswith("splatflow/") and  # modules, not data files (the viewer's JS)
                (d.endswith(".py") or ((REPO / d).is_dir() and any((REPO / d).rglob("*.py"))))]
    unused = [d for d in lib_deps if not any(_covered(f, [d]) for f in needed)]
    assert not unused, f"dvc.yaml: stage {stage} lists {unused} under deps but never imports them"


# ------------------------------------------------------------------------------------------------- params


#: Accessor methods of the params dataclasses and the keys each reads (splatflow/pipeline/config.py).
ACCESSORS = {"scene": {"base.scenes"}, "base.scene_resolution": {"base.resolution", "base.scenes"}}


def _imported_function(tree: ast.Module, name: str) -> tuple[ast.FunctionDef, Path] | None:
    """The definition of ``name`` when the module imports it from a splatflow module (``from m import name``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("splatflow") and \
                any(a.name == name and a.asname is None for a in node.names):
            f = _module_file(node.module)
            if f is None:
                return None
            for d in ast.parse(f.read_text()).body:
                if isinstance(d, ast.FunctionDef) and d.name == name:
                    return d, f
    return None


def params_read(stage_file: Path, root: ast.AST | None = None, var: str = "params", depth: int = 0) -> set[str]:
    """Params sections a stage module reads: ``params.<section>[.<key>]`` attribute chains, the accessors in
    ``ACCESSORS``, and the reads of splatflow functions ``params`` is passed to whole (followed into their
    source). Passing it on any other way is reported as ``*``: the test cannot tell what is read then."""
    tree = ast.parse(stage_file.read_text())
    root = root or tree
    reads: set[str] = set()
    parents = {}
    for node in ast.walk(root):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    for node in ast.walk(root):
        if not (isinstance(node, ast.Name) and node.id == var and isinstance(node.ctx, ast.Load)):
            continue
        chain, cur = [], node
        while isinstance(parents.get(cur), ast.Attribute):
            cur = parents[cur]
            chain.append(cur.attr)
        if not chain:
            call = parents.get(node)
            # `source_path(params, paths)`: a helper in the same module, whose own reads are counted where they are
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and _local_function(tree, call.func.id):
                continue
            found = _imported_function(tree, call.func.id) if isinstance(call, ast.Call) and \
                isinstance(call.func, ast.Name) and node in call.args and depth < 3 else None
            if found is None:
                reads.add("*")
                continue
            fn, fn_file = found
            pos = call.args.index(node)
            arg = fn.args.args[pos].arg if pos < len(fn.args.args) else None
            reads |= params_read(fn_file, fn, arg, depth + 1) if arg else {"*"}
        elif chain[0] in ACCESSORS or ".".join(chain[:2]) in ACCESSORS:
            reads |= ACCESSORS.get(chain[0]) or ACCESSORS[".".join(chain[:2])]
        else:  # `params.train` -> train; `params.prune.max_psnr_drop_db` -> that key (dvc.yaml may name one key)
            reads.add(".".join(chain[:2]))
    return reads


def _local_function(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def _needs_threads(stage_file: Path) -> bool:
    """``stage_main(..., needs_threads=False)`` skips the thread setup (default True)."""
    for node in ast.walk(ast.parse(stage_file.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "stage_main":
            for kw in node.keywords:
                if kw.arg == "needs_threads":
                    return bool(ast.literal_eval(kw.value))
            return True
    raise AssertionError(f"{stage_file} does not call stage_main")


@pytest.mark.parametrize("stage", STAGES)
def test_stage_declares_exactly_the_params_it_reads(stage):
    entry = _stages()[stage]
    stage_file = REPO / "stages" / f"{stage}.py"
    reads = params_read(stage_file) | SHELL_READS
    if _needs_threads(stage_file):
        reads.add(THREADS_READ)
    assert "*" not in reads, f"{stage_file} passes the whole params object on; pass the sections it needs"
    declared = [k.replace("${key}", "<scene>") for k in _param_keys(entry)]
    deps = _dep_paths(entry)

    def declared_covers(section: str) -> bool:
        if section == "base.scenes":  # the scene's own entry, or this stage's share of it (stage settings)
            return "base.scenes.<scene>" in declared or f"data/${{key}}/settings/{stage}.json" in deps
        return any(section == d or section.startswith(d + ".") for d in declared)

    missing = sorted(s for s in reads if not declared_covers(s))
    assert not missing, (f"dvc.yaml: stage {stage} reads params {missing} but does not declare them under params: "
                         "changing them would rerun nothing")
    unread = sorted(d for d in declared
                    if not any(r == d or r.startswith(d + ".") or d.startswith(r + ".") for r in reads))
    assert not unread, f"dvc.yaml: stage {stage} declares params {unread} it never reads: a change reruns it for nothing"


def test_the_analysis_sees_lazy_imports_and_transitive_modules():
    """The checker itself: prune imports splatflow.compress.prune inside run(), which imports metrics and the
    dataset."""
    files = transitive_files(REPO / "stages" / "prune.py")
    assert "splatflow/compress/prune.py" in files and "splatflow/evaluation/metrics.py" in files
    assert "splatflow/scene/dataset.py" in files
    assert not files & PLUMBING
    assert params_read(REPO / "stages" / "prune.py") >= {"prune", "train", "base.seed"}


def test_each_stage_gets_its_share_of_the_scene_entry():
    """A stage depends on data/<scene>/settings/<stage>.json, which holds the scene's overrides of exactly the
    sections it declares (splatflow.pipeline.scene_settings.STAGE_PARAMS), and not on the whole base.scenes.<scene>: a
    scene's own export settings must not rerun its SfM and training."""
    from splatflow.pipeline.scene_settings import STAGE_PARAMS

    stages = _stages()
    writes = [o if isinstance(o, str) else next(iter(o)) for o in stages["settings"]["do"]["outs"]]
    assert writes == [f"data/${{key}}/settings/{s}.json" for s in STAGE_PARAMS] + ["metrics/${key}/info/settings.json"]
    assert "base.scenes.${key}" in _param_keys(stages["settings"])
    for stage, sections in STAGE_PARAMS.items():
        entry = stages[stage]
        assert f"data/${{key}}/settings/{stage}.json" in _dep_paths(entry), stage
        declared = [k for k in _param_keys(entry) if not k.startswith("base.")]
        assert sorted(declared) == sorted(sections), (stage, declared, sections)
