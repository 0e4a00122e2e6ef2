"""`megatron-dapo profile-engine` refuses what it cannot measure or should not write: out-of-range
values, a server that never answers (within --timeout-s) and a fit worse than --max-fit-error."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_dapo.cli import main as cli_main
from megatron_dapo.runtime.net import LOOPBACK

GENEROUS_S = 120  # far below the hour a silent server used to cost, far above --timeout-s


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--batch-sizes", "1,0", "comma-separated integers in [1, 65536]"),
        ("--batch-sizes", "1,99999999999999999999", "comma-separated integers in [1, 65536]"),
        ("--prompt-lens", "nan", "comma-separated integers in [1, 16777216]"),
        ("--new-tokens", "1", "an integer in [2, 16777216]"),
        ("--new-tokens", "1e30", "an integer in [2, 16777216]"),
        ("--repeats", "0", "an integer in [1, 1000]"),
        ("--max-token-id", "4294967296", "an integer in [2, 2147483647]"),
        ("--seed", "-1", "an integer >= 0"),
        ("--timeout-s", "0", "a finite number in (0, 86400]"),
        ("--timeout-s", "inf", "a finite number in (0, 86400]"),
        ("--max-fit-error", "nan", "a finite number > 0"),
        ("--max-fit-error", "-0.1", "a finite number > 0"),
        ("--since", "nan", "a finite number"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_flag(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["profile-engine", "--server", f"http://{LOOPBACK}:1", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: expected {expected}, got '{value}'" in capsys.readouterr().err


class _Silent(BaseHTTPRequestHandler):
    """Answers /health (when the server says so) and nothing else: holds every other request open."""

    def do_GET(self):
        if self.path == "/health" and self.server.healthy:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.stop.wait()

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(params=["silent", "healthy_then_silent"])
def silent_server(request):
    """A TCP server on loopback that accepts and never answers (or answers only /health)."""
    server = ThreadingHTTPServer((LOOPBACK, 0), _Silent)
    server.daemon_threads = True
    server.healthy, server.stop = request.param == "healthy_then_silent", threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}", request.param
    server.stop.set()
    server.shutdown()
    server.server_close()
    thread.join(30)


def test_a_silent_server_fails_within_the_timeout(silent_server, tmp_path, capsys):
    url, kind = silent_server
    out = tmp_path / "cost.json"
    result = {}
    argv = ["profile-engine", "--server", url, "--timeout-s", "2", "--out", str(out)]
    run = threading.Thread(target=lambda: result.update(rc=cli_main(argv)), daemon=True)
    run.start()
    run.join(GENEROUS_S)
    assert not run.is_alive(), f"profile-engine still waiting on a silent server after {GENEROUS_S} s"
    err = capsys.readouterr().err
    assert result["rc"] == 1 and not out.exists()
    if kind == "silent":
        assert f"GET {url}/health" in err and "not healthy after 2.0s" in err, err
    else:
        assert f"GET {url}/v1/loads: no answer within 2 s (timed out)" in err, err


def _noisy_trace(path) -> None:
    """Decode steps whose times do not depend on batch or context: no cost model fits them."""
    rng = random.Random(0)
    rows = [
        {
            "t": float(i),
            "kind": "decode",
            "n": rng.randint(1, 16),
            "kv": rng.randint(10, 5000),
            "s": rng.uniform(0.001, 0.1),
        }
        for i in range(400)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_fit_worse_than_max_fit_error_is_not_written(tmp_path, capsys):
    trace, out = tmp_path / "noisy.jsonl", tmp_path / "cost.json"
    _noisy_trace(trace)
    assert cli_main(["profile-engine", "--from-trace", str(trace), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "exceeds --max-fit-error 50.00%" in err and f"{out} not written" in err and not out.exists()
    # the same fit, accepted as it is when the limit allows it: written with its error
    assert cli_main(["profile-engine", "--from-trace", str(trace), "--out", str(out), "--max-fit-error", "10"]) == 0
    saved = json.loads(out.read_text())
    assert 0.5 < saved["fit_rel_error"] <= 10 and f"{saved['fit_rel_error']:.2%}" in capsys.readouterr().out
