"""A batch on worker hosts that share nothing: serial (one host) against spread (two hosts), in one run.

Sets up what tests/test_hosts.py does (tests/_hosts.py: an OpenSSH server holding the DVC remote, ``splatflow
serve --shared`` on PostgreSQL, worker hosts with their own clone, venv, DVC cache and ``$HOME``, all over
loopback), then runs ``splatflow batch --hosts`` twice on scenes of equal work: first with one worker host, then
with two. Each toy stage holds for ``--stage-seconds`` (a stand-in for a host's GPU work, which on real hosts does
not compete for one machine's cores), so the figures measure what the orchestration adds and what spreading
gains. Prints both wall times, the ratio and the per-scene overhead.

    .venv/bin/python bench/hosts.py --scenes 4 --stage-seconds 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import _hosts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenes", type=int, default=4, help="scenes per batch (default 4)")
    ap.add_argument("--stage-seconds", type=float, default=10.0,
                    help="how long each of a scene's two stages holds on its host (default 10)")
    args = ap.parse_args()
    if args.scenes < 2:
        ap.error("--scenes must be at least 2 (two hosts share them)")
    why = _hosts.missing_reason()
    if why:
        sys.exit(f"bench/hosts.py: {why}")
    serial = tuple(f"s{i}" for i in range(args.scenes))
    spread = tuple(f"p{i}" for i in range(args.scenes))
    hold = {"FAKE_SLEEP_ONE": str(args.stage_seconds), "FAKE_SLEEP_TWO": str(args.stage_seconds)}
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        t0 = time.monotonic()
        print("setting up: sshd, serve --shared (PostgreSQL, Prefect, MLflow), the user's checkout ...", flush=True)
        with _hosts.team(Path(tmp), serial + spread) as team:
            print(f"  {time.monotonic() - t0:.0f} s", flush=True)
            figures = {}
            for label, scenes, hosts in (("serial", serial, ("host1",)), ("spread", spread, ("host1", "host2"))):
                for h in hosts:
                    if h not in team.workers:
                        team.start_host(h, **hold)
                print(f"{label}: {len(scenes)} scenes on {len(hosts)} host(s) ...", flush=True)
                t1 = time.monotonic()
                p = team.batch(*scenes, max_concurrent=len(hosts))
                figures[label] = time.monotonic() - t1
                if p.returncode != 0:
                    sys.exit(f"the {label} batch failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
                for line in p.stdout.splitlines():
                    if " on host" in line:
                        print(f"  {line}")
                print(f"  {figures[label]:.1f} s", flush=True)
    work = 2 * args.stage_seconds
    print(f"\n{args.scenes} scenes, {args.stage_seconds:g} s of stage work each of two stages")
    print(f"serial (1 host):  {figures['serial']:.1f} s  ({figures['serial'] / args.scenes - work:.1f} s per scene "
          f"beyond its {work:g} s of stage work)")
    print(f"spread (2 hosts): {figures['spread']:.1f} s")
    print(f"spread / serial:  {figures['spread'] / figures['serial']:.2f}  (ideal 0.50)")


if __name__ == "__main__":
    main()
