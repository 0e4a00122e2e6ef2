"""Helpers shared by the bridge test workers: HF reference logits and megatron logits at any layout."""

from __future__ import annotations

import torch
import torch.distributed as dist


def hf_logits(hf_dir, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def causal_mask(seq: int) -> torch.Tensor:
    # megatron's convention: True = masked
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def megatron_logits(chunks, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full (TP-gathered, vocab-trimmed) logits [B, S, V] on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for c in chunks:
        c.eval()
    b, s = input_ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = causal_mask(s)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        out = chunks[0](input_ids, pos, mask)
        return _gather_vocab(out)[..., :vocab_size].float()

    # One micro-batch per sample: the interleaved (VPP) schedule needs at least PP micro-batches.
    def forward_step(data_iter, model):
        ids = next(data_iter)
        out = model(ids, pos[:1], mask)

        def loss_func(output, non_loss_data=False):
            if non_loss_data:
                return output
            return output.sum() * 0, {}

        return out, loss_func

    n = len(chunks)
    iters = [iter(input_ids.split(1)) for _ in range(n)]
    outs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if n > 1 else iters[0],
        model=chunks if n > 1 else chunks[0],
        num_microbatches=b,
        seq_length=s,
        micro_batch_size=1,
        forward_only=True,
        collect_non_loss_data=True,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return _gather_vocab(torch.cat(list(outs), dim=0))[..., :vocab_size].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
