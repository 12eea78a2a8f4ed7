"""Pack downloaded cp312 wheels into the folder a device call carries (scripts/device_bundle.sh).

SGLang's and FlashInfer's wheels (39 and 65 MB) do not fit a call's 64 MiB beside the ~31 MB
working tree. Both are mostly files a Llama/Qwen2 runtime on one GPU never opens: SGLang's Rust
extensions (the Rust HTTP/gRPC servers and multimodal processing) and its diffusion runtime,
FlashInfer's CUDA sources for MoE, MLA, FP4/FP8 GEMMs and Blackwell kernels. Those are left
out, and the rest is stored as one solid xz tarball of the installed tree (Python sources and
C++ headers compress about 7x there, 3x in a wheel's per-file zip), with every pure-Python
wheel beside them. FlashInfer keeps what its JIT compiles attention from: its headers,
CUTLASS's and CCCL's headers, and the top level of its csrc folder (prefill, decode, page,
cascade). Wheels with compiled code (which xz barely shrinks) are carried as they are and
installed with `pip install --no-index --no-deps --target`.

    python scripts/device_bundle.py pack WHEEL_DIR BUNDLE_DIR   # writes BUNDLE_DIR/site.tar.xz and wheels/
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import lzma
import shutil
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

# Paths inside the installed tree (as a wheel lists them) that the device's runtime never reads.
LEFT_OUT = {
    "sglang": (
        "sglang/srt/rust_extensions/*.so",  # the Rust HTTP, gRPC, bench and multimodal servers
        "sglang/srt/mem_cache/rust_tree_core/*.so",  # a Rust radix tree picrag's cache does not use
        "sglang/multimodal_gen/*",  # the diffusion-model runtime
        "sglang/test/*",
    ),
    "flashinfer_python": (
        "flashinfer/data/csrc/*/*",  # MoE, MLA, FP4/FP8 GEMM, sampling and Blackwell sources
        "flashinfer/data/cutlass/*",  # but its headers, kept below
        "flashinfer/experimental/*/csrc/*",
        "flashinfer/fused_moe/backends/*/artifacts/*",
    ),
}
KEPT_ANYWAY = {"flashinfer_python": ("flashinfer/data/cutlass/include/*", "flashinfer/data/cutlass/tools/util/include/*")}
NEVER = ("*/__pycache__/*", "*.pyc", "*.data/data/*", "*.data/scripts/*", "*.data/headers/*")
INSTALLED_AS_IS = ("purelib", "platlib")  # a wheel's NAME.data/<scheme>/ folders that pip puts in site
XZ_PRESET = 9 | lzma.PRESET_EXTREME


@dataclass(frozen=True)
class Packed:
    wheel: str
    wheel_bytes: int
    files_kept: int
    bytes_kept: int
    bytes_left_out: int


def distribution_of(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower()


def kept(path: str, distribution: str) -> bool:
    if any(fnmatch.fnmatch(path, pattern) for pattern in NEVER):
        return False
    if any(fnmatch.fnmatch(path, pattern) for pattern in KEPT_ANYWAY.get(distribution, ())):
        return True
    return not any(fnmatch.fnmatch(path, pattern) for pattern in LEFT_OUT.get(distribution, ()))


def installed_path(path: str) -> str:
    """Where pip puts a wheel's file in site-packages (NAME.data/purelib/x -> x)."""
    parts = path.split("/", 2)
    if len(parts) == 3 and parts[0].endswith(".data") and parts[1] in INSTALLED_AS_IS:
        return parts[2]
    return path


def in_tarball(wheel: Path) -> bool:
    """Trimmed wheels, and pure-Python ones, which compress far better in one solid tarball."""
    return distribution_of(wheel) in LEFT_OUT or wheel.name.endswith("-none-any.whl")


def unpack_trimmed(wheel: Path, site: Path) -> Packed:
    """Install `wheel` into `site` as pip would (a wheel's files are its installed tree, but for
    its .data folders, of which only purelib/platlib matter to a runtime), leaving out what
    LEFT_OUT names."""
    distribution = distribution_of(wheel)
    files = left_out = kept_bytes = 0
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            if not kept(info.filename, distribution):
                left_out += info.file_size
                continue
            target = site / installed_path(info.filename)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(info))
            files += 1
            kept_bytes += info.file_size
    return Packed(wheel.name, wheel.stat().st_size, files, kept_bytes, left_out)


def pack(wheel_dir: Path, bundle: Path) -> dict:
    wheels = sorted(wheel_dir.glob("*.whl"))
    missing = set(LEFT_OUT) - {distribution_of(w) for w in wheels}
    if missing:
        raise SystemExit(f"device_bundle: no wheel for {', '.join(sorted(missing))} in {wheel_dir}")
    (bundle / "wheels").mkdir(parents=True, exist_ok=True)
    carried = []
    for wheel in wheels:
        if not in_tarball(wheel):
            shutil.copy2(wheel, bundle / "wheels" / wheel.name)
            carried.append({"wheel": wheel.name, "bytes": wheel.stat().st_size})
    packed = []
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch)
        for wheel in wheels:
            if in_tarball(wheel):
                packed.append(unpack_trimmed(wheel, site))
        with tarfile.open(bundle / "site.tar.xz", "w:xz", preset=XZ_PRESET) as tar:
            for path in sorted(site.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=path.relative_to(site).as_posix())
    return {"site.tar.xz": {"bytes": (bundle / "site.tar.xz").stat().st_size,
                            "packages": [vars(p) for p in packed]},
            "wheels": carried}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["pack"])
    parser.add_argument("wheel_dir", type=Path)
    parser.add_argument("bundle", type=Path)
    args = parser.parse_args(argv)
    report = pack(args.wheel_dir, args.bundle)
    (args.bundle / "pack.json").write_text(json.dumps(report, indent=2) + "\n")
    for item in report["site.tar.xz"]["packages"]:
        if not item["bytes_left_out"]:
            continue
        print(f"[bundle] {item['wheel']}: {item['wheel_bytes'] / 2**20:.1f} MiB wheel, kept {item['files_kept']} files "
              f"({item['bytes_kept'] / 2**20:.1f} MiB), left out {item['bytes_left_out'] / 2**20:.1f} MiB")
    print(f"[bundle] site.tar.xz {report['site.tar.xz']['bytes'] / 2**20:.2f} MiB; "
          f"{len(report['wheels'])} wheels {sum(w['bytes'] for w in report['wheels']) / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
