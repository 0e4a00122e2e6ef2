"""A training run survives a dead or stalled rollout server: the TP=2 torchrun trainer of test_loop_run
with two embedded servers of its own, one SIGKILLed (under each sync policy) or SIGSTOPped (all_at_once,
a short rollout.request_timeout_s and the default sync timeout derived from it) once the first step is
trained. The run finishes all its steps on the other server (left out of the weight sync and of routing),
which ends at the trainer's final weights: its logprobs equal an HF forward with the weights the trainer
dumped after the last step. A stall leaves the other server healthy: its requests, paused while the trainer
awaits the stalled one, do not time out (the router never marks it unhealthy). A hang or a crash fails the
run's own bound (run_torchrun's timeout); a stopped server is continued and stopped at the end."""

import asyncio
import json
import os
import signal
import threading
import time

import pytest
import torch

from tests.dist_utils import run_torchrun
from tests.sync.test_relaunch import _healthy
from tests.trainer.test_loop import CONFIG, _args, _rows, env, policy_run  # noqa: F401  (the module fixture: model, data)

pytestmark = pytest.mark.slow

STEPS = 4
PROBE = [5, 17, 3, 29, 11, 8, 40, 2, 19]


@pytest.fixture
def own_servers(env, tmp_path):  # noqa: F811
    from megatron_dapo.rollout.launcher import launch_embedded_servers

    servers = launch_embedded_servers(str(env["model"]), 2, tmp_path / "logs", timeout_s=240)
    try:
        yield servers
    finally:
        for s in servers:
            if s.alive():
                os.killpg(s.proc.pid, signal.SIGCONT)  # a stopped server takes no SIGTERM
            s.stop()


def _run_args(env, urls, run_dir, policy, pause_mode, *overrides):  # noqa: F811  (env: the fixture's value)
    """The loop's arguments for a STEPS-step run against `urls` under one sync policy, one server enough."""
    one_server_enough = "rollout.min_healthy_servers=1"
    return _args({**env, "urls": urls}, run_dir, *policy_run(STEPS, policy, pause_mode), one_server_enough, *overrides)


def _fault_after_first_step(out, server, fault: str, stop: threading.Event):
    """SIGKILL (kill) or SIGSTOP (stall) `server` once the trainer has dumped step 0's weights (mid-run)."""
    while not stop.is_set():
        if (out / "weights_step0.pt").exists():
            server.kill() if fault == "kill" else os.killpg(server.proc.pid, signal.SIGSTOP)
            return
        time.sleep(0.05)


async def _version_and_logprobs(url):
    from megatron_dapo.rollout.client import SGLangClient

    async with SGLangClient(url, retries=0) as c:
        return (await c.get_model_info())["weight_version"], await c.prompt_logprobs(PROBE)


