"""The model the shared `picrag_server` serves: the default model cut to its first layers.

The shared server's group (about 300 tests) is the longest any test worker runs, and most of its
CPU is the model's forwards. What those tests check (reuse equals the prefix cache at offset 0, a
covering link equals `full`, concurrent answers equal serial ones, bounds, routes, reports) holds
for any decoder, so they run on SmolLM2 with its first SHALLOW_LAYERS of 30 layers: the same
tokenizer, chat template, vocabulary, head shapes and real weights, about a fifth of the compute
per token. The tiny-pool and chunk-store-restart servers serve it too; the default model whole
is what `shipped_checkpoint_server` and the other tests that start servers of their own serve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SHALLOW_LAYERS = 6
_WEIGHTS = "model.safetensors"


def write_shallow_model(model_dir: Path, directory: Path, layers: int = SHALLOW_LAYERS) -> Path:
    """`model_dir` (an HF Llama-family folder) with only decoder layers 0..layers-1, into
    `directory`/`model_dir.name`: under the default model's folder name, so that what picrag ships
    per model name (auto's calibration table) applies, as the tests of that mechanism expect."""
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    assert layers < config["num_hidden_layers"], (layers, config["num_hidden_layers"])
    directory = directory / model_dir.name
    directory.mkdir(parents=True)
    kept = {name: tensor for name, tensor in load_file(model_dir / _WEIGHTS).items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    save_file(kept, directory / _WEIGHTS, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for path in model_dir.iterdir():
        if path.name not in (_WEIGHTS, "config.json") and path.is_file():
            shutil.copy(path, directory / path.name)
    (directory / "picrag-model.json").unlink(missing_ok=True)  # not a converted preset
    return directory
