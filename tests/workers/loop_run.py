"""One training run on the torchrun path, for the loop tests.

usage (torchrun): loop_run.py CONFIG OUT_DIR STOP_AFTER|-  [key.sub=value ...]
Runs `train_rank` with the given overrides against the servers in rollout.servers; after every
step rank 0 writes the full HF-named weights to OUT_DIR/weights_step{N}.pt (the test compares
runs through them), the rows of the step's batch rank 0 trained (its DP shard: the whole batch at
DP=1, as in the loop tests; tokens, rollout logprobs, token versions) to
OUT_DIR/batch_step{N}.pt, and the rank-0 result to OUT_DIR/result.json.
With LOOP_RUN_HOLD=N:FILE in the environment every rank waits after step N until FILE exists (a test's
fault, such as a relaunched server, lands between two given steps).
With LOOP_RUN_TAKE_AHEAD=N rank 0 takes step N's batch from the coordinator (the call a checkpoint makes)
just before the weight sync of step N - 1, so that step N trains on samples of the weights before that
sync whatever the machine's speed: the staleness bound is then used by construction, not by a race
between the producer and the trainer.
With trainer.placement=colocated the ranks launch the servers themselves (apps/launch.py's
torchrun_colocated_servers, as `train` does under torchrun), and each rank appends to
OUT_DIR/resident_rank{R}.jsonl its engine's device bytes per part (offload's storages) while it waits
for a batch (the rollout phase) and in on_step_end (the weight update phase).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch


def take_ahead(step: int) -> None:
    from megatron_dapo.trainer.loop import Trainer

    sync_weights = Trainer.sync_weights

    def sync_after_taking(self, version):
        if version == step and self.rank == 0:
            self.coord.checkpoint_state(step)  # blocks until step's batch is complete; kept for take_step
        return sync_weights(self, version)

    Trainer.sync_weights = sync_after_taking


def resident_bytes(actor) -> dict[str, int]:
    """The device bytes each part of the engine holds now (0: offloaded)."""
    return {part: sum(s.nbytes() for s in ss) for part, ss in actor.engine._offload.storages().items()}


def record_resident(out: Path) -> None:
    from megatron_dapo.trainer.loop import Trainer

    take_batch = Trainer.take_batch

    def take_recording(self, step):
        record(out, step, "rollout", self.actor)
        return take_batch(self, step)

    Trainer.take_batch = take_recording


def record(out: Path, step: int, phase: str, actor) -> None:
    import torch.distributed as dist

    out.mkdir(parents=True, exist_ok=True)
    line = {"step": step, "phase": phase, **resident_bytes(actor)}
    with open(out / f"resident_rank{dist.get_rank()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def main():
    config, out, stop_after, *overrides = sys.argv[1:]
    out = Path(out)
    from megatron_dapo.apps.launch import elastic_restart, torchrun_colocated_servers
    from megatron_dapo.config import load_config
    from megatron_dapo.trainer.loop import RunSetupError, train_rank

    cfg = load_config(config, overrides)
    colocated = cfg.trainer.placement == "colocated"
    if colocated:
        record_resident(out)
    if os.environ.get("LOOP_RUN_TAKE_AHEAD"):
        take_ahead(int(os.environ["LOOP_RUN_TAKE_AHEAD"]))

    hold = os.environ.get("LOOP_RUN_HOLD")
    hold_step, hold_file = (int(hold.split(":", 1)[0]), Path(hold.split(":", 1)[1])) if hold else (None, None)

    def hold_after(step):
        deadline = time.monotonic() + 300
        while step == hold_step and not hold_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"LOOP_RUN_HOLD: {hold_file} not there after 300 s")
            time.sleep(0.1)

    def dump_weights(step, actor, batch):
        if colocated:
            record(out, step, "update", actor)
        weights = {name: t.clone() for name, t in actor.export_weights() if t is not None}
        if weights:  # rank 0
            out.mkdir(parents=True, exist_ok=True)
            torch.save(weights, out / f"weights_step{step}.pt")
            torch.save(
                {
                    k: getattr(batch, k)
                    for k in (
                        "input_ids",
                        "prompt_lengths",
                        "response_lengths",
                        "rollout_logprobs",
                        "token_versions",
                        "temperature",
                    )
                },
                out / f"batch_step{step}.pt",
            )
        hold_after(step)

    def run(urls):
        return train_rank(
            cfg,
            urls,
            resume=cfg.checkpoint.resume or elastic_restart(cfg) > 0,  # what `train` does under torchrun
            stop_after=None if stop_after == "-" else int(stop_after),
            on_step_end=dump_weights,
        )

    try:
        if colocated:
            with torchrun_colocated_servers(cfg) as urls:
                result = run(urls)
        else:
            result = run(list(cfg.rollout.servers))
    except RunSetupError as e:
        print(f"RUN SETUP ERROR: {e}", flush=True)
        sys.exit(3)
    if result is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"steps_done": result.steps_done, "last_step": result.last_step}))
        print("loop_run done", result.steps_done, flush=True)


if __name__ == "__main__":
    main()
