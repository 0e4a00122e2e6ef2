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
from megatron_dapo.runtime.hooks import import_function, is_function_spec
from megatron_dapo.runtime.net import is_loopback, is_this_host, is_wildcard


def _check_parallel(cfg: DapoConfig, errors: list[str]) -> None:
    parallel, trainer = cfg.parallel, cfg.trainer
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(parallel, name) < 1:
            errors.append(f"parallel.{name}={getattr(parallel, name)} must be >= 1")
    for name in ("vpp", "etp", "dp"):
        value = getattr(parallel, name)
        if value is not None and value < 1:
            errors.append(f"parallel.{name}={value} must be >= 1 or null")
    if parallel.cp_comm_type is not None and parallel.cp == 1:
        errors.append(f"parallel.cp_comm_type={parallel.cp_comm_type} applies to parallel.cp > 1 only (cp=1)")
    if parallel.cp > 1 and cfg.model.transformer_impl == "local" and parallel.cp_comm_type not in (None, "all_gather"):
        errors.append(
            f"parallel.cp_comm_type={parallel.cp_comm_type} needs model.transformer_impl=transformer_engine; the local "
            f"spec's context-parallel attention all-gathers K/V (cp_comm_type=all_gather or null)"
        )
    if parallel.vpp is not None and parallel.vpp > 1 and parallel.pp < 2:
        errors.append(f"parallel.vpp={parallel.vpp} needs parallel.pp >= 2 (got {parallel.pp})")
    if trainer.nnodes < 1 or trainer.gpus_per_node < 1:
        errors.append(f"trainer.nnodes={trainer.nnodes} and trainer.gpus_per_node={trainer.gpus_per_node} must be >= 1")
    if errors:
        return
    world = derived.trainer_world_size(cfg)
    if world < 1:
        errors.append(
            f"trainer world size is {world}: trainer.nnodes * trainer.gpus_per_node = "
            f"{trainer.nnodes * trainer.gpus_per_node} "
            f"GPUs, rollout.num_servers * rollout.server_tp = {derived.launched_rollout_gpus(cfg)} go to SGLang"
        )
        return
    total = trainer.nnodes * trainer.gpus_per_node
    if trainer.world_size is not None and world + derived.launched_rollout_gpus(cfg) > total:
        errors.append(
            f"trainer.world_size={world} plus {derived.launched_rollout_gpus(cfg)} SGLang GPUs "
            f"(rollout.num_servers * rollout.server_tp) exceed trainer.nnodes * trainer.gpus_per_node = {total}"
        )
        return
    mp = derived.model_parallel_size(cfg)
    if world % mp:
        errors.append(
            f"parallel.tp * parallel.pp * parallel.cp = {parallel.tp}*{parallel.pp}*{parallel.cp} = {mp} "
            f"does not divide "
            f"the trainer world size {world} ({_world_source(cfg)})"
        )
        return
    if parallel.dp is not None and mp * parallel.dp != world:
        errors.append(
            f"parallel.tp * parallel.pp * parallel.cp * parallel.dp = {mp}*{parallel.dp} = {mp * parallel.dp} != "
            f"trainer world size {world} ({_world_source(cfg)})"
        )
        return
    etp = derived.expert_tp_size(cfg)
    stage_ranks = world // parallel.pp
    if stage_ranks % (parallel.ep * etp):
        errors.append(
            f"parallel.ep * parallel.etp = {parallel.ep}*{etp} must divide tp * cp * dp = {stage_ranks} "
            f"(the ranks of one pipeline stage)"
        )
    if cfg.trainer.backend == "fsdp2":
        bad = [f"parallel.{n}={getattr(parallel, n)}" for n in ("tp", "pp", "cp", "ep") if getattr(parallel, n) != 1]
        if bad:
            errors.append(f"trainer.backend=fsdp2 shards over data parallel only; set {', '.join(bad)} to 1")


def _world_source(cfg: DapoConfig) -> str:
    if cfg.trainer.world_size is not None:
        return "trainer.world_size"
    trainer, used = cfg.trainer, derived.launched_rollout_gpus(cfg)
    text = f"trainer.nnodes * trainer.gpus_per_node = {trainer.nnodes}*{trainer.gpus_per_node}"
    return text + (f" minus {used} SGLang GPUs (rollout.num_servers * rollout.server_tp)" if used else "")


