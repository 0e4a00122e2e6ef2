"""The plan of a config on a cluster, as `megatron-dapo plan` (megatron_dapo.apps.plan) prints it.

Checks a config against a cluster shape before anything is launched: validates it with the
cluster's node and GPU counts, prints the process layout (trainer ranks and their TP / CP / PP /
DP / EP groups, which GPUs host which SGLang engines) and a per-GPU memory estimate
(`megatron_dapo.planner.memory`), and fails naming the term that does not fit.

Placement: trainer ranks take the first GPUs of the job, node-major (rank r on node r // G,
local GPU r % G); launched SGLang servers take the following GPUs in blocks of
rollout.server_tp, and a server never spans nodes; launched embedded servers (no reserved GPUs) go
round-robin over the nodes (server s on node s % nnodes). With trainer.placement=colocated the servers take
the trainer's own GPUs instead, one per rollout.server_tp consecutive ones, and the memory estimate is
per phase of the step cycle (`megatron_dapo.planner.colocation`). The Ray launcher places the processes
where this layout says (megatron_dapo.apps.launch). Rank groups come from megatron-core's own
`RankGenerator` with its default order "tp-cp-ep-dp-pp", so they are the groups the trainer builds.
The step-time estimate (`megatron_dapo.planner.speed`, at `--mfu` of the peak of `--trainer-gpu` or
`--gpu-tflops`) is the one the simulator trains at.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_dapo.config import derived
from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.config.shapes import ModelShape, resolve_model_shape
from megatron_dapo.planner.colocation import (
    ColocatedPhases,
    colocated_phases,
    cpu_optimizer_step_s,
    cycle_s,
    optimizer_steps_per_step,
)
from megatron_dapo.planner.memory import (
    GiB,
    RolloutMemory,
    StageMemory,
    active_params,
    megatron_stage_memory,
    rollout_memory,
    total_params,
    training_memory,
    weight_store_bytes,
)
from megatron_dapo.planner.refit import IB_400G_GBPS, NVLINK_GBPS, RefitEstimate, crosses_nodes, refit_estimate
from megatron_dapo.planner.refit_cost import format_refit_costs, refit_cost
from megatron_dapo.planner.speed import (
    DEFAULT_MFU,
    H100_BF16_TFLOPS,
    TrainerSpeed,
    trainer_speed,
)
from megatron_dapo.types import RoutingShape

MEGATRON_ORDER = "tp-cp-ep-dp-pp"


@dataclass
class Layout:
    world_size: int
    groups: dict[str, list[list[int]]]  # "tp", "cp", "dp", "pp", "ep", "etp", "edp" -> rank groups
    trainer_gpus: list[tuple[int, int]]  # rank -> (node, local gpu)
    servers: list[list[tuple[int, int]]]  # server -> its (node, local gpu)s
    server_nodes: list[int] = field(default_factory=list)  # launched server -> its node (SGLang and embedded)
    idle_gpus: list[tuple[int, int]] = field(default_factory=list)


def _rank_groups(cfg: DapoConfig) -> dict[str, list[list[int]]]:
    """Rank groups of every parallel dimension, from megatron-core's RankGenerator."""
    from megatron.core.parallel_state import RankGenerator

    parallel = cfg.parallel
    dp = derived.data_parallel_size(cfg)
    world = derived.trainer_world_size(cfg)
    etp = derived.expert_tp_size(cfg)
    edp = world // (etp * parallel.ep * parallel.pp)
    dense = RankGenerator(tp=parallel.tp, ep=1, dp=dp, pp=parallel.pp, cp=parallel.cp, order=MEGATRON_ORDER)
    expert = RankGenerator(tp=etp, ep=parallel.ep, dp=edp, pp=parallel.pp, cp=1, order=MEGATRON_ORDER)
    return {
        "tp": dense.get_ranks("tp"),
        "cp": dense.get_ranks("cp"),
        "dp": dense.get_ranks("dp"),
        "pp": dense.get_ranks("pp"),
        "ep": expert.get_ranks("ep"),
        "etp": expert.get_ranks("tp"),
        "edp": expert.get_ranks("dp"),
    }


