"""Sequence packing for the actor: several sequences per micro-batch, each attending only to itself.

A packed micro-batch is one row of L tokens holding sequences back to back (then padding). Each
sequence keeps its own positions (0, 1, ... from its first token), and attention never crosses a
sequence boundary:

* with Transformer Engine, megatron-core's THD format: `PackedSeqParams` with cu_seqlens;
* on the local spec, a block-diagonal causal attention mask, and RoPE driven by the per-sequence
  position ids (:func:`per_sequence_rope`; megatron-core's GPTModel would otherwise rotate by
  the position in the packed row).

Targets: the logit at position t predicts token t+1 of the same sequence. For a sequence with
prompt length P and total length n, its response tokens P..n-1 are predicted at P-1..n-2;
`target_index[i, k]` is the packed position that predicts response token k of packed sequence i.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_dapo.bridge.parallel import unwrap_model

IGNORE_INDEX = -100  # target id of positions that predict nothing (logprob 0, no gradient)


@dataclass
class PackedMicroBatch:
    rows: list[int]  # batch row of each packed sequence, in packed order
    tokens: torch.Tensor  # [1, L] int64
    position_ids: torch.Tensor  # [1, L] int64, restarting at 0 for each sequence
    target_ids: torch.Tensor  # [1, L] int64, IGNORE_INDEX where a position predicts no response token
    cu_seqlens: torch.Tensor  # [n + 1] int32 offsets of the sequences (padding is one more segment)
    target_index: torch.Tensor  # [n, R] int64 packed position predicting response token k of sequence i
    target_valid: torch.Tensor  # [n, R] bool, k < response length of sequence i

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed sequences (with their padding to `seq_multiple`, none by default)."""
        return int(self.cu_seqlens[len(self.rows)])

    def attention_mask(self) -> torch.Tensor:
        """[1, 1, L, L] bool, True where attention is NOT allowed (megatron-core's convention)."""
        return block_causal_mask(self.cu_seqlens, self.length)

    def packed_seq_params(self):
        """megatron-core THD parameters for Transformer Engine attention."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
        )

    def gather(self, per_position: torch.Tensor) -> torch.Tensor:
        """[1, L] values at packed positions -> [n, R] per sequence and response token (0 where invalid)."""
        out = per_position[0][self.target_index.to(per_position.device)]
        return out * self.target_valid.to(device=out.device, dtype=out.dtype)


@dataclass(frozen=True)
class PackingRules:
    """What an engine needs of the micro-batches it runs (every DP rank packs the same count)."""

    seq_multiple: int = 1  # each sequence padded to a multiple (context parallelism cuts it into 2*cp chunks)
    pad_multiple: int = 1  # each packed row padded to a multiple (x tp under sequence parallelism)
    count_multiple: int = 1  # the micro-batch count a multiple (the interleaved pipeline runs them in groups of pp)
    same_length: bool = False  # every micro-batch of one length, agreed over DP (pipeline stages exchange one shape)


def plan_micro_batches(lengths: list[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Indices into `lengths`, grouped into micro-batches of at most `max_tokens` tokens.

    First-fit decreasing: longest sequences first, each into the first micro-batch with room. A
    sequence longer than the budget gets a micro-batch of its own (never split, never dropped).
    At least `min_count` micro-batches are returned (possibly empty), so that every data-parallel
    rank can run the same number (MoE all-to-all and pipeline stages need it).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens per micro-batch must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    # Split the fullest bins until there are enough (only empty bins once each holds one sequence).
    while len(bins) < min_count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins.append([])
            continue
        b = max(splittable, key=lambda b: sum(lengths[i] for i in bins[b]))
        seqs = bins[b]
        bins[b], extra = seqs[: len(seqs) // 2], seqs[len(seqs) // 2 :]
        bins.append(extra)
    return [sorted(b) for b in bins]


def pack(
    sequences: list[list[int]],
    prompt_lengths: list[int],
    rows: list[int],
    length: int | None = None,
    pad_multiple: int = 1,
    pad_id: int = 0,
    seq_multiple: int = 1,
) -> PackedMicroBatch:
    """Pack `sequences[r]` for r in `rows` into one micro-batch of `length` tokens (None: as short as
    possible, rounded up to `pad_multiple`). An empty `rows` gives an all-padding micro-batch.

    `seq_multiple` pads every sequence (inside its own segment, after its last token, so causal attention
    keeps it from the real tokens) to a multiple of it: context parallelism cuts each into 2*cp chunks."""
    total = sum(padded_length(len(sequences[r]), seq_multiple) for r in rows)
    if length is None:
        length = max(1, total)
        length = -(-length // pad_multiple) * pad_multiple
    if total > length:
        raise ValueError(f"{total} tokens do not fit in a packed micro-batch of {length}")
    if (length - total) % seq_multiple:
        raise ValueError(f"packed length {length} leaves a padding segment that is not a multiple of {seq_multiple}")
    tokens = torch.full((1, length), pad_id, dtype=torch.long)
    positions = torch.zeros((1, length), dtype=torch.long)
    targets = torch.full((1, length), IGNORE_INDEX, dtype=torch.long)
    resp_lens = [len(sequences[r]) - prompt_lengths[r] for r in rows]
    width = max([1, *resp_lens])
    index = torch.zeros((len(rows), width), dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    cu = [0]
    for i, r in enumerate(rows):
        seq, p = sequences[r], prompt_lengths[r]
        if p < 1:
            raise ValueError(f"row {r}: prompt length {p} < 1 (the first response token needs a context token)")
        if p > len(seq):
            raise ValueError(f"row {r}: prompt length {p} exceeds the sequence length {len(seq)}")
        o, n = cu[-1], len(seq)
        tokens[0, o : o + n] = torch.as_tensor(seq, dtype=torch.long)
        positions[0, o : o + n] = torch.arange(n)
        k = n - p
        if k:
            at = torch.arange(o + p - 1, o + n - 1)
            targets[0, at] = tokens[0, o + p : o + n]
            index[i, :k] = at
            valid[i, :k] = True
        end = o + padded_length(n, seq_multiple)
        positions[0, o + n : end] = torch.arange(n, end - o)
        cu.append(end)
    if cu[-1] < length:  # trailing padding: its own segment, so real tokens never attend to it
        positions[0, cu[-1] :] = torch.arange(length - cu[-1])
        cu.append(length)
    return PackedMicroBatch(list(rows), tokens, positions, targets, torch.tensor(cu, dtype=torch.int32), index, valid)


def padded_length(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    seg = torch.zeros(length, dtype=torch.long)
    seg[cu_seqlens[1:-1].long()] = 1
    seg = seg.cumsum(0)
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    return (~allowed)[None, None]


@contextlib.contextmanager
def per_sequence_rope(model, position_ids: torch.Tensor, cp: int = 1):
    """Inside this block the GPTModel's RoPE rotates token t by `position_ids[0, t]`.

    With context parallelism `position_ids` are this rank's tokens' (GPTModel asks for a table of
    cp times the local length, then would cut its own share: the positions already are that share).

    megatron-core's RotaryEmbedding returns the table for positions 0..S-1 of the (packed) row;
    for a packed row each sequence must restart at 0 -- RoPE is relative, but the rounding of
    cos/sin at large angles is not, and per-sequence positions reproduce the unpacked numbers.
    """
    rope = getattr(unwrap_model(model), "rotary_pos_emb", None)
    if rope is None or position_ids.shape[0] != 1:
        yield
        return
    pos = position_ids[0]

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        if max_seq_len != pos.numel() * cp:
            raise RuntimeError(
                f"rotary table for {max_seq_len} positions requested, packed row has {pos.numel()} x cp={cp}"
            )
        table = type(rope).get_emb(rope, int(pos.max()) + 1, offset)  # [P, 1, 1, D]
        return table[pos.to(table.device)]

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward
