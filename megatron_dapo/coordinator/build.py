"""The rollout side of a run built from its config: sampling parameters, tokenizer, prompt datasets,
reward runner and the producer with its router. The coordinator service builds its producer here;
the simulator builds the same producer over simulated engines and virtual time."""

from __future__ import annotations

import time

from megatron_dapo.config.derived import gen_batch_size, max_new_tokens, routing_shape
from megatron_dapo.coordinator.producer import ProducerSettings, RolloutProducer
from megatron_dapo.coordinator.router import Router
from megatron_dapo.data.dataset import PromptDataset, PromptSampler
from megatron_dapo.rewards import RewardRunner, get_reward
from megatron_dapo.rewards.registry import RewardCall
from megatron_dapo.rollout.types import SamplingParams


def sampling_params(cfg, n: int = 1):
    sampling = cfg.rollout.sampling
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=max_new_tokens(cfg),
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        n=n,
    )


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.hf_path)


def prompt_dataset(cfg, files, tokenizer):
    data = cfg.data
    return PromptDataset(
        files, tokenizer, data.max_prompt_length, truncation=data.truncation, prompt_key=data.prompt_key
    )


def reward_runner(cfg):
    """The run's reward runner (in `reward.num_workers` worker processes when > 0; `close()` ends them)."""
    # the dataset's extra_info is passed as keyword arguments: built-ins ignore what they do not know
    call = RewardCall(get_reward(cfg.reward.name), tuple(dict(cfg.reward.kwargs).items()))
    return RewardRunner(default=call, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)


def coordination_settings(rollout) -> dict:
    """ProducerSettings fields of rollout.redundancy / rollout.retry / rollout.migration."""
    return {
        "extra_samples": rollout.redundancy.extra_samples,
        "extra_prompts": rollout.redundancy.extra_prompts,
        "retry_threshold": rollout.retry.threshold if rollout.retry.enabled else 0,
        "migration": rollout.migration,
        "check_interval_s": rollout.sync.check_interval_ms / 1000.0,
    }


def build_producer(
    cfg,
    server_urls,
    dataset,
    tokenizer,
    registry=None,
    client_factory=None,
    clock=time.monotonic,
    cost_model=None,
    rewards=None,
):
    """The rollout producer and its router as `cfg` says; `client_factory` / `clock` / `cost_model` /
    `rewards`: the simulator's engines, virtual time, engine cost model and rewards (megatron_dapo.sim),
    else HTTP clients, real time, rollout.routing.cost_model's file and the reward runner `cfg` names."""
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
    rollout = cfg.rollout

    # the simulator's engines model time, not routing: only HTTP servers are asked for routed experts
    routed = routing_shape(cfg) if client_factory is None else None

    def router():
        extra = {"routed_experts": routed} if client_factory is None else {"client_factory": client_factory}
        return Router(
            server_urls,
            api_key=rollout.api_key,
            max_in_flight_per_server=rollout.concurrency,
            client_kwargs={"timeout_s": rollout.request_timeout_s},
            registry=registry,
            routing=rollout.routing,
            queue=rollout.queue,
            cost_model=cost_model,
            **extra,
        )

    rewards = reward_runner(cfg) if rewards is None else rewards
    return RolloutProducer(router, dataset, sampler, rewards, settings, tokenizer=tokenizer, clock=clock)
