"""Progress bars in a log file: a line now and then and the last frame, never a run of \\r redraws."""

from __future__ import annotations

import io
import subprocess
import sys

from tqdm import tqdm

from splatflow.pipeline.progress import LineProgress


def test_a_bar_in_a_log_is_a_few_lines_ending_with_its_last_frame():
    log = io.StringIO()
    out = LineProgress(log, every_s=3600.0)  # no timed line during the test: the first frame and the last
    for _ in tqdm(range(500), desc="train", file=out, mininterval=0, miniters=1):
        pass
    print("train [demo]: 500 steps", file=out)
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("train:") and "500/500" in lines[1] and lines[2] == "train [demo]: 500 steps"


def test_a_stage_writes_lines_when_its_output_is_captured():
    code = ("from splatflow.pipeline.progress import install_for_logs; install_for_logs(0.0); import sys\n"
            "from tqdm import tqdm\n"
            "for _ in tqdm(range(50), desc='evaluate', mininterval=0, miniters=1): pass\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stderr and "50/50" in p.stderr.splitlines()[-1]
    assert len(p.stderr.splitlines()) >= 50  # every_s = 0: each frame is a line of its own
    assert all(line.strip() for line in p.stderr.splitlines())
