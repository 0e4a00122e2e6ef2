"""Per-server weight sync end to end: the TP=2 torchrun trainer of test_loop_run and its two embedded
servers, with `rollout.sync.policy` greedy (pause mode abort: interrupted requests come back through
partial rollout) and status_based (pause mode retract). Each server takes the trainer's weights from
the host-memory store on its own, through its own update group, while training goes on.

Checked against independent references: every response token's recorded weight version is the one
that produced it (its rollout logprob equals an HF forward with that version's weights, dumped by
the trainer after each step, and differs from the neighbouring version's); every token's version is
in [step - staleness, step]; every batch is full, nothing regenerated, nothing over the bound; each
server took increasing versions, one sync each, and its metrics (version, syncs, time syncing,
idle) are logged.
"""

import pytest
import torch

from tests.trainer.test_loop import _run, env, policy_run  # noqa: F401  (the module fixture: servers, model, data)

pytestmark = pytest.mark.slow

STEPS = 2


def _hf_model(env):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(env["model"], torch_dtype=torch.float32).eval()


def _weights(env, out, version):
    """The weights of `version`: the HF model for 0, else the trainer's after step version - 1."""
    if version == 0:
        return _hf_model(env).state_dict()
    return torch.load(out / f"weights_step{version - 1}.pt")


@torch.no_grad()
def _logprobs(model, ids, temperature):
    logits = model(torch.tensor([ids])).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)  # logprob of token t given < t


def _check_run(env, name, policy, pause_mode, *overrides):
    run_dir, rows = _run(env, name, *policy_run(STEPS, policy, pause_mode), *overrides)
    out = run_dir / "out"
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        assert r["groups/kept"] == 4 and r["groups/over_staleness_bound"] == 0
        assert r["rollout/tokens_regenerated"] == 0 and r["sync/store_bytes"] > 0
        for i in range(2):
            assert {f"server/{i}/{k}" for k in ("version", "syncs", "sync_s", "idle_s")} <= r.keys()
            assert 0 <= r[f"server/{i}/version"] <= r["step"] + 1 and r[f"server/{i}/idle_s"] >= 0

    # each server synced on its own: versions increasing, from the first sync (version 0) on
    events = [e for r in rows for e in r["server_syncs"]]
    for i in range(2):
        versions = [e["version"] for e in events if e["server"] == i]
        assert versions[0] == 0 and versions == sorted(set(versions)) and len(versions) >= 2, (i, versions)
        assert all(e["end"] >= e["start"] for e in events if e["server"] == i)
    assert rows[-1]["server/0/syncs"] + rows[-1]["server/1/syncs"] >= 4

    # every token's version is exact: the server's logprob equals that version's, not a neighbour's
    batches = [torch.load(out / f"batch_step{step}.pt") for step in range(STEPS)]
    model, ref = _hf_model(env), {}
    for v in range(STEPS + 1):
        model.load_state_dict(_weights(env, out, v))
        ref[v] = {tuple(ids): _logprobs(model, ids, b["temperature"]) for b in batches for ids in b["input_ids"]}
    checked = distinguished = 0
    for step, b in enumerate(batches):
        for ids, p, n, lps, vers in zip(
            b["input_ids"], b["prompt_lengths"], b["response_lengths"], b["rollout_logprobs"], b["token_versions"]
        ):
            assert len(vers) == n and all(step - 1 <= v <= step for v in vers), (step, vers)
            assert vers == sorted(vers), (step, vers)  # a continuation never goes back to older weights
            for j, v in enumerate(vers):
                want, neighbour = (float(ref[w][tuple(ids)][p - 1 + j]) for w in (v, v + 1))
                assert abs(lps[j] - want) < 1e-4, (step, j, v, lps[j], want)
                checked += 1
                distinguished += abs(lps[j] - neighbour) > 1e-4
    assert checked > 0 and distinguished > checked // 2, (checked, distinguished)
    return rows, events


def test_greedy_sync_per_server_with_partial_rollout(env):  # noqa: F811
    _check_run(env, "greedy", "greedy", "abort")


def test_status_based_sync_per_server(env):  # noqa: F811
    rows, _ = _check_run(env, "status", "status_based", "retract", "rollout.loads.interval_ms=50")
    # the load poller ran beside the loop: each server's own report is in the step metrics
    for r in rows:
        for i in range(2):
            assert r[f"server/{i}/kv_capacity"] > 0 and r[f"server/{i}/running"] >= 0
    assert any(r[f"server/{i}/throughput"] > 0 for r in rows for i in range(2))
