"""Asynchronous DAPO throughput on CPU: weight-sync policies x staleness, through the real stack.

A generation-heavy setting, one run: 4 embedded rollout servers (real HTTP on 127.0.0.1, one
process each), a megatron-core trainer (TP=1, gloo, this process as rank 0 of a world of 1) and the
training loop of megatron_dapo.trainer.loop (`train_rank`, unchanged). For every setting the loop
trains from the same initial weights on the same data: `--warmup` steps (default staleness + 1: with
staleness s the producer fills s + 1 buffers ahead while the first batch is awaited, and steps that
drain them would flatter large s), then `--measure` steps, the only ones the numbers cover.

Long-tailed response lengths up to `--max-len` (512) tokens come from the model itself: a tiny
random Qwen3 (4 layers, hidden 64, character vocabulary) samples at temperature 1 until it emits
<|im_end|>. Its end-of-turn logit is raised by `--eos-shift` along the mean direction of its final
hidden states (`_shift_eos`), which sets the median length; the per-token chance of stopping varies
with the state, so lengths are spread out with a tail cut at max-len (the cut is max_response_length,
as in DAPO). A group finishes with its slowest of n samples and a buffer with its slowest group: the
stragglers that per-server sync and staleness are meant to hide. The measured lengths are printed and
written to the JSON.

Settings are named override sets crossed with staleness 0..3: by default `all_at_once`, `greedy` and
`status_based` (`rollout.sync.policy`, everything else equal). `--setting NAME key=value ...` adds one
more set (e.g. the routing / migration / retry switches); `--baseline` names the set the
ratios are taken against, at the same staleness.

Printed per setting: trained tokens/s (prompt + response tokens of the trained batches / wall time),
the rollout servers' idle fraction (ServerRegistry idle_s: no request in flight and not syncing, over
wall time, averaged over servers), the share idle or syncing (ServerRegistry sync_s added: an
all_at_once sync pauses servers that still hold requests, which the registry counts as busy), mean
staleness of the trained groups, mean step time, and the ratios against the baseline. With `--repeats R`
the whole list runs R times, round by round (so that every setting sees the machine's load swings), and
the table shows medians. `--out results.json` keeps every setting's per-step numbers (step, train, sync
and generation-wait times, response lengths per sample), so that a simulator can be fed the same setting
(megatron-dapo simulate).
    python benchmarks/async_throughput.py [--measure 3 --warmup S+1 --repeats 1 --batch 4 --n 4 --max-len 512]
        [--staleness 0 1 2 3] [--policies all_at_once greedy status_based]
        [--setting advanced rollout.routing.method=throughput_optimal ...] [--out results.json]
    python benchmarks/async_throughput.py --report results.json   # the table of a saved run
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "qwen3" / "tiny_qwen3_cpu.yaml"
POLICY_SETTINGS = {p: [f"rollout.sync.policy={p}"] for p in ("all_at_once", "greedy", "status_based")}


@dataclass
class Setting:
    name: str  # the override set, e.g. "greedy"
    staleness: int
    overrides: list[str]

    @property
    def label(self) -> str:
        return f"{self.name}@s{self.staleness}"


@dataclass
class Result:
    """One setting's measurements; per-step lists cover every step, the summary only steps >= warmup."""

    setting: Setting
    warmup: int
    repeat: int = 0  # the round of --repeats it was measured in
    config: dict = field(default_factory=dict)  # the run's resolved algo / rollout / data sections
    step_s: list[float] = field(default_factory=list)  # loop's time/step_s: take batch + train + sync + log
    train_s: list[float] = field(default_factory=list)  # the trainer's step alone (time/train_s)
    sync_s: list[float] = field(default_factory=list)  # time/sync_s: inline sync, or the weight-store put
    gen_wait_s: list[float] = field(default_factory=list)  # time the trainer waited for its batch
    step_end: list[float] = field(default_factory=list)  # time.monotonic() when each step ended
    tokens: list[int] = field(default_factory=list)  # prompt + response tokens trained per step
    response_lengths: list[list[int]] = field(default_factory=list)  # per step, per sample
    staleness_mean: list[float] = field(default_factory=list)
    idle_s: list[list[float]] = field(default_factory=list)  # per step, per server: cumulative idle
    server_sync_s: list[list[float]] = field(default_factory=list)  # per step, per server: cumulative syncing
    syncs: list[list[float]] = field(default_factory=list)  # per step, per server: cumulative syncs
    step_end_wall: list[float] = field(default_factory=list)  # time.time() when each step ended (trace clock)
    # per step, per-server sync policies: each server sync that ended in it ({"server", "version", "start", "end"})
    server_syncs: list[list[dict]] = field(default_factory=list)
    # --step-trace: the decode cost model fitted on the servers' own decode steps in the measured window
    # (profile_engine.fit_trace's JSON: coefficients, fit_rel_error, total_time_rel_error, steps, points)
    cost_fit: dict | None = None

    def _window(self) -> slice:
        return slice(self.warmup, None)

    def wall_s(self) -> float:
        """Measured window: from the end of the last warm-up step to the end of the last step."""
        return self.step_end[-1] - self.step_end[self.warmup - 1]

    def tokens_per_s(self) -> float:
        return sum(self.tokens[self._window()]) / self.wall_s()

    def _server_fraction(self, per_step: list[list[float]]) -> float:
        first, last = per_step[self.warmup - 1], per_step[-1]
        return statistics.mean((b - a) / self.wall_s() for a, b in zip(first, last))

    def idle_fraction(self) -> float:
        return self._server_fraction(self.idle_s)

    def unavailable_fraction(self) -> float:
        """Idle or syncing: an all_at_once sync pauses servers that still hold requests, which the
        registry counts as busy, not idle; its sync time is every server's."""
        return self.idle_fraction() + self._server_fraction(self.server_sync_s)

    def mean(self, name: str) -> float:
        return statistics.mean(getattr(self, name)[self._window()])

    def summary(self) -> dict:
        lengths = sorted(x for step in self.response_lengths[self._window()] for x in step)
        return {
            "tokens_per_s": self.tokens_per_s(),
            "idle_fraction": self.idle_fraction(),
            "idle_or_sync_fraction": self.unavailable_fraction(),
            "staleness_mean": self.mean("staleness_mean"),
            "step_s": self.mean("step_s"),
            "train_s": self.mean("train_s"),
            "sync_s": self.mean("sync_s"),
            "gen_wait_s": self.mean("gen_wait_s"),
            "wall_s": self.wall_s(),
            "response_length_mean": statistics.mean(lengths),
            "response_length_p50": _quantile(lengths, 0.5),
            "response_length_p90": _quantile(lengths, 0.9),
            "response_length_max": lengths[-1],
        }


