"""The embedded SGLang-compatible server: `megatron-dapo serve --model DIR` (server.py), engine.py generates.

It speaks the protocol of megatron_dapo.rollout (the layer below) and loads weights with
megatron_dapo.bridge.hf_loader; the coordinator and the trainer reach it over HTTP only."""
