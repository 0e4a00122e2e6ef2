"""Cross-field rules of a config, checked before any process starts.

`validate_config` collects every broken rule and raises one ConfigError whose one-line message
names the key(s) of each; it returns notes about checks it had to skip (no model shape known).
Model-dependent rules use the shape resolved by `shapes.resolve_model_shape`.
"""

from __future__ import annotations

from dataclasses import replace
from urllib.parse import urlparse

from megatron_dapo.config import derived
from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.config.shapes import ModelShape, resolve_model_shape
from megatron_dapo.runtime.net import is_loopback, is_this_host, is_wildcard


def _check_parallel(cfg: DapoConfig, errors: list[str]) -> None:
    p, t = cfg.parallel, cfg.trainer
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name) < 1:
            errors.append(f"parallel.{name}={getattr(p, name)} must be >= 1")
    for name in ("vpp", "etp", "dp"):
        value = getattr(p, name)
        if value is not None and value < 1:
            errors.append(f"parallel.{name}={value} must be >= 1 or null")
    if p.cp_comm_type is not None and p.cp == 1:
        errors.append(f"parallel.cp_comm_type={p.cp_comm_type} applies to parallel.cp > 1 only (cp=1)")
    if p.cp > 1 and cfg.model.transformer_impl == "local" and p.cp_comm_type not in (None, "all_gather"):
        errors.append(
            f"parallel.cp_comm_type={p.cp_comm_type} needs model.transformer_impl=transformer_engine; the local "
            f"spec's context-parallel attention all-gathers K/V (cp_comm_type=all_gather or null)"
        )
    if p.vpp is not None and p.vpp > 1 and p.pp < 2:
        errors.append(f"parallel.vpp={p.vpp} needs parallel.pp >= 2 (got {p.pp})")
    if t.nnodes < 1 or t.gpus_per_node < 1:
        errors.append(f"trainer.nnodes={t.nnodes} and trainer.gpus_per_node={t.gpus_per_node} must be >= 1")
    if errors:
        return
    world = derived.trainer_world_size(cfg)
    if world < 1:
        errors.append(
            f"trainer world size is {world}: trainer.nnodes * trainer.gpus_per_node = {t.nnodes * t.gpus_per_node} "
            f"GPUs, rollout.num_servers * rollout.server_tp = {derived.launched_rollout_gpus(cfg)} go to SGLang"
        )
        return
    total = t.nnodes * t.gpus_per_node
    if t.world_size is not None and world + derived.launched_rollout_gpus(cfg) > total:
        errors.append(
            f"trainer.world_size={world} plus {derived.launched_rollout_gpus(cfg)} SGLang GPUs "
            f"(rollout.num_servers * rollout.server_tp) exceed trainer.nnodes * trainer.gpus_per_node = {total}"
        )
        return
    mp = derived.model_parallel_size(cfg)
    if world % mp:
        errors.append(
            f"parallel.tp * parallel.pp * parallel.cp = {p.tp}*{p.pp}*{p.cp} = {mp} does not divide "
            f"the trainer world size {world} ({_world_source(cfg)})"
        )
        return
    if p.dp is not None and mp * p.dp != world:
        errors.append(
            f"parallel.tp * parallel.pp * parallel.cp * parallel.dp = {mp}*{p.dp} = {mp * p.dp} != "
            f"trainer world size {world} ({_world_source(cfg)})"
        )
        return
    etp = derived.expert_tp_size(cfg)
    stage_ranks = world // p.pp
    if stage_ranks % (p.ep * etp):
        errors.append(
            f"parallel.ep * parallel.etp = {p.ep}*{etp} must divide tp * cp * dp = {stage_ranks} "
            f"(the ranks of one pipeline stage)"
        )
    if cfg.trainer.backend == "fsdp2":
        bad = [f"parallel.{n}={getattr(p, n)}" for n in ("tp", "pp", "cp", "ep") if getattr(p, n) != 1]
        if bad:
            errors.append(f"trainer.backend=fsdp2 shards over data parallel only; set {', '.join(bad)} to 1")


def _world_source(cfg: DapoConfig) -> str:
    if cfg.trainer.world_size is not None:
        return "trainer.world_size"
    t, used = cfg.trainer, derived.launched_rollout_gpus(cfg)
    text = f"trainer.nnodes * trainer.gpus_per_node = {t.nnodes}*{t.gpus_per_node}"
    return text + (f" minus {used} SGLang GPUs (rollout.num_servers * rollout.server_tp)" if used else "")


