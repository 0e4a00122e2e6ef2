"""The embedded SGLang-compatible server: `megatron-dapo serve --model DIR` (server.py), engine.py generates."""
