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
