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
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.config import dump_yaml
from megatron_dapo.config.derived import checkpoint_dir
from megatron_dapo.coordinator.batch import probe_batch
from megatron_dapo.trainer import checkpoint as ckpt
from megatron_dapo.trainer.metrics import MetricsWriter, console_line

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


def _save(cfg, actor, step: int, version: int, coord, next_step: int | None, rank: int) -> Path | None:
    save_dir = Path(checkpoint_dir(cfg))
    tmp = ckpt.begin_save(save_dir, step) if rank == 0 else ckpt.tmp_dir(save_dir, step)
    dist.barrier()
    actor.save_checkpoint(str(tmp / "model"))
    ckpt.save_rng(tmp, rank)
    dist.barrier()
    final = None
    if rank == 0:
        # the coordinator's state with the next step's batch, taken now
        ckpt.write_rollout_state(tmp, coord.checkpoint_state(next_step))
        ckpt.write_trainer_state(tmp, {"step": step, "version": version, "world_size": dist.get_world_size()})
        final = ckpt.commit_save(save_dir, step, cfg.checkpoint.keep_last)
        log.info("checkpoint saved: %s", final)
    dist.barrier()
    return final


def prepare_output_dirs(cfg) -> None:
    """Create logging.run_dir and the checkpoint directory; OSError naming the key unless both are
    writable directories (a file in the way, a read-only file system)."""
    import tempfile

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
        raise ckpt.CheckpointError(f"{found} was saved by {state['world_size']} trainer ranks, this run has {world_size}")
    for r in range(world_size):
        ckpt.read_rng(found, r)
    return found, ckpt.read_rollout_state(found)


def build_actor(cfg):
    """This rank's actor, HF weights loaded: Megatron (trainer.actor) or FSDP2 (trainer.fsdp_actor)."""
    if cfg.trainer.backend == "fsdp2":
        from megatron_dapo.trainer.fsdp_actor import FSDPActor

        return FSDPActor(cfg)
    from megatron_dapo.trainer.actor import MegatronActor

    return MegatronActor(cfg)


def train_rank(cfg, server_urls: list[str], server_tp_sizes: list[int] | None = None, resume: bool | None = None,
               stop_after: int | None = None, on_step_end=None) -> RunResult | None:
    """Run the whole training on this trainer rank; returns the result on rank 0 (None elsewhere).

    `stop_after`: leave after this many steps of this invocation (as if the run were stopped there).
    `on_step_end(step, actor, batch)`: called on every rank after each step's weight sync with the
    rows this rank trained (its DP shard, a RolloutBatch); a collective point: the callback may run
    collectives such as `actor.export_weights()`.
    """
    from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel

    resume = cfg.checkpoint.resume if resume is None else resume
    info = init_distributed()
    rank = info.rank
    p = cfg.parallel
    init_model_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep, etp=p.etp, seed=cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    run_dir = Path(cfg.logging.run_dir)

    # Output directories, data and the checkpoint to resume first, on rank 0, before anything
    # collective: a bad one is reported on every rank at once instead of leaving the other ranks
    # waiting in a collective (or failing at the first save, after a step of work). The coordinator
    # (its own process) loads the data and builds the rollout side.
    coord = writer = resumed = None
    per_server = cfg.rollout.sync.policy != "all_at_once"
    error = None
    try:
        if rank == 0:
            from megatron_dapo.coordinator.process import start_coordinator
            from megatron_dapo.data.dataset import DatasetError

            try:
                prepare_output_dirs(cfg)
                dump_yaml(cfg, run_dir / "config.yaml")
                if resume:
                    resumed = _read_resume_checkpoint(cfg, dist.get_world_size())
                coord = start_coordinator(cfg, server_urls)
                sizes = coord.setup()
                log.info("rollout coordinator: %s; train prompts: %d (%d dropped, %d truncated as longer than %d "
                         "tokens)", coord.where, sizes["train"], sizes["dropped"], sizes["truncated"],
                         cfg.data.max_prompt_length)
                if resumed is not None:
                    found, state = resumed
                    coord.restore(str(found), state, ckpt.read_trainer_state(found)["step"] + 1)
            except (DatasetError, ValueError, OSError, ckpt.CheckpointError) as e:
                error = f"{type(e).__name__}: {e}"
        error, found = _broadcast((error, resumed and str(resumed[0])))
        if error is not None:
            raise RunSetupError(error)
        if rank == 0:
            writer = MetricsWriter(run_dir, cfg.logging.tensorboard)
        return _train(cfg, rank, coord, writer, found, server_urls, server_tp_sizes, resume, per_server,
                      stop_after, on_step_end)
    finally:
        if coord is not None:
            coord.close()
        if writer is not None:
            writer.close()


