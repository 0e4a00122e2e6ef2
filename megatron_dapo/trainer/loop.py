"""The DAPO training loop, as run by every trainer rank (launched by Ray or by torchrun).

    step t:  the coordinator hands rank 0 step t's batch (B informative groups, no sample older than
             t - staleness) cut into DP shards -> each rank receives its own shard -> actor:
             old-logprob recompute, DAPO loss, optimizer step -> weight sync (all ranks export HF
             tensors, rank 0 broadcasts) -> servers at t + 1 -> metrics, checkpoint, validation

The rollout side runs in the coordinator (megatron_dapo.coordinator.service): a subprocess of rank 0
under torchrun, a named Ray actor under Ray. It generates the next batches while this one trains,
within the staleness bound. Checkpoints hold the model and optimizer (the actor's torch_dist
checkpoint), RNG states, the data position, the weight version, the buffered groups, and the
already-generated batch of the next step, so a resumed run trains the next step on exactly the data
the interrupted one would have.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.config import config_to_dict, derived, dump_yaml
from megatron_dapo.config.derived import checkpoint_dir
from megatron_dapo.coordinator.process import start_coordinator
from megatron_dapo.coordinator.restart import RestartingCoordinator, abort_every_request
from megatron_dapo.coordinator.val_metrics import by_source
from megatron_dapo.data.dataset import DatasetError
from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel
from megatron_dapo.shards import data_parallel_ranks, scatter_shards
from megatron_dapo.trainer import checkpoint as ckpt
from megatron_dapo.trainer.actor import build_actor
from megatron_dapo.trainer.colocation import ColocationCycle, ServerMemory
from megatron_dapo.trainer.metrics import MetricsWriter, console_line
from megatron_dapo.trainer.weight_sync import build_weight_sync

log = logging.getLogger(__name__)


class RunSetupError(RuntimeError):
    """The run cannot start (bad dataset, reward function, tokenizer); raised on every rank."""


@dataclass
class RunResult:
    steps_done: int
    last_step: int
    metrics: list[dict]
    val: dict


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def prepare_output_dirs(cfg) -> None:
    """Create logging.run_dir and the checkpoint directory; OSError naming the key unless both are
    writable directories (a file in the way, a read-only file system)."""
    for key, d in (("logging.run_dir", cfg.logging.run_dir), ("checkpoint.save_dir", checkpoint_dir(cfg))):
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=d).close()
        except OSError as e:
            raise OSError(f"{key}: cannot write to {d} ({e.strerror or type(e).__name__})") from None


def _read_resume_checkpoint(cfg, world_size: int) -> tuple[Path, dict] | None:
    """Rank 0, before anything collective: the verified checkpoint to resume from and its rollout state
    (None: no checkpoint, start from scratch). Every file of it is checked here, so that a broken
    checkpoint is one named error on every rank instead of a failure inside a collective."""
    found = ckpt.find_resume_checkpoint(checkpoint_dir(cfg))
    if found is None:
        return None
    state = ckpt.read_trainer_state(found)
    if state["world_size"] != world_size:
        raise ckpt.CheckpointError(
            f"{found} was saved by {state['world_size']} trainer ranks, this run has {world_size}"
        )
    for r in range(world_size):
        ckpt.read_rng(found, r)
    return found, ckpt.read_rollout_state(found)


def train_rank(
    cfg,
    server_urls: list[str],
    server_tp_sizes: list[int] | None = None,
    resume: bool | None = None,
    stop_after: int | None = None,
    on_step_end=None,
) -> RunResult | None:
    """Run the whole training on this trainer rank; returns the result on rank 0 (None elsewhere).

    `stop_after`: leave after this many steps of this invocation (as if the run were stopped there).
    `on_step_end(step, actor, batch)`: called on every rank after each step's weight sync with the
    rows this rank trained (its DP shard, a RolloutBatch); a collective point: the callback may run
    collectives such as `actor.export_weights()`.
    """
    resume = cfg.checkpoint.resume if resume is None else resume
    rank = init_distributed().rank
    parallel = cfg.parallel
    init_model_parallel(
        tp=parallel.tp,
        pp=parallel.pp,
        vpp=parallel.vpp,
        cp=parallel.cp,
        ep=parallel.ep,
        etp=parallel.etp,
        seed=cfg.trainer.seed,
    )
    torch.manual_seed(cfg.trainer.seed)
    coord = writer = None
    try:
        # Rank 0 checks the output directories, the data and the checkpoint to resume before anything
        # collective: a bad one is reported on every rank at once instead of leaving the other ranks
        # waiting in a collective (or failing at the first save, after a step of work).
        coord, found, error = _start_rollout_side(cfg, server_urls, resume) if rank == 0 else (None, None, None)
        error, found = _broadcast((error, found))
        if error is not None:
            raise RunSetupError(error)
        if rank == 0:
            writer = MetricsWriter(
                Path(cfg.logging.run_dir),
                cfg.logging.tensorboard,
                _resume_version(found, resume),
                wandb=cfg.logging.wandb,
                config=config_to_dict(cfg),
            )
        trainer = Trainer(cfg, rank, coord, writer, server_urls, server_tp_sizes, on_step_end)
        return trainer.fit(trainer.restore(found, resume), stop_after)
    finally:
        if coord is not None:
            coord.close()
        if writer is not None:
            writer.close()


def _resume_version(found: str | None, resume: bool) -> int | None:
    """The weight version a resumed run continues from (-1: resume found no checkpoint, so it starts
    over and no row survives; None: no resume, rows are appended)."""
    if not resume:
        return None
    return ckpt.read_trainer_state(found)["version"] if found is not None else -1


def _start_rollout_side(cfg, server_urls, resume: bool):
    """Rank 0: output directories, the checkpoint to resume, and the coordinator (its own process, which
    loads the data and builds the rollout side). Returns (coordinator client, checkpoint found, error)."""
    coord = found = None
    try:
        prepare_output_dirs(cfg)
        dump_yaml(cfg, Path(cfg.logging.run_dir) / "config.yaml")
        resumed = _read_resume_checkpoint(cfg, dist.get_world_size()) if resume else None
        coord = RestartingCoordinator(
            lambda: start_coordinator(cfg, server_urls),
            cfg.trainer.max_coordinator_restarts,
            abort_servers=lambda: abort_every_request(server_urls, cfg.rollout.api_key),
            resume_hint=lambda: _resume_hint(cfg),
        )
        sizes = coord.setup()
        log.info(
            "rollout coordinator: %s; train prompts: %d (%d dropped, %d truncated as longer than %d tokens)",
            coord.where,
            sizes["train"],
            sizes["dropped"],
            sizes["truncated"],
            cfg.data.max_prompt_length,
        )
        if resumed is not None:
            found, state = resumed
            coord.restore(str(found), state, ckpt.read_trainer_state(found)["step"] + 1)
            found = str(found)
    except (DatasetError, ValueError, OSError, ckpt.CheckpointError) as e:
        return coord, None, f"{type(e).__name__}: {e}"
    except BaseException:
        if coord is not None:
            coord.close()
        raise
    return coord, found, None


def _resume_hint(cfg) -> str:
    """Where a run that lost its coordinator can resume from, for the error that says so."""
    try:
        found = ckpt.find_resume_checkpoint(checkpoint_dir(cfg))
    except ckpt.CheckpointError as e:
        return str(e)
    return f"{found} (checkpoint.resume=true)" if found is not None else f"no checkpoint yet in {checkpoint_dir(cfg)}"


class Trainer:
    """One trainer rank's side of the run: the actor, its weight sync and (rank 0) the coordinator
    client and the metrics writer. `fit` is the loop; each step reads top to bottom in `train_step`."""

    def __init__(self, cfg, rank: int, coord, writer, server_urls, server_tp_sizes=None, on_step_end=None):
        self.cfg, self.rank, self.coord, self.writer, self.on_step_end = cfg, rank, coord, writer, on_step_end
        # trainer.placement=colocated: the servers hand the GPUs over while the model is built
        self.colocation = _colocation_cycle(cfg, rank, server_urls) if derived.colocated(cfg) else None
        if self.colocation is not None:
            self.colocation.release_servers()
        self.actor = build_actor(cfg)
        if self.colocation is not None:
            self.colocation.engine = self.actor.engine
        self.weight_sync = build_weight_sync(cfg, self.actor, rank, coord, server_urls, server_tp_sizes)
        self.dp_rank_of = data_parallel_ranks(self.actor.layout.dp_rank)
        self.history: list[dict] = []
        self.val: dict = {}

    # ---- state -----------------------------------------------------------------------------------
    def restore(self, found: str | None, resume: bool) -> int:
        """Load the checkpoint found by rank 0 (model, optimizer, RNG); returns the first step to train."""
        if resume and found is None and self.rank == 0:
            log.warning("resume requested but %s holds no checkpoint: starting from scratch", checkpoint_dir(self.cfg))
        if found is None:
            return 0
        found = Path(found)
        self.actor.load_checkpoint(str(found / "model"))
        ckpt.load_rng(found, self.rank)
        start_step = ckpt.read_trainer_state(found)["step"] + 1
        if self.rank == 0:
            log.info("resumed from %s: next step %d", found, start_step)
        return start_step

    def save(self, step: int, next_step: int | None) -> Path | None:
        """A checkpoint after `step` (weights version step + 1), with the coordinator's state and, unless
        `next_step` is None, the next step's batch, taken now. Collective; a failed write on any rank is a
        CheckpointError on every rank (`ckpt.save_collective`)."""

        def write_rank0_files(tmp: Path) -> None:
            ckpt.write_rollout_state(tmp, self.coord.checkpoint_state(next_step))
            state = {"step": step, "version": step + 1, "world_size": dist.get_world_size()}
            ckpt.write_trainer_state(tmp, state)

        final = ckpt.save_collective(
            checkpoint_dir(self.cfg),
            step,
            lambda tmp: self.actor.save_checkpoint(str(tmp / "model")),
            write_rank0_files,
            self.cfg.checkpoint.keep_last,
        )
        if final is not None:
            log.info("checkpoint saved: %s", final)
        return final

    # ---- the loop --------------------------------------------------------------------------------
    def fit(self, start_step: int, stop_after: int | None = None) -> RunResult | None:
        cfg, total = self.cfg, self.cfg.trainer.total_steps
        if self.colocation is None:
            self.weight_sync.start(start_step)  # the servers start from exactly the trainer's weights
        else:  # the same, inside the cycle's end: then the first rollout
            self.colocation.offload_train_state()
            self.weight_sync.push(start_step)
            self.colocation.offload_params()
            self.weight_sync.check(start_step)
            self.colocation.metrics()  # logged; not the first step's
        if self.rank == 0:
            self.coord.start()
        if cfg.trainer.val_every and start_step == 0:
            self.validate(0)
        bar = self._progress_bar(start_step)
        done = 0
        try:
            for step in range(start_step, total):
                metrics = self.train_step(step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        acc=f"{metrics['reward/accuracy']:.2f}",
                        kept=int(metrics["groups/kept"]),
                        gen=int(metrics["groups/gen_batches"]),
                        refresh=False,
                    )
                done += 1
                last = step == total - 1
                if self.colocation is None and self._save_due(step):  # colocated: saved in the step
                    self.save(step, None if last else step + 1)
                if cfg.trainer.val_every and ((step + 1) % cfg.trainer.val_every == 0 or last):
                    self.validate(step + 1)
                if stop_after is not None and done >= stop_after:
                    break
        finally:  # the coordinator and the metrics writer are closed by train_rank
            if bar is not None:
                bar.close()
            self.weight_sync.close()
        return RunResult(done, start_step + done - 1, self.history, self.val) if self.rank == 0 else None

    def _save_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_every
        return bool(every and (step + 1) % every == 0) or step == self.cfg.trainer.total_steps - 1

    def take_batch(self, step: int):
        """Step `step`'s batch from the coordinator (rank 0) and this rank's own DP shard of it."""
        data = self.coord.take_step(step, self.actor.layout.dp) if self.rank == 0 else None
        return data, scatter_shards(data and data.shards, self.dp_rank_of)

    def train_step(self, step: int) -> dict | None:
        """Step `step`: take its batch, train on this rank's shard, sync weights at version step + 1, log."""
        if self.colocation is not None:
            return self.colocated_step(step)
        t_step = time.perf_counter()
        data, shard = self.take_batch(step)
        t_gen = time.perf_counter() - t_step
        t0 = time.perf_counter()
        train_metrics = self.actor.train_step(shard)
        t_train = time.perf_counter() - t0
        sync_metrics = self.sync_weights(step + 1)
        metrics = None
        if self.rank == 0:
            metrics = self._log_step(step, data, train_metrics, sync_metrics, t_step, t_gen, t_train)
        if self.on_step_end is not None:
            self.on_step_end(step, self.actor, shard.batch)
        return metrics

    def colocated_step(self, step: int) -> dict | None:
        """Step `step` of the colocated cycle (trainer/colocation.py): the rollout ran with the trainer
        offloaded; the servers release, the trainer reloads, trains (and checkpoints, the only phase with its
        whole state on the GPUs), offloads gradients and optimizer state, pushes the weights to the resumed
        servers, offloads its parameters; the servers get their KV cache back; then the coordinator learns
        version step + 1 and the next rollout starts."""
        cycle = self.colocation
        t_step = time.perf_counter()
        data, shard = self.take_batch(step)
        t_gen = time.perf_counter() - t_step
        cycle.release_servers()
        cycle.reload_trainer()
        t0 = time.perf_counter()
        train_metrics = self.actor.train_step(shard)
        t_train = time.perf_counter() - t0
        if self._save_due(step):  # the next batch is not generated yet: a resumed run generates it
            self.save(step, None)
        cycle.offload_train_state()
        self.weight_sync.push(step + 1)  # AllAtOnceSync: colocated runs validate rollout.sync.policy=all_at_once
        if self.on_step_end is not None:  # it may export the weights: the parameters are still here
            self.on_step_end(step, self.actor, shard.batch)
        cycle.offload_params()
        sync_metrics = self.weight_sync.check(step + 1)  # the servers' probe needs their KV cache
        if self.rank == 0:
            self.coord.set_version(step + 1)
            sync_metrics = {**sync_metrics, **cycle.metrics()}
            return self._log_step(step, data, train_metrics, sync_metrics, t_step, t_gen, t_train)
        cycle.metrics()
        return None

    def sync_weights(self, version: int) -> dict[str, float]:
        return self.weight_sync.after_step(version)

    def validate(self, step: int) -> None:
        res = self.coord.validate() if self.rank == 0 else None
        if res is not None:
            self.writer.log(step, res)
            self.writer.table(step, "val/by_source", "data source", by_source(res))
            self.val.setdefault("first", (step, res))
            self.val["last"] = (step, res)
            self.val.setdefault("all", []).append((step, res))
            log.info("step %d validation: %s", step, res)

    # ---- rank 0's bookkeeping ----------------------------------------------------------------------
    def _log_step(self, step, data, train_metrics, sync_metrics, t_step, t_gen, t_train) -> dict:
        m = dict(data.metrics)
        m.update({k: float(v) for k, v in train_metrics.items()})
        m.update(sync_metrics)
        m.update(self.coord.registry.metrics())
        elapsed = time.perf_counter() - t_step
        m.update(
            {
                "time/generation_wait_s": t_gen,
                "time/train_s": t_train,
                "time/step_s": elapsed,
                "throughput/tokens_per_s": data.tokens / max(1e-9, elapsed),
            }
        )
        extra = {**data.extra, "weight_version": step + 1, **self.weight_sync.step_extra()}
        self.writer.log(step, m, staleness=data.staleness, extra=extra)
        if step % self.cfg.logging.log_every == 0 or step == self.cfg.trainer.total_steps - 1:
            log.info("step %d: %s", step, console_line(m))
        self.history.append({"step": step, **m})
        return m

    def _progress_bar(self, start_step: int):
        if self.rank != 0 or not self.cfg.logging.progress_bar:
            return None
        from tqdm import tqdm  # only rank 0 with a progress bar needs it

        return tqdm(
            total=self.cfg.trainer.total_steps, initial=start_step, desc="DAPO", unit="step", dynamic_ncols=True
        )


def _colocation_cycle(cfg, rank: int, server_urls) -> ColocationCycle:
    """This rank's colocated cycle: rank 0 calls the servers, every rank meets at the default group's barriers."""
    servers = ServerMemory(server_urls, cfg.rollout.api_key, derived.sync_timeout_s(cfg)) if rank == 0 else None
    return ColocationCycle(servers, dist.barrier)