@torch.no_grad()
def _reference_logprobs(model_dir, weights):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    lp = torch.log_softmax(model(torch.tensor([PROBE])).logits[0, :-1].double(), -1)
    return lp.gather(-1, torch.tensor(PROBE[1:]).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize(
    "policy, pause_mode, fault",
    [
        ("all_at_once", "in_place", "kill"),
        ("greedy", "abort", "kill"),
        ("status_based", "retract", "kill"),
        ("all_at_once", "in_place", "stall"),
    ],
)
def test_a_run_finishes_all_steps_after_a_server_is_lost(env, own_servers, tmp_path, policy, pause_mode, fault):  # noqa: F811
    urls = [s.url for s in own_servers]
    run_dir = tmp_path / "run"
    out = run_dir / "out"
    args = _run_args(
        env,
        urls,
        run_dir,
        policy,
        pause_mode,
        # a stall: rollout.sync.timeout_s left at its default, a quarter of the request timeout (5 s); a
        # stalled server's requests fail over once they time out
        *(
            ("rollout.request_timeout_s=20",)
            if fault == "stall"
            else ("rollout.sync.timeout_s=30", "rollout.request_timeout_s=3600")
        ),
    )
    stop = threading.Event()
    killer = threading.Thread(target=_fault_after_first_step, args=(out, own_servers[1], fault, stop), daemon=True)
    killer.start()
    try:
        log = run_torchrun("loop_run.py", 2, str(CONFIG), str(out), "-", *args, timeout=420)
    finally:
        stop.set()
        killer.join(10)
    if fault == "kill":
        assert not own_servers[1].alive()  # the fault happened
    else:
        assert own_servers[1].proc is not None and _stopped(own_servers[1].proc.pid)
        # the stalled server was left out; the healthy one's paused requests outlived the wait for it
        assert f"server {urls[0]} marked unhealthy" not in log, log[-6000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert json.loads((out / "result.json").read_text())["steps_done"] == STEPS
    # the server that went on holds the trainer's final weights (version STEPS: after step STEPS - 1)
    version, lps = asyncio.run(_version_and_logprobs(urls[0]))
    assert version == str(STEPS)
    final = _reference_logprobs(env["model"], torch.load(out / f"weights_step{STEPS - 1}.pt"))
    assert max(abs(a - b) for a, b in zip(lps, final)) < 1e-4
    before = _reference_logprobs(env["model"], torch.load(out / f"weights_step{STEPS - 2}.pt"))
    assert max(abs(a - b) for a, b in zip(final, before)) > 1e-4  # the check tells versions apart


def _stopped(pid: int) -> bool:
    import psutil

    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


def _kill_then_release_once_relaunched(out, server, stop: threading.Event):
    """SIGKILL `server` once step 0's weights are dumped; once the supervisor has it healthy again, let the run
    go on past step 1 (loop_run's LOOP_RUN_HOLD), so the syncs after steps 2 and 3 re-admit and update it."""
    while not stop.is_set() and not (out / "weights_step0.pt").exists():
        time.sleep(0.05)
    if stop.is_set():
        return
    first = server.proc.pid
    server.kill()
    while not stop.is_set() and not (server.alive() and server.proc.pid != first and _healthy(server.url)):
        time.sleep(0.1)
    (out / "relaunched").touch()


@pytest.mark.parametrize(
    "policy, pause_mode, layout",
    [
        ("all_at_once", "in_place", ()),
        ("greedy", "abort", ()),
        # rollout.sync.sources auto -> per_stage: each pipeline stage re-forms its own group with the server
        ("all_at_once", "retract", ("parallel.tp=1", "parallel.pp=2")),
    ],
    ids=["all_at_once", "greedy", "per_stage_pp2"],
)
def test_a_killed_server_is_relaunched_and_ends_at_the_final_weights(  # noqa: F811
    env,  # noqa: F811
    own_servers,
    tmp_path,
    policy,
    pause_mode,
    layout,
):
    """The Done-when of issue 26: one of two servers SIGKILLed mid-run, relaunched by the supervisor the Ray
    driver runs (here the test is the driver of its own servers), re-admitted by the trainer's weight sync:
    the run finishes all its steps and the relaunched server holds the trainer's final weights."""
    from megatron_dapo.rollout.supervisor import ServerSupervisor

    urls = [s.url for s in own_servers]
    run_dir = tmp_path / "run"
    out = run_dir / "out"
    out.mkdir(parents=True)
    args = _run_args(env, urls, run_dir, policy, pause_mode, "rollout.sync.timeout_s=30", *layout)
    supervisor = ServerSupervisor(own_servers, max_relaunches=1, check_interval_s=0.2, backoff_s=0.2).start()
    stop = threading.Event()
    fault = threading.Thread(target=_kill_then_release_once_relaunched, args=(out, own_servers[1], stop), daemon=True)
    fault.start()
    try:
        log = run_torchrun(
            "loop_run.py",
            2,
            str(CONFIG),
            str(out),
            "-",
            *args,
            timeout=420,
            env={"LOOP_RUN_HOLD": f"1:{out / 'relaunched'}"},
        )
    finally:
        stop.set()
        fault.join(10)
        supervisor.stop()
    assert supervisor.relaunches == [0, 1] and (out / "relaunched").exists()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert json.loads((out / "result.json").read_text())["steps_done"] == STEPS
    assert f"rollout server {urls[1]} re-admitted at weight version" in log
    # back in routing by the end, and both servers hold the trainer's final weights (version STEPS)
    assert rows[-1]["server/1/down"] == 0.0 and rows[-1]["server/0/down"] == 0.0
    if layout:  # both stages broadcast every sync, the re-admitting one included
        assert all(r["sync/sources"] == 2 for r in rows), [r.get("sync/sources") for r in rows]
    final = _reference_logprobs(env["model"], torch.load(out / f"weights_step{STEPS - 1}.pt"))
    for url in urls:
        version, lps = asyncio.run(_version_and_logprobs(url))
        assert version == str(STEPS), url
        assert max(abs(a - b) for a, b in zip(lps, final)) < 1e-4, url
