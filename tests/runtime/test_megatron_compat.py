"""runtime.megatron_compat: the supported megatron-core range, and loud failures when a release removes what
this package builds on (GPTModel and its layer specs first: docs/design/megatron-core-versions.md)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_dapo.runtime import megatron_compat as compat

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_states_the_compat_range_and_the_installed_release_is_in_it():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "megatron-core"]
    assert str(req.specifier) == str(Requirement("megatron-core" + compat.SUPPORTED_RANGE).specifier)
    for tested in compat.TESTED_VERSIONS:
        assert Version(tested) in req.specifier, tested
    installed = compat.megatron_core_version()
    assert Version(installed) in req.specifier, f"megatron-core {installed} is outside {req.specifier}"


def _megatron_core_imports() -> dict[tuple[str, str], list[str]]:
    """(module, name) -> ['file:line', ...] for every `from megatron.core... import name` in the package,
    function-level imports included (most are: they fail only when the code path runs). megatron_compat
    itself is left out: it imports what only some releases have, each behind a check of which it is."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted((ROOT / "megatron_dapo").rglob("*.py")):
        if path.name == "megatron_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[:2] == ["megatron", "core"]:
                for alias in node.names:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    found.setdefault((node.module, alias.name), []).append(where)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("megatron.core"):
                        module, _, name = alias.name.rpartition(".")
                        found.setdefault((module, name), []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _provides(module: str, name: str) -> bool:
    try:
        if hasattr(importlib.import_module(module), name):
            return True
        importlib.import_module(f"{module}.{name}")  # a submodule not imported by its package
        return True
    except ImportError:
        return False


def test_what_the_providers_build_on_exists():
    missing = compat.missing_names(compat.PROVIDERS_BUILD_ON)
    assert not missing, (
        f"megatron-core {compat.megatron_core_version()} removed {', '.join(missing)}, which the Qwen3 / "
        "Qwen3-MoE / Qwen2.5 providers build their models from (models/provider.py, specs.py, "
        "core_attention.py): docs/design/megatron-core-versions.md says what replaces GPTModel (HybridModel) "
        "and what the move changes"
    )


def test_every_megatron_core_name_the_package_imports_exists():
    imports = _megatron_core_imports()
    # the providers' building blocks and the trainer's are among them: the scan is not vacuous
    for needed in [
        ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec"),
        ("megatron.core.transformer", "TransformerConfig"),
        ("megatron.core.transformer.moe.router_replay", "RouterReplayAction"),
        ("megatron.core.optimizer", "get_megatron_optimizer"),
    ]:
        assert needed in imports, needed
    missing = {f"{m}.{n}": where for (m, n), where in imports.items() if not _provides(m, n)}
    assert not missing, (
        f"megatron-core {compat.megatron_core_version()} no longer provides what megatron_dapo imports: "
        + "; ".join(f"{name} (imported at {', '.join(where)})" for name, where in sorted(missing.items()))
        + ": handle the difference in runtime/megatron_compat.py"
    )


def test_the_names_cpu_mode_replaces_exist():
    missing = compat.missing_names(compat.CPU_MODE_REPLACES)
    assert not missing, f"megatron-core {compat.megatron_core_version()} lacks {missing}: runtime/cpu.py replaces them"
    assert compat.missing_names([("megatron.core.models.gpt", "NoSuchModel")]) == [
        "megatron.core.models.gpt.NoSuchModel"
    ]


def test_gpt_model_class_is_megatron_cores():
    from megatron.core.models.gpt.gpt_model import GPTModel

    assert compat.gpt_model_class() is GPTModel


_SAVE = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron_dapo.runtime import megatron_compat as compat
    from megatron_dapo.runtime.cpu import enable_cpu_mode
    from megatron_dapo.trainer.checkpoint import megatron_save

    enable_cpu_mode()
    out = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=0, world_size=1)
    megatron_save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "iteration": 7}, out)
    print(compat.common_state_in_dcp(), compat.common_state_file(out), compat.read_common_state(out)["iteration"])
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_the_common_state_is_where_the_installed_release_puts_it(tmp_path):
    """common_state_in_dcp() agrees with what megatron_save (dist_checkpointing.save) really writes, and
    read_common_state reads it back."""
    out = tmp_path / "ckpt"
    out.mkdir()
    run = subprocess.run([sys.executable, "-c", _SAVE, str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    in_dcp, where, iteration = run.stdout.split()[-3:]
    assert iteration == "7"
    assert (out / compat.COMMON_PT).exists() == (in_dcp == "False")
    assert where == ("__0_0.distcp" if in_dcp == "True" else compat.COMMON_PT)
