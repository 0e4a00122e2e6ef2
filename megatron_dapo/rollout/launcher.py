"""Start and stop rollout server processes: SGLang (`python -m sglang.launch_server`) or the embedded one.

A server runs in its own process group with stdout/stderr in a log file; `start()` returns once its
`/health` answers 200 (or raises with the log's tail if the process died or the wait timed out);
`stop()` sends SIGTERM to the group, then SIGKILL after a grace period. Flag names are SGLang 0.5.23's
(`srt/arg_groups/fields/*.py`: field `tp_size` -> `--tp-size`; the unit test checks every flag against
the snapshot of those fields).

Seeded rollouts (`rollout.sampling.seeded`, on by default) send a `sampling_seed` per sample. SGLang
uses it only when launched with `--enable-deterministic-inference`, which `rollout.deterministic_inference`
adds (off by default: batch-invariant kernels cost throughput) when resumed runs must regenerate the
same samples. Without it SGLang ignores the seed. The embedded server always honours it; its flag of
the same name makes its logprobs batch-invariant.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.config.derived import colocated, routing_shape
from megatron_dapo.runtime.lifetime import EXIT_WITH_PARENT_ENV
from megatron_dapo.runtime.net import LOOPBACK, free_port


@dataclass
class SGLangServerArgs:
    model_path: str
    port: int = 30000
    host: str = LOOPBACK
    tp_size: int = 1
    mem_fraction_static: float | None = 0.8
    api_key: str | None = None
    dtype: str | None = None  # "auto" | "bfloat16" | "float16" | "float32"
    served_model_name: str | None = None
    weight_version: str | None = None
    random_seed: int | None = None
    context_length: int | None = None
    base_gpu_id: int | None = None
    enable_memory_saver: bool = False  # needed by release/resume_memory_occupation
    enable_deterministic_inference: bool = False  # honours sampling_seed; batch-invariant kernels
    enable_return_routed_experts: bool = False  # meta_info.routed_experts, for rollout routing replay (R3)
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False  # token ids in, token ids out
    log_level: str | None = None
    extra_args: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg, model_path: str, port: int, **overrides) -> "SGLangServerArgs":
        """From a resolved run config (`cfg.rollout`: server_tp, mem_fraction_static, host, api_key, extra_args)."""
        rollout = cfg.rollout
        kw = dict(
            model_path=model_path,
            port=port,
            host=rollout.host,
            tp_size=rollout.server_tp,
            mem_fraction_static=rollout.mem_fraction_static,
            api_key=rollout.api_key,
            extra_args=list(rollout.extra_args),
            enable_deterministic_inference=rollout.deterministic_inference,
            enable_return_routed_experts=routing_shape(cfg) is not None,  # algo.routing_replay
            # colocated: the step cycle releases and resumes the server's weights and KV cache
            enable_memory_saver=colocated(cfg),
        )
        kw.update(overrides)
        return cls(**kw)


def sglang_command(args: SGLangServerArgs, python: str = sys.executable) -> list[str]:
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(args.model_path),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--tp-size",
        str(args.tp_size),
    ]
    optional = {
        "--mem-fraction-static": args.mem_fraction_static,
        "--api-key": args.api_key,
        "--dtype": args.dtype,
        "--served-model-name": args.served_model_name,
        "--weight-version": args.weight_version,
        "--random-seed": args.random_seed,
        "--context-length": args.context_length,
        "--base-gpu-id": args.base_gpu_id,
        "--log-level": args.log_level,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    for flag, on in {
        "--enable-memory-saver": args.enable_memory_saver,
        "--enable-deterministic-inference": args.enable_deterministic_inference,
        "--enable-return-routed-experts": args.enable_return_routed_experts,
        "--trust-remote-code": args.trust_remote_code,
        "--skip-tokenizer-init": args.skip_tokenizer_init,
    }.items():
        if on:
            cmd.append(flag)
    return cmd + list(args.extra_args)


def embedded_command(
    model_dir: str,
    port: int,
    host: str = LOOPBACK,
    api_key: str | None = None,
    device: str = "auto",
    seed: int = 0,
    threads: int | None = 1,
    deterministic_inference: bool = False,
    batching: str = "static",
    return_routed_experts: bool = False,
    memory_saver: bool = False,
    extra_args: list[str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    cmd = [
        python,
        "-m",
        "megatron_dapo.cli",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        "--seed",
        str(seed),
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    if deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if batching != "static":
        cmd += ["--batching", batching]
    if return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if memory_saver:
        cmd.append("--enable-memory-saver")
    return cmd + list(extra_args or [])


class ServerProcess:
    """One server process: start, wait for /health, log to a file, stop cleanly."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        host: str = LOOPBACK,
        log_path: str | Path | None = None,
        env: dict | None = None,
        api_key: str | None = None,
    ):
        self.cmd, self.port, self.host = cmd, port, host
        self.log_path = Path(log_path) if log_path else Path(f"rollout_server_{port}.log")
        self.env = env
        self.api_key = api_key  # an api key secret never appears in logged commands
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host if self.host != '0.0.0.0' else LOOPBACK}:{self.port}"

    def start(self, timeout_s: float = 600.0, wait: bool = True) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env or {})
        env[EXIT_WITH_PARENT_ENV] = str(os.getpid())  # the embedded server exits with this process
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        if wait:
            self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never via a proxy
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server on port {self.port} exited with {self.proc.returncode} during "
                    f"start-up; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with no_proxy.open(f"{self.url}/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # refused, reset, timed out, or an HTTP error status (urllib's HTTPError)
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"server on port {self.port} not healthy after {timeout_s}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def restart(self, timeout_s: float = 600.0) -> None:
        """Start it again, on its port (the same URL), after it exited; return once healthy (else raise)."""
        self.stop()
        self.start(timeout_s)

    def move_to_port(self, port: int) -> None:
        """Re-point a stopped server's command line at another port (its --port flag)."""
        i = self.cmd.index("--port")
        self.cmd[i + 1] = str(port)
        self.port = port

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as tests simulate it)."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        if not self.alive():
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def launch_sglang(
    args: SGLangServerArgs, log_path: str | Path, timeout_s: float = 1200.0, env: dict | None = None
) -> ServerProcess:
    """Start an SGLang server; needs the `sglang` package (GPU machines: pip install megatron-dapo[gpu])."""

    if importlib.util.find_spec("sglang") is None:
        raise ImportError(
            "SGLang is not installed: `pip install sglang==0.5.23` (GPU only), or set rollout.engine: embedded"
        )
    return ServerProcess(sglang_command(args), args.port, args.host, log_path, env, args.api_key).start(timeout_s)


