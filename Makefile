# splatflow: `make demo` sets everything up and runs the pipeline on the demo scene; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY := PASSIVE
export GOMP_SPINCOUNT := 20000
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: venv web demo test repro ui serve

# torch==2.13.0 (CPU) is pinned in pyproject.toml; gsplat goes in without its deps, which would pull another torch.
# uv resolves and downloads in parallel (pip looked the ~250 packages up one after another: ~3 of its 4.5 minutes);
# it gets pip's own index settings (tools/uv_index_args.py), so both pick the same wheels, and compiles the byte code
# pip would; pip itself is brought up to date as before (tests/_hosts.py installs with it). Where uv cannot be
# installed, pip does it all.
PIP := $(PY) -m pip -q --disable-pip-version-check
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install uv || $(PIP) install -U pip
	if [ -x $(VENV)/bin/uv ]; then \
	  uv=($(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode $$($(PY) tools/uv_index_args.py)); \
	  "$${uv[@]}" --upgrade-package pip pip -e '.[test]' && "$${uv[@]}" --no-deps gsplat==1.5.3 lpips==0.1.4; \
	else \
	  $(PIP) install -e '.[test]' && $(PIP) install --no-deps gsplat==1.5.3 lpips==0.1.4; \
	fi
	@# lpips is installed only for its v0.1 linear-layer files; its torchvision dependency is not used.
	@! $(PY) -m pip check | grep -v '^lpips .* torchvision' | grep .
	touch $@

venv: $(VENV)/.installed

# The report's 3D viewer: pinned npm packages (splatflow/web/package-lock.json) bundled into one script (needs npm).
WEB := splatflow/web/dist/splat-viewer.js
$(WEB): splatflow/web/package.json splatflow/web/package-lock.json splatflow/web/entry.js $(VENV)/.installed
	$(VENV)/bin/splatflow build-web

web: venv $(WEB)

demo: venv web
	$(VENV)/bin/splatflow demo-scene
	$(VENV)/bin/splatflow run demo
	@echo
	@echo "report:  $(CURDIR)/reports/demo/index.html   (open it in a browser; it works offline)"
	@echo "viewer:  $(VENV)/bin/splatflow view demo        (interactive, http://127.0.0.1:8080; Ctrl-C stops)"
	@echo "runs:    $(VENV)/bin/splatflow ui               (then open the MLflow and Prefect links it prints)"
	@echo "numbers: $(VENV)/bin/splatflow metrics          (LPIPS n/a? $(VENV)/bin/splatflow weights fetch, once)"

repro: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/dvc repro

# two workers, a test file each at a time (--dist loadfile): the suite is mostly subprocesses waiting on each other
# (DVC, servers, imports), so two share 2 cores well: 23 min instead of 46 on a 2-core Zen 3 host
# The sources are byte-compiled first: the suite starts hundreds of Python processes (stages, DVC, the CLI), and where
# PYTHONDONTWRITEBYTECODE is set (CI images often set it) each would compile splatflow's modules again (~0.4 CPU-s).
# The CPU training kernels compile into numba's cache (two helper processes, ~2 min on 2 cores after an install or a
# kernel change; nothing when cached) while npm fetches the viewer's packages, instead of before the tests start.
TEST_WORKERS ?= 2
test: venv
	$(PY) -c 'import torch; from splatflow.train.precompile import precompile; torch.cuda.is_available() or precompile(2)' \
	  & kernels=$$!; $(MAKE) --no-print-directory web && $(PY) -m compileall -q splatflow stages flows tests; \
	  rc=$$?; wait $$kernels && exit $$rc
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

ui: venv
	$(VENV)/bin/splatflow ui

serve: venv
	$(VENV)/bin/splatflow serve --workers 2
