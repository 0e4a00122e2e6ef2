"""megatron-core dist_checkpointing -> HF safetensors. Same as `megatron-dapo convert megatron-to-hf`.

python tools/checkpoint_convert/megatron_to_hf.py --ckpt ckpt/qwen3-8b --out Qwen3-8B-dapo
"""

import sys

from megatron_dapo.bridge.cli import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
