"""The pipeline shell: what every DVC stage shares.

The stage shell (``stage``: arguments, params, seeds, threads, metrics, errors, tracking), the typed
params (``config``) and each stage's share of a scene's own entry (``scene_settings``), the fixed
per-scene paths (``paths``) and result files (``records``), the one device of a run (``device``),
user-facing errors (``errors``), the stop flag (``stop``), progress bars (``progress``) and the
process defaults ``import splatflow`` sets (``runtime_env``).
"""