def embedded_server(
    model_dir: str, log_path: str | Path, port: int | None = None, api_key: str | None = None, **kw
) -> ServerProcess:
    """An embedded SGLang-compatible server process (not started) on a free port of `host` (default loopback)."""
    host = kw.get("host", LOOPBACK)
    port = port or free_port(host)
    env = {"OMP_NUM_THREADS": str(kw.get("threads") or 1), "TOKENIZERS_PARALLELISM": "false"}
    if api_key:
        env["MEGATRON_DAPO_API_KEY"] = api_key  # through the environment, not the command line
    return ServerProcess(embedded_command(model_dir, port, **kw), port, host, log_path, env, api_key)


def embedded_options(cfg, device: str) -> dict:
    """The keyword arguments of `embedded_server` / `launch_embedded(_servers)` that a run config decides
    (`cfg.rollout`; `rollout.extra_args` are `megatron-dapo serve` flags here, e.g. `--dtype bfloat16`)."""
    from megatron_dapo.config.derived import routing_shape

    rollout = cfg.rollout
    return dict(
        host=rollout.host,
        api_key=rollout.api_key,
        device=device,
        deterministic_inference=rollout.deterministic_inference,
        batching=rollout.embedded_batching,
        return_routed_experts=routing_shape(cfg) is not None,  # algo.routing_replay
        # colocated: the step cycle's release frees the weights and KV cache (refilled by the weight update)
        memory_saver=colocated(cfg),
        extra_args=list(rollout.extra_args),
    )


def rollout_model_path(cfg) -> str:
    """The checkpoint the run's servers start from: `model.hf_path`, or with rollout.weight_format=fp8_block its
    FP8 block copy (`<logging.run_dir>/rollout_fp8`, written by `convert hf-to-fp8` once and reused; a
    model.hf_path that is FP8 already is used as it is). Call it in the driver, before servers start."""
    import json

    from megatron_dapo.bridge import fp8

    src = Path(cfg.model.hf_path)
    if cfg.rollout.weight_format != "fp8_block":
        return str(src)
    config = src / "config.json"
    if config.is_file() and fp8.is_fp8_block_config(json.loads(config.read_text()).get("quantization_config")):
        return str(src)
    out = Path(cfg.logging.run_dir) / "rollout_fp8"
    if not (out / "config.json").is_file():  # the conversion renames a complete directory into place
        from megatron_dapo.bridge.convert import hf_to_fp8

        hf_to_fp8(src, out)
    return str(out)


def launch_embedded(
    model_dir: str,
    log_path: str | Path,
    port: int | None = None,
    api_key: str | None = None,
    timeout_s: float = 300.0,
    **kw,
) -> ServerProcess:
    """Start one embedded server and wait until it is healthy."""
    return embedded_server(model_dir, log_path, port, api_key, **kw).start(timeout_s)


def launch_embedded_servers(
    model_dir: str, count: int, log_dir: str | Path, api_key: str | None = None, timeout_s: float = 300.0, **kw
) -> list[ServerProcess]:
    """Start `count` embedded servers at once (their start-ups overlap); all healthy, or all stopped."""
    servers = [
        embedded_server(model_dir, Path(log_dir) / f"server_{i}.log", api_key=api_key, seed=i, **kw)
        for i in range(count)
    ]
    start_servers(servers, timeout_s)
    return servers


def start_servers(servers: list[ServerProcess], timeout_s: float = 300.0, port_retries: int = 3) -> None:
    """Start servers at once and wait for all; a server whose free port was taken meanwhile moves to another."""
    try:
        for s in servers:
            s.start(wait=False)
        for s in servers:
            for attempt in range(port_retries + 1):
                try:
                    s.wait_healthy(timeout_s)
                    break
                except RuntimeError:
                    if attempt == port_retries or "address already in use" not in s.log_tail().lower():
                        raise
                    s.move_to_port(free_port())
                    s.start(wait=False)
    except BaseException:
        for s in servers:
            s.stop()
        raise
