"""`megatron-dapo plot RUN_DIR`: PNG curves of a run's TensorBoard scalars.

One figure per scalar group (the part of the tag before "/": reward, response, actor, time, ...),
one panel per scalar, written to RUN_DIR/plots/<group>.png.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read_scalars(tb_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    tb_dir = run_dir / "tensorboard"
    if not tb_dir.exists():
        raise FileNotFoundError(f"{tb_dir} does not exist: is {run_dir} a megatron-dapo run directory?")
    scalars = read_scalars(tb_dir)
    if not scalars:
        raise ValueError(f"{tb_dir} holds no scalars yet")
    out_dir = Path(out_dir or run_dir / "plots")
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[str]] = defaultdict(list)
    for tag in sorted(scalars):
        groups[tag.split("/")[0]].append(tag)
    written = []
    for group, tags in groups.items():
        cols = min(3, len(tags))
        rows = (len(tags) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        for ax, tag in zip(axes.flat, tags):
            steps, values = zip(*scalars[tag])
            ax.plot(steps, values, marker="." if len(steps) < 50 else None)
            ax.set_title(tag, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(tags) :]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / f"{group}.png"
        tmp = path.with_name(path.stem + ".tmp.png")
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        tmp.replace(path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-dapo plot", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    args = p.parse_args(argv)
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0