def plan_layout(cfg: DapoConfig) -> Layout:
    """Place trainer ranks and launched SGLang servers on the cluster of `cfg.trainer`."""
    trainer, rollout = cfg.trainer, cfg.rollout
    gpus = trainer.nnodes * trainer.gpus_per_node
    world = derived.trainer_world_size(cfg)
    launched = derived.launched_rollout_gpus(cfg)
    if world + launched > gpus:
        raise ConfigError(
            f"trainer.world_size={world} plus {launched} SGLang GPUs (rollout.num_servers * rollout.server_tp) "
            f"exceed the {gpus} GPUs of trainer.nnodes * trainer.gpus_per_node"
        )

    def where(g: int) -> tuple[int, int]:
        return divmod(g, trainer.gpus_per_node)

    trainer_gpus = [where(g) for g in range(world)]
    servers = []
    if derived.colocated(cfg) and rollout.engine == "sglang":  # on the trainer's GPUs (validated to fit)
        tp = rollout.server_tp
        servers = [trainer_gpus[s * tp : (s + 1) * tp] for s in range(derived.colocated_servers(cfg))]
    if launched:
        for s in range(rollout.num_servers):
            start = world + s * rollout.server_tp
            block = [where(g) for g in range(start, start + rollout.server_tp)]
            if len({node for node, _ in block}) > 1:
                raise ConfigError(
                    f"rollout server {s} (rollout.server_tp={rollout.server_tp}) would span nodes "
                    f"{block[0][0]} and {block[-1][0]}: the {world} trainer ranks leave "
                    f"{trainer.gpus_per_node - world % trainer.gpus_per_node} GPUs on node "
                    f"{world // trainer.gpus_per_node}; "
                    f"make the trainer world size a multiple of trainer.gpus_per_node or change rollout.server_tp"
                )
            servers.append(block)
    if servers:
        server_nodes = [block[0][0] for block in servers]
    else:  # embedded servers reserve no GPU: spread over the nodes
        n_launched = 0 if rollout.servers else rollout.num_servers
        server_nodes = [s % trainer.nnodes for s in range(n_launched)]
    idle = [where(g) for g in range(world + launched, gpus)]
    return Layout(world, _rank_groups(cfg), trainer_gpus, servers, server_nodes, idle)


# ------------------------------------------------------------------------------------------ report


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 4, 8] -> '0,4,8'."""
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(ranks) > 2 and steps == {1}:
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 6 and len(steps) == 1:
        return f"{ranks[0]},{ranks[1]},{ranks[2]},...,{ranks[-1]}"
    return ",".join(map(str, ranks))


def _groups_line(name: str, groups: list[list[int]], limit: int = 4) -> str:
    shown = " ".join(f"[{_ranks(g)}]" for g in groups[:limit])
    more = f" ... ({len(groups)} groups)" if len(groups) > limit else ""
    return f"  {name:<4} size {len(groups[0]):>3}: {shown}{more}"


def _gpus(block: list[tuple[int, int]]) -> str:
    node = block[0][0]
    return f"node {node} GPU {_ranks([g for _, g in block])}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


@dataclass(frozen=True)
class StepEstimate:
    """One training step's tokens and time at the assumed mean lengths (megatron_dapo.planner.speed)."""

    prompt_tokens: float  # mean per sample
    response_tokens: float
    speed: TrainerSpeed

    def tokens(self, cfg: DapoConfig) -> float:
        return cfg.algo.train_batch_size * cfg.rollout.n_resp_per_prompt * (self.prompt_tokens + self.response_tokens)


@dataclass
class Plan:
    cfg: DapoConfig
    shape: ModelShape
    shape_source: str
    layout: Layout
    gpu_mem_gib: float
    headroom: float
    stages: list[StageMemory]
    rollout: RolloutMemory | None
    step: StepEstimate | None = None  # None: the layout leaves no trainer GPU
    refit: RefitEstimate | None = None
    refit_link: str = ""  # which link the refit estimate assumes, in words
    colocated: ColocatedPhases | None = None  # trainer.placement=colocated: memory by phase, transfers

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_mem_gib * GiB * (1 - self.headroom))


