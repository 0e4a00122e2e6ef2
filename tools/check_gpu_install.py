"""Check that the GPU install resolves: `pip install -e ".[gpu]" -c constraints/gpu.txt` (docs/install.md).

usage: python tools/check_gpu_install.py [--sglang-metadata METADATA] [--pins-only] [--cache DIR]

1. pins: constraints/gpu.txt and pyproject.toml (dependencies + the `gpu` extra) against SGLang 0.5.23's own
   requirements, read from its wheel's METADATA (`--sglang-metadata`, or the wheel downloaded without its
   dependencies into the cache): every pin satisfies SGLang's specifier, every exact pin of SGLang is
   admitted by our ranges, and the versions SGLang pins for torch / transformers / tokenizers are ours.
2. resolve (skipped with --pins-only): the whole dependency set of the GPU install resolved by `uv pip compile`
   for Python 3.11 and 3.12 on x86_64 Linux, from package metadata only (uv reads a wheel's METADATA with
   HTTP range requests, and builds nothing). Transformer Engine's PyTorch extension is the one sdist in the
   set, whose setup.py picks its core library by torch's CUDA major (13 for torch 2.14.1 from PyPI): its
   metadata is declared to the resolver (TE_TORCH_REQUIRES), so it is not built either.
   Needs `uv` (the `test` extra installs it) and PyPI.

Exit status 1 on any conflict, each named.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints" / "gpu.txt"
SGLANG = "0.5.23"
MUST_MATCH = ("torch", "transformers", "tokenizers")  # SGLang pins them; the GPU install must run those
PYTHONS = ("3.11", "3.12")
PLATFORM = "x86_64-manylinux_2_34"  # SGLang 0.5.23's x86_64 wheel is manylinux_2_34
TORCH_CUDA_MAJOR = 13  # torch 2.14.1 on PyPI is a CUDA 13 build (its nvidia-*-cu13 / cuda-toolkit 13 requirements)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _env(python: str) -> dict:
    return {
        "python_version": python,
        "python_full_version": python + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def _applies(req: Requirement, python: str) -> bool:
    return req.marker is None or req.marker.evaluate(_env(python))


def metadata_requirements(text: str, python: str) -> list[Requirement]:
    """The Requires-Dist entries of a METADATA / PKG-INFO text that apply on Linux x86_64 (no extra)."""
    msg = email.parser.Parser().parsestr(text, headersonly=True)
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if _applies(r, python)]


def constraint_pins(path: Path, python: str) -> dict[str, Version]:
    """name -> pinned version of each `name==version` line of a constraints file that applies."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ValueError(f"{path}: {line!r} is not a `name==version` pin")
        if _applies(req, python):
            pins[_norm(req.name)] = Version(specs[0].version)
    return pins


def project_requirements(python: str) -> list[Requirement]:
    """pyproject.toml's dependencies and its `gpu` extra that apply."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]]
    return [r for r in reqs if _applies(r, python)]


def _exact(req: Requirement) -> Version | None:
    specs = list(req.specifier)
    return Version(specs[0].version) if len(specs) == 1 and specs[0].operator == "==" else None


def pin_conflicts(sglang: list[Requirement], pins: dict[str, Version], ours: list[Requirement]) -> list[str]:
    """Each disagreement between SGLang's requirements, our constraint pins and our ranges, in words."""
    problems = []
    theirs = {_norm(r.name): r for r in sglang}
    for name, version in sorted(pins.items()):
        if name in theirs and not theirs[name].specifier.contains(version, prereleases=True):
            problems.append(f"constraints/gpu.txt pins {name}=={version}; SGLang {SGLANG} requires {theirs[name]}")
    for req in ours:
        name = _norm(req.name)
        if name in theirs and (pinned := _exact(theirs[name])) and not req.specifier.contains(pinned, True):
            problems.append(f"pyproject.toml requires {req}; SGLang {SGLANG} pins {theirs[name]}")
        if name in pins and not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"pyproject.toml requires {req}; constraints/gpu.txt pins {name}=={pins[name]}")
    for name in MUST_MATCH:
        want = _exact(theirs[name]) if name in theirs else None
        if want is None:
            problems.append(f"SGLang {SGLANG} no longer pins {name} exactly: revisit MUST_MATCH")
        elif pins.get(name) != want:
            have = pins.get(name)
            problems.append(f"constraints/gpu.txt must pin {name}=={want} (SGLang {SGLANG}'s); it pins {have}")
    return problems


