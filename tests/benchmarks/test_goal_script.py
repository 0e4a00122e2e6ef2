"""benchmarks/coordination_goal.sh's tables (issue 25 item 4): rows rated by produced tokens/s, the trained
rate beside them, older JSONs without a produced rate read by their trained one."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def row(mode, staleness, seeds):
    """A simulate --json row: the seeds' means, and each seed's own numbers."""
    keys = {k for s in seeds for k in s}
    mean = {k: sum(s[k] for s in seeds) / len(seeds) for k in keys}
    return {"mode": mode, "staleness": staleness, "rollout_busy": 0.9, **mean, "seeds": seeds}


def seed(trained, produced=None):
    out = {"tokens_per_s": trained, "rollout_busy": 0.9, "trainer_busy": 0.5, "step_s": 10.0}
    if produced is not None:
        out["produced_per_s"] = produced
    return out


def run(out: Path, *args: str, **env: str) -> str:
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "coordination_goal.sh"), *args],
        cwd=ROOT,
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_goal_table_rates_rows_by_produced_tokens(tmp_path):
    rows = [
        row("sync", 0, [seed(100.0), seed(120.0)]),  # an old row: no produced rate, its trained one stands in
        # async at staleness 2 banked work in its window (trained < produced); the best async row by produced
        # rate is staleness 2 although staleness 1 trained more
        row("async", 1, [seed(300.0, 290.0), seed(300.0, 290.0)]),
        row("async", 2, [seed(250.0, 400.0), seed(270.0, 420.0)]),
        row("advanced", 2, [seed(500.0, 430.0), seed(520.0, 450.0)]),
        row("ceiling", 2, [seed(600.0, 610.0), seed(600.0, 610.0)]),
    ]
    (tmp_path / "psrl_14b_8x8.json").write_text(json.dumps(rows))
    text = run(tmp_path, TABLE_ONLY="1")
    line = next(x for x in text.splitlines() if x.startswith("psrl_14b_8x8 |"))
    cells = line.split(" | ")
    assert cells[1] == "110"  # sync: the trained mean
    assert cells[2] == "410 [400-420] (2)" and cells[3] == "440 [430-450] (2)"
    assert cells[4] == "610"
    assert cells[5] == f"{440 / 410:.2f}" and cells[6] == f"{440 / 110:.2f}"
    assert cells[7] == "260 [250-270] / 510 [500-520]"  # trained rates beside the produced ones


def test_ablation_table_rates_variants_by_produced_tokens(tmp_path):
    for name, produced in (("async", 400.0), ("advanced", 500.0), ("no_routing", 450.0)):
        r = row("advanced", 2, [seed(produced - 50, produced)])
        r.update(migrations=0, aborted_tokens=0, mean_decode_batch=20.0, refusals=0)
        (tmp_path / f"ablation_{name}.json").write_text(json.dumps([r]))
    text = run(tmp_path, "ablation-table")
    lines = {x.split(" | ")[0]: x.split(" | ") for x in text.splitlines() if " | " in x}
    assert lines["no_routing"][1:5] == ["450 [450-450]", "0.90", "1.12", "400 [400-400]"]