def make_plan(
    cfg: DapoConfig,
    gpu_mem_gib: float = 80.0,
    headroom: float = 0.1,
    prompt_tokens: float = 256,
    response_tokens: float | None = None,
    peak_tflops: float = H100_BF16_TFLOPS,
    mfu: float = DEFAULT_MFU,
    link_gbps: float | None = None,
) -> Plan:
    """Layout, memory and step time of `cfg` (already validated) on GPUs of `gpu_mem_gib`; raises nothing
    on fit. Step time at mean `prompt_tokens` / `response_tokens` per sample (default response: the mean
    of the simulator's DAPO-like length model, megatron_dapo.planner.lengths.dapo_like). Refit time over a
    link of `link_gbps` Gbit/s (default: NVLink when the trainer and the launched servers share one node,
    else 400G InfiniBand)."""
    resolved = resolve_model_shape(cfg.model)
    if resolved.shape is None:
        raise ConfigError(
            f"model.hf_path={cfg.model.hf_path!r}: no config.json there, no model.hf_config and no built-in "
            f"shape; plan needs the model's shape"
        )
    layout = plan_layout(cfg)
    stages = training_memory(cfg, resolved.shape)
    rollout = None
    if layout.servers:
        rollout = rollout_memory(cfg, resolved.shape, int(gpu_mem_gib * GiB))
    for name, n in (("--prompt-len", prompt_tokens), ("--response-len", response_tokens)):
        if n is not None and not n >= 0:
            raise ValueError(f"{name}={n} must be >= 0 (mean tokens per sample)")
    if response_tokens is None:
        from megatron_dapo.planner.lengths import dapo_like, mean_length

        response_tokens = mean_length(dapo_like(cfg.data.max_response_length))
    step = None
    if derived.trainer_world_size(cfg) >= 1:
        speed = trainer_speed(cfg, resolved.shape, prompt_tokens + response_tokens, peak_tflops, mfu)
        step = StepEstimate(prompt_tokens, response_tokens, speed)
    remote = crosses_nodes(layout.trainer_gpus, layout.servers)
    where = "inter-node" if remote else "intra-node"
    if link_gbps is None:
        link_gbps = IB_400G_GBPS if remote else NVLINK_GBPS
        link = f"{where}: {'400G InfiniBand' if remote else 'NVLink'}, {link_gbps:g} Gbit/s"
    else:
        link = f"{where}, --link-gbps {link_gbps:g}"
    refit = refit_estimate(cfg, resolved.shape, link_gbps)
    plan = Plan(cfg, resolved.shape, resolved.source, layout, gpu_mem_gib, headroom, stages, rollout, step)
    plan.refit, plan.refit_link = refit, link
    if derived.colocated(cfg) and rollout is not None:
        plan.colocated = colocated_phases(cfg, stages, rollout)
    return plan


def fit_errors(plan: Plan) -> list[str]:
    """Why the plan does not fit, one message per failing GPU kind, naming the largest term."""
    errors = []
    usable = plan.usable_bytes
    worst = max(plan.stages, key=lambda s: s.total)
    if worst.total > usable:
        terms = worst.terms()
        big = max(terms, key=terms.get)
        hint = {
            "optimizer": "use optimizer.use_distributed_optimizer=true, optimizer.cpu_offload=true or more "
            "data-parallel ranks",
            "activations": "set model.recompute_granularity=full or lower algo.max_tokens_per_micro_batch",
            "logits": "raise parallel.tp or lower algo.max_tokens_per_micro_batch",
            "params": "raise parallel.tp / parallel.pp / parallel.ep",
            "grads": "raise parallel.tp / parallel.pp / parallel.ep",
        }[big]
        errors.append(
            f"training GPU (pipeline stage {worst.stage}) needs {worst.total / GiB:.1f} GiB > {usable / GiB:.1f} GiB "
            f"usable ({plan.gpu_mem_gib:g} GiB - {plan.headroom:.0%} headroom); largest term: {big} "
            f"{terms[big] / GiB:.1f} GiB ({hint})"
        )
    co = plan.colocated
    if co is not None and co.update > usable:
        errors.append(
            f"colocated GPU during the weight update: trainer parameters + server weights + one bucket = "
            f"{co.update / GiB:.1f} GiB > {usable / GiB:.1f} GiB usable (raise parallel.tp / parallel.ep, "
            f"rollout.server_tp, or lower rollout.sync.bucket_mb)"
        )
    rollout = plan.rollout
    if rollout is not None:
        if rollout.kv_pool <= 0:
            errors.append(
                f"rollout GPU: weights {rollout.weights / GiB:.1f} GiB exceed rollout.mem_fraction_static="
                f"{plan.cfg.rollout.mem_fraction_static} x {plan.gpu_mem_gib:g} GiB = "
                f"{rollout.static_budget / GiB:.1f} GiB "
                f"(raise rollout.server_tp or rollout.mem_fraction_static)"
            )
        elif rollout.full_sequences < 1:
            errors.append(
                f"rollout GPU: KV cache of {rollout.kv_pool / GiB:.1f} GiB holds {rollout.kv_tokens} tokens, "
                f"fewer than one "
                f"sequence of data.max_prompt_length + data.max_response_length = {rollout.seq_len} "
                f"(raise rollout.server_tp or rollout.mem_fraction_static)"
            )
    return errors