def _download(spec: str, cache: Path, pattern: str) -> Path:
    found = sorted(cache.glob(pattern))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(cache), spec]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        found = sorted(cache.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip download {spec} left no {pattern} in {cache}")
    return found[-1]


def sglang_metadata(cache: Path) -> str:
    wheel = _download(f"sglang=={SGLANG}", cache, f"sglang-{SGLANG}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.read(f"sglang-{SGLANG}.dist-info/METADATA").decode()


# transformer-engine-torch's requirements as its setup.py states them (2.11.0: build_tools/pytorch.py's
# install_requirements() plus the core library it picks by torch's CUDA major), read from its sdist by hand.
# Not read by this script: `pip download` of that sdist prepares its metadata, which installs torch (some
# GB with its CUDA libraries) into a build environment and runs setup.py.
TE_TORCH_REQUIRES = ["torch>=2.1", "einops", "onnxscript", "onnx", "packaging", "pydantic"]
TE_TORCH_REQUIRES_PYTHON = ">=3.10.0"


def te_torch_metadata(version: Version) -> dict:
    """transformer-engine-torch's metadata as its setup.py produces it against torch 2.14.1 (CUDA 13)."""
    return {
        "name": "transformer-engine-torch",
        "version": str(version),
        "requires-dist": [*TE_TORCH_REQUIRES, f"transformer-engine-cu{TORCH_CUDA_MAJOR}=={version}"],
        "requires-python": TE_TORCH_REQUIRES_PYTHON,
    }


def resolve(python: str, te_meta: dict, workdir: Path) -> tuple[bool, str]:
    """`uv pip compile` of the GPU install for `python`: (resolved, uv's output)."""
    reqs = workdir / "gpu.in"
    reqs.write_text("\n".join(str(r) for r in project_requirements(python)) + "\n")
    config = workdir / "uv.toml"
    meta = te_meta
    config.write_text(
        "[[dependency-metadata]]\n"
        f'name = "{meta["name"]}"\nversion = "{meta["version"]}"\n'
        f'requires-python = "{meta["requires-python"]}"\n'
        f"requires-dist = {[str(r) for r in meta['requires-dist']]!r}\n".replace("'", '"')
    )
    cmd = [
        "uv", "pip", "compile", str(reqs), "-c", str(CONSTRAINTS), "--config-file", str(config),
        "--python-version", python, "--python-platform", PLATFORM, "--quiet",
        "-o", str(workdir / f"gpu-{python}.txt"),
    ]  # fmt: skip
    # the target interpreter is only named: uv must not fetch one (only package registries are reached)
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return run.returncode == 0, (run.stdout + run.stderr).strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-metadata", type=Path, help="SGLang 0.5.23's METADATA file (default: download the wheel)")
    ap.add_argument("--pins-only", action="store_true", help="skip the resolve (no uv, no network but the wheel)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "megatron-dapo" / "gpu-install")
    args = ap.parse_args(argv)
    text = args.sglang_metadata.read_text() if args.sglang_metadata else sglang_metadata(args.cache)
    failed = False
    for python in PYTHONS:
        problems = pin_conflicts(metadata_requirements(text, python), constraint_pins(CONSTRAINTS, python),
                                 project_requirements(python))  # fmt: skip
        for p in problems:
            print(f"python {python}: {p}")
        failed |= bool(problems)
        if not problems:
            print(f"python {python}: pins agree with SGLang {SGLANG}'s requirements")
    if args.pins_only:
        return int(failed)
    te = constraint_pins(CONSTRAINTS, PYTHONS[-1])["transformer-engine-torch"]
    te_meta = te_torch_metadata(te)
    with tempfile.TemporaryDirectory() as tmp:
        for python in PYTHONS:
            ok, out = resolve(python, te_meta, Path(tmp))
            if ok:
                lock = (Path(tmp) / f"gpu-{python}.txt").read_text()
                pinned = [line for line in lock.splitlines() if line and not line.startswith(("#", " "))]
                versions = {n: v for n, _, v in (p.partition("==") for p in pinned)}
                print(
                    f"python {python}: the GPU install resolves ({len(pinned)} packages: "
                    + ", ".join(f"{n}=={versions.get(n)}" for n in ("torch", "transformers", "megatron-core",
                                                                    "transformer-engine", "sglang"))
                    + ")"
                )  # fmt: skip
            else:
                print(f"python {python}: the GPU install does not resolve:\n{out}")
                failed = True
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
