"""Orchestration helpers behind ``splatflow ui/serve/rerun/compare``: servers, reruns, plots as PNG.

The Prefect flows themselves live in ``flows/`` (only wiring); what they and the CLI share lives here.
"""
