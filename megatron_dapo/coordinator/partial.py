"""Partial rollout: an interrupted request continues from its tokens instead of starting over.

A server aborts a request (a weight update with abort, a pause in abort mode, an abort by rid) and
answers with the tokens and logprobs generated so far. The continuation is a new request whose
input is the prompt plus those tokens, with `max_new_tokens` reduced by their number and the same
sampling seed: seeded draws depend on (seed, absolute position) only, so with unchanged weights
the continued request produces exactly the tokens the uninterrupted one would have. The pieces
are then merged back into one sample whose weight-version spans say which weights made each token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

import torch

from megatron_dapo.rollout.types import Sample, SamplingParams, WeightVersionSpan


def continuation_sampling(sampling: SamplingParams, generated: int) -> SamplingParams:
    """One sample's parameters for continuing after `generated` tokens (same seed, fewer new tokens)."""
    return replace(sampling, n=1, max_new_tokens=max(0, sampling.max_new_tokens - generated))


def version_spans(sample: Sample) -> list[WeightVersionSpan]:
    """The sample's spans, one covering all its tokens when the server reported a single version."""
    if sample.weight_versions:
        return [replace(s) for s in sample.weight_versions]
    return [WeightVersionSpan(str(sample.weight_version), 0, len(sample.output_ids))]


def merge_continuation(prefix: Sample, cont: Sample) -> Sample:
    """`prefix` (interrupted) followed by `cont` (its continuation) as one sample of the original prompt."""
    offset = len(prefix.output_ids)
    spans = [s for s in version_spans(prefix) if s.end > s.start]
    for s in version_spans(cont):
        if s.end <= s.start:
            continue
        if spans and spans[-1].version == s.version and spans[-1].end == offset + s.start:
            spans[-1].end = offset + s.end
        else:
            spans.append(WeightVersionSpan(s.version, offset + s.start, offset + s.end))
    versions = {s.version for s in spans}
    return replace(
        cont,
        rid=prefix.rid,
        prompt_ids=list(prefix.prompt_ids),
        output_ids=list(prefix.output_ids) + list(cont.output_ids),
        logprobs=list(prefix.logprobs) + list(cont.logprobs),
        # one version: no spans, and that version (not the one of an empty last piece) is the sample's
        weight_version=spans[0].version if len(versions) == 1 else cont.weight_version,
        weight_versions=spans if len(versions) > 1 else [],
        text=prefix.text + cont.text,
        group_id=prefix.group_id,
        index=prefix.index,
        num_retractions=prefix.num_retractions + cont.num_retractions,
        routed_experts=joined_routing(prefix, cont),
    )


def joined_routing(prefix: Sample, cont: Sample) -> torch.Tensor | None:
    """The routed experts of `prefix` then `cont` (which the router asked from the first position the
    prefix's rows do not cover, or from 0 when the prefix generated nothing), each from its own weights."""
    if cont.routed_experts is None or not prefix.output_ids:
        return cont.routed_experts
    if prefix.routed_experts is None:
        raise ValueError(f"sample {prefix.rid}: its continuation carries routed experts, its first piece none")
    return torch.cat([prefix.routed_experts, cont.routed_experts])


def continuation_ids(sample: Sample) -> list[int]:
    """The input of a request continuing `sample`: its prompt and the tokens generated so far."""
    return list(sample.prompt_ids) + list(sample.output_ids)


async def finish_partial(
    generate: Callable[[Sample, SamplingParams], Awaitable[Sample]],
    sample: Sample,
    sampling: SamplingParams,
    max_stalls: int = 3,
    on_resume: Callable[[], None] | None = None,
    on_progress: Callable[[Sample], None] | None = None,
) -> Sample:
    """Continue `sample` (of prompt `sample.prompt_ids`, drawn with `sampling`) until it is not aborted.

    `generate(so_far, sampling)` sends one request continuing the trajectory `so_far` (its input: the
    prompt and the tokens so far, `continuation_ids`; e.g. through the router, sticky to the group);
    `on_resume()` is called per continuation request, `on_progress(merged)` after each (what a
    checkpoint saves of a request still in flight). Gives up after `max_stalls` + 1 aborts in a row
    that added no token (a server that aborts everything would otherwise loop forever).
    """
    stalls = 0
    while sample.aborted:
        cont = continuation_sampling(sampling, len(sample.output_ids))
        if cont.max_new_tokens == 0:  # aborted just as its budget ran out
            return replace(sample, finish_reason="length")
        if stalls > max_stalls:
            raise RuntimeError(f"sample {sample.rid}: aborted {stalls} times in a row without a new token")
        if on_resume is not None:
            on_resume()
        piece = await generate(sample, cont)
        stalls = 0 if piece.output_ids else stalls + 1
        sample = merge_continuation(sample, piece)
        if on_progress is not None:
            on_progress(sample)
    return sample