def _check_model(cfg: DapoConfig, shape: ModelShape, source: str, errors: list[str]) -> None:
    p = cfg.parallel
    if p.tp >= 1 and shape.num_attention_heads % p.tp:
        errors.append(f"parallel.tp={p.tp} does not divide num_attention_heads={shape.num_attention_heads} ({source})")
    if p.tp >= 1 and shape.num_kv_heads % p.tp:
        errors.append(f"parallel.tp={p.tp} does not divide num_key_value_heads={shape.num_kv_heads} ({source})")
    if p.pp >= 1:
        stages = p.pp * (p.vpp or 1)
        if shape.num_layers % stages:
            keys = "parallel.pp * parallel.vpp" if p.vpp else "parallel.pp"
            errors.append(f"{keys}={stages} does not divide num_hidden_layers={shape.num_layers} ({source})")
    if shape.is_moe:
        if p.ep >= 1 and shape.num_experts % p.ep:
            errors.append(f"parallel.ep={p.ep} does not divide num_experts={shape.num_experts} ({source})")
        if p.tp > 1 and not p.sequence_parallel and cfg.trainer.backend == "megatron":
            errors.append(f"parallel.sequence_parallel must be true for an MoE model with parallel.tp={p.tp}")
        if cfg.trainer.backend == "fsdp2" and cfg.algo.routing_replay != "none":
            errors.append(
                f"trainer.backend=fsdp2 does not replay the rollout's routing; algo.routing_replay="
                f"{cfg.algo.routing_replay or 'null (rollout for an MoE model)'} needs trainer.backend=megatron, "
                f"or set algo.routing_replay=none ({source})"
            )
    else:
        if cfg.algo.routing_replay == "rollout":
            errors.append(f"algo.routing_replay=rollout needs an MoE model; the model is dense ({source}): use none")
        if p.ep > 1:
            errors.append(f"parallel.ep={p.ep} but the model is dense ({source}); use parallel.ep=1")
        if p.etp is not None and p.etp > 1:
            errors.append(f"parallel.etp={p.etp} but the model is dense ({source})")
    r = cfg.rollout
    if r.engine == "sglang" and r.server_tp >= 1 and shape.num_attention_heads % r.server_tp:
        errors.append(
            f"rollout.server_tp={r.server_tp} does not divide "
            f"num_attention_heads={shape.num_attention_heads} ({source})"
        )


def _check_algo(cfg: DapoConfig, errors: list[str]) -> None:
    a = cfg.algo
    if not 0.0 <= a.clip_ratio_low < 1.0:
        errors.append(f"algo.clip_ratio_low={a.clip_ratio_low} must be in [0, 1)")
    if a.clip_ratio_high < 0.0:
        errors.append(f"algo.clip_ratio_high={a.clip_ratio_high} must be >= 0")
    if a.clip_ratio is not None and (a.clip_ratio_low, a.clip_ratio_high) != (a.clip_ratio, a.clip_ratio):
        errors.append(
            f"algo.clip_ratio={a.clip_ratio} conflicts with algo.clip_ratio_low={a.clip_ratio_low} / "
            f"algo.clip_ratio_high={a.clip_ratio_high}: give either the symmetric clip_ratio or the pair"
        )
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1.0:
        errors.append(f"algo.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual clip; DAPO recipe: 10.0) or null")
    if a.loss_scale_factor is not None:
        if not a.loss_scale_factor > 0:
            errors.append(f"algo.loss_scale_factor={a.loss_scale_factor} must be > 0 or null")
        if a.loss_agg_mode != "seq-mean-token-sum-norm":
            errors.append(
                f"algo.loss_scale_factor={a.loss_scale_factor} only applies to "
                f"algo.loss_agg_mode=seq-mean-token-sum-norm (got {a.loss_agg_mode})"
            )
    if a.fused_lm_head is True and cfg.trainer.backend == "fsdp2":
        errors.append(
            "algo.fused_lm_head=true applies to the Megatron actor only, not trainer.backend=fsdp2; "
            "set algo.fused_lm_head=false"
        )
    _check_batches(cfg, errors)
    _check_shaping(cfg, errors)
    _check_dp_share(cfg, errors)