def _quantile(ordered: list[int], q: float) -> int:
    """The nearest-rank q-quantile of an ascending list."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def build_settings(staleness: list[int], policies: list[str], extra: list[list[str]]) -> list[Setting]:
    """Named override sets x staleness: the default sync policies, then each `--setting NAME k=v ...`."""
    sets = {p: POLICY_SETTINGS[p] for p in policies}
    for name, *overrides in extra:
        if name in sets:
            raise SystemExit(f"--setting {name}: the name is taken (one of {', '.join(sets)})")
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise SystemExit(f"--setting {name}: overrides are key.sub=value, got {bad}")
        sets[name] = overrides
    return [Setting(name, s, list(o)) for s in staleness for name, o in sets.items()]


# ---- the model and the data -----------------------------------------------------------------------
def _shift_eos(model, eos: int, shift: float, prompt: list[int]) -> None:
    """Raise the end-of-turn logit by about `shift` where the final hidden state points along its mean
    direction (the final RMSNorm leaves no constant component to add a bias to)."""
    import torch

    with torch.no_grad():
        h = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.lm_head.weight[eos] += shift * h / h.norm() ** 2


def prepare(work: Path, max_len: int, eos_shift: float, seed: int = 0) -> dict:
    """The tiny model (with its end-of-turn logit shifted) and the arithmetic prompts, under `work`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.data.arithmetic import ArithmeticTask, write_task
    from megatron_dapo.data.char_tokenizer import build_char_tokenizer, vocab_size
    from megatron_dapo.models.tiny import save_tiny_hf_model

    model_dir = work / "model"
    build_char_tokenizer(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    save_tiny_hf_model(
        "qwen3",
        model_dir,
        seed=seed,
        vocab_size=vocab_size(),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        max_position_embeddings=64 + max_len,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12+7?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    _shift_eos(model, tok.eos_token_id, eos_shift, list(prompt))
    model.save_pretrained(model_dir)
    train, _ = write_task(work / "data", ArithmeticTask(max_operand=29, ops="+-", seed=seed), num_test=10)
    return {"model": model_dir, "train": train}


def base_overrides(paths: dict, urls: list[str], args) -> list[str]:
    return [
        f"model.hf_path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        "data.val_files=[]",
        f"data.max_response_length={args.max_len}",
        "data.max_prompt_length=64",
        "parallel.tp=1",
        "trainer.gpus_per_node=1",
        "trainer.val_every=0",
        "checkpoint.save_every=0",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"algo.train_batch_size={args.batch}",
        f"algo.ppo_mini_batch_size={args.batch}",
        f"rollout.n_resp_per_prompt={args.n}",
        # a random model answers nothing right: dynamic sampling would drop every group
        "algo.filter_groups.enable=false",
        f"rollout.servers={json.dumps(urls)}",
        "rollout.sync.verify=false",
        "optimizer.lr=1e-4",
        "optimizer.lr_warmup_steps=0",
    ]


# ---- one setting ----------------------------------------------------------------------------------
def run_setting(setting: Setting, base: list[str], steps: int, warmup: int, run_root: Path) -> Result:
    from megatron_dapo.config import config_to_dict, load_config
    from megatron_dapo.trainer.loop import train_rank

    cfg = load_config(
        str(CONFIG),
        [
            *base,
            f"algo.staleness={setting.staleness}",
            f"trainer.total_steps={steps + 1}",  # the last step would save a checkpoint
            f"logging.run_dir={run_root / setting.label}",
            *setting.overrides,
        ],
    )
    res = Result(
        setting, warmup, config={k: v for k, v in config_to_dict(cfg).items() if k in ("algo", "rollout", "data")}
    )

    def on_step_end(step, actor, batch):
        res.step_end.append(time.monotonic())
        res.step_end_wall.append(time.time())
        res.tokens.append(sum(len(x) for x in batch.input_ids))
        res.response_lengths.append([int(n) for n in batch.response_lengths])

    out = train_rank(cfg, list(cfg.rollout.servers), resume=False, stop_after=steps, on_step_end=on_step_end)
    for row in out.metrics:
        res.step_s.append(row["time/step_s"])
        res.train_s.append(row["time/train_s"])
        res.sync_s.append(row["time/sync_s"])
        res.gen_wait_s.append(row["time/generation_wait_s"])
        res.staleness_mean.append(row["staleness/mean"])
        servers = sorted({k.split("/")[1] for k in row if k.startswith("server/")}, key=int)
        res.idle_s.append([row[f"server/{i}/idle_s"] for i in servers])
        res.server_sync_s.append([row[f"server/{i}/sync_s"] for i in servers])
        res.syncs.append([row[f"server/{i}/syncs"] for i in servers])
        res.server_syncs.append(list(row.get("server_syncs", [])))
    return res


# ---- the report -----------------------------------------------------------------------------------
def median_summaries(results: list[Result]) -> dict[str, tuple[Setting, dict, list[float]]]:
    """Per setting label, in first-run order: its setting, the median of every summary number over the
    repeats, and the tokens/s of each repeat."""
    by_label: dict[str, list[Result]] = {}
    for r in results:
        by_label.setdefault(r.setting.label, []).append(r)
    out = {}
    for label, rs in by_label.items():
        sums = [r.summary() for r in rs]
        out[label] = (
            rs[0].setting,
            {k: statistics.median(m[k] for m in sums) for k in sums[0]},
            [m["tokens_per_s"] for m in sums],
        )
    return out


def table(results: list[Result], baseline: str) -> str:
    rows = median_summaries(results)
    base = {st.staleness: m for st, m, _ in rows.values() if st.name == baseline}
    lines = [
        "| setting | s | tokens/s | (each repeat) | x base | server idle % | x base | idle or syncing % "
        "| mean staleness | step s | train s | gen wait s | resp len p50 / p90 / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for st, m, each in rows.values():
        b = base.get(st.staleness)
        ratio = f"{m['tokens_per_s'] / b['tokens_per_s']:.2f}" if b else "-"
        idle_ratio = f"{m['idle_fraction'] / b['idle_fraction']:.2f}" if b and b["idle_fraction"] > 0 else "-"
        lines.append(
            f"| {st.name} | {st.staleness} | {m['tokens_per_s']:.0f} | {' / '.join(f'{x:.0f}' for x in each)} "
            f"| {ratio} "
            f"| {100 * m['idle_fraction']:.1f} | {idle_ratio} | {100 * m['idle_or_sync_fraction']:.1f} "
            f"| {m['staleness_mean']:.2f} "
            f"| {m['step_s']:.2f} | {m['train_s']:.2f} | {m['gen_wait_s']:.2f} "
            f"| {m['response_length_p50']:.0f} / {m['response_length_p90']:.0f} "
            f"/ {m['response_length_max']:.0f} |"
        )
    return "\n".join(lines)


def fit_window(res: Result, traces: list[Path]) -> dict | None:
    """The cost model of the servers' decode steps in `res`'s measured window (None if too few to fit)."""
    from megatron_dapo.apps.profile_engine import fit_trace

    try:
        return fit_trace([str(t) for t in traces], since=res.step_end_wall[res.warmup - 1], until=res.step_end_wall[-1])
    except ValueError as e:
        print(f"{res.setting.label}: no cost fit ({e})", file=sys.stderr)
        return None


def advanced_setting(config: Path, cost_model: Path | None, extra: list[str]) -> list[str]:
    """`--setting advanced ...`: the rollout-coordination switches of an advanced YAML (the simulator's
    own reading of it, sim.cli.advanced_overrides), the routing cost model of these engines, then `extra`."""
    from megatron_dapo.sim.cli import advanced_overrides

    out = ["advanced", *advanced_overrides(config)]
    if cost_model is not None:
        out.append(f"rollout.routing.cost_model={cost_model}")
    return out + list(extra)


def write_json(path: Path, args, results: list[Result]) -> None:
    doc = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "layout": "per-step lists cover every step (the summary leaves out the first `warmup`); "
        "response_lengths[step] lists the trained samples group by group (n consecutive "
        "samples per group, groups in draw order); times in seconds, step_end monotonic",
        "medians": {label: m for label, (_, m, _) in median_summaries(results).items()},
        "results": [
            {
                "setting": asdict(r.setting),
                "label": r.setting.label,
                "summary": r.summary(),
                **{k: v for k, v in asdict(r).items() if k != "setting"},
            }
            for r in results
        ],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def read_json(path: Path) -> tuple[dict, list[Result]]:
    """A saved run (`--out`): its settings and every result."""
    doc = json.loads(path.read_text())
    fields = {f for f in Result.__dataclass_fields__}
    results = [
        Result(**{**{k: v for k, v in r.items() if k in fields}, "setting": Setting(**r["setting"])})
        for r in doc["results"]
    ]
    return doc["settings"], results


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.runtime.cli_args import number

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", type=int, default=3, help="measured steps per setting, after the warm-up")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps left out of the numbers (>= 1; default: the setting's staleness + 1)",
    )
    ap.add_argument("--batch", type=int, default=4, help="prompts (groups) per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-len", type=int, default=512, help="max response tokens (data.max_response_length)")
    ap.add_argument("--eos-shift", type=float, default=1.7, help="end-of-turn logit shift: sets the median length")
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument(
        "--server-batching",
        choices=("static", "continuous"),
        default="static",
        help="the embedded servers' --batching: static (their default) or continuous (SGLang's)",
    )
    ap.add_argument(
        "--server-kv-tokens",
        type=int,
        default=None,
        help="the embedded servers' --max-total-tokens (KV pool per server; default: unbounded)",
    )
    ap.add_argument(
        "--server-slowdown",
        type=number(float, 0.0, 1.0, low_open=True),
        nargs="+",
        default=None,
        metavar="F",
        help="each server's serve --slowdown, one per server (e.g. 1 0.5: the second at half pace); the "
        "--step-trace cost fit then reads only the servers at 1",
    )
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all settings; the table shows medians")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--policies", nargs="+", default=list(POLICY_SETTINGS), choices=list(POLICY_SETTINGS))
    ap.add_argument(
        "--setting",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "KEY=VALUE"),
        help="one more named override set, run at every staleness",
    )
    ap.add_argument(
        "--advanced-config",
        type=Path,
        default=None,
        help="add the set `advanced`: this advanced YAML's rollout-coordination switches "
        "(e.g. configs/qwen3/advanced_qwen3_8b.yaml)",
    )
    ap.add_argument(
        "--advanced-cost-model",
        type=Path,
        default=None,
        help="rollout.routing.cost_model of `advanced` (throughput_optimal routing needs one): "
        "a profile-engine JSON of these engines, e.g. a trace fit of an earlier run",
    )
    ap.add_argument(
        "--advanced-overrides",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="applied to `advanced` after the YAML's switches (e.g. rollout.redundancy.extra_prompts=0)",
    )
    ap.add_argument("--baseline", default="all_at_once", help="the set ratios are taken against")
    ap.add_argument(
        "--step-trace",
        action="store_true",
        help="servers trace their decode steps (serve --step-trace, under the work dir); each "
        "setting's JSON gets `cost_fit`, the cost model fitted on its measured window",
    )
    ap.add_argument("--out", type=Path, default=None, help="write every setting's numbers as JSON")
    ap.add_argument("--work-dir", type=Path, default=None, help="model, data and run dirs (default: a temp dir)")
    ap.add_argument("--report", type=Path, default=None, help="print the table of a saved --out file; run nothing")
    args = ap.parse_args(argv)
    if args.server_slowdown is not None and len(args.server_slowdown) != args.servers:
        ap.error(f"--server-slowdown: {len(args.server_slowdown)} values for {args.servers} servers")
    if args.report is not None:
        saved, results = read_json(args.report)
        print(table(results, saved.get("baseline", args.baseline)))
        return 0
    if min(args.measure, args.repeats, args.warmup or 1) < 1:
        raise SystemExit(f"--measure {args.measure}, --repeats {args.repeats} and --warmup {args.warmup} must be >= 1")
    extra = list(args.setting)
    if args.advanced_config is not None:
        extra.insert(0, advanced_setting(args.advanced_config, args.advanced_cost_model, args.advanced_overrides))
    settings = build_settings(args.staleness, args.policies, extra)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import torch

    from megatron_dapo.apps.launch import exit_on_sigterm
    from megatron_dapo.config.errors import ConfigError
    from megatron_dapo.rollout.launcher import embedded_server, start_servers
    from megatron_dapo.runtime.distributed import destroy_distributed
    from megatron_dapo.runtime.net import LOOPBACK, free_port

    exit_on_sigterm()  # a killed benchmark still stops its servers (they run in sessions of their own)
    torch.set_num_threads(1)  # many processes on few cores: no spinning intra-op threads
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(free_port())}
    )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="async_throughput_"))
    paths = prepare(work, args.max_len, args.eos_shift)
    traces = [work / "traces" / f"server_{i}.jsonl" for i in range(args.servers)] if args.step_trace else []
    servers = [
        embedded_server(
            str(paths["model"]),
            work / "server_logs" / f"server_{i}.log",
            seed=i,
            extra_args=["--batching", args.server_batching]
            + (["--max-total-tokens", str(args.server_kv_tokens)] if args.server_kv_tokens else [])
            + (["--step-trace", str(traces[i])] if traces else [])
            + (["--slowdown", str(args.server_slowdown[i])] if args.server_slowdown else []),
        )
        for i in range(args.servers)
    ]
    start_servers(servers, timeout_s=300)
    args.traces = [str(t) for t in traces]  # recorded with the settings in --out
    results = []
    t0 = time.time()
    try:
        base = base_overrides(paths, [s.url for s in servers], args)
        for repeat in range(args.repeats):  # rounds over all settings: each sees the machine's load swings
            for setting in settings:
                t = time.time()
                warmup = args.warmup if args.warmup is not None else setting.staleness + 1
                try:
                    res = run_setting(setting, base, warmup + args.measure, warmup, work / "runs" / f"r{repeat}")
                except ConfigError as e:  # e.g. the advanced set's retry at staleness 0
                    print(f"[{repeat}] {setting.label}: skipped ({e})", file=sys.stderr, flush=True)
                    continue
                res.repeat = repeat
                if traces:  # the engines' own pace: a slowed server's steps are stretched
                    speeds = args.server_slowdown or [1.0] * len(traces)
                    res.cost_fit = fit_window(res, [t for t, f in zip(traces, speeds) if f == 1.0])
                results.append(res)
                m = res.summary()
                print(
                    f"[{repeat}] {setting.label}: {m['tokens_per_s']:.0f} tokens/s, "
                    f"idle {100 * m['idle_fraction']:.1f}%, step {m['step_s']:.2f}s ({time.time() - t:.0f}s wall)",
                    file=sys.stderr,
                    flush=True,
                )
                if args.out:
                    write_json(args.out, args, results)
    finally:
        for s in servers:
            s.stop()
        destroy_distributed()
    pool = f", KV pool {args.server_kv_tokens}" if args.server_kv_tokens else ""
    print(
        f"{args.servers} embedded servers ({args.server_batching} batching{pool}), B={args.batch} x n={args.n}, "
        f"max_len {args.max_len}, eos_shift {args.eos_shift}, {args.measure} measured steps per setting after "
        f"{args.warmup if args.warmup is not None else 'staleness + 1'} warm-up, "
        f"total {time.time() - t0:.0f}s"
    )
    print(table(results, args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
