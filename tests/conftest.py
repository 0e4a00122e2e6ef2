import os

import pytest

# Keep CPU tests from oversubscribing the 2-core CI machine (each torchrun rank is a process).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A test that runs a Ray driver in this process would otherwise replace builtins.print for every later test.
os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")


def pytest_collection_modifyitems(config, items):
    from tests import shared_launch

    shared_launch.set_timeouts(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing means nothing runs anyway
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


SGLANG_PEER_KEY = "peer-secret"


@pytest.fixture(scope="module")
def sglang_peer(tmp_path_factory):
    """A peer built from SGLang 0.5.23's own code (tests/sglang_peer.py), api key SGLANG_PEER_KEY, one
    placeholder request in its running batch. Installs SGLang into the cache on first use; fails, never
    skips, when that is impossible."""
    import sys
    import time
    import urllib.error
    import urllib.request
    from pathlib import Path

    from megatron_dapo.rollout.launcher import ServerProcess
    from megatron_dapo.runtime.net import free_port
    from tests import sglang_peer as peer

    peer.ensure_installed()
    root = Path(__file__).resolve().parent.parent
    port = free_port()
    env = {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    server = ServerProcess(
        [sys.executable, "-m", "tests.sglang_peer", "serve", "--port", str(port), "--running-requests", "1"],
        port,
        log_path=tmp_path_factory.mktemp("peer") / "peer.log",
        env={**env, "SGLANG_PEER_API_KEY": SGLANG_PEER_KEY},
    ).start(wait=False)
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 300
    try:
        while True:  # SGLang's /health asks its scheduler; the peer's own state route says it is up
            if not server.alive():
                raise RuntimeError(f"SGLang peer exited during start-up:\n{server.log_tail()}")
            try:
                with no_proxy.open(f"{server.url}/peer/state", timeout=2.0):
                    break
            except urllib.error.HTTPError:  # 401 without the key: it is serving
                break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang peer not up after 300 s:\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        server.stop()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "torchrun_checks(nproc, checks, timeout): checks run by one shared launch (tests/shared_launch.py)"
    )


@pytest.fixture
def torchrun_checks(request, tmp_path_factory):
    """Call it to assert the test's `torchrun_checks` checks passed in their shared launch; it returns the
    launch's output."""
    from tests import shared_launch

    launch = shared_launch.launch_for(request, tmp_path_factory)
    checks = request.node.get_closest_marker(shared_launch.MARKER).args[1]
    return lambda: launch.assert_passed(checks)
