"""requirements/device-wheels.txt, the wheels a device call carries for the lent GPU: pinned, one
version each, and nothing the device image already has at that version. The image's package
list lives in the device notes (KINDS.md), present only where a device tool is mounted: the
comparison with it is skipped elsewhere (CI), the list's own checks are not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "requirements" / "device-wheels.txt"
KINDS = Path("/work/.library/device/KINDS.md")
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!-]+)$")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_wheels(text: str) -> list[tuple[str, str]]:
    """(name, version) of each requirement line; comments and blank lines skipped."""
    pins = []
    for number, line in enumerate(text.splitlines(), 1):
        requirement = line.split("#", 1)[0].strip()
        if not requirement:
            continue
        match = PIN.match(requirement)
        assert match, f"device-wheels.txt:{number}: {requirement!r} is not pinned as NAME==VERSION"
        pins.append((match["name"], match["version"]))
    return pins


def image_packages(text: str) -> dict[str, str | None]:
    """The H200 image's packages from KINDS.md: every name of its 'Packages:' list, with the
    version where the 'pip list' row gives one (None where it does not)."""
    section = text.split("## Python packages already there", 1)[1]
    listed = section.split("Packages:", 1)[1].split("\n", 1)[0].strip().rstrip(".")
    names = {normalized(name.strip()) for name in listed.split(",") if name.strip()}
    versions: dict[str, str] = {}
    pip_row = next((line for line in text.splitlines() if line.startswith("| pip list")), "")
    for name, version in re.findall(r"([A-Za-z0-9][A-Za-z0-9._-]*) (\d[\w.+]*)(?=,|\s*\|)", pip_row):
        versions[normalized(name)] = version
    return {name: versions.get(name) for name in names}


def test_every_wheel_is_pinned_once():
    pins = pinned_wheels(WHEELS.read_text())
    names = [normalized(name) for name, _ in pins]
    assert len(pins) > 10
    assert len(names) == len(set(names)), f"named twice: {sorted({n for n in names if names.count(n) > 1})}"
    # The two the bundle trims (scripts/device_bundle.py) must be there, at SGLang's own pins.
    assert ("sglang", "0.5.23") in pins and ("flashinfer-python", "0.7.2") in pins


def test_the_parsers_read_what_they_are_given():
    assert pinned_wheels("# c\nfoo==1.0  # why\n\nBar_baz==2.3.post1\n") == [("foo", "1.0"), ("Bar_baz", "2.3.post1")]
    with pytest.raises(AssertionError, match="not pinned"):
        pinned_wheels("foo>=1\n")
    kinds = ("| pip list, as a session saw it | torch 2.11.0, transformers 5.17.0 |\n"
             "## Python packages already there\n\nintro. Packages: torch, Transformers, typing-extensions.\n")
    assert image_packages(kinds) == {"torch": "2.11.0", "transformers": "5.17.0", "typing-extensions": None}


def test_nothing_the_image_has_at_that_version():
    if not KINDS.is_file():
        pytest.skip(f"the device notes' package list ({KINDS}) is not on this machine")
    image = image_packages(KINDS.read_text())
    assert {"torch", "triton", "transformers", "numpy"} <= set(image), "KINDS.md's package list did not parse"
    for name, version in pinned_wheels(WHEELS.read_text()):
        if normalized(name) not in image:
            continue
        seen = image[normalized(name)]
        # Carried over the image's copy only for another version, which must then be known.
        assert seen is not None, f"{name}: the image has it (version not listed): carry it only for another version"
        assert seen != version, f"{name}=={version}: the image has that version already"
