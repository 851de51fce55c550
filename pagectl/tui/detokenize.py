"""Token ids as text for the block inspector, in the console's process.

The engine answers ``inspect_block`` with ids only (detokenizing on its thread would cost
steps). The console loads the model's tokenizer (``RuntimeInfo.tokenizer_path``) once, in a
worker thread, the first time a block is inspected, and decodes there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Detokenizer:
    """Loads a tokenizer lazily; ``decode`` is safe to call from worker threads.

    Args:
        path: a function giving the tokenizer directory (read when first needed: the daemon
            may not be found yet when the console starts); "" or None: no tokenizer.
    """

    def __init__(self, path: Callable[[], str | None]) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._tok: Any = None
        self._loaded_from: str | None = None
        # Why there is no text ("" while all is well).
        self.error = ""

    def decode(self, token_ids: list[int]) -> str | None:
        """The text of ``token_ids``, or None without a tokenizer (``error`` says why)."""
        path = self._path() or ""
        with self._lock:
            if path != self._loaded_from:
                self._loaded_from = path
                self._tok, self.error = None, ""
                if path:
                    try:
                        from pagectl.engine.tokenizer import load_tokenizer

                        self._tok = load_tokenizer(path)
                    except Exception as e:  # a missing or broken tokenizer: ids only
                        self.error = f"cannot load the tokenizer: {e}"
                    if self._tok is None and not self.error:
                        self.error = "the model has no tokenizer"
                else:
                    self.error = "no tokenizer path in the runtime file"
            tok = self._tok
        if tok is None:
            return None
        return tok.decode(token_ids, skip_special_tokens=False)
