"""slime's own loss code as a judge for the tests (a source tree found on this machine, never copied here).

slime (THUDM/slime) is not released on PyPI (the PyPI name "slime" is an unrelated package), so unlike
verl (tests/verl_peer.py) it cannot be pip-installed in CI: its check runs only where a source tree is
present. `find_source()` takes the tree from the environment variable MEGATRON_DAPO_SLIME_SRC, else the
newest ~/.cache/megatron-dapo/slime-<commit> directory (`git clone https://github.com/THUDM/slime` and
`git archive HEAD | tar -x -C ~/.cache/megatron-dapo/slime-$(git rev-parse --short HEAD)`); `skip_reason()`
says why the check cannot run when there is none.

`run(cases)` judges in a subprocess (`python -m tests.slime_peer IN OUT`): there slime is imported
unmodified with nothing stubbed (megatron-core and ray are this environment's own; slime's CPU import path
needs nothing else), torch.distributed is initialised on gloo with world size 1 and megatron-core's
parallel state with TP = PP = CP = DP = 1, and each case runs slime's training-path loss,
`slime.backends.megatron_utils.loss.loss_function`, on float32 logits: the log-probs from the logits
(slime's own vocab-parallel autograd function), the policy loss it dispatches on `advantage_estimator`
(`compute_policy_loss`, `compute_gspo_kl` + `compute_policy_loss`, `compute_cispo_loss`), the rollout
correction it applies (`vanilla_tis_function`, `icepop_function`, or examples/train_infer_mismatch_helper/
mis.py's `compute_mis_weights_with_cp` through `custom_tis_function_path`), its reducers and its
rescaling for Megatron. A subprocess, because it initialises torch.distributed and megatron's global
state, which the pytest process must not keep. torch.compile is off there (TORCHDYNAMO_DISABLE=1):
slime compiles `compute_policy_loss` / `compute_cispo_loss` for the GPU; on CPU inductor would build C++
for every shape on a 2-core machine, and the eager function is the same Python code.

A case: {"args": overrides of DEFAULT_ARGS (slime's argument names), "micro_batches": [{"logits" [1, T, V]
float32, "tokens": [LongTensor prompt+response], "response_lengths", "loss_masks", "advantages",
"log_probs", "rollout_log_probs" (lists, one tensor of response length per sample)}]}. Its result:
{"loss": the step's loss after Megatron's scaling (schedules.forward_step_calc_loss divides a per-sample
loss by num_microbatches; with calculate_per_token_loss finalize_model_grads divides by the step's token
count), "grads": [d loss / d logits per micro-batch], "logs": [{metric: value} per micro-batch, slime's
raw reducer sums], "num_tokens": [slime's per-micro-batch token count]}.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

SRC_ENV = "MEGATRON_DAPO_SLIME_SRC"
CACHE_ROOT = Path.home() / ".cache" / "megatron-dapo"
# The snapshot the tests were written and run against (git archive of THUDM/slime at this commit).
TESTED_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
REPO_ROOT = Path(__file__).resolve().parent.parent

# slime's argument defaults (slime/utils/arguments.py) for the fields its loss path reads, with the
# overrides every case needs: no entropy / KL term (DAPO has none), no top-p replay, one CP layout.
DEFAULT_ARGS = {
    "loss_type": "policy_loss",
    "advantage_estimator": "grpo",
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "eps_clip_c": None,
    "calculate_per_token_loss": False,
    "use_rollout_logprobs": False,
    "use_tis": False,
    "get_mismatch_metrics": False,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "custom_tis_function_path": None,
    "custom_pg_loss_reducer_function_path": None,
    "use_opsm": False,
    "opsm_delta": 1e-4,
    "use_kl_loss": False,
    "use_unbiased_kl": False,
    "kl_loss_type": "k1",
    "kl_loss_coef": 0.0,
    "entropy_coef": 0.0,
    "rollout_temperature": 1.0,
    "rollout_top_p": 1.0,
    "log_probs_chunk_size": -1,
    "allgather_cp": False,
    "recompute_loss_function": False,
    # examples/train_infer_mismatch_helper/mis.py (its mis.yaml keys)
    "tis_level": "token",
    "tis_mode": "truncate",
    "tis_lower_bound": None,
    "tis_upper_bound": 2.0,
    "use_rs": False,
    "rs_level": "token",
    "rs_lower_bound": None,
    "rs_upper_bound": None,
    "rs_veto_threshold": None,
    "tis_batch_normalize": False,
}
LOSS_MODULE = Path("slime", "backends", "megatron_utils", "loss.py")  # what a usable tree holds
MIS_FUNCTION = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"


def find_source() -> Path | None:
    """slime's source tree: $MEGATRON_DAPO_SLIME_SRC if set (even when it holds none: then None), else
    the newest ~/.cache/megatron-dapo/slime-* tree, else None."""
    if SRC_ENV in os.environ:
        src = Path(os.environ[SRC_ENV])
        return src if (src / "slime" / "backends" / "megatron_utils" / "loss.py").exists() else None
    trees = [
        p for p in CACHE_ROOT.glob("slime-*") if (p / "slime" / "backends" / "megatron_utils" / "loss.py").exists()
    ]
    return max(trees, key=lambda p: p.stat().st_mtime) if trees else None


def skip_reason() -> str:
    where = f"${SRC_ENV}={os.environ[SRC_ENV]!r}" if SRC_ENV in os.environ else f"{CACHE_ROOT}/slime-*"
    return (
        f"slime's source is not present ({where} holds no {LOSS_MODULE}): slime is not "
        "released on PyPI (pip's 'slime' is an unrelated package), so this check runs only where a THUDM/slime "
        f"tree is: set {SRC_ENV} to a clone, or git archive one into {CACHE_ROOT}/slime-<short commit> "
        f"(tested at {TESTED_COMMIT[:7]})"
    )


def run(cases: dict, src: Path, timeout: float = 600) -> dict:
    """Each case's result (module doc), computed by slime's code in a subprocess."""
    import torch

    with tempfile.TemporaryDirectory(prefix="slime-peer-") as tmp:
        inp, out = Path(tmp) / "cases.pt", Path(tmp) / "results.pt"
        torch.save(cases, inp)
        env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(src)]))
        cmd = [sys.executable, "-m", "tests.slime_peer", str(inp), str(out), str(Path(tmp) / "dist-init")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"slime judge failed (rc {proc.returncode}): {proc.stderr[-4000:]}")
        return torch.load(out)


# ---------------------------------------------------------------- subprocess side
def _init_distributed(init_file: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def _batch(mb: dict) -> dict:
    """slime's micro-batch (the actor's RolloutBatch keys its loss reads); rollout_mask_sums = each sample's
    own loss-token count (every sample its own rollout: slime's per-sample mean)."""
    total = [len(t) for t in mb["tokens"]]
    return {
        "unconcat_tokens": mb["tokens"],
        "total_lengths": total,
        "response_lengths": list(mb["response_lengths"]),
        "loss_masks": mb["loss_masks"],
        "advantages": mb["advantages"],
        "log_probs": mb["log_probs"],
        "rollout_log_probs": mb["rollout_log_probs"],
        "rollout_mask_sums": [m.sum() for m in mb["loss_masks"]],
    }


def _run_case(case: dict) -> dict:
    from slime.backends.megatron_utils.loss import loss_function

    args = Namespace(**{**DEFAULT_ARGS, **case["args"]})
    mbs = case["micro_batches"]
    gbs = sum(len(mb["tokens"]) for mb in mbs)
    logits = [mb["logits"].detach().clone().float().requires_grad_() for mb in mbs]
    losses, tokens, logs = [], [], []
    for mb, lg in zip(mbs, logits, strict=True):
        loss, num_tokens, log = loss_function(args, _batch(mb), len(mbs), gbs, lg)
        losses.append(loss)
        tokens.append(num_tokens)
        logs.append({k: float(v) for k, v in zip(["count", *log["keys"]], log["values"].tolist(), strict=True)})
    if args.calculate_per_token_loss:  # finalize_model_grads: gradients / the step's token count
        total = sum(losses) / sum(float(t) for t in tokens)
    else:  # forward_step_calc_loss: loss / clamp(normalizer = 1, 1) / num_microbatches
        total = sum(loss / len(mbs) for loss in losses)
    total.backward()
    return {
        "loss": total.detach(),
        "grads": [lg.grad.detach() for lg in logits],
        "logs": logs,
        "num_tokens": [float(t) for t in tokens],
    }


def main(argv: list[str]) -> None:
    import torch

    inp, out, init_file = argv
    _init_distributed(init_file)
    cases = torch.load(inp)
    torch.save({name: _run_case(case) for name, case in cases.items()}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
