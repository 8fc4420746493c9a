"""The live view: the splat being trained, in the same viser viewer as ``splatflow view``, refreshed every few seconds.

:class:`LiveView` is a watcher of the training run's sink (:mod:`splatflow.train.sink`). Between two steps, at
most once every ``every_s`` seconds, it copies the parameters (a few MB, milliseconds) and hands the copy to its
own thread, which converts it and sends it to the browsers; the training thread never waits for that thread or
for a browser, and skips a refresh while the previous one is still being sent. It reads the model and changes nothing (not even
the sparse step's deferred rows, which show a few steps behind), so a run with the live view ends with the
parameters of the same run without it.

``splatflow run SCENE --view`` asks the train stage for it through the environment (:data:`ENV`, the address to
serve on; :data:`ENV_EVERY`, the refresh interval), as ``MLFLOW_RUN_ID`` reaches the stages: watching a run is no
parameter of the pipeline, so it changes no DVC dependency and reruns nothing.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

from splatflow.pipeline.errors import UserError
from splatflow.formats.common import as_numpy_splats

ENV = "SPLATFLOW_LIVE_VIEW"  # host:port to serve the live view on (unset: no live view)
ENV_EVERY = "SPLATFLOW_LIVE_VIEW_EVERY_S"  # seconds between two refreshes
EVERY_S = 5.0  # seconds between two refreshes; its cost to training speed: bench/live_view.py
DEFAULT_ADDRESS = "127.0.0.1:8080"


def parse_address(text: str, source: str = ENV) -> tuple[str, int]:
    """``host:port`` or ``port`` -> (host, port); a UserError naming ``source`` otherwise."""
    host, _, port = text.strip().rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 < number < 65536:
        raise UserError(f"{source}={text!r}: expected PORT or HOST:PORT (e.g. {DEFAULT_ADDRESS})")
    return host or "127.0.0.1", number


def parse_every(text: str, source: str = ENV_EVERY) -> float:
    try:
        every = float(text)
    except ValueError:
        every = -1.0
    if not (every >= 0 and math.isfinite(every)):
        raise UserError(f"{source}={text!r}: expected a number of seconds >= 0 (default {EVERY_S:g})")
    return every


class LiveView:
    """Serves the model of a running training in splatflow's viewer, with step, PSNR and Gaussian count.

    ``cameras``: the scene's cameras (:func:`splatflow.present.report.scene_cameras`); ``title``: what the caption
    names (the scene). The server starts with the first refresh, at the first step; ``log`` gets its address.
    """

    def __init__(self, cameras: list, *, title: str, host: str = "127.0.0.1", port: int = 8080,
                 every_s: float = EVERY_S, log=print):
        self.cameras, self.title, self.host, self.port = cameras, title, host, port
        self.every_s, self.log = float(every_s), log
        self.viewer = None
        self.shown_step = 0  # the step of the model the browsers have now
        self.refreshes = 0
        self._psnr: float | None = None
        self._last = -math.inf
        self._pending: tuple | None = None
        self._busy = False
        self._wake = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        # viser and its dependencies are imported here, before training, not by the viewer's thread during a step:
        # an import there that draws from the global `random` would draw from the run's generator, which the loop
        # lends to the global one for the span of a step (splatflow.train.rng), and change the run
        # lazy: viser, which only a watched run needs
        import splatflow.present.viewer  # noqa: F401

        self._thread = threading.Thread(target=self._serve, name="splatflow-live-view", daemon=True)
        self._thread.start()

    # -- the training side: called between steps, never waits ------------------------------------------------
    def after_step(self, trainer, row: dict) -> None:
        if row.get("psnr") is not None:
            self._psnr = float(row["psnr"])
        if self._error is not None:
            raise RuntimeError(f"the live view stopped: {self._error}")
        now = time.monotonic()
        if trainer.step < trainer.cfg.max_steps and (self._busy or now - self._last < self.every_s):
            return  # (the last step's model is always handed over: the view ends on the trained splat)
        self._last = now
        snapshot = trainer.state.splats().stored()  # CPU copies, the 3D smoothing filter with them (baked in _show)
        with self._wake:
            self._busy = True
            self._pending = (snapshot, int(trainer.step), int(trainer.cfg.max_steps), self._psnr,
                             int(trainer.sched.sh.degree(max(trainer.step - 1, 0))))
            self._wake.notify()

    # -- the viewer's thread -----------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._pending is None:
                    return
                # busy from here until this job is shown: a job handed over while the last one was being shown
                # found _busy cleared by that one's end, and wait_idle must not return before this one is shown
                job, self._pending, self._busy = self._pending, None, True
            try:
                self._show(*job)
            except BaseException as e:  # noqa: BLE001 - reported to the training side, which drops the hook
                self._error = e
                return
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _show(self, snapshot, step: int, max_steps: int, psnr: float | None, degree: int) -> None:
        splats = as_numpy_splats(snapshot, degree)  # as in an export: bands not trained yet zero, the filter baked
        status = (f"{self.title}: training, step {step:,} / {max_steps:,}, "
                  + (f"PSNR {psnr:.2f} dB" if psnr is not None else "PSNR not logged yet"))
        if self.viewer is None:
            from splatflow.present.viewer import LoadedModel, SplatViewer  # lazy: viser, which only a watched run needs

            sh_max = int(round(math.sqrt(splats["shN"].shape[1] + 1))) - 1
            model = LoadedModel(splats, sh_max, Path(self.title), "training", list(self.cameras), status=status)
            self.viewer = SplatViewer(model, host=self.host, port=self.port)
            if self.viewer.server.get_port() != self.port:
                self.log(f"live view: port {self.port} is taken; using {self.viewer.server.get_port()}")
            self.log(f"live view: open {self.viewer.url}  (the splat being trained, refreshed every "
                     f"{self.every_s:g} s; it ends with the train stage, `splatflow view {self.title}` shows the "
                     "result)")
        else:
            self.viewer.show(splats, status)
        self.shown_step = step
        self.refreshes += 1

    # -- lifetime ----------------------------------------------------------------------------------------------
    @property
    def url(self) -> str | None:
        return self.viewer.url if self.viewer is not None else None

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Until the last refresh handed over is shown (True), or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while self._busy or self._pending is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._error is not None:
                    return False
                self._wake.wait(left)
        return self._error is None

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=30)
        if self.viewer is not None:
            self.viewer.stop()


def from_env(paths, log=print) -> list[LiveView]:
    """The train stage's watchers: ``[LiveView]`` when :data:`ENV` asks for one, else ``[]``."""
    address = os.environ.get(ENV, "").strip()
    if not address:
        return []
    host, port = parse_address(address)
    every = parse_every(os.environ[ENV_EVERY]) if os.environ.get(ENV_EVERY, "").strip() else EVERY_S
    from splatflow.present.report import scene_cameras  # lazy: the report module (its PLY, SPZ and web-bundle readers)

    cams = scene_cameras(paths)
    return [LiveView(cams, title=paths.scene, host=host, port=port, every_s=every, log=log)]

