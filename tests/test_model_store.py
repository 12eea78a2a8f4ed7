"""The model store under concurrent first use: a preset is converted once per PICRAG_HOME."""

from __future__ import annotations

import logging
import threading

from picrag_core import directory_lock, model_store


class _Waiting(logging.Handler):
    """Sets an event when a caller logs that it waits for another's conversion."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("waiting for another writer of"):
            self.seen.set()


def test_callers_that_start_together_convert_a_preset_once(tmp_path, monkeypatch, caplog):
    """The first caller converts; one that starts meanwhile waits for it and returns its folder,
    instead of converting again and replacing the folder the first may already be loading."""
    monkeypatch.setenv("PICRAG_HOME", str(tmp_path))
    waiting = _Waiting()
    logging.getLogger(directory_lock.__name__).addHandler(waiting)
    caplog.set_level(logging.WARNING, logger=directory_lock.__name__)
    conversions = []
    results: list = []

    def second_caller() -> None:
        results.append(model_store.ensure_model())

    second = threading.Thread(target=second_caller)

    def convert(_gguf, out) -> None:
        conversions.append(out)
        if len(conversions) == 1:  # the second caller starts while the first converts
            second.start()
            waiting.seen.wait(timeout=30)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "_convert_gguf", convert)
    monkeypatch.setattr(model_store, "file_sha256", lambda _path: "digest")
    try:
        first = model_store.ensure_model()
        second.join(timeout=30)
    finally:
        logging.getLogger(directory_lock.__name__).removeHandler(waiting)
    assert waiting.seen.is_set(), "the second caller did not wait for the first's conversion"
    assert len(conversions) == 1
    assert results == [first] and (first / "config.json").is_file()



def test_a_conversion_parses_each_gguf_header_once_and_leaves_gguf_as_it_was(tmp_path, monkeypatch):
    """transformers reads the GGUF three times per conversion (config, tokenizer, weights) and
    builds gguf's tensor-name table once per submodule; inside the conversion each file is parsed
    once, through transformers' own reader (which looks `gguf.GGUFReader` up when called: if it
    bound it at import, this fails), and gguf's own functions are back afterwards, even when the
    conversion fails."""
    import gguf
    import numpy as np
    import pytest
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed: list[str] = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, file, *args, **kwargs) -> None:
            parsed.append(str(file))
            super().__init__(file, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    originals = gguf.GGUFReader, gguf.get_tensor_name_map

    with model_store._gguf_parsed_once():
        for _ in range(3):
            assert load_gguf_checkpoint(str(path))["config"]["num_hidden_layers"] == 1
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
    assert parsed == [str(path)]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals
    load_gguf_checkpoint(str(path))
    assert len(parsed) == 2  # outside a conversion, every call parses the file again

    with pytest.raises(RuntimeError), model_store._gguf_parsed_once():
        raise RuntimeError("conversion failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals
