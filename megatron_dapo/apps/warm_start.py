"""A short supervised warm start of a Hugging Face model (the CPU demo's starting point).

RL from a random tiny model sees only all-wrong groups, which dynamic sampling drops; a few
hundred steps of next-token training on reference responses teach the answer format and some
of the arithmetic, so that DAPO starts with informative groups (some right, some wrong).
The loss covers response tokens only, like the RL objective.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from megatron_dapo.data.dataset import encode_chat


def sft_examples(tokenizer, rows: list[dict], response_of) -> list[tuple[list[int], int]]:
    """(prompt + response + eos token ids, prompt length) per dataset row."""
    out = []
    for row in rows:
        prompt = encode_chat(tokenizer, row["prompt"])
        response = tokenizer.encode(response_of(row), add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((prompt + response, len(prompt)))
    return out


def supervised_warm_start(
    model_dir: str | Path,
    examples: list[tuple[list[int], int]],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> list[float]:
    """Train the HF model in `model_dir` on `examples` for `steps` steps (AdamW, cosine decay);
    save it to `out_dir` (default: in place, atomically). Returns the loss per step."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    pad = 0
    losses = []
    for _ in tqdm(range(steps), desc="warm start", disable=not progress, leave=False):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (seq, plen) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, plen : len(seq)] = torch.tensor(seq[plen:])
            mask[i, : len(seq)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    target = Path(out_dir or model_dir)
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    for f in Path(model_dir).glob("tokenizer*"):  # keep the tokenizer next to the weights
        (tmp / f.name).write_bytes(f.read_bytes())
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return losses
