"""The rollout side of DAPO training: keep the servers busy, judge groups, buffer informative ones.

`RolloutProducer` runs an asyncio loop on its own thread of the coordinator process
(megatron_dapo.coordinator.service; not a trainer process). It submits prompt groups (one
`/generate` with n samples each; a batch of n seeded ones when seeded) through the router; when a
group's n samples are back it is scored (reward runner, overlong shaping) and judged by dynamic
sampling; kept groups occupy staleness slots, and the trainer takes step t's full buffer with
`take_batch(t)`.

Bounded staleness by reservation (megatron_dapo.coordinator.staleness): a group is dispatched only if
it can reserve a slot in a buffer no later than V_traj + s, so none is ever too old when trained and none
is thrown away for it; the protocol: docs/design/staleness-by-reservation.md.

Partial rollout (`partial_rollout`, megatron_dapo.coordinator.partial). A sample the server aborted
(e.g. a weight update that aborts requests) continues from its tokens and logprobs, on the same
seed, with the weights the server holds now; its spans record the version of every token. Without
it the whole group is generated again from scratch (its tokens counted as regenerated). A
checkpoint keeps the groups in flight with their slots and partial samples; a resumed producer
dispatches them again, continuing what the servers had answered.

Seeded rollouts. With `settings.seed` set, sample i of the prompt at draw number d (the sampler's
position, see `PromptSampler.next_draw`) is generated with `sampling_seed = sample_seed(seed, d, i)`,
as one batch request of n entries with n = 1 and a seed each (SGLang gives the n copies of one
seeded request the same seed, hence the same tokens). A group's samples then depend only on the
weights and on where the prompt was drawn, and a batch lists its groups in draw order, not in the
order they finished. So a resumed synchronous run (staleness 0) regenerates exactly the batches the
interrupted one would have. SGLang honours the seed only with --enable-deterministic-inference.

Dynamic sampling limit. Groups judged since the last batch was taken count towards the next one;
when they reach max_num_gen_batches * gen_batch_size without B kept, the producer stops and
`take_batch` raises `DynamicSamplingExhausted` with the counts.

Rollout coordination switches (all off by default; see README "Rollout coordination"):
- `extra_samples` (sample-level redundancy): n + extra samples per group, one request each; the
  first n to finish are kept (re-indexed 0..n-1 in index order), the rest aborted. Advantages use
  exactly the n kept.
- `extra_prompts` (prompt-level redundancy): each staleness buffer takes B + extra reservations and
  is ready with B completed groups; the controller moves or drops the surplus reservations
  (megatron_dapo.coordinator.staleness) and the producer aborts the dropped groups.
- `retry_threshold` (the proactive filter, megatron_dapo.coordinator.retry): while the trainer waits
  on a buffer a few groups short, its in-flight groups are aborted and completed groups of later
  buffers moved down into it.
- `migration` (megatron_dapo.coordinator.migration): every `check_interval_s` the servers' loads are
  compared; the chosen server's requests are aborted and continue elsewhere (partial rollout).
An aborted group's prompt counts as drawn (the sampler is a stream: giving a prompt back would change
which seed later draws get): `totals` counts every such group by reason, so every draw is trained,
waiting, in flight, dropped or aborted. With any of the switches on, a group is sent as one batch
request with a rid per sample (also unseeded), so the router can abort it. Which samples and groups
are kept then depends on timing: each sample keeps its seed, but a seeded run no longer reproduces
its batches exactly (not even at staleness 0).

Parts: `settings` (settings, records, counters), `state` (`ProducerState` and `Signals`, which the
parts share and receive instead of the producer), `slot_filler` (what to dispatch next), `generation`
(one group's requests, an aborted sample continued), `completion` (a finished or aborted group),
`batches` (the trainer's side, the proactive filter), `migrate`, `checkpoint`, `handoff` (calls from
other threads run on the loop), `core` (`RolloutProducer`, which wires them and runs the loop).
"""

from megatron_dapo.coordinator.producer.core import RolloutProducer
from megatron_dapo.coordinator.producer.settings import (
    COORDINATION_COUNTS,
    BatchInfo,
    DynamicSamplingExhausted,
    InFlight,
    ProducerCounters,
    ProducerSettings,
    response_text,
    sample_seed,
)

__all__ = [
    "COORDINATION_COUNTS",
    "BatchInfo",
    "DynamicSamplingExhausted",
    "InFlight",
    "ProducerCounters",
    "ProducerSettings",
    "RolloutProducer",
    "response_text",
    "sample_seed",
]
