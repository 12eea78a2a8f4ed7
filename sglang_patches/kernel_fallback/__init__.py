"""Install the pure-torch `sgl_kernel` stand-in, only where no real `sgl_kernel` imports."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

FALLBACK_ROOT = Path(__file__).resolve().parent
PTH_NAME = "picrag_sgl_kernel_fallback.pth"


def _pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def real_kernel_status() -> str:
    """'real', 'missing' or 'broken: <error>' for sgl_kernel, ignoring our own stand-in."""
    probe = (
        "import importlib.util, sys\n"
        f"sys.path = [p for p in sys.path if p.rstrip('/') != {str(FALLBACK_ROOT)!r}]\n"
        "spec = importlib.util.find_spec('sgl_kernel')\n"
        "if spec is None: print('missing'); raise SystemExit\n"
        "try:\n"
        "    import sgl_kernel\n"
        "    print('real')\n"
        "except Exception as e:\n"
        "    print('broken: ' + repr(e)[:300])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, check=False,
    )
    return (out.stdout.strip().splitlines() or ["broken: probe failed: " + out.stderr[-300:]])[-1]


def install() -> str:
    pth = _pth_path()
    pth.unlink(missing_ok=True)
    status = real_kernel_status()
    if status == "missing":
        pth.write_text(str(FALLBACK_ROOT) + "\n")
        return f"installed pure-torch sgl_kernel fallback ({pth})"
    if status == "real":
        return "a real sgl_kernel imports: fallback not installed"
    return f"sgl_kernel is installed but does not import ({status}); fallback not installed"


def main(argv: list[str]) -> int:
    if argv[1:] != ["install"]:
        print("usage: python -m sglang_patches.kernel_fallback install", file=sys.stderr)
        return 2
    print(f"[setup] {install()}")
    return 0

