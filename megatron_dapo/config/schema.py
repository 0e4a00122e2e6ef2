"""The typed configuration of a megatron-dapo run.

One dataclass per section; `DapoConfig` is the whole file. YAML files and `key.sub=value`
overrides are loaded into these classes by `megatron_dapo.config.load`, and cross-field rules
live in `megatron_dapo.config.validate`.

Defaults are DAPO's (Yu et al. 2025, arXiv:2503.14476, and verl's `recipe/dapo/run_dapo_qwen2.5_32b.sh`):
lr 1e-6 with 10 warm-up steps, weight decay 0.1, grad clip 1.0, clip ratios 0.2 / 0.28, token-mean
loss, dynamic sampling on `acc` with up to 10 generation batches, overlong buffer 4096 with penalty
1.0, 512 prompts per step in mini-batches of 32, max response 20480 tokens. The paper samples 16
responses per prompt; the product default is 8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

# the coordination sections check their own values (their policies run on checked copies)
from megatron_dapo.config.coordination import MigrationConfig, QueueConfig, RoutingConfig, SyncPolicyConfig

Dtype = Literal["fp32", "bf16", "fp16"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass
class ModelConfig:
    # HF model directory (config.json, tokenizer, initial weights). A hub id such as "Qwen/Qwen3-8B"
    # is accepted too: validation then uses the built-in shape of that model (see config/shapes.py).
    hf_path: str = ""
    # Inline HF config.json fields, used for validation / planning when hf_path has no config.json
    # yet (the tiny CPU configs, whose model directory the demo creates). When both exist they must agree.
    hf_config: Optional[dict[str, Any]] = None
    dtype: Dtype = "bf16"  # parameter / compute dtype of the trainer (fp32 master weights in the optimizer)
    # local = megatron-core's torch layer spec (CPU, tests); transformer_engine = TE spec (GPU).
    transformer_impl: Literal["local", "transformer_engine"] = "transformer_engine"
    # Activation recompute: none, selective (attention core only), full (whole layers).
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    recompute_method: Literal["uniform", "block"] = "uniform"  # only for full recompute
    recompute_num_layers: int = 1  # layers per recompute chunk (uniform) or recomputed layers per stage (block)
    moe_grouped_gemm: bool = True  # grouped GEMM for the experts (TE); ignored for dense models
    # MoE load-balancing loss weight; None = the HF config's router_aux_loss_coef.
    moe_aux_loss_coeff: Optional[float] = None


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved 1F1B); None = off
    # context parallel size: each packed sequence is cut into 2*cp chunks, CP rank r keeps chunks r and 2cp-1-r
    cp: int = 1
    # Transformer Engine's CP attention exchange: p2p (ring), all_gather (K/V) or a2a (heads); null = p2p
    # with TE, all_gather on the local spec (the only one it has; the others are refused there)
    cp_comm_type: Optional[Literal["p2p", "all_gather", "a2a"]] = None
    ep: int = 1  # expert parallel size (MoE)
    etp: Optional[int] = None  # expert tensor parallel size; None = same as tp
    dp: Optional[int] = None  # data parallel size; None = derived: trainer world size / (tp * pp * cp)
    sequence_parallel: bool = False  # required for MoE with tp > 1
    moe_token_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"


@dataclass
class OptimizerConfig:
    lr: float = 1e-6  # DAPO
    min_lr: float = 0.0  # floor of the decay schedule
    weight_decay: float = 0.1  # DAPO
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global grad-norm clip; DAPO
    lr_warmup_steps: int = 10  # linear warm-up over optimizer steps; DAPO
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"  # verl's DAPO: constant after warm-up
    lr_decay_steps: Optional[int] = None  # None = trainer.total_steps
    use_distributed_optimizer: bool = True  # shard optimizer states over data-parallel ranks
    # Keep (a share of) the fp32 master weights and Adam states in CPU memory and step them on the CPU:
    # megatron-core's HybridDeviceOptimizer (Megatron engine, distributed optimizer, CUDA only); see
    # docs/placement.md for its cost
    cpu_offload: bool = False
    offload_fraction: float = 1.0  # with cpu_offload: the share of the optimizer state (by parameters) on the CPU


@dataclass
class FilterGroupsConfig:
    """Dynamic sampling: drop groups whose metric has zero spread, generate more until the batch is full."""

    enable: bool = True
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    max_num_gen_batches: int = 10  # give up (clear error) after this many generation batches; 0 = no limit


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment over the last `len` tokens before max_response_length."""

    enable: bool = True
    len: int = 4096
    penalty_factor: float = 1.0


