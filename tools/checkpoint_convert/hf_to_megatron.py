"""HF safetensors -> megatron-core dist_checkpointing. Same as `megatron-dapo convert hf-to-megatron`.

python tools/checkpoint_convert/hf_to_megatron.py --hf Qwen3-8B --out ckpt/qwen3-8b --tp 2
"""

import sys

from megatron_dapo.bridge.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
