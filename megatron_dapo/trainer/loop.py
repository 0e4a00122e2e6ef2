"""The DAPO training loop, as run by every trainer rank (launched by Ray or by torchrun).

    step t:  rank 0 takes a batch of B informative groups (no sample older than t - staleness)
             -> every rank gets it -> actor: old-logprob recompute, DAPO loss, optimizer step
             -> weight sync (all ranks export HF tensors, rank 0 broadcasts) -> servers at t + 1
             -> metrics, checkpoint, validation

Rank 0 also runs the rollout producer (megatron_dapo.trainer.rollout_side) on a background
thread: generation of the next batches overlaps the training of this one, within the staleness
bound. Checkpoints hold the model and optimizer (the actor's torch_dist checkpoint), RNG states,
the data position, the weight version, the buffered groups, and the already-generated batch of
the next step, so a resumed run trains the next step on exactly the data the interrupted one would have.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.config import dump_yaml
from megatron_dapo.config.derived import checkpoint_dir, gen_batch_size, max_new_tokens
from megatron_dapo.trainer import checkpoint as ckpt
from megatron_dapo.trainer.batch import RolloutBatch, build_batch, probe_batch
from megatron_dapo.trainer.groups import JudgedGroup
from megatron_dapo.trainer.metrics import (MetricsWriter, batch_metrics, console_line, response_metrics,
                                           staleness_metrics)
from megatron_dapo.trainer.rollout_side import BatchInfo, ProducerSettings, RolloutProducer

log = logging.getLogger(__name__)


class RunSetupError(RuntimeError):
    """The run cannot start (bad dataset, reward function, tokenizer); raised on every rank."""


@dataclass
class RunResult:
    steps_done: int
    last_step: int
    metrics: list[dict]
    val: dict


def sampling_params(cfg, n: int = 1):
    from megatron_dapo.rollout.types import SamplingParams

    s = cfg.rollout.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=max_new_tokens(cfg),
                          stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None, n=n)


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.hf_path)


def prompt_dataset(cfg, files, tokenizer):
    from megatron_dapo.data.dataset import PromptDataset

    d = cfg.data
    return PromptDataset(files, tokenizer, d.max_prompt_length, truncation=d.truncation, prompt_key=d.prompt_key)


def reward_runner(cfg):
    from megatron_dapo.rewards import RewardRunner, get_reward

    fn = get_reward(cfg.reward.name)
    kwargs = dict(cfg.reward.kwargs)
    call = (lambda response, ground_truth, **extra: fn(response, ground_truth, **{**extra, **kwargs})) if kwargs else fn
    # the dataset's extra_info is passed as keyword arguments: built-ins ignore what they do not know
    return RewardRunner(default=_tolerant(call), timeout_s=cfg.reward.timeout_s)


def _tolerant(fn):
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn
    names = {p.name for p in params}
    return lambda response, ground_truth, **extra: fn(response, ground_truth, **{k: v for k, v in extra.items() if k in names})


def coordination_settings(r) -> dict:
    """ProducerSettings fields of rollout.redundancy / rollout.retry / rollout.migration."""
    from megatron_dapo.coordinator.migration import MigrationPolicyConfig

    m = r.migration
    return {
        "extra_samples": r.redundancy.extra_samples,
        "extra_prompts": r.redundancy.extra_prompts,
        "retry_threshold": r.retry.threshold if r.retry.enabled else 0,
        "migration": MigrationPolicyConfig(m.indicator, m.threshold, m.stop_indicator, m.stop_threshold)
        if m.enabled else None,
        "check_interval_s": r.sync.check_interval_ms / 1000.0,
    }


def _build_producer(cfg, server_urls, dataset, tokenizer, registry=None):
    from megatron_dapo.coordinator.queues import QueueConfig
    from megatron_dapo.coordinator.routing import RoutingConfig
    from megatron_dapo.data.dataset import PromptSampler
    from megatron_dapo.rollout.router import Router

    fg = cfg.algo.filter_groups
    settings = ProducerSettings(
        train_batch_size=cfg.algo.train_batch_size,
        n=cfg.rollout.n_resp_per_prompt,
        sampling=sampling_params(cfg),
        max_response_length=cfg.data.max_response_length,
        staleness=cfg.algo.staleness,
        gen_batch_size=gen_batch_size(cfg),
        max_num_gen_batches=fg.max_num_gen_batches if fg.enable else 0,
        filter_metric=fg.metric if fg.enable else None,
        overlong=cfg.algo.overlong_buffer,
        seed=cfg.trainer.seed if cfg.rollout.sampling.seeded else None,
        partial_rollout=cfg.rollout.partial_rollout,
        **coordination_settings(cfg.rollout),
    )
    sampler = PromptSampler(len(dataset), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    r = cfg.rollout

    def router():
        return Router(server_urls, api_key=r.api_key, max_in_flight_per_server=r.concurrency,
                      client_kwargs={"timeout_s": r.request_timeout_s}, registry=registry,
                      routing=RoutingConfig(**vars(r.routing)), queue=QueueConfig(**vars(r.queue)))

    return RolloutProducer(router, dataset, sampler, reward_runner(cfg), settings, tokenizer=tokenizer)


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _step_metrics(info: BatchInfo, cfg, batch: RolloutBatch) -> dict:
    m = response_metrics(info.groups)
    m.update(batch_metrics(batch))
    m.update({
        "groups/kept": info.kept,
        "groups/dropped_all_correct": info.dropped_all_correct,
        "groups/dropped_all_wrong": info.dropped_all_wrong,
        "groups/gen_batches": info.gen_batches,
        "reward/failures": info.reward_failures,
        # measured on the batch, not assumed: the reservation protocol keeps it at 0
        "groups/over_staleness_bound": sum(n for k, n in info.staleness.items() if k > cfg.algo.staleness),
    })
    m.update(info.metrics())
    m.update(staleness_metrics(info.staleness, cfg.algo.staleness))
    return m


def _save(cfg, actor, step: int, version: int, producer: RolloutProducer | None, next_info: BatchInfo | None,
          rank: int) -> Path | None:
    save_dir = Path(checkpoint_dir(cfg))
    tmp = ckpt.begin_save(save_dir, step) if rank == 0 else ckpt.tmp_dir(save_dir, step)
    dist.barrier()
    actor.save_checkpoint(str(tmp / "model"))
    ckpt.save_rng(tmp, rank)
    dist.barrier()
    final = None
    if rank == 0:
        rollout = producer.state_dict()
        rollout["next_batch"] = None if next_info is None else {
            **{k: getattr(next_info, k) for k in ("kept", "dropped_all_correct", "dropped_all_wrong", "gen_batches",
                                                   "reward_failures", "wait_s", "reserved_slots",
                                                   "occupied_slots", "partial_resumes", "tokens_regenerated")},
            "staleness": dict(next_info.staleness),
            "coordination": dict(next_info.coordination),
            "groups": [g.to_state() for g in next_info.groups],
        }
        ckpt.write_rollout_state(tmp, rollout)
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


def _restore_rollout(producer: RolloutProducer, found: Path, state: dict) -> BatchInfo | None:
    """Load a checkpoint's rollout state into the producer; returns the saved next batch. A state
    that does not fit (missing keys, wrong types) is a CheckpointError naming the file."""
    from megatron_dapo.data.dataset import DatasetError

    try:
        pending = _restore_next(state.pop("next_batch"))
        producer.load_state_dict(state)
    except DatasetError:  # a sampler state for another dataset: it says so
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ckpt.CheckpointError(f"{found / 'rollout.json'} does not fit this run ({type(e).__name__}: {e})") from None
    return pending


def _restore_next(state: dict | None) -> BatchInfo | None:
    if state is None:
        return None
    state.pop("dropped_stale", None)  # checkpoints from before staleness by reservation
    return BatchInfo(groups=[JudgedGroup.from_state(g) for g in state.pop("groups")],
                     staleness=Counter({int(k): v for k, v in state.pop("staleness").items()}),
                     coordination=Counter(state.pop("coordination", {})), **state)


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
    `on_step_end(step, actor, batch)`: called on every rank after each step's weight sync (a
    collective point: the callback may run collectives such as `actor.export_weights()`).
    """
    from megatron_dapo.runtime.distributed import init_distributed, init_model_parallel
    from megatron_dapo.sync.bridge import WeightSyncBridge

    resume = cfg.checkpoint.resume if resume is None else resume
    info = init_distributed()
    rank = info.rank
    p = cfg.parallel
    init_model_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep, etp=p.etp, seed=cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    run_dir = Path(cfg.logging.run_dir)

    # Output directories, data and the checkpoint to resume first, on rank 0, before anything
    # collective: a bad one is reported on every rank at once instead of leaving the other ranks
    # waiting in a collective (or failing at the first save, after a step of work).
    producer = writer = val_data = resumed = restored_next = registry = None
    per_server = cfg.rollout.sync.policy != "all_at_once"
    error = None
    if rank == 0:
        from megatron_dapo.coordinator.servers import ServerRegistry

        # each server's weight version, routing state and sync / idle time (versions set by the first sync)
        registry = ServerRegistry(server_urls, version=-1)
        from megatron_dapo.data.dataset import DatasetError

        try:
            prepare_output_dirs(cfg)
            dump_yaml(cfg, run_dir / "config.yaml")
            if resume:
                resumed = _read_resume_checkpoint(cfg, dist.get_world_size())
            tokenizer = load_tokenizer(cfg)
            dataset = prompt_dataset(cfg, cfg.data.train_files, tokenizer)
            log.info("train prompts: %d (%d dropped, %d truncated as longer than %d tokens)", len(dataset),
                     dataset.num_dropped_too_long, dataset.num_truncated, cfg.data.max_prompt_length)
            if cfg.data.val_files:
                val_data = prompt_dataset(cfg, cfg.data.val_files, tokenizer)
            producer = _build_producer(cfg, server_urls, dataset, tokenizer, registry)
            if resumed is not None:
                restored_next = _restore_rollout(producer, *resumed)
        except (DatasetError, ValueError, OSError, ckpt.CheckpointError) as e:
            error = f"{type(e).__name__}: {e}"
    error, found = _broadcast((error, resumed and str(resumed[0])))
    if error is not None:
        raise RunSetupError(error)
    if rank == 0:
        writer = MetricsWriter(run_dir, cfg.logging.tensorboard)

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
                                   on_publish=lambda url, v: producer.set_version(v), on_error=producer.fail)
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


    start_step, pending = 0, None
    if resume and found is None and rank == 0:
        log.warning("resume requested but %s holds no checkpoint: starting from scratch", checkpoint_dir(cfg))
    if found is not None:
        found = Path(found)
        actor.load_checkpoint(str(found / "model"))
        ckpt.load_rng(found, rank)
        start_step = ckpt.read_trainer_state(found)["step"] + 1
        if rank == 0:
            pending = restored_next
            log.info("resumed from %s: next step %d", found, start_step)
    # Servers may hold anything (a previous run's weights, a resumed run's older ones): start them
    # from exactly the trainer's weights, at the version the first step is consumed at.
    sync(start_step)
    if syncer is not None:  # every server starts from the trainer's weights, then each follows its policy
        syncer.sync_all()
        syncer.start()

    val = {}

    def validate(step):
        if rank == 0 and val_data is not None:
            from megatron_dapo.trainer.evaluate import ValSettings, evaluate

            res = evaluate(server_urls, val_data, producer.rewards, ValSettings.from_config(cfg),
                           api_key=cfg.rollout.api_key, tokenizer=producer.tokenizer,
                           timeout_s=cfg.rollout.request_timeout_s).metrics
            writer.log(step, res)
            val.setdefault("first", (step, res))
            val["last"] = (step, res)
            val.setdefault("all", []).append((step, res))
            log.info("step %d validation: %s", step, res)

    poller = None
    if rank == 0:
        from megatron_dapo.coordinator.load_poller import LoadPoller, poll_interval_s

        if (interval := poll_interval_s(cfg.rollout)) is not None:  # each server's own load, in the registry
            poller = LoadPoller(registry, interval, api_key=cfg.rollout.api_key).start()
        producer.start()
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
            if rank == 0:
                binfo = pending if pending is not None else producer.take_batch(step)
                pending = None
                batch = build_batch(binfo.groups, step, cfg.rollout.sampling.temperature,
                                    cfg.algo.norm_adv_by_std, cfg.algo.overlong_filter)
            else:
                binfo, batch = None, None
            batch = _broadcast(batch)
            t_gen = time.perf_counter() - t_step
            t0 = time.perf_counter()
            train_metrics = actor.train_step(batch)
            t_train = time.perf_counter() - t0
            sync_metrics = sync(step + 1)
            if rank == 0:
                if not per_server:
                    producer.set_version(step + 1)
                tokens = sum(len(x) for x in batch.input_ids)
                m = _step_metrics(binfo, cfg, batch)
                m.update({k: float(v) for k, v in train_metrics.items()})
                m.update(sync_metrics)
                m.update(registry.metrics())
                m.update({"time/generation_wait_s": t_gen, "time/train_s": t_train,
                          "time/step_s": time.perf_counter() - t_step,
                          "throughput/tokens_per_s": tokens / max(1e-9, time.perf_counter() - t_step)})
                extra = {"prompt_indices": batch.prompt_indices, "weight_version": step + 1,
                         "sample_versions": [min(v) if v else step for v in batch.token_versions]}
                if per_server:
                    extra["server_syncs"] = registry.take_events()
                writer.log(step, m, staleness=binfo.staleness, extra=extra)
                if step % cfg.logging.log_every == 0 or step == total - 1:
                    log.info("step %d: %s", step, console_line(m))
                history.append({"step": step, **m})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(acc=f"{m['reward/accuracy']:.2f}", kept=int(m["groups/kept"]),
                                    gen=int(m["groups/gen_batches"]), refresh=False)
            if on_step_end is not None:
                on_step_end(step, actor, batch)
            done += 1
            last = step == total - 1
            every = cfg.checkpoint.save_every
            if (every and (step + 1) % every == 0) or last:
                next_info = None
                if rank == 0 and not last:
                    next_info = pending = producer.take_batch(step + 1)
                _save(cfg, actor, step, step + 1, producer, next_info, rank)
            if cfg.trainer.val_every and ((step + 1) % cfg.trainer.val_every == 0 or last):
                validate(step + 1)
            if stop_after is not None and done >= stop_after:
                break
        if bar is not None:
            bar.close()
    finally:
        if poller is not None:
            poller.stop()
        if producer is not None:
            producer.stop()
        if writer is not None:
            writer.close()
        if syncer is not None:
            syncer.close()
        if bridge is not None:
            bridge.close()
    if rank == 0:
        return RunResult(done, start_step + done - 1, history, val)
    return None
