"""`megatron-dapo plan CONFIG --nodes N --gpus-per-node G [--gpu-mem-gib M] [key=value ...]`

Checks a config against a cluster shape before anything is launched: validates it with the
cluster's node and GPU counts, prints the process layout (trainer ranks and their TP / CP / PP /
DP / EP groups, which GPUs host which SGLang engines) and a per-GPU memory estimate
(`megatron_dapo.planner.memory`), and fails naming the term that does not fit.

Placement: trainer ranks take the first GPUs of the job, node-major (rank r on node r // G,
local GPU r % G); launched SGLang servers take the following GPUs in blocks of
rollout.server_tp, and a server never spans nodes. Rank groups come from megatron-core's own
`RankGenerator` with its default order "tp-cp-ep-dp-pp", so they are the groups the trainer builds.
The step-time estimate (`megatron_dapo.planner.speed`, at `--mfu` of the peak of `--trainer-gpu` or
`--gpu-tflops`) is the one the simulator trains at.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field

from megatron_dapo.config import derived
from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.load import load_config
from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.config.shapes import ModelShape, resolve_model_shape
from megatron_dapo.config.validate import validate_config
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
from megatron_dapo.planner.speed import (
    DEFAULT_MFU,
    GPU_BF16_TFLOPS,
    H100_BF16_TFLOPS,
    TrainerSpeed,
    peak_tflops,
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
    idle_gpus: list[tuple[int, int]] = field(default_factory=list)


def _rank_groups(cfg: DapoConfig) -> dict[str, list[list[int]]]:
    """Rank groups of every parallel dimension, from megatron-core's RankGenerator."""
    from megatron.core.parallel_state import RankGenerator

    p = cfg.parallel
    dp = derived.data_parallel_size(cfg)
    world = derived.trainer_world_size(cfg)
    etp = derived.expert_tp_size(cfg)
    edp = world // (etp * p.ep * p.pp)
    dense = RankGenerator(tp=p.tp, ep=1, dp=dp, pp=p.pp, cp=p.cp, order=MEGATRON_ORDER)
    expert = RankGenerator(tp=etp, ep=p.ep, dp=edp, pp=p.pp, cp=1, order=MEGATRON_ORDER)
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
    t, r = cfg.trainer, cfg.rollout
    gpus = t.nnodes * t.gpus_per_node
    world = derived.trainer_world_size(cfg)
    launched = derived.launched_rollout_gpus(cfg)
    if world + launched > gpus:
        raise ConfigError(
            f"trainer.world_size={world} plus {launched} SGLang GPUs (rollout.num_servers * rollout.server_tp) "
            f"exceed the {gpus} GPUs of trainer.nnodes * trainer.gpus_per_node"
        )

    def where(g: int) -> tuple[int, int]:
        return divmod(g, t.gpus_per_node)

    trainer_gpus = [where(g) for g in range(world)]
    servers = []
    if launched:
        for s in range(r.num_servers):
            start = world + s * r.server_tp
            block = [where(g) for g in range(start, start + r.server_tp)]
            if len({node for node, _ in block}) > 1:
                raise ConfigError(
                    f"rollout server {s} (rollout.server_tp={r.server_tp}) would span nodes "
                    f"{block[0][0]} and {block[-1][0]}: the {world} trainer ranks leave "
                    f"{t.gpus_per_node - world % t.gpus_per_node} GPUs on node {world // t.gpus_per_node}; "
                    f"make the trainer world size a multiple of trainer.gpus_per_node or change rollout.server_tp"
                )
            servers.append(block)
    idle = [where(g) for g in range(world + launched, gpus)]
    return Layout(world, _rank_groups(cfg), trainer_gpus, servers, idle)


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
            "optimizer": "use optimizer.use_distributed_optimizer=true or more data-parallel ranks",
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
    r = plan.rollout
    if r is not None:
        if r.kv_pool <= 0:
            errors.append(
                f"rollout GPU: weights {r.weights / GiB:.1f} GiB exceed rollout.mem_fraction_static="
                f"{plan.cfg.rollout.mem_fraction_static} x {plan.gpu_mem_gib:g} GiB = {r.static_budget / GiB:.1f} GiB "
                f"(raise rollout.server_tp or rollout.mem_fraction_static)"
            )
        elif r.full_sequences < 1:
            errors.append(
                f"rollout GPU: KV cache of {r.kv_pool / GiB:.1f} GiB holds {r.kv_tokens} tokens, fewer than one "
                f"sequence of data.max_prompt_length + data.max_response_length = {r.seq_len} "
                f"(raise rollout.server_tp or rollout.mem_fraction_static)"
            )
    return errors


