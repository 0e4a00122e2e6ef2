"""One step's batch cut into data-parallel shards: what each trainer rank trains on.

The coordinator builds the step's `RolloutBatch` (advantages are normalised per group, so they
need the whole group) and cuts it here; each trainer rank then receives only its shard (TP / PP
peers of one DP replica the same one). The cut is the one the actor always made itself: per
mini-batch of `ppo_mini_batch_size` groups, whole groups go to the DP rank with the fewest tokens
so far. A shard keeps its rows in the batch's order and carries the global numbers the loss
normalises by (each mini-batch's loss tokens and sequences over all ranks), so a step trained on
shards is the same computation, bit for bit, as one trained on the whole batch.
"""

from __future__ import annotations

import torch

from megatron_dapo.types import DPShard, RolloutBatch


def split_groups_over_ranks(
    group_of_row: list[int], row_tokens: list[int], groups: list[int], dp: int
) -> list[list[int]]:
    """Rows of `groups` for each of `dp` ranks: whole groups, greedily balancing token counts."""
    members: dict[int, list[int]] = {g: [] for g in groups}
    for r, g in enumerate(group_of_row):
        if g in members:
            members[g].append(r)
    load = [0] * dp
    out: list[list[int]] = [[] for _ in range(dp)]
    for g in sorted(groups, key=lambda g: (-sum(row_tokens[r] for r in members[g]), g)):
        k = min(range(dp), key=lambda i: (load[i], i))
        out[k].extend(members[g])
        load[k] += sum(row_tokens[r] for r in members[g])
    return [sorted(rows) for rows in out]


def loss_counts(batch: RolloutBatch, rows: list[int]) -> tuple[int, int]:
    """(loss tokens, sequences with loss tokens) of `rows`: the DAPO loss's global normalisers."""
    lengths = [batch.response_lengths[r] * batch.response_loss_mask[r] for r in rows]
    return sum(lengths), sum(1 for n in lengths if n > 0)


def select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """The batch restricted to `rows` (in that order); group ids and prompt indices stay global."""
    index = torch.tensor(rows, dtype=torch.long)
    return RolloutBatch(
        input_ids=[batch.input_ids[r] for r in rows],
        prompt_lengths=[batch.prompt_lengths[r] for r in rows],
        response_lengths=[batch.response_lengths[r] for r in rows],
        advantages=batch.advantages[index].clone(),
        rollout_logprobs=[batch.rollout_logprobs[r] for r in rows],
        response_loss_mask=[batch.response_loss_mask[r] for r in rows],
        token_versions=[batch.token_versions[r] for r in rows],
        group_index=batch.group_index[index].clone(),
        temperature=batch.temperature,
        step=batch.step,
        prompt_indices=list(batch.prompt_indices),
        routed_experts=None if batch.routed_experts is None else [batch.routed_experts[r] for r in rows],
    )


def shard_batch(batch: RolloutBatch, dp_size: int, mini_batch_groups: int) -> list[DPShard]:
    """The step batch cut into `dp_size` shards: mini-batches of `mini_batch_groups` groups (in
    group order), each split over the ranks by whole groups, balancing tokens."""
    group_of_row = batch.group_index.tolist()
    tokens = [len(x) for x in batch.input_ids]
    group_ids = sorted(set(group_of_row))
    minis = [group_ids[i : i + mini_batch_groups] for i in range(0, len(group_ids), mini_batch_groups)]
    per_rank: list[list[list[int]]] = [[] for _ in range(dp_size)]  # rank -> mini -> global rows
    counts = []
    for mini in minis:
        split = split_groups_over_ranks(group_of_row, tokens, mini, dp_size)
        for rank, rows in enumerate(split):
            per_rank[rank].append(rows)
        counts.append(loss_counts(batch, [r for rows in split for r in rows]))
    shards = []
    for rank, mini_rows in enumerate(per_rank):
        rows = sorted(r for rs in mini_rows for r in rs)  # the batch's order (the old-logprob packing follows it)
        local = {r: i for i, r in enumerate(rows)}
        shards.append(
            DPShard(select_rows(batch, rows), rank, dp_size, [[local[r] for r in rs] for rs in mini_rows], list(counts))
        )
    return shards


def data_parallel_ranks(dp_rank: int) -> list[int]:
    """The DP rank of every trainer rank, by global rank, from each rank's own (collective; once per run)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(dp_rank))
    return out


def scatter_shards(shards: list[DPShard] | None, dp_rank_of: list[int], src: int = 0) -> DPShard:
    """Rank `src` holds the step's shards (one per DP rank); every rank receives its own DP rank's
    shard only (TP / PP peers the same one). Collective."""
    import torch.distributed as dist

    box: list = [None]
    send = [shards[d] for d in dp_rank_of] if dist.get_rank() == src else None
    dist.scatter_object_list(box, send, src=src)
    return box[0]