def _check_batches(cfg: DapoConfig, errors: list[str]) -> None:
    """Batch sizes, epochs, staleness and micro-batch budget (algo.*)."""
    a = cfg.algo
    if a.train_batch_size < 1:
        errors.append(f"algo.train_batch_size={a.train_batch_size} must be >= 1")
    if a.ppo_mini_batch_size < 1:
        errors.append(f"algo.ppo_mini_batch_size={a.ppo_mini_batch_size} must be >= 1")
    elif a.train_batch_size >= 1 and a.train_batch_size % a.ppo_mini_batch_size:
        errors.append(
            f"algo.ppo_mini_batch_size={a.ppo_mini_batch_size} does not divide "
            f"algo.train_batch_size={a.train_batch_size}"
        )
    if a.ppo_epochs < 1:
        errors.append(f"algo.ppo_epochs={a.ppo_epochs} must be >= 1")
    if a.gen_batch_size is not None and a.gen_batch_size < 1:
        errors.append(f"algo.gen_batch_size={a.gen_batch_size} must be >= 1 or null")
    if a.staleness < 0:
        errors.append(f"algo.staleness={a.staleness} must be >= 0 (0 = synchronous)")
    if a.staleness_buffer_groups is not None and a.staleness_buffer_groups != a.train_batch_size:
        errors.append(
            f"algo.staleness_buffer_groups={a.staleness_buffer_groups} must equal algo.train_batch_size="
            f"{a.train_batch_size} (or be null): a staleness buffer is one training step's batch, as in PSRL; "
            f"more groups in flight than the batch is batch-level redundancy (rollout.redundancy.extra_prompts)"
        )
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if a.max_tokens_per_micro_batch is not None and a.max_tokens_per_micro_batch < seq:
        errors.append(
            f"algo.max_tokens_per_micro_batch={a.max_tokens_per_micro_batch} is below one full sequence "
            f"(data.max_prompt_length + data.max_response_length = {seq})"
        )


def _check_shaping(cfg: DapoConfig, errors: list[str]) -> None:
    """KL, entropy, dynamic sampling, overlong shaping and rollout importance sampling (algo.*)."""
    a = cfg.algo
    if a.kl_coef != 0:
        errors.append(
            f"algo.kl_coef={a.kl_coef} is not supported: DAPO removes the KL penalty (Yu et al. 2025, "
            f"arXiv:2503.14476, sec. 2.3 'Removing KL Divergence'), so no reference policy is kept; set 0"
        )
    if a.entropy_coeff < 0:
        errors.append(f"algo.entropy_coeff={a.entropy_coeff} must be >= 0")
    if a.filter_groups.enable and cfg.rollout.n_resp_per_prompt < 2:
        errors.append(
            f"algo.filter_groups.enable needs rollout.n_resp_per_prompt >= 2 (got {cfg.rollout.n_resp_per_prompt}): "
            f"a group of one never has spread"
        )
    if a.filter_groups.max_num_gen_batches < 0:
        errors.append(f"algo.filter_groups.max_num_gen_batches={a.filter_groups.max_num_gen_batches} must be >= 0")
    ob = a.overlong_buffer
    if ob.enable:
        if not 0 < ob.len < cfg.data.max_response_length:
            errors.append(
                f"algo.overlong_buffer.len={ob.len} must be in "
                f"(0, data.max_response_length={cfg.data.max_response_length})"
            )
        if ob.penalty_factor < 0:
            errors.append(f"algo.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")
    if a.rollout_is.enable and a.rollout_is.cap < 1.0:
        errors.append(f"algo.rollout_is.cap={a.rollout_is.cap} must be >= 1")


def _check_dp_share(cfg: DapoConfig, errors: list[str]) -> None:
    """Every data-parallel rank gets at least one sequence per optimizer step (only once the rest holds)."""
    a = cfg.algo
    if not errors:
        dp = _dp_or_none(cfg)
        samples = a.ppo_mini_batch_size * cfg.rollout.n_resp_per_prompt
        if dp is not None and samples < dp:
            errors.append(
                f"algo.ppo_mini_batch_size * rollout.n_resp_per_prompt = {samples} sequences per optimizer step "
                f"is fewer than the {dp} data-parallel ranks"
            )


def _dp_or_none(cfg: DapoConfig) -> int | None:
    try:
        world, mp = derived.trainer_world_size(cfg), derived.model_parallel_size(cfg)
    except Exception:
        return None
    return derived.data_parallel_size(cfg) if mp >= 1 and world >= 1 and world % mp == 0 else None