def _check_model(cfg: DapoConfig, shape: ModelShape, source: str, errors: list[str]) -> None:
    parallel = cfg.parallel
    if cfg.rollout.weight_format == "fp8_block" and cfg.rollout.engine == "sglang":
        _check_fp8_block_shapes(cfg, shape, source, errors)
    if parallel.tp >= 1 and shape.num_attention_heads % parallel.tp:
        errors.append(
            f"parallel.tp={parallel.tp} does not divide num_attention_heads={shape.num_attention_heads} ({source})"
        )
    if parallel.tp >= 1 and shape.num_kv_heads % parallel.tp:
        errors.append(f"parallel.tp={parallel.tp} does not divide num_key_value_heads={shape.num_kv_heads} ({source})")
    if parallel.pp >= 1:
        stages = parallel.pp * (parallel.vpp or 1)
        if shape.num_layers % stages:
            keys = "parallel.pp * parallel.vpp" if parallel.vpp else "parallel.pp"
            errors.append(f"{keys}={stages} does not divide num_hidden_layers={shape.num_layers} ({source})")
    if shape.is_moe:
        if parallel.ep >= 1 and shape.num_experts % parallel.ep:
            errors.append(f"parallel.ep={parallel.ep} does not divide num_experts={shape.num_experts} ({source})")
        if parallel.tp > 1 and not parallel.sequence_parallel and cfg.trainer.backend == "megatron":
            errors.append(f"parallel.sequence_parallel must be true for an MoE model with parallel.tp={parallel.tp}")
        if cfg.trainer.backend == "fsdp2" and cfg.algo.routing_replay != "none":
            errors.append(
                f"trainer.backend=fsdp2 does not replay the rollout's routing; algo.routing_replay="
                f"{cfg.algo.routing_replay or 'null (rollout for an MoE model)'} needs trainer.backend=megatron, "
                f"or set algo.routing_replay=none ({source})"
            )
    else:
        if cfg.algo.routing_replay == "rollout":
            errors.append(f"algo.routing_replay=rollout needs an MoE model; the model is dense ({source}): use none")
        if parallel.ep > 1:
            errors.append(f"parallel.ep={parallel.ep} but the model is dense ({source}); use parallel.ep=1")
        if parallel.etp is not None and parallel.etp > 1:
            errors.append(f"parallel.etp={parallel.etp} but the model is dense ({source})")
    rollout = cfg.rollout
    if rollout.engine == "sglang" and rollout.server_tp >= 1 and shape.num_attention_heads % rollout.server_tp:
        errors.append(
            f"rollout.server_tp={rollout.server_tp} does not divide "
            f"num_attention_heads={shape.num_attention_heads} ({source})"
        )


def _check_algo(cfg: DapoConfig, errors: list[str]) -> None:
    algo = cfg.algo
    if not 0.0 <= algo.clip_ratio_low < 1.0:
        errors.append(f"algo.clip_ratio_low={algo.clip_ratio_low} must be in [0, 1)")
    if algo.clip_ratio_high < 0.0:
        errors.append(f"algo.clip_ratio_high={algo.clip_ratio_high} must be >= 0")
    if algo.clip_ratio is not None and (algo.clip_ratio_low, algo.clip_ratio_high) != (
        algo.clip_ratio,
        algo.clip_ratio,
    ):
        errors.append(
            f"algo.clip_ratio={algo.clip_ratio} conflicts with algo.clip_ratio_low={algo.clip_ratio_low} / "
            f"algo.clip_ratio_high={algo.clip_ratio_high}: give either the symmetric clip_ratio or the pair"
        )
    if algo.clip_ratio_c is not None and algo.clip_ratio_c <= 1.0:
        errors.append(f"algo.clip_ratio_c={algo.clip_ratio_c} must be > 1 (dual clip; DAPO recipe: 10.0) or null")
    if algo.loss_scale_factor is not None:
        if not algo.loss_scale_factor > 0:
            errors.append(f"algo.loss_scale_factor={algo.loss_scale_factor} must be > 0 or null")
        if algo.loss_agg_mode != "seq-mean-token-sum-norm":
            errors.append(
                f"algo.loss_scale_factor={algo.loss_scale_factor} only applies to "
                f"algo.loss_agg_mode=seq-mean-token-sum-norm (got {algo.loss_agg_mode})"
            )
    if algo.fused_lm_head is True and cfg.trainer.backend == "fsdp2":
        errors.append(
            "algo.fused_lm_head=true applies to the Megatron actor only, not trainer.backend=fsdp2; "
            "set algo.fused_lm_head=false"
        )
    _check_batches(cfg, errors)
    _check_shaping(cfg, errors)
    _check_policy_loss(cfg, errors)
    _check_dp_share(cfg, errors)