@dataclass
class GeoRejectConfig:
    """Geometric rejection: drop a whole response whose geometric-mean ratio pi_old / pi_rollout
    (exp of the mean token log-ratio) leaves [lower, upper] (verl's seq_mean_k1 preset 0.999 / 1.001)."""

    enable: bool = False
    lower: float = 0.999
    upper: float = 1.001


@dataclass
class RolloutCorrectionConfig:
    """Correction of the rollout / trainer mismatch, from the trainer's old-policy logprobs over the
    rollout's (megatron_dapo.algo.rollout_correction; formulas and sources in docs/algorithm.md)."""

    # token_tis: truncated token weights (min(rho, upper)); token_mis / icepop: token weights zeroed
    # outside [lower, upper]; seq_tis / seq_mis: the same on the response's product of ratios; none: off.
    mode: Literal["none", "token_tis", "token_mis", "icepop", "seq_tis", "seq_mis"] = "token_tis"
    lower: Optional[float] = None  # lower bound of the *_mis / icepop weight (None = 0; IcePop's alpha)
    upper: float = 2.0  # truncation (tis) or upper mask bound (mis, icepop: IcePop's beta)
    geo_reject: GeoRejectConfig = field(default_factory=GeoRejectConfig)
    # Take the rollout logprobs as the old policy and skip the trainer's old-logprob forward (one forward
    # less per step); the correction's ratio is then pi_current / pi_rollout, detached. Sound only when the
    # rollout is the old policy (algo.staleness=0) or a correction bounds the mismatch: refused otherwise.
    bypass: bool = False


@dataclass
class GSPOConfig:
    """GSPO's own clip range on the sequence ratio (Zheng et al. 2025, arXiv:2507.18071, sec. 5.1)."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4


@dataclass
class CISPOConfig:
    """CISPO's clip of the detached token IS weight (MiniMax-M1, arXiv:2506.13585, eq. 4-5)."""

    # None = no lower bound: the paper sets epsilon_low^IS large and tunes only the upper bound
    clip_ratio_low: Optional[float] = None
    # 1 + this caps the weight; the paper publishes no value: 0.28 is DAPO's clip-higher bound, which is
    # also what verl's cispo loss takes (the actor's clip_ratio_high)
    clip_ratio_high: float = 0.28


