"""A character-level tokenizer in the Hugging Face format, built by the project for the CPU demo.

Every printable ASCII character and the newline is one token; Qwen's chat special tokens
(`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`) are whole tokens. It is saved as
`tokenizer.json` + `tokenizer_config.json` with a Qwen-style chat template, so
`AutoTokenizer.from_pretrained(dir)` and `apply_chat_template` work exactly as for a real model.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
# Padded with reserved special tokens (as Qwen's vocabulary is) to the tiny models' 256 rows, so the
# model's vocab_size, megatron-core's padded vocabulary and the tokenizer all agree.
VOCAB_SIZE = 256
RESERVED = tuple(f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(CHARS)))

# Qwen's template, minus tool calls and system defaults: short prompts keep the demo fast.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer(out_dir: str | Path) -> Path:
    """Write the tokenizer files to `out_dir`; return it. Vocabulary: specials, CHARS, reserved."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    for t in RESERVED:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    # Every character is its own piece ("." would leave newlines out).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + RESERVED])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def vocab_size() -> int:
    return VOCAB_SIZE