def _check_batches(cfg: DapoConfig, errors: list[str]) -> None:
    """Batch sizes, epochs, staleness and micro-batch budget (algo.*)."""
    algo = cfg.algo
    if algo.train_batch_size < 1:
        errors.append(f"algo.train_batch_size={algo.train_batch_size} must be >= 1")
    if algo.ppo_mini_batch_size < 1:
        errors.append(f"algo.ppo_mini_batch_size={algo.ppo_mini_batch_size} must be >= 1")
    elif algo.train_batch_size >= 1 and algo.train_batch_size % algo.ppo_mini_batch_size:
        errors.append(
            f"algo.ppo_mini_batch_size={algo.ppo_mini_batch_size} does not divide "
            f"algo.train_batch_size={algo.train_batch_size}"
        )
    if algo.ppo_epochs < 1:
        errors.append(f"algo.ppo_epochs={algo.ppo_epochs} must be >= 1")
    if algo.gen_batch_size is not None and algo.gen_batch_size < 1:
        errors.append(f"algo.gen_batch_size={algo.gen_batch_size} must be >= 1 or null")
    if algo.staleness < 0:
        errors.append(f"algo.staleness={algo.staleness} must be >= 0 (0 = synchronous)")
    if algo.staleness_buffer_groups is not None and algo.staleness_buffer_groups != algo.train_batch_size:
        errors.append(
            f"algo.staleness_buffer_groups={algo.staleness_buffer_groups} must equal algo.train_batch_size="
            f"{algo.train_batch_size} (or be null): a staleness buffer is one training step's batch, as in PSRL; "
            f"more groups in flight than the batch is batch-level redundancy (rollout.redundancy.extra_prompts)"
        )
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if algo.max_tokens_per_micro_batch is not None and algo.max_tokens_per_micro_batch < seq:
        errors.append(
            f"algo.max_tokens_per_micro_batch={algo.max_tokens_per_micro_batch} is below one full sequence "
            f"(data.max_prompt_length + data.max_response_length = {seq})"
        )


def _check_shaping(cfg: DapoConfig, errors: list[str]) -> None:
    """KL, entropy, dynamic sampling, overlong shaping and rollout importance sampling (algo.*)."""
    algo = cfg.algo
    if algo.kl_coef != 0:
        errors.append(
            f"algo.kl_coef={algo.kl_coef} is not supported: DAPO removes the KL penalty (Yu et al. 2025, "
            f"arXiv:2503.14476, sec. 2.3 'Removing KL Divergence'), so no reference policy is kept; set 0"
        )
    if algo.entropy_coeff < 0:
        errors.append(f"algo.entropy_coeff={algo.entropy_coeff} must be >= 0")
    if algo.filter_groups.enable and cfg.rollout.n_resp_per_prompt < 2:
        errors.append(
            f"algo.filter_groups.enable needs rollout.n_resp_per_prompt >= 2 (got {cfg.rollout.n_resp_per_prompt}): "
            f"a group of one never has spread"
        )
    if algo.filter_groups.max_num_gen_batches < 0:
        errors.append(f"algo.filter_groups.max_num_gen_batches={algo.filter_groups.max_num_gen_batches} must be >= 0")
    ob = algo.overlong_buffer
    if ob.enable:
        if not 0 < ob.len < cfg.data.max_response_length:
            errors.append(
                f"algo.overlong_buffer.len={ob.len} must be in "
                f"(0, data.max_response_length={cfg.data.max_response_length})"
            )
        if ob.penalty_factor < 0:
            errors.append(f"algo.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")
    _check_rollout_correction(cfg, errors)


POLICY_LOSSES = ("dapo", "gspo", "cispo")
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")


def _check_hook(field: str, value: str, names: tuple[str, ...], errors: list[str]) -> None:
    """A built-in name, or a `package.module:function` that imports."""
    if value in names:
        return
    if not is_function_spec(value):
        errors.append(f"{field}={value!r}: expected one of {names} or 'package.module:function'")
        return
    try:
        import_function(value, field)
    except ValueError as e:
        errors.append(str(e))