@dataclass
class AlgoConfig:
    # grpo (group-normalised), rloo (leave-one-out), reinforce_plus_plus (batch-normalised), or a
    # 'package.module:function' called as fn(rewards [N], group_ids [N], response_lengths [N]) -> [N]
    adv_estimator: str = "grpo"
    # dapo (token ratio, clip-higher), gspo (sequence ratio, algo.gspo), cispo (clipped IS weight x
    # REINFORCE, algo.cispo), or a 'package.module:function' taking dapo_policy_loss's arguments and
    # returning (loss, metrics)
    policy_loss: str = "dapo"
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    norm_adv_by_std: bool = True  # False = Dr.GRPO (r - mean) without the std division
    # Symmetric shorthand (verl's clip_ratio): sets both clip_ratio_low and clip_ratio_high; giving
    # either of those explicitly with another value is an error. None = use the pair.
    clip_ratio: Optional[float] = None
    clip_ratio_low: float = 0.2  # epsilon_low; DAPO clip-higher
    clip_ratio_high: float = 0.28  # epsilon_high; DAPO clip-higher
    # Dual-clip bound c > 1 for A < 0; 10.0 as in verl's DAPO recipe scripts (recipe/dapo/*.sh set
    # actor_rollout_ref.actor.clip_ratio_c=10.0; verl's own default is 3.0). None = off.
    clip_ratio_c: Optional[float] = 10.0
    loss_agg_mode: LossAggMode = "token-mean"  # DAPO token-level loss over the global batch
    # Constant divisor of each sequence's token sum in seq-mean-token-sum-norm (verl's
    # loss_scale_factor); None = data.max_response_length. Only valid with that mode.
    loss_scale_factor: Optional[float] = None
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False  # mask truncated responses out of the loss (kept in the group baseline)
    # max weight versions a consumed sample may lag; 0 = synchronous on-policy. Enforced by reserving a
    # slot in a buffer <= V_traj + staleness at dispatch (megatron_dapo.coordinator.staleness): never discarded.
    staleness: int = 3
    # Group slots of each staleness buffer (PSRL's psrl.staleness_buffer_entries); None = train_batch_size.
    # In PSRL a buffer is one training batch: the trainer consumes one full buffer per weight version, and
    # psrl.data.train_batch_size only sizes data loading. So here it must equal train_batch_size; a buffer
    # with more slots than the batch is PSRL's batch-level redundancy (rollout.redundancy.extra_prompts).
    staleness_buffer_groups: Optional[int] = None
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # Must be 0: DAPO removes the KL term (arXiv:2503.14476, sec. 2.3), so there is no reference policy.
    kl_coef: float = 0.0
    entropy_coeff: float = 0.0
    train_batch_size: int = 512  # prompts (groups) per training step; DAPO
    ppo_mini_batch_size: int = 32  # prompts per optimizer step; DAPO
    ppo_epochs: int = 1
    # Prompts submitted per generation batch (verl's gen_batch_size); None = train_batch_size.
    gen_batch_size: Optional[int] = None
    # Token budget of one packed micro-batch per rank; None = max_prompt_length + max_response_length.
    max_tokens_per_micro_batch: Optional[int] = None
    # Megatron actor: apply the LM head inside the logprob op, chunked over tokens
    # (megatron_dapo.kernels.fused_linear_logprobs), so the [tokens, vocab] logits are never
    # materialised; same numbers up to fp32 rounding. null = true with trainer.backend=megatron, false
    # with fsdp2 (whose actor does not support it; an explicit true there is refused).
    fused_lm_head: Optional[bool] = None
    # Rollout routing replay (R3, arXiv:2510.11370), MoE models only: `rollout` has the servers return the
    # experts each token was routed to (SGLang's --enable-return-routed-experts) and carries them with the
    # samples to the trainer (metric rollout/routing_bytes), whose Megatron actor replays them with
    # megatron-core's RouterReplay (metrics actor/routing_agreement, actor/routing_replay_bytes).
    # `none`: off. None = rollout for an MoE model, none for a dense one; rollout on a dense model or
    # with trainer.backend=fsdp2 is an error.
    routing_replay: Optional[Literal["none", "rollout"]] = None


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off (SGLang's convention)
    max_new_tokens: Optional[int] = None  # None = data.max_response_length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Give every sample its own sampling_seed, derived from trainer.seed and the prompt's position in
    # the data stream, so a resumed synchronous run (algo.staleness=0) regenerates exactly the samples
    # of the uninterrupted one. The embedded server always honours it; SGLang only when launched with
    # --enable-deterministic-inference (rollout.deterministic_inference; it slows generation down),
    # else it ignores the seed. Bitwise-equal logprobs (they enter the loss via rollout_correction) also need
    # that flag, on either server. False = one /generate with n samples per prompt, server-side randomness.
    seeded: bool = True


@dataclass
class SyncConfig(SyncPolicyConfig):
    """Weight sync trainer -> rollout servers after each step: when each server syncs (the policy fields,
    megatron_dapo.coordinator.sync_policy.SyncPolicyConfig) and how the weight transport moves the weights."""

    bucket_mb: int = 512  # tensors are broadcast in buckets of about this many MiB
    pause_generation: bool = True  # pause servers during an update; False = let in-flight requests finish
    # SGLang pause mode: in_place (running requests keep their KV, no cache flush), retract (re-prefilled
    # with the new weights, cache flushed) or abort; see docs/rollout-and-weight-sync.md
    pause_mode: Literal["in_place", "retract", "abort"] = "in_place"
    flatten_bucket: bool = False  # broadcast one flat buffer per bucket instead of one per tensor
    verify: bool = False  # after a sync, compare server and trainer logprobs on a probe sequence
    verify_tolerance: float = 1e-4  # max abs logprob difference accepted by verify
    # Which trainer ranks broadcast the weights: rank0 = everything gathered on trainer rank 0, which sends
    # it all; per_stage = the first rank of each pipeline stage (and each expert-parallel rank holding
    # experts) broadcasts only its own tensors over an update group of its own; auto = per_stage when
    # parallel.pp > 1 or parallel.ep > 1 with policy all_at_once and the megatron backend, else rank0.
    # per_stage needs policy all_at_once (the greedy / status_based store is rank 0's copy) and
    # trainer.backend=megatron (both refused otherwise).
    sources: Literal["auto", "rank0", "per_stage"] = "auto"
    # How the weights move (policy all_at_once): broadcast = over an NCCL/gloo weight-update group with every
    # server (/update_weights_from_distributed); ipc = CUDA IPC / shared-memory handles posted to
    # /update_weights_from_tensor, for servers on trainer rank 0's host (colocated): every server must be on
    # that host, so ipc needs trainer.nnodes 1, policy all_at_once and sources rank0/auto (refused otherwise).
    transport: Literal["broadcast", "ipc"] = "broadcast"
    # Bound on each HTTP call and broadcast of a sync (pause, update, end, continue): a server that does not
    # answer within it is left out of the sync and of routing (see docs/operations.md). None = a quarter of
    # rollout.request_timeout_s, at most 300 s. Under policy all_at_once it must be below
    # rollout.request_timeout_s: healthy servers stay paused while a stalled one is awaited, and their
    # paused requests must not time out meanwhile.
    timeout_s: Optional[float] = None


@dataclass
class RetryConfig:
    """Proactive filtering (megatron_dapo.coordinator.retry): when the trainer waits on a buffer at most
    `threshold` groups short and later buffers hold enough completed groups, give up its in-flight
    groups, move completed ones down from the newest later buffers, dispatch fresh prompts.
    Needs algo.staleness >= 1 (there are no later buffers at 0)."""

    enabled: bool = False
    threshold: int = 4  # largest gap (groups) the filter closes


@dataclass
class RedundancyConfig:
    """Redundant rollout: over-provision, keep the first to finish, abort the rest (cuts tail latency,
    but biases towards short responses; see docs/rollout-coordination.md)."""

    extra_samples: int = 0  # generate n + this samples per group, keep the first n to finish
    extra_prompts: int = 0  # up to train_batch_size + this groups in flight per staleness buffer


@dataclass
class LoadsConfig:
    """Each server's own load report (/v1/loads), kept in the coordinator's server registry."""

    # Polling period; 0 = off, unless the routing policy needs the loads (then every 200 ms).
    interval_ms: float = 0.0


@dataclass
class RolloutConfig:
    engine: Literal["sglang", "embedded"] = "sglang"
    # External server URLs (http://host:port). Empty = the driver launches num_servers servers itself.
    servers: list[str] = field(default_factory=list)
    num_servers: int = 1  # servers the driver launches (ignored when `servers` is given)
    server_tp: int = 1  # GPUs per launched server (SGLang --tp-size)
    mem_fraction_static: float = 0.8  # SGLang --mem-fraction-static: weights + KV cache share of GPU memory
    n_resp_per_prompt: int = 8  # group size
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    concurrency: int = 256  # max in-flight /generate requests per server
    api_key: Optional[str] = None  # sent as Bearer token; launched servers require it
    request_timeout_s: float = 3600.0  # per /generate request
    # Fewest servers the run goes on with: a server lost (unreachable or stalled in a sync) is left out and
    # the run goes on with the rest; below this many it stops with an error naming the lost servers.
    min_healthy_servers: int = 1
    # Relaunch a server this run launched (rollout.num_servers, Ray launcher) when its process exits, on its
    # port, at most relaunch_max times per server (then it is given up, logged); once healthy, the trainer's
    # next sync re-admits it (current weights, logprob check with sync.verify, routing). External servers
    # (rollout.servers) are never relaunched, but are re-admitted the same way when they answer /health again.
    relaunch: bool = True
    relaunch_max: int = 3  # relaunches per launched server over the run; one more exit and it is given up
    host: str = "127.0.0.1"  # bind address of launched servers
    # appended to the launch command of each server the run starts: SGLang's, or `megatron-dapo serve`'s for
    # the embedded engine (e.g. ["--dtype", "bfloat16"]: a bf16 rollout engine beside an fp32 trainer)
    extra_args: list[str] = field(default_factory=list)
    # Launch servers (SGLang or embedded) with --enable-deterministic-inference: seeds honoured and
    # batch-invariant logprobs, so a resumed synchronous run reproduces the uninterrupted one exactly.
    # Costs generation throughput (the embedded server then runs one forward per sequence).
    deterministic_inference: bool = False
    # How the embedded servers the driver launches schedule (`serve --batching`): static, a batch runs
    # until its last sequence ends; continuous, as SGLang: arrivals join the running batch.
    embedded_batching: Literal["static", "continuous"] = "static"
    # Partial rollout: a sample the server aborts (an update that aborts requests, a pause in abort
    # mode) continues from its tokens and logprobs, same seed, max_new_tokens reduced; each token keeps
    # the weight version that made it. False = the aborted group is generated again from scratch.
    partial_rollout: bool = True
    # The weights the servers run: bf16 (the trainer's export as is), or fp8_block: every linear weight
    # float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (the released Qwen3-FP8 layout;
    # embeddings, norms, router gates and lm_head stay bf16), quantized on each sync; the servers start from
    # an FP8 checkpoint (`megatron-dapo convert --weight-format fp8_block`). Needs a rollout correction
    # (algo.rollout_correction.mode not none): the rollout then samples from a policy the trainer does not hold.
    weight_format: Literal["bf16", "fp8_block"] = "bf16"
    sync: SyncConfig = field(default_factory=SyncConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    redundancy: RedundancyConfig = field(default_factory=RedundancyConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    loads: LoadsConfig = field(default_factory=LoadsConfig)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl, DAPO-Math-17k schema
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # column holding the chat messages
    max_prompt_length: int = 2048  # DAPO; longer prompts are handled by `truncation`
    # Prompts longer than max_prompt_length: drop (skip them, counted; what verl's
    # filter_overlong_prompts=True does, as in its DAPO recipe), error (stop, naming file and row),
    # or cut them to max_prompt_length keeping the left part, the right part, or both ends (middle),
    # as verl's `truncation` left / right / middle.
    truncation: Literal["drop", "error", "left", "right", "middle"] = "drop"
    max_response_length: int = 20480  # DAPO
    shuffle: bool = True
    seed: int = 1  # shuffling seed


@dataclass
class RewardConfig:
    name: str = "dapo_math"  # registered reward function
    # a reward call running over this time scores the sample as failed; it counts from the call's start
    # (waiting for a free thread or worker does not)
    timeout_s: float = 10.0
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the reward function
    # worker processes scoring rewards (a hanging call's worker is killed, a crashed one replaced);
    # 0 = 32 threads of the coordinator process (a hung one is replaced, up to 32 at once; then the run
    # stops with RewardCallsHang)
    num_workers: int = 0


@dataclass
class ValConfig:
    """Held-out evaluation as the DAPO paper reports it: avg@32 on AIME, i.e. n = 32 samples per problem at
    temperature 1.0, top_p 0.7 (verl's DAPO recipe, `val_kwargs`). Per data source: mean@n (= avg@n),
    best@n (any of the n correct) and maj@n (majority vote over the reward's extracted answers)."""

    n: int = 32  # samples per held-out prompt; 0 = none (then greedy must be on)
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: Optional[int] = None  # None = data.max_response_length
    greedy: bool = False  # also one greedy (temperature 0) answer per prompt: the `greedy` metric


@dataclass
class TrainerConfig:
    backend: Literal["megatron", "fsdp2"] = "megatron"
    launcher: Literal["ray", "torchrun"] = "ray"  # torchrun: trainer ranks from torchrun, external servers
    # split: trainer and rollout servers on separate GPUs; colocated: one server per rollout.server_tp trainer
    # GPUs on the same GPUs, taking turns (synchronous, offload between phases); docs/placement.md
    placement: Literal["split", "colocated"] = "split"
    total_steps: int = 100
    seed: int = 42
    nnodes: int = 1
    gpus_per_node: int = 8  # on CPU: trainer processes per node
    # Trainer world size; None = nnodes * gpus_per_node minus the GPUs of launched SGLang servers
    # (rollout.num_servers * rollout.server_tp when engine is sglang and no external servers are given).
    world_size: Optional[int] = None
    ray_address: Optional[str] = None  # None = start a local Ray cluster; "auto" = join the running one
    # Address the trainer's listeners bind: the local Ray cluster (node IP), the trainer ranks' and the
    # weight-sync group's TCPStores. An IP of this host; 0.0.0.0 / :: are refused (docs/security.md).
    bind_host: str = "127.0.0.1"
    val_every: int = 0  # steps between validations (and one before the first step); 0 = off
    val: ValConfig = field(default_factory=ValConfig)  # how validation and `megatron-dapo eval` sample
    # Times trainer rank 0 starts the rollout coordinator again when its process (or Ray actor) dies, from
    # the state it keeps after every step (coordinator/restart.py); then the run stops naming the checkpoint
    # to resume from. 0 = the first death stops the run.
    max_coordinator_restarts: int = 3
    # Times the trainer ranks are started again, all of them, from the latest checkpoint when one dies or
    # raises during training; servers stay up. Ray: by the driver, None = 2. torchrun: by its elastic agent
    # (`--max-restarts`), None = torchrun's; a value here must equal torchrun's. 0 = the first failure stops the run.
    max_restarts: Optional[int] = None


@dataclass
class WandbConfig:
    # disabled | offline (a run directory under <run_dir>/wandb, `wandb sync` uploads it later) | online
    mode: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "megatron-dapo"
    name: Optional[str] = None  # run name; None = the last part of logging.run_dir


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"  # TensorBoard logs, plots, the resolved config, server logs
    tensorboard: bool = True
    log_every: int = 1  # steps between console log lines
    progress_bar: bool = True
    # Weights & Biases (`pip install megatron-dapo[wandb]`): mirrors every TensorBoard scalar, the
    # resolved config and a table per validation
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = None  # None = <logging.run_dir>/checkpoints
    save_every: int = 0  # steps between saves; 0 = only at the end
    resume: bool = False  # continue from the latest complete checkpoint in save_dir
    keep_last: int = 2  # older checkpoints are deleted; 0 = keep all


@dataclass
class DapoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
