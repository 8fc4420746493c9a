"""Benchmark: what Prefect's ephemeral API adds to a `splatflow run` with no Prefect server up.

`splatflow run` without a server runs its `reconstruct` flow against Prefect's ephemeral API: a temporary server
process on the database in PREFECT_HOME, started by the first API call and stopped at exit. This script times,
each in a fresh process, `import prefect` alone and `import prefect` plus one trivial flow run with one task
against the ephemeral API (the server's start and stop included), wall and CPU seconds (the server's CPU
included: it is a grandchild, reaped), and prints the difference: what the ephemeral API costs a run. A new
PREFECT_HOME folder gives the first start (the database is created and migrated), an existing one every later
start; ``--rounds`` later starts follow the first.

    .venv/bin/python bench/prefect_ephemeral.py [--home /tmp/prefect-bench] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time

IMPORT = "import prefect; from prefect import flow, task"
FLOW = IMPORT + """
@task
def noop():
    return 1

@flow(name="ephemeral-probe")
def probe():
    return noop()

probe()
"""


def _timed(code: str, env: dict) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return time.perf_counter() - t0, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", default="/tmp/prefect-ephemeral-bench", help="PREFECT_HOME (emptied first)")
    ap.add_argument("--rounds", type=int, default=2, help="later starts after the first")
    args = ap.parse_args()
    shutil.rmtree(args.home, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=args.home, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="600")
    for r in range(args.rounds + 1):
        load = os.getloadavg()[0]
        imp_wall, imp_cpu = _timed(IMPORT, env)
        run_wall, run_cpu = _timed(FLOW, env)
        print(f"{'first start' if r == 0 else 'later start'}: import prefect {imp_wall:.1f} s / {imp_cpu:.1f} CPU-s; "
              f"with one flow run on the ephemeral API {run_wall:.1f} s / {run_cpu:.1f} CPU-s; the ephemeral API "
              f"adds {run_wall - imp_wall:.1f} s / {run_cpu - imp_cpu:.1f} CPU-s (load average {load:.1f})",
              flush=True)


if __name__ == "__main__":
    main()