def _check_policy_loss(cfg: DapoConfig, errors: list[str]) -> None:
    """algo.policy_loss and algo.adv_estimator (built-in names or hooks) and the variants' clip ranges."""
    algo = cfg.algo
    _check_hook("algo.policy_loss", algo.policy_loss, POLICY_LOSSES, errors)
    _check_hook("algo.adv_estimator", algo.adv_estimator, ADV_ESTIMATORS, errors)
    if algo.policy_loss == "gspo" and algo.loss_agg_mode != "seq-mean-token-mean":
        errors.append(
            f"algo.policy_loss=gspo needs algo.loss_agg_mode=seq-mean-token-mean (got {algo.loss_agg_mode}): GSPO's "
            "objective is the mean over sequences of the sequence-ratio term (arXiv:2507.18071, eq. 5)"
        )
    g, c = algo.gspo, algo.cispo
    if not (0 <= g.clip_ratio_low < 1 and g.clip_ratio_high >= 0):
        errors.append(
            f"algo.gspo.clip_ratio_low={g.clip_ratio_low} / clip_ratio_high={g.clip_ratio_high}: need 0 <= low < 1 "
            "and high >= 0"
        )
    if not ((c.clip_ratio_low is None or 0 <= c.clip_ratio_low < 1) and c.clip_ratio_high >= 0):
        errors.append(
            f"algo.cispo.clip_ratio_low={c.clip_ratio_low} / clip_ratio_high={c.clip_ratio_high}: need low null or "
            "in [0, 1) and high >= 0"
        )


FP8_BLOCK = 128


def _sglang_ep_size(extra_args: list[str]) -> int:
    """SGLang's expert parallel size as rollout.extra_args set it (--ep-size / --ep / --expert-parallel-size)."""
    names = ("--ep-size", "--ep", "--expert-parallel-size")
    for i, a in enumerate(extra_args):
        name, eq, value = str(a).partition("=")
        if name in names:
            value = value if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else "1")
            return int(value) if str(value).isdigit() and int(value) > 0 else 1
    return 1


