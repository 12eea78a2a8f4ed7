"""scripts/setup.sh's filter of pip's stderr: the sglang requirements left out on purpose become
one line, and everything else (a real conflict with its header included) passes unchanged."""

from __future__ import annotations

import subprocess
from pathlib import Path

FILTER = Path(__file__).resolve().parents[1] / "scripts" / "fold_sglang_requirements.awk"
HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
          "installed. This behaviour is the source of the following dependency conflicts.")
LEFT_OUT = [
    "sglang 0.5.23 requires anthropic>=0.20.0, which is not installed.",
    'sglang 0.5.23 requires deepseek-recipe==0.2.0; (sys_platform == "linux"), which is not installed.',
    "sglang 0.5.23 requires sglang-kernel==0.4.10, which is not installed.",
]
SUMMARY = ("[setup] 3 requirements of sglang 0.5.23 are not installed, on purpose: "
           "CUDA kernels and features picrag does not use")


def folded(*lines: str) -> list[str]:
    text = "".join(line + "\n" for line in lines)
    result = subprocess.run(["awk", "-f", str(FILTER)], input=text, capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def test_left_out_requirements_become_one_line():
    warning = "WARNING: Location 'file:///opt/pypi/simple/sglang/' is ignored: it is neither a file nor a directory."
    assert folded(warning, HEADER, *LEFT_OUT) == [warning, SUMMARY]


def test_a_real_conflict_keeps_its_header():
    conflict = "sglang 0.5.23 requires python-dateutil<3, but you have python-dateutil 4.0.0 which is incompatible."
    assert folded(HEADER, *LEFT_OUT, conflict) == [HEADER, conflict, SUMMARY]


def test_other_output_passes_unchanged():
    lines = ["ERROR: Could not open requirements file: [Errno 2] No such file or directory: 'x.txt'",
             "sglang 0.5.23 requires numpy, which is not installed, or so it says"]
    assert folded(*lines) == lines
