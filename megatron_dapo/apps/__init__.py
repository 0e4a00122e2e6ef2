"""The programs built on the library, one module per `megatron-dapo` sub-command (megatron_dapo.cli):
`train` (train.py, over the Ray / torchrun launch in launch.py), `eval`, `demo` (with its supervised
warm start), `smoke`, `plan`, `plot`, `profile-engine`. Nothing in the library imports them."""