def _check_fp8_block_shapes(cfg: DapoConfig, shape: ModelShape, source: str, errors: list[str]) -> None:
    """SGLang 0.5.23's Fp8LinearMethod (`validate_block_quant_shapes`) refuses, at server start, a merged linear
    (qkv, gate_up) whose parts and a TP-split dimension that are not whole 128-row / 128-column blocks."""
    tp = max(cfg.rollout.server_tp, 1)
    parts = {
        "q (num_attention_heads * head_dim)": shape.num_attention_heads * shape.head_dim // tp,
        "k / v (num_key_value_heads * head_dim)": max(shape.num_kv_heads // tp, 1) * shape.head_dim,
    }
    ffn = shape.moe_ffn_hidden_size if shape.is_moe else shape.ffn_hidden_size
    # experts are split over the MoE TP size, server_tp / --ep-size (SGLang's moe_tp_size)
    parts["gate / up (intermediate size)"] = ffn // (
        max(tp // _sglang_ep_size(cfg.rollout.extra_args), 1) if shape.is_moe else tp
    )
    bad = [f"{k} per server TP rank = {v}" for k, v in parts.items() if v % FP8_BLOCK]
    if bad:
        errors.append(
            f"rollout.weight_format=fp8_block with rollout.engine=sglang: SGLang's FP8 block linears need each merged "
            f"output part and TP-split dimension to be a multiple of {FP8_BLOCK}; not so: {'; '.join(bad)} "
            f"(rollout.server_tp={tp}, {source}; for MoE experts, --ep-size in rollout.extra_args splits them whole)"
        )


def _check_rollout_correction(cfg: DapoConfig, errors: list[str]) -> None:
    rc = cfg.algo.rollout_correction
    masked = rc.mode in ("token_mis", "icepop", "seq_mis")
    if rc.mode in ("token_tis", "seq_tis") and rc.upper < 1.0:
        errors.append(f"algo.rollout_correction.upper={rc.upper} must be >= 1 for mode={rc.mode} (a truncation)")
    if masked and not rc.upper > 0:
        errors.append(f"algo.rollout_correction.upper={rc.upper} must be > 0")
    if rc.lower is not None and not masked:
        errors.append(
            f"algo.rollout_correction.lower={rc.lower} is used only by modes token_mis, icepop and seq_mis "
            f"(mode={rc.mode}); set it null"
        )
    if rc.mode == "icepop" and rc.lower is None:
        errors.append(
            "algo.rollout_correction.mode=icepop needs algo.rollout_correction.lower (IcePop's alpha; with no lower "
            "bound it is token_mis)"
        )
    if rc.lower is not None and masked and not 0 <= rc.lower < rc.upper:
        errors.append(f"algo.rollout_correction.lower={rc.lower} must be in [0, upper={rc.upper})")
    geo = rc.geo_reject
    if geo.enable and not 0 < geo.lower < 1 < geo.upper:
        errors.append(
            f"algo.rollout_correction.geo_reject: need 0 < lower < 1 < upper, got lower={geo.lower}, upper={geo.upper}"
        )
    if cfg.rollout.weight_format == "fp8_block" and cfg.rollout.sync.verify:
        errors.append(
            "rollout.sync.verify=true with rollout.weight_format=fp8_block: the servers run the FP8-rounded weights, "
            "so their logprobs differ from the trainer's by design; set rollout.sync.verify=false (the metrics "
            "actor/mismatch_* show the gap)"
        )
    if cfg.rollout.weight_format == "fp8_block" and rc.mode == "none":
        errors.append(
            "rollout.weight_format=fp8_block with algo.rollout_correction.mode=none: FP8 rollout samples from a "
            "quantized policy the trainer does not hold, and nothing would correct the mismatch; use token_tis "
            "(the default) or another mode (docs/fp8-rollout.md)"
        )
    if rc.bypass and cfg.algo.staleness > 0 and rc.mode == "none" and not geo.enable:
        errors.append(
            f"algo.rollout_correction.bypass=true with algo.staleness={cfg.algo.staleness} and no correction "
            "(mode=none, geo_reject off): the rollout logprobs would stand for the old policy of samples up to "
            f"{cfg.algo.staleness} versions stale, uncorrected; use staleness 0 or turn a correction on"
        )


def _check_dp_share(cfg: DapoConfig, errors: list[str]) -> None:
    """Every data-parallel rank gets at least one sequence per optimizer step (only once the rest holds)."""
    algo = cfg.algo
    if not errors:
        dp = _dp_or_none(cfg)
        samples = algo.ppo_mini_batch_size * cfg.rollout.n_resp_per_prompt
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
    optim = cfg.optimizer
    if optim.lr <= 0:
        errors.append(f"optimizer.lr={optim.lr} must be > 0")
    if not 0 <= optim.min_lr <= optim.lr:
        errors.append(f"optimizer.min_lr={optim.min_lr} must be in [0, optimizer.lr={optim.lr}]")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(optim, name) < 1.0:
            errors.append(f"optimizer.{name}={getattr(optim, name)} must be in [0, 1)")
    if optim.adam_eps <= 0:
        errors.append(f"optimizer.adam_eps={optim.adam_eps} must be > 0")
    if optim.weight_decay < 0:
        errors.append(f"optimizer.weight_decay={optim.weight_decay} must be >= 0")
    if optim.clip_grad < 0:
        errors.append(f"optimizer.clip_grad={optim.clip_grad} must be >= 0 (0 = off)")
    if optim.lr_warmup_steps < 0:
        errors.append(f"optimizer.lr_warmup_steps={optim.lr_warmup_steps} must be >= 0")
    if optim.lr_decay_steps is not None and optim.lr_decay_steps < 1:
        errors.append(f"optimizer.lr_decay_steps={optim.lr_decay_steps} must be >= 1 or null")
    if not 0.0 <= optim.offload_fraction <= 1.0:  # also refuses NaN
        errors.append(f"optimizer.offload_fraction={optim.offload_fraction} must be in [0, 1]")
    elif not optim.cpu_offload and optim.offload_fraction != 1.0:
        errors.append(
            f"optimizer.offload_fraction={optim.offload_fraction} applies only with optimizer.cpu_offload=true"
        )
    if optim.cpu_offload:
        if cfg.trainer.backend != "megatron":
            errors.append(
                f"optimizer.cpu_offload=true needs trainer.backend=megatron (megatron-core's HybridDeviceOptimizer); "
                f"trainer.backend={cfg.trainer.backend} steps torch AdamW on its own shards"
            )
        elif not optim.use_distributed_optimizer:
            errors.append(
                "optimizer.cpu_offload=true needs optimizer.use_distributed_optimizer=true (megatron-core runs its "
                "HybridDeviceOptimizer as a precision-aware distributed optimizer)"
            )


def _check_rollout(cfg: DapoConfig, errors: list[str]) -> None:
    rollout, sampling = cfg.rollout, cfg.rollout.sampling
    for i, url in enumerate(rollout.servers):
        if not url.startswith(("http://", "https://")):
            errors.append(f"rollout.servers[{i}]={url!r} must be an http:// or https:// URL")
    if rollout.num_servers < 1:
        errors.append(f"rollout.num_servers={rollout.num_servers} must be >= 1")
    if rollout.server_tp < 1:
        errors.append(f"rollout.server_tp={rollout.server_tp} must be >= 1")
    if derived.launched_rollout_gpus(cfg) and rollout.server_tp > cfg.trainer.gpus_per_node:
        errors.append(
            f"rollout.server_tp={rollout.server_tp} exceeds trainer.gpus_per_node={cfg.trainer.gpus_per_node}: "
            f"an SGLang engine runs on one node"
        )
    if rollout.embedded_batching != "static" and (rollout.engine != "embedded" or rollout.servers):
        errors.append(
            f"rollout.embedded_batching={rollout.embedded_batching} applies only to embedded servers the driver "
            f"launches (rollout.engine=embedded, no rollout.servers); SGLang always batches continuously"
        )
    if rollout.engine == "embedded" and rollout.server_tp != 1:
        errors.append(f"rollout.server_tp={rollout.server_tp}: the embedded engine has no tensor parallelism; use 1")
    # colocated: the torchrun ranks launch the servers themselves (apps/launch.py, torchrun_colocated_servers)
    if cfg.trainer.launcher == "torchrun" and rollout.engine == "sglang" and not rollout.servers:
        if not derived.colocated(cfg):
            errors.append("trainer.launcher=torchrun starts no SGLang servers: list them in rollout.servers")
    if not 0.0 < rollout.mem_fraction_static < 1.0:
        errors.append(f"rollout.mem_fraction_static={rollout.mem_fraction_static} must be in (0, 1)")
    if rollout.n_resp_per_prompt < 1:
        errors.append(f"rollout.n_resp_per_prompt={rollout.n_resp_per_prompt} must be >= 1")
    if rollout.concurrency < 1:
        errors.append(f"rollout.concurrency={rollout.concurrency} must be >= 1")
    if rollout.request_timeout_s <= 0:
        errors.append(f"rollout.request_timeout_s={rollout.request_timeout_s} must be > 0")
    # Training needs the logprobs of a proper sampling distribution: temperature 0 (greedy) has none.
    if sampling.temperature <= 0:
        errors.append(f"rollout.sampling.temperature={sampling.temperature} must be > 0")
    if not 0.0 < sampling.top_p <= 1.0:
        errors.append(f"rollout.sampling.top_p={sampling.top_p} must be in (0, 1]")
    if sampling.top_k == 0 or sampling.top_k < -1:
        errors.append(f"rollout.sampling.top_k={sampling.top_k} must be -1 (off) or >= 1")
    if sampling.max_new_tokens is not None and not 1 <= sampling.max_new_tokens <= cfg.data.max_response_length:
        errors.append(
            f"rollout.sampling.max_new_tokens={sampling.max_new_tokens} must be in [1, data.max_response_length="
            f"{cfg.data.max_response_length}]"
        )
    if rollout.sync.timeout_s is not None and rollout.sync.timeout_s <= 0:
        errors.append(
            f"rollout.sync.timeout_s={rollout.sync.timeout_s} must be > 0 (or null: a quarter of "
            f"rollout.request_timeout_s, at most 300 s)"
        )
    elif (
        rollout.sync.timeout_s is not None
        and rollout.sync.policy == "all_at_once"
        and rollout.sync.timeout_s >= rollout.request_timeout_s
    ):
        errors.append(
            f"rollout.sync.timeout_s={rollout.sync.timeout_s} must be below rollout.request_timeout_s="
            f"{rollout.request_timeout_s} under rollout.sync.policy=all_at_once: the healthy servers stay paused "
            f"while a stalled one is awaited, and their paused requests would time out and mark them unhealthy "
            f"(null: a quarter of rollout.request_timeout_s, at most 300 s)"
        )
    servers = len(rollout.servers) or rollout.num_servers
    if not 1 <= rollout.min_healthy_servers <= servers:
        errors.append(
            f"rollout.min_healthy_servers={rollout.min_healthy_servers} must be between 1 and the {servers} server(s)"
        )
    if rollout.relaunch_max < 1:
        errors.append(
            f"rollout.relaunch_max={rollout.relaunch_max} must be >= 1 (rollout.relaunch=false: never relaunch)"
        )
    if rollout.sync.bucket_mb < 1:
        errors.append(f"rollout.sync.bucket_mb={rollout.sync.bucket_mb} must be >= 1")
    if rollout.sync.verify_tolerance <= 0:
        errors.append(f"rollout.sync.verify_tolerance={rollout.sync.verify_tolerance} must be > 0")
    if rollout.sync.sources == "per_stage" and rollout.sync.policy != "all_at_once":
        errors.append(
            f"rollout.sync.sources=per_stage needs rollout.sync.policy=all_at_once (got {rollout.sync.policy}: its "
            "weight store is trainer rank 0's copy); use rollout.sync.sources=rank0 or auto"
        )
    if rollout.sync.sources == "per_stage" and cfg.trainer.backend == "fsdp2":
        errors.append(
            "rollout.sync.sources=per_stage applies to trainer.backend=megatron (pipeline stages / expert ranks), "
            "not fsdp2; use rollout.sync.sources=rank0 or auto"
        )
    if rollout.sync.transport == "ipc":
        _check_ipc_transport(cfg, errors)
    if rollout.loads.interval_ms < 0:
        errors.append(f"rollout.loads.interval_ms={rollout.loads.interval_ms} must be >= 0 (0 = off)")
    # the coordinator's own sections check their values when built; the loader sets fields one by one
    for section in (rollout.sync, rollout.migration, rollout.routing, rollout.queue):
        try:
            replace(section)
        except ValueError as e:
            errors.append(str(e))
    _check_rollout_coordination(cfg, errors)
    _check_routing(cfg, errors)
    _check_placement(cfg, errors)


def _check_placement(cfg: DapoConfig, errors: list[str]) -> None:
    """trainer.placement=colocated: trainer and servers take turns on the same GPUs, so nothing may need
    them both at once (docs/placement.md says why each rule holds)."""
    if not derived.colocated(cfg):
        return
    rollout, why = cfg.rollout, "trainer.placement=colocated"
    if cfg.algo.staleness != 0:
        errors.append(
            f"{why} needs algo.staleness=0 (got {cfg.algo.staleness}): rollout and training take turns on the same "
            f"GPUs, so no rollout can run ahead of training"
        )
    if rollout.servers:
        errors.append(f"{why} launches its servers on the trainer's GPUs; external rollout.servers cannot share them")
    if rollout.sync.policy != "all_at_once":
        errors.append(
            f"{why} needs rollout.sync.policy=all_at_once (got {rollout.sync.policy}): greedy / status_based update "
            f"each server on its own while training runs, but colocated servers are released during training"
        )
    if rollout.sync.pause_generation and rollout.sync.pause_mode != "abort":
        errors.append(
            f"{why} needs rollout.sync.pause_mode=abort (got {rollout.sync.pause_mode}): the servers release their "
            f"KV cache before training, so requests still running then are aborted (with rollout.partial_rollout "
            f"they continue from their tokens after the update) instead of kept on the server"
        )
    if rollout.server_tp >= 1 and cfg.trainer.gpus_per_node % rollout.server_tp:
        errors.append(
            f"{why}: rollout.server_tp={rollout.server_tp} must divide trainer.gpus_per_node="
            f"{cfg.trainer.gpus_per_node} (one server per server_tp GPUs of a node)"
        )
    elif rollout.server_tp >= 1 and rollout.num_servers != derived.colocated_servers(cfg):
        errors.append(
            f"{why}: rollout.num_servers={rollout.num_servers} must be {derived.colocated_servers(cfg)}, one "
            f"server per rollout.server_tp={rollout.server_tp} of the {derived.trainer_world_size(cfg)} trainer GPUs"
        )


def _check_ipc_transport(cfg: DapoConfig, errors: list[str]) -> None:
    """rollout.sync.transport=ipc: trainer rank 0 hands every server handles to its own memory (CUDA IPC,
    shared memory), which reach only processes on its host, inline at each step."""
    sync = cfg.rollout.sync
    if sync.policy != "all_at_once":
        errors.append(
            f"rollout.sync.transport=ipc needs rollout.sync.policy=all_at_once (got {sync.policy}: the per-server "
            "store syncs each server later from a host copy, over its own update group); use transport broadcast"
        )
    if sync.sources == "per_stage":
        errors.append(
            "rollout.sync.transport=ipc sends every tensor from trainer rank 0 (rollout.sync.sources=per_stage "
            "broadcasts from each pipeline stage); use rollout.sync.sources=rank0 or auto"
        )
    if cfg.trainer.nnodes > 1:
        errors.append(
            f"rollout.sync.transport=ipc needs every server on trainer rank 0's host (IPC handles do not cross "
            f"hosts), but trainer.nnodes={cfg.trainer.nnodes}; use rollout.sync.transport=broadcast"
        )


def _check_rollout_coordination(cfg: DapoConfig, errors: list[str]) -> None:
    """rollout.migration / retry / redundancy: each switch only where it can act."""
    rollout = cfg.rollout
    for key in ("extra_samples", "extra_prompts"):
        if getattr(rollout.redundancy, key) < 0:
            errors.append(f"rollout.redundancy.{key}={getattr(rollout.redundancy, key)} must be >= 0 (0 = off)")
    if rollout.retry.threshold < 1:
        errors.append(f"rollout.retry.threshold={rollout.retry.threshold} must be >= 1")
    if rollout.retry.enabled and cfg.algo.staleness < 1:
        errors.append(
            "rollout.retry.enabled needs algo.staleness >= 1: it moves completed groups down from "
            "later staleness buffers, and at staleness 0 there are none"
        )
    migration = rollout.migration
    if migration.enabled:
        if not rollout.partial_rollout:
            errors.append(
                "rollout.migration.enabled needs rollout.partial_rollout: migrated requests "
                "continue from their tokens on another server"
            )
        servers = len(rollout.servers) if rollout.servers else rollout.num_servers
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
    data = cfg.data
    if data.max_prompt_length < 1 or data.max_response_length < 1:
        errors.append(
            f"data.max_prompt_length={data.max_prompt_length} and data.max_response_length={data.max_response_length} "
            f"must be >= 1"
        )
    if not data.prompt_key:
        errors.append("data.prompt_key must not be empty")
    if cfg.reward.timeout_s <= 0:
        errors.append(f"reward.timeout_s={cfg.reward.timeout_s} must be > 0")
    if cfg.reward.num_workers < 0:
        errors.append(f"reward.num_workers={cfg.reward.num_workers} must be >= 0 (0 = threads of the coordinator)")
    trainer = cfg.trainer
    for key, seed in (("trainer.seed", trainer.seed), ("data.seed", data.seed)):
        if not 0 <= seed < 2**32:  # numpy and megatron-core's seeding take 32-bit unsigned seeds
            errors.append(f"{key}={seed} must be in [0, 2**32)")
    if trainer.total_steps < 1:
        errors.append(f"trainer.total_steps={trainer.total_steps} must be >= 1")
    if trainer.max_restarts is not None and trainer.max_restarts < 0:
        errors.append(f"trainer.max_restarts={trainer.max_restarts} must be >= 0")
    if trainer.max_coordinator_restarts < 0:
        errors.append(f"trainer.max_coordinator_restarts={trainer.max_coordinator_restarts} must be >= 0")
    if trainer.val_every < 0:
        errors.append(f"trainer.val_every={trainer.val_every} must be >= 0")
    _check_val(cfg, errors)
    _check_bind_host(trainer.bind_host, errors)
    _check_servers_reach(cfg, errors)
    if trainer.world_size is not None and trainer.world_size < 1:
        errors.append(f"trainer.world_size={trainer.world_size} must be >= 1 or null")
    if cfg.logging.log_every < 1:
        errors.append(f"logging.log_every={cfg.logging.log_every} must be >= 1")
    ckpt = cfg.checkpoint
    if ckpt.save_every < 0:
        errors.append(f"checkpoint.save_every={ckpt.save_every} must be >= 0")
    if ckpt.keep_last < 0:
        errors.append(f"checkpoint.keep_last={ckpt.keep_last} must be >= 0")


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
    val = cfg.trainer.val
    if val.n < 0:
        errors.append(f"trainer.val.n={val.n} must be >= 0")
    elif val.n == 0 and not val.greedy:
        errors.append("trainer.val.n=0 with trainer.val.greedy=false evaluates nothing: set n >= 1 or greedy")
    if val.temperature <= 0:
        errors.append(f"trainer.val.temperature={val.temperature} must be > 0 (greedy answers: trainer.val.greedy)")
    if not 0.0 < val.top_p <= 1.0:
        errors.append(f"trainer.val.top_p={val.top_p} must be in (0, 1]")
    if val.max_new_tokens is not None and val.max_new_tokens < 1:
        errors.append(f"trainer.val.max_new_tokens={val.max_new_tokens} must be >= 1 or null")


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
