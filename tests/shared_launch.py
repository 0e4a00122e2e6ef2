"""Checks of several test files in one torchrun launch per world size.

A test marked `@pytest.mark.torchrun_checks(nproc, ["MODULE:CHECK", ...], timeout=s)` (MODULE: a worker in
tests/workers/ with a CHECKS table) takes the fixture `torchrun_checks` and calls it: every selected test
marked with the same nproc has its checks run by one launch of tests/workers/check_suite.py, started by
the first of them, so that each rank imports torch, megatron-core and transformers once instead of once
per test (the bulk of a small launch's time on a CPU machine). The launch's limit is the sum of the tests'
own; each test asserts only its checks, and a failing check is reported by its own test with the output
of its launch (the checks after it run in a new launch: tests.dist_utils.run_check_launches).
"""

from __future__ import annotations

import pytest

from tests.dist_utils import CheckResults, run_check_launches

MARKER = "torchrun_checks"
_LAUNCHES = pytest.StashKey[dict]()


def _marker(item):
    return item.get_closest_marker(MARKER)


def group(items, nproc: int) -> tuple[list[str], float]:
    """The checks (in test order, once each) and the summed time limit of the tests marked for `nproc`."""
    checks, timeout = [], 0.0
    for item in items:
        m = _marker(item)
        if m is not None and m.args[0] == nproc:
            checks += [c for c in m.args[1] if c not in checks]
            timeout += m.kwargs["timeout"]
    return checks, timeout


def set_timeouts(items) -> None:
    """Give each marked test the time of its whole launch (any of them may be the one that starts it)."""
    for item in items:
        m = _marker(item)
        if m is not None:
            item.add_marker(pytest.mark.timeout(group(items, m.args[0])[1] + 60))


def launch_for(request, tmp_path_factory) -> CheckResults:
    """The launch holding the requesting test's checks, run on first use."""
    nproc = _marker(request.node).args[0]
    launches = request.config.stash.setdefault(_LAUNCHES, {})
    if nproc not in launches:
        checks, timeout = group(request.session.items, nproc)
        tmpdir = tmp_path_factory.mktemp(f"checks_{nproc}_ranks")
        launches[nproc] = run_check_launches("check_suite.py", nproc, checks, tmpdir, timeout)
    return launches[nproc]