def _check_optimizer(cfg: DapoConfig, errors: list[str]) -> None:
    o = cfg.optimizer
    if o.lr <= 0:
        errors.append(f"optimizer.lr={o.lr} must be > 0")
    if not 0 <= o.min_lr <= o.lr:
        errors.append(f"optimizer.min_lr={o.min_lr} must be in [0, optimizer.lr={o.lr}]")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            errors.append(f"optimizer.{name}={getattr(o, name)} must be in [0, 1)")
    if o.adam_eps <= 0:
        errors.append(f"optimizer.adam_eps={o.adam_eps} must be > 0")
    if o.weight_decay < 0:
        errors.append(f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    if o.clip_grad < 0:
        errors.append(f"optimizer.clip_grad={o.clip_grad} must be >= 0 (0 = off)")
    if o.lr_warmup_steps < 0:
        errors.append(f"optimizer.lr_warmup_steps={o.lr_warmup_steps} must be >= 0")
    if o.lr_decay_steps is not None and o.lr_decay_steps < 1:
        errors.append(f"optimizer.lr_decay_steps={o.lr_decay_steps} must be >= 1 or null")


def _check_rollout(cfg: DapoConfig, errors: list[str]) -> None:
    r, s = cfg.rollout, cfg.rollout.sampling
    for i, url in enumerate(r.servers):
        if not url.startswith(("http://", "https://")):
            errors.append(f"rollout.servers[{i}]={url!r} must be an http:// or https:// URL")
    if r.num_servers < 1:
        errors.append(f"rollout.num_servers={r.num_servers} must be >= 1")
    if r.server_tp < 1:
        errors.append(f"rollout.server_tp={r.server_tp} must be >= 1")
    if derived.launched_rollout_gpus(cfg) and r.server_tp > cfg.trainer.gpus_per_node:
        errors.append(
            f"rollout.server_tp={r.server_tp} exceeds trainer.gpus_per_node={cfg.trainer.gpus_per_node}: "
            f"an SGLang engine runs on one node"
        )
    if r.embedded_batching != "static" and (r.engine != "embedded" or r.servers):
        errors.append(
            f"rollout.embedded_batching={r.embedded_batching} applies only to embedded servers the driver "
            f"launches (rollout.engine=embedded, no rollout.servers); SGLang always batches continuously"
        )
    if r.engine == "embedded" and r.server_tp != 1:
        errors.append(f"rollout.server_tp={r.server_tp}: the embedded engine has no tensor parallelism; use 1")
    if cfg.trainer.launcher == "torchrun" and r.engine == "sglang" and not r.servers:
        errors.append("trainer.launcher=torchrun starts no SGLang servers: list them in rollout.servers")
    if not 0.0 < r.mem_fraction_static < 1.0:
        errors.append(f"rollout.mem_fraction_static={r.mem_fraction_static} must be in (0, 1)")
    if r.n_resp_per_prompt < 1:
        errors.append(f"rollout.n_resp_per_prompt={r.n_resp_per_prompt} must be >= 1")
    if r.concurrency < 1:
        errors.append(f"rollout.concurrency={r.concurrency} must be >= 1")
    if r.request_timeout_s <= 0:
        errors.append(f"rollout.request_timeout_s={r.request_timeout_s} must be > 0")
    # Training needs the logprobs of a proper sampling distribution: temperature 0 (greedy) has none.
    if s.temperature <= 0:
        errors.append(f"rollout.sampling.temperature={s.temperature} must be > 0")
    if not 0.0 < s.top_p <= 1.0:
        errors.append(f"rollout.sampling.top_p={s.top_p} must be in (0, 1]")
    if s.top_k == 0 or s.top_k < -1:
        errors.append(f"rollout.sampling.top_k={s.top_k} must be -1 (off) or >= 1")
    if s.max_new_tokens is not None and not 1 <= s.max_new_tokens <= cfg.data.max_response_length:
        errors.append(
            f"rollout.sampling.max_new_tokens={s.max_new_tokens} must be in [1, data.max_response_length="
            f"{cfg.data.max_response_length}]"
        )
    if r.sync.timeout_s is not None and r.sync.timeout_s <= 0:
        errors.append(f"rollout.sync.timeout_s={r.sync.timeout_s} must be > 0 (or null: rollout.request_timeout_s)")
    servers = len(r.servers) or r.num_servers
    if not 1 <= r.min_healthy_servers <= servers:
        errors.append(
            f"rollout.min_healthy_servers={r.min_healthy_servers} must be between 1 and the {servers} server(s)"
        )
    if r.relaunch_max < 1:
        errors.append(f"rollout.relaunch_max={r.relaunch_max} must be >= 1 (rollout.relaunch=false: never relaunch)")
    if r.sync.bucket_mb < 1:
        errors.append(f"rollout.sync.bucket_mb={r.sync.bucket_mb} must be >= 1")
    if r.sync.verify_tolerance <= 0:
        errors.append(f"rollout.sync.verify_tolerance={r.sync.verify_tolerance} must be > 0")
    if r.sync.sources == "per_stage" and r.sync.policy != "all_at_once":
        errors.append(
            f"rollout.sync.sources=per_stage needs rollout.sync.policy=all_at_once (got {r.sync.policy}: its "
            "weight store is trainer rank 0's copy); use rollout.sync.sources=rank0 or auto"
        )
    if r.sync.sources == "per_stage" and cfg.trainer.backend == "fsdp2":
        errors.append(
            "rollout.sync.sources=per_stage applies to trainer.backend=megatron (pipeline stages / expert ranks), "
            "not fsdp2; use rollout.sync.sources=rank0 or auto"
        )
    if r.loads.interval_ms < 0:
        errors.append(f"rollout.loads.interval_ms={r.loads.interval_ms} must be >= 0 (0 = off)")
    # the coordinator's own sections check their values when built; the loader sets fields one by one
    for section in (r.sync, r.migration, r.routing, r.queue):
        try:
            replace(section)
        except ValueError as e:
            errors.append(str(e))
    _check_rollout_coordination(cfg, errors)
    _check_routing(cfg, errors)


def _check_rollout_coordination(cfg: DapoConfig, errors: list[str]) -> None:
    """rollout.migration / retry / redundancy: each switch only where it can act."""
    r = cfg.rollout
    for key in ("extra_samples", "extra_prompts"):
        if getattr(r.redundancy, key) < 0:
            errors.append(f"rollout.redundancy.{key}={getattr(r.redundancy, key)} must be >= 0 (0 = off)")
    if r.retry.threshold < 1:
        errors.append(f"rollout.retry.threshold={r.retry.threshold} must be >= 1")
    if r.retry.enabled and cfg.algo.staleness < 1:
        errors.append(
            "rollout.retry.enabled needs algo.staleness >= 1: it moves completed groups down from "
            "later staleness buffers, and at staleness 0 there are none"
        )
    m = r.migration
    if m.enabled:
        if not r.partial_rollout:
            errors.append(
                "rollout.migration.enabled needs rollout.partial_rollout: migrated requests "
                "continue from their tokens on another server"
            )
        servers = len(r.servers) if r.servers else r.num_servers
        if servers < 2:
            errors.append(f"rollout.migration.enabled needs at least 2 rollout servers, got {servers}")


def _check_routing(cfg: DapoConfig, errors: list[str]) -> None:
    routing = cfg.rollout.routing
    if routing.method.startswith("throughput_optimal"):
        if not routing.cost_model:
            errors.append(
                f"rollout.routing.method={routing.method} needs rollout.routing.cost_model (the JSON "
                f"written by `megatron-dapo profile-engine`)"
            )
        else:
            try:
                CostModel.load(routing.cost_model)
            except ValueError as e:
                errors.append(f"rollout.routing.cost_model: {e}")
    elif routing.cost_model:
        errors.append(
            f"rollout.routing.cost_model is used only by throughput_optimal routing "
            f"(rollout.routing.method={routing.method})"
        )


def _check_rest(cfg: DapoConfig, errors: list[str]) -> None:
    if not cfg.model.hf_path:
        errors.append("model.hf_path is required (HF model directory or hub id)")
    d = cfg.data
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        errors.append(
            f"data.max_prompt_length={d.max_prompt_length} and data.max_response_length={d.max_response_length} "
            f"must be >= 1"
        )
    if not d.prompt_key:
        errors.append("data.prompt_key must not be empty")
    if cfg.reward.timeout_s <= 0:
        errors.append(f"reward.timeout_s={cfg.reward.timeout_s} must be > 0")
    if cfg.reward.num_workers < 0:
        errors.append(f"reward.num_workers={cfg.reward.num_workers} must be >= 0 (0 = threads of the coordinator)")
    t = cfg.trainer
    for key, seed in (("trainer.seed", t.seed), ("data.seed", d.seed)):
        if not 0 <= seed < 2**32:  # numpy and megatron-core's seeding take 32-bit unsigned seeds
            errors.append(f"{key}={seed} must be in [0, 2**32)")
    if t.total_steps < 1:
        errors.append(f"trainer.total_steps={t.total_steps} must be >= 1")
    if t.val_every < 0:
        errors.append(f"trainer.val_every={t.val_every} must be >= 0")
    _check_val(cfg, errors)
    _check_bind_host(t.bind_host, errors)
    _check_servers_reach(cfg, errors)
    if t.world_size is not None and t.world_size < 1:
        errors.append(f"trainer.world_size={t.world_size} must be >= 1 or null")
    if cfg.logging.log_every < 1:
        errors.append(f"logging.log_every={cfg.logging.log_every} must be >= 1")
    c = cfg.checkpoint
    if c.save_every < 0:
        errors.append(f"checkpoint.save_every={c.save_every} must be >= 0")
    if c.keep_last < 0:
        errors.append(f"checkpoint.keep_last={c.keep_last} must be >= 0")


def _check_bind_host(host: str, errors: list[str]) -> None:
    try:
        wildcard = is_wildcard(host)
    except ValueError:
        errors.append(f"trainer.bind_host={host!r} must be an IP address of this host (e.g. 127.0.0.1)")
        return
    if wildcard:
        errors.append(
            f"trainer.bind_host={host} would listen on every interface: name one address of this host "
            f"(127.0.0.1 for one machine, the cluster-network IP for several)"
        )


def _check_servers_reach(cfg: DapoConfig, errors: list[str]) -> None:
    """Trainer rank 0 hosts the weight-update group's store at trainer.bind_host: a loopback one is out of
    reach of a rollout server on another machine."""
    try:
        if not is_loopback(cfg.trainer.bind_host):
            return
    except ValueError:  # refused by _check_bind_host
        return
    for i, url in enumerate(cfg.rollout.servers):
        host = urlparse(url).hostname
        if host and not is_this_host(host):
            errors.append(
                f"trainer.bind_host={cfg.trainer.bind_host} is loopback, but rollout.servers[{i}]={url} is on "
                f"another machine, which cannot join the weight-update group there: set trainer.bind_host to "
                f"this node's cluster address"
            )


def _check_val(cfg: DapoConfig, errors: list[str]) -> None:
    v = cfg.trainer.val
    if v.n < 0:
        errors.append(f"trainer.val.n={v.n} must be >= 0")
    elif v.n == 0 and not v.greedy:
        errors.append("trainer.val.n=0 with trainer.val.greedy=false evaluates nothing: set n >= 1 or greedy")
    if v.temperature <= 0:
        errors.append(f"trainer.val.temperature={v.temperature} must be > 0 (greedy answers: trainer.val.greedy)")
    if not 0.0 < v.top_p <= 1.0:
        errors.append(f"trainer.val.top_p={v.top_p} must be in (0, 1]")
    if v.max_new_tokens is not None and v.max_new_tokens < 1:
        errors.append(f"trainer.val.max_new_tokens={v.max_new_tokens} must be >= 1 or null")


def validate_config(cfg: DapoConfig) -> list[str]:
    """Raise ConfigError listing every broken rule; return notes about skipped checks."""
    errors: list[str] = []
    notes: list[str] = []
    _check_rest(cfg, errors)
    # Model-shape errors first: "tp=3 does not divide 4 heads" is the root cause of a layout error.
    if cfg.model.hf_path or cfg.model.hf_config is not None:
        resolved = resolve_model_shape(cfg.model)
        if resolved.shape is None:
            notes.append(
                f"model.hf_path={cfg.model.hf_path!r} has no config.json yet and no model.hf_config is given: "
                f"checks against the model shape (heads, layers, experts) were skipped"
            )
        else:
            _check_model(cfg, resolved.shape, resolved.source, errors)
    layout_errors: list[str] = []
    _check_parallel(cfg, layout_errors)
    errors += layout_errors
    _check_optimizer(cfg, errors)
    _check_rollout(cfg, errors)
    algo_errors: list[str] = []
    _check_algo(cfg, algo_errors)
    errors += algo_errors
    if errors:
        raise ConfigError("; ".join(dict.fromkeys(errors)))
    return notes