def format_plan(plan: Plan) -> str:
    out = _format_layout(plan) + [""] + _format_memory(plan)
    if plan.colocated is not None:
        out += _format_colocated(plan)
    if plan.step is not None:
        out += ["", _format_step(plan)]
        if plan.colocated is not None:
            out.append(_format_colocated_step(plan))
        routing = derived.routing_shape(plan.cfg)
        if routing is not None:
            out.append(_format_routing(plan, routing))
    if plan.refit is not None:
        out += _format_refit(plan)
        costs = [refit_cost(plan.cfg, plan.shape, plan.refit, f) for f in ("bf16", "fp8_block")]
        out += format_refit_costs(costs, len(plan.layout.servers) or len(plan.cfg.rollout.servers))
    return "\n".join(out)


def _format_colocated(plan: Plan) -> list[str]:
    """Each phase's memory on a colocated GPU, the host memory and the offload traffic per step."""
    co, cfg = plan.colocated, plan.cfg
    usable = plan.usable_bytes

    def fits(n: int) -> str:
        return "fits" if n <= usable else "DOES NOT FIT"

    out = [
        f"colocated GPU by phase, GiB (usable {usable / GiB:.2f}; peak {co.peak / GiB:.2f}):",
        f"  rollout   {co.rollout / GiB:8.2f}  server weights {co.rollout_weights / GiB:.2f} + KV cache "
        f"{max(co.rollout_kv, 0) / GiB:.2f} (mem_fraction_static {cfg.rollout.mem_fraction_static}); trainer offloaded"
        f" -- {fits(co.rollout)}",
        f"  training  {co.training / GiB:8.2f}  the training GPU above; servers released -- {fits(co.training)}",
        f"  update    {co.update / GiB:8.2f}  trainer params + server weights + a {cfg.rollout.sync.bucket_mb} MiB "
        f"bucket; grads and optimizer offloaded -- {fits(co.update)}",
        f"  host memory per GPU: {co.host / GiB:.2f} GiB (pinned copies of params and the optimizer's GPU part"
        + (", the optimizer's CPU part" if cfg.optimizer.cpu_offload else "")
        + f"); per node of {cfg.trainer.gpus_per_node} GPUs: {co.host * cfg.trainer.gpus_per_node / GiB:.0f} GiB",
        f"  offload / reload per step and GPU over PCIe at {co.pcie_gb_s:g} GB/s (assumed): "
        f"{co.offload_bytes / 1e9:.2f} GB out, {co.reload_bytes / 1e9:.2f} GB back -> {co.transfer_s:.2f} s "
        f"(gradients freed, not copied)",
    ]
    return out


def _update_s(plan: Plan) -> float:
    """The weight update's time: the refit estimate of the chosen sync source (on one node, over NVLink)."""
    if plan.refit is None:
        return 0.0
    return plan.refit.per_stage_s if derived.sync_sources(plan.cfg) == "per_stage" else plan.refit.rank0_s


def _format_colocated_step(plan: Plan) -> str:
    co, cfg, st = plan.colocated, plan.cfg, plan.step
    train = st.speed.step_s(st.tokens(cfg))
    update = _update_s(plan)
    text = (
        f"colocated step, trainer side (estimate): train {train:.0f} s on all {st.speed.gpus} GPUs + offload / reload "
        f"{co.transfer_s:.1f} s"
    )
    if cfg.optimizer.cpu_offload:
        text += (
            f" + CPU optimizer {cpu_optimizer_step_s(cfg, co):.1f} s ({optimizer_steps_per_step(cfg)} optimizer steps "
            f"x {co.cpu_optimizer_params / 1e9:.2f} B params per GPU at {co.cpu_adam_params_s / 1e9:.2f} B/s, their "
            f"fp32 grads and params over PCIe)"
        )
    total = train + cycle_s(cfg, co, update)
    return (
        text + f" + weight update {update:.2f} s = {total:.0f} s; rollout runs between steps on all GPUs, not beside "
        f"training (`megatron-dapo simulate` times the whole step)"
    )


