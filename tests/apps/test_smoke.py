import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_smoke_command_trains_and_loss_falls():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", "smoke", "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"smoke: loss ([\d.]+) -> ([\d.]+) over 20 steps \(TP=2, backend (\w+)", proc.stdout)
    assert m, proc.stdout[-3000:]
    first, last = float(m[1]), float(m[2])
    assert last < 0.5 * first  # the command itself also fails when it does not learn