def format_plan(plan: Plan) -> str:
    out = _format_layout(plan) + [""] + _format_memory(plan)
    if plan.step is not None:
        out += ["", _format_step(plan)]
        routing = derived.routing_shape(plan.cfg)
        if routing is not None:
            out.append(_format_routing(plan, routing))
    if plan.refit is not None:
        out += _format_refit(plan)
    return "\n".join(out)


def _format_refit(plan: Plan) -> list[str]:
    r, gb = plan.refit, 1e9
    chosen = derived.sync_sources(plan.cfg)
    mark = {m: " <- rollout.sync.sources" if m == chosen else "" for m in ("rank0", "per_stage")}
    return [
        f"refit per step (estimate, {plan.refit_link}; {r.model_bytes / gb:.2f} GB of weights in "
        f"{plan.cfg.model.dtype}, export sources: {len(r.source_bytes)}; TP gathers and HTTP not counted):",
        f"  rank0:     {r.rank0_bytes / gb:.2f} GB through rank 0 (other sources' shares in, the model out) "
        f"-> {r.rank0_s:.2f} s{mark['rank0']}",
        f"  per_stage: busiest source {r.per_stage_busiest_bytes / gb:.2f} GB; the sources take turns and every "
        f"server receives the model -> {r.per_stage_s:.2f} s{mark['per_stage']}",
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
    cfg, s, lay = plan.cfg, plan.shape, plan.layout
    p, t, r = cfg.parallel, cfg.trainer, cfg.rollout
    out = []
    out.append(f"cluster: {t.nnodes} nodes x {t.gpus_per_node} GPUs, {plan.gpu_mem_gib:g} GiB each")
    moe = f", {s.num_experts} experts (top {s.moe_topk})" if s.is_moe else ""
    out.append(
        f"model: {s.family} ({plan.shape_source}): {_count(total_params(s))} params "
        f"({_count(active_params(s))} active), {s.num_layers} layers, hidden {s.hidden_size}, "
        f"{s.num_attention_heads} heads / {s.num_kv_heads} KV heads{moe}"
    )
    first, last = lay.trainer_gpus[0], lay.trainer_gpus[-1]
    dp = derived.data_parallel_size(cfg)
    out.append(
        f"trainer ({t.backend}): {lay.world_size} ranks on node {first[0]} GPU {first[1]} .. "
        f"node {last[0]} GPU {last[1]}; "
        f"tp={p.tp} pp={p.pp}{f' vpp={p.vpp}' if p.vpp else ''} cp={p.cp} dp={dp}"
        + (
            f" ep={p.ep} etp={derived.expert_tp_size(cfg)} edp={derived.expert_data_parallel_size(cfg)}"
            if s.is_moe
            else ""
        )
        + (" sequence-parallel" if p.sequence_parallel else "")
    )
    if t.backend == "megatron":
        names = ["tp", "cp", "pp", "dp"] + (["ep", "etp", "edp"] if s.is_moe else [])
        out += [_groups_line(n, lay.groups[n]) for n in names]
    if lay.servers:
        out.append(f"rollout: {len(lay.servers)} SGLang servers x TP {r.server_tp}")
        out += [f"  server {i}: {_gpus(b)}" for i, b in enumerate(lay.servers)]
    elif r.servers:
        out.append(f"rollout: {len(r.servers)} external servers: {', '.join(r.servers)}")
    else:
        out.append(f"rollout: {r.num_servers} embedded servers (CPU / small models, no reserved GPUs)")
    if lay.idle_gpus:
        out.append(f"idle GPUs: {len(lay.idle_gpus)}")
    return out


def _format_memory(plan: Plan) -> list[str]:
    """Per training GPU (per stage), per rollout GPU, and the host weight store."""
    cfg, s, t, r = plan.cfg, plan.shape, plan.cfg.trainer, plan.cfg.rollout
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
    if t.backend == "megatron":
        alt = _optimizer_alternative(plan)
        state = "off" if cfg.optimizer.use_distributed_optimizer else "on"
        out.append(f"  optimizer states with the distributed optimizer {state}: {alt / scale:.2f} {unit} (stage 0)")
    if plan.rollout is not None:
        ro = plan.rollout
        out.append(
            f"memory per rollout GPU, GiB (mem_fraction_static {r.mem_fraction_static}): "
            f"weights {ro.weights / GiB:.2f}, "
            f"KV cache {max(ro.kv_pool, 0) / GiB:.2f} = {ro.kv_tokens} tokens "
            f"({ro.kv_bytes_per_token} B/token), {ro.full_sequences} full sequences of {ro.seq_len} tokens"
        )
    store = weight_store_bytes(cfg, s)
    if store:
        out.append(
            f"weight store (rollout.sync.policy={r.sync.policy}): {store / scale:.2f} {unit} of host memory on "
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


# -------------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dapo plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--nodes", type=int, required=True, help="nodes in the job (sets trainer.nnodes)")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node (sets trainer.gpus_per_node)")
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of GPU memory kept free for the CUDA context, NCCL and fragmentation (0.1)",
    )
    parser.add_argument(
        "--trainer-gpu",
        choices=sorted(GPU_BF16_TFLOPS),
        help="the trainer GPUs, for their peak bf16 TFLOP/s in the step time (default h100)",
    )
    parser.add_argument(
        "--gpu-tflops",
        type=float,
        help=f"peak bf16 TFLOP/s per trainer GPU, instead of --trainer-gpu ({H100_BF16_TFLOPS:g}, H100)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help=f"trainer model FLOPs utilisation, for the step time ({DEFAULT_MFU})",
    )
    parser.add_argument(
        "--link-gbps",
        type=float,
        help=f"Gbit/s of the trainer -> rollout server link, for the refit time (default: {NVLINK_GBPS:g}, "
        f"NVLink, when the trainer and the servers share one node, else {IB_400G_GBPS:g}, 400G InfiniBand)",
    )
    parser.add_argument("--prompt-len", type=float, default=256, help="mean prompt tokens, for the step time (256)")
    parser.add_argument(
        "--response-len",
        type=float,
        help="mean response tokens, for the step time (default: the simulator's DAPO-like "
        "lengths for data.max_response_length)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)

    overrides = [*args.overrides, f"trainer.nnodes={args.nodes}", f"trainer.gpus_per_node={args.gpus_per_node}"]
    try:
        cfg = load_config(args.config, overrides, validate=False)
        for note in validate_config(cfg):
            print(f"note: {note}", file=sys.stderr)
        peak = peak_tflops(args.trainer_gpu, args.gpu_tflops)
        plan = make_plan(
            cfg, args.gpu_mem_gib, args.headroom, args.prompt_len, args.response_len, peak, args.mfu, args.link_gbps
        )
    except (ConfigError, ValueError) as e:
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    errors = fit_errors(plan)
    for err in errors:
        print(f"does not fit: {err}", file=sys.stderr)
    if errors:
        return 1
    print("fits: yes")
    return 0