def _train(cfg, rank, coord, writer, found, server_urls, server_tp_sizes, resume, per_server, stop_after,
           on_step_end) -> RunResult | None:
    from megatron_dapo.coordinator.shards import data_parallel_ranks, scatter_shards
    from megatron_dapo.sync.bridge import WeightSyncBridge

    registry = coord.registry if coord is not None else None
    actor = build_actor(cfg)
    # Under torchrun this variable makes every TCP rendezvous a client of torchrun's agent store;
    # the weight-update group's rendezvous (trainer rank 0 hosting, servers joining) would then
    # have no host and hang. The default group is formed already, so it no longer needs it.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    byte_budget = int(cfg.rollout.sync.bucket_mb * 1024 * 1024)
    # A fixed probe sequence: after each sync the servers' logprobs of it must equal the trainer's.
    probe = torch.randint(3, actor.arch.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    bridge = store = syncer = None
    if per_server:
        from megatron_dapo.sync.per_server import PerServerSync, WeightStore

        store = WeightStore()
        if rank == 0:
            syncer = PerServerSync(server_urls, cfg.rollout.sync, registry, store, api_key=cfg.rollout.api_key,
                                   server_tp_sizes=server_tp_sizes, probe=probe,
                                   on_publish=lambda url, v: coord.set_version(v), on_error=coord.fail)
            syncer.connect()
    else:
        bridge = WeightSyncBridge(server_urls, cfg.rollout.sync, api_key=cfg.rollout.api_key,
                                  server_tp_sizes=server_tp_sizes)
        bridge.connect()

    def store_weights(version: int) -> dict:
        """Per-server sync: the new weights go to the store; each server takes them when its policy says."""
        t0 = time.perf_counter()
        ref = actor.compute_logprobs(probe_batch(probe, version))[0].tolist() if cfg.rollout.sync.verify else None
        store.put(version, actor.export_weights(byte_budget=byte_budget), ref)
        out = {"time/sync_s": time.perf_counter() - t0}
        if rank == 0:
            out["sync/store_bytes"] = float(store.snapshot().nbytes)
            syncer.notify()
        return out

    def sync(version: int) -> dict:
        if per_server:
            return store_weights(version)
        t0 = time.perf_counter()
        stats = bridge.sync(actor.export_weights(byte_budget=byte_budget), version=version)
        out = stats.as_metrics() if stats is not None else {}
        out["time/sync_s"] = time.perf_counter() - t0
        if cfg.rollout.sync.verify:
            ref = actor.compute_logprobs(probe_batch(probe, version))[0]
            if rank == 0:
                out["sync/verify_max_abs_diff"] = bridge.verify(probe, ref.tolist())
                out["sync/probe_logprob_mean"] = float(ref.double().mean())
        if rank == 0:
            registry.publish_all(version, out["time/sync_s"])
        return out


    start_step = 0
    if resume and found is None and rank == 0:
        log.warning("resume requested but %s holds no checkpoint: starting from scratch", checkpoint_dir(cfg))
    if found is not None:
        found = Path(found)
        actor.load_checkpoint(str(found / "model"))
        ckpt.load_rng(found, rank)
        start_step = ckpt.read_trainer_state(found)["step"] + 1
        if rank == 0:
            log.info("resumed from %s: next step %d", found, start_step)
    # Servers may hold anything (a previous run's weights, a resumed run's older ones): start them
    # from exactly the trainer's weights, at the version the first step is consumed at.
    sync(start_step)
    if syncer is not None:  # every server starts from the trainer's weights, then each follows its policy
        syncer.sync_all()
        syncer.start()

    val = {}

    def validate(step):
        res = coord.validate() if rank == 0 else None
        if res is not None:
            writer.log(step, res)
            val.setdefault("first", (step, res))
            val["last"] = (step, res)
            val.setdefault("all", []).append((step, res))
            log.info("step %d validation: %s", step, res)

    dp_rank_of = data_parallel_ranks(actor.dp_rank)
    if rank == 0:
        coord.start()
    try:
        total = cfg.trainer.total_steps
        if cfg.trainer.val_every and start_step == 0:
            validate(0)
        bar = None
        if rank == 0 and cfg.logging.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=start_step, desc="DAPO", unit="step", dynamic_ncols=True)
        history, done = [], 0
        for step in range(start_step, total):
            t_step = time.perf_counter()
            data = coord.take_step(step, actor.dp_size) if rank == 0 else None
            shard = scatter_shards(data and data.shards, dp_rank_of)  # each rank: its own DP shard only
            t_gen = time.perf_counter() - t_step
            t0 = time.perf_counter()
            train_metrics = actor.train_step(shard)
            t_train = time.perf_counter() - t0
            sync_metrics = sync(step + 1)
            if rank == 0:
                if not per_server:
                    coord.set_version(step + 1)
                m = dict(data.metrics)
                m.update({k: float(v) for k, v in train_metrics.items()})
                m.update(sync_metrics)
                m.update(registry.metrics())
                m.update({"time/generation_wait_s": t_gen, "time/train_s": t_train,
                          "time/step_s": time.perf_counter() - t_step,
                          "throughput/tokens_per_s": data.tokens / max(1e-9, time.perf_counter() - t_step)})
                extra = {**data.extra, "weight_version": step + 1}
                if per_server:
                    extra["server_syncs"] = registry.take_events()
                writer.log(step, m, staleness=data.staleness, extra=extra)
                if step % cfg.logging.log_every == 0 or step == total - 1:
                    log.info("step %d: %s", step, console_line(m))
                history.append({"step": step, **m})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(acc=f"{m['reward/accuracy']:.2f}", kept=int(m["groups/kept"]),
                                    gen=int(m["groups/gen_batches"]), refresh=False)
            if on_step_end is not None:
                on_step_end(step, actor, shard.batch)
            done += 1
            last = step == total - 1
            every = cfg.checkpoint.save_every
            if (every and (step + 1) % every == 0) or last:
                _save(cfg, actor, step, step + 1, coord, None if last else step + 1, rank)
            if cfg.trainer.val_every and ((step + 1) % cfg.trainer.val_every == 0 or last):
                validate(step + 1)
            if stop_after is not None and done >= stop_after:
                break
        if bar is not None:
            bar.close()
    finally:  # the coordinator and the metrics writer are closed by train_rank
        if syncer is not None:
            syncer.close()
        if bridge is not None:
            bridge.close()
    if rank == 0:
        return RunResult(done, start_step + done - 1, history, val)
    return None