def _format_refit(plan: Plan) -> list[str]:
    refit, gb = plan.refit, 1e9
    chosen = derived.sync_sources(plan.cfg)
    mark = {m: " <- rollout.sync.sources" if m == chosen else "" for m in ("rank0", "per_stage")}
    return [
        f"refit per step (estimate, {plan.refit_link}; {refit.model_bytes / gb:.2f} GB of weights in "
        f"{plan.cfg.model.dtype}, export sources: {len(refit.source_bytes)}; the wire only, the whole cost below):",
        f"  rank0:     {refit.rank0_bytes / gb:.2f} GB through rank 0 (other sources' shares in, the model out) "
        f"-> {refit.rank0_s:.2f} s{mark['rank0']}",
        f"  per_stage: busiest source {refit.per_stage_busiest_bytes / gb:.2f} GB; the sources take turns and every "
        f"server receives the model -> {refit.per_stage_s:.2f} s{mark['per_stage']}",
    ]


def _format_routing(plan: Plan, routing: RoutingShape) -> str:
    """The routed experts (algo.routing_replay=rollout) one step's samples carry to the trainer."""
    tokens = plan.step.tokens(plan.cfg)
    per_token = routing.bytes_per_token
    return (
        f"routing replay (algo.routing_replay=rollout): {tokens / 1e6:.2f} M tokens x {len(routing.moe_layers)} "
        f"MoE layers x top {routing.top_k} x {routing.dtype.itemsize} B ({str(routing.dtype).removeprefix('torch.')}) "
        f"= {tokens * per_token / 2**20:.1f} MiB per step, held by the coordinator until the step is trained"
    )


def _format_layout(plan: Plan) -> list[str]:
    """The cluster, the model, the trainer's ranks and groups, the rollout servers' GPUs."""
    cfg, shape, lay = plan.cfg, plan.shape, plan.layout
    parallel, trainer, rollout = cfg.parallel, cfg.trainer, cfg.rollout
    out = []
    out.append(f"cluster: {trainer.nnodes} nodes x {trainer.gpus_per_node} GPUs, {plan.gpu_mem_gib:g} GiB each")
    moe = f", {shape.num_experts} experts (top {shape.moe_topk})" if shape.is_moe else ""
    out.append(
        f"model: {shape.family} ({plan.shape_source}): {_count(total_params(shape))} params "
        f"({_count(active_params(shape))} active), {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads / {shape.num_kv_heads} KV heads{moe}"
    )
    first, last = lay.trainer_gpus[0], lay.trainer_gpus[-1]
    dp = derived.data_parallel_size(cfg)
    out.append(
        f"trainer ({trainer.backend}): {lay.world_size} ranks on node {first[0]} GPU {first[1]} .. "
        f"node {last[0]} GPU {last[1]}; "
        f"tp={parallel.tp} pp={parallel.pp}{f' vpp={parallel.vpp}' if parallel.vpp else ''} cp={parallel.cp} dp={dp}"
        + (
            f" ep={parallel.ep} etp={derived.expert_tp_size(cfg)} edp={derived.expert_data_parallel_size(cfg)}"
            if shape.is_moe
            else ""
        )
        + (" sequence-parallel" if parallel.sequence_parallel else "")
    )
    if trainer.backend == "megatron":
        names = ["tp", "cp", "pp", "dp"] + (["ep", "etp", "edp"] if shape.is_moe else [])
        out += [_groups_line(n, lay.groups[n]) for n in names]
    if lay.servers:
        out.append(f"rollout: {len(lay.servers)} SGLang servers x TP {rollout.server_tp}")
        out += [f"  server {i}: {_gpus(b)}" for i, b in enumerate(lay.servers)]
    elif rollout.servers:
        out.append(f"rollout: {len(rollout.servers)} external servers: {', '.join(rollout.servers)}")
    else:
        out.append(f"rollout: {rollout.num_servers} embedded servers (CPU / small models, no reserved GPUs)")
        out += [f"  server {i}: node {node}" for i, node in enumerate(lay.server_nodes)]
    if lay.idle_gpus:
        out.append(f"idle GPUs: {len(lay.idle_gpus)}")
    return out


def _format_memory(plan: Plan) -> list[str]:
    """Per training GPU (per stage), per rollout GPU, and the host weight store."""
    cfg, shape, trainer, rollout = plan.cfg, plan.shape, plan.cfg.trainer, plan.cfg.rollout
    out = []
    worst = max(plan.stages, key=lambda st: st.total)
    # GiB for real models, MiB for the tiny CPU ones (where GiB would print only zeros).
    unit, scale = ("GiB", GiB) if worst.total >= GiB else ("MiB", 1024**2)

    def mem(n: float) -> str:
        return f"{n / scale:9.2f}"

    tokens = derived.max_tokens_per_micro_batch(cfg)
    out.append(
        f"memory per training GPU, {unit} (micro-batch of {tokens} tokens, "
        f"recompute {cfg.model.recompute_granularity}, "
        f"distributed optimizer {'on' if cfg.optimizer.use_distributed_optimizer else 'off'}):"
    )
    out.append("  stage    params     grads optimizer activations    logits     total | act: none      full")
    for st in plan.stages:
        out.append(
            f"  {st.stage:>5} {mem(st.params)} {mem(st.grads)} {mem(st.optimizer)}   {mem(st.activations)} "
            f"{mem(st.logits)} {mem(st.total)} |  {mem(st.activations_no_recompute)} "
            f"{mem(st.activations_full_recompute)}"
        )
    if cfg.optimizer.cpu_offload:
        st = worst
        out.append(
            f"  optimizer.cpu_offload (offload_fraction {cfg.optimizer.offload_fraction}): "
            f"{st.optimizer_cpu / scale:.2f} {unit} of host memory per GPU (Adam states, fp32 master weights and "
            f"a pinned fp32 gradient copy); "
            f"{st.optimizer / scale:.2f} {unit} stay on the GPU"
        )
    elif trainer.backend == "megatron":
        alt = _optimizer_alternative(plan)
        state = "off" if cfg.optimizer.use_distributed_optimizer else "on"
        out.append(f"  optimizer states with the distributed optimizer {state}: {alt / scale:.2f} {unit} (stage 0)")
    if plan.rollout is not None:
        ro = plan.rollout
        out.append(
            f"memory per rollout GPU, GiB (mem_fraction_static {rollout.mem_fraction_static}): "
            f"weights {ro.weights / GiB:.2f}, "
            f"KV cache {max(ro.kv_pool, 0) / GiB:.2f} = {ro.kv_tokens} tokens "
            f"({ro.kv_bytes_per_token} B/token), {ro.full_sequences} full sequences of {ro.seq_len} tokens"
        )
    store = weight_store_bytes(cfg, shape)
    if store:
        out.append(
            f"weight store (rollout.sync.policy={rollout.sync.policy}): {store / scale:.2f} {unit} of host memory on "
            f"trainer rank 0 (the newest weights and the previous ones a lagging server may still read)"
        )
    out.append(
        f"usable per GPU: {plan.usable_bytes / GiB:.2f} GiB; largest training GPU: {worst.total / scale:.2f} {unit}"
    )
    return out


def _format_step(plan: Plan) -> str:
    st, cfg = plan.step, plan.cfg
    tokens = st.tokens(cfg)
    sp = st.speed
    return (
        f"trainer step (estimate): {cfg.algo.train_batch_size} prompts x {cfg.rollout.n_resp_per_prompt} samples x "
        f"{st.prompt_tokens + st.response_tokens:.0f} tokens (mean prompt {st.prompt_tokens:.0f} + response "
        f"{st.response_tokens:.0f}) = {tokens / 1e6:.2f} M tokens -> {sp.step_s(tokens):.0f} s on {sp.gpus} GPUs "
        f"at {sp.mfu:.0%} of {sp.peak_tflops:.0f} TFLOP/s ({sp.flops_per_token:.3g} FLOPs per token; "
        f"`megatron-dapo simulate` trains at this rate)"
    )


def _optimizer_alternative(plan: Plan) -> int:
    flipped = dataclasses.replace(
        plan.cfg,
        optimizer=dataclasses.replace(
            plan.cfg.optimizer, use_distributed_optimizer=not plan.cfg.optimizer.use_distributed_optimizer
        ),
    )
    return megatron_stage_memory(flipped, plan.shape, 0).optimizer
