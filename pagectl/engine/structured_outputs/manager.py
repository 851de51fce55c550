"""Grammar compilation off the engine step, the compiled-grammar cache, per-sequence matchers.

Invariants:
- The engine loop never compiles: ``StructuredOutputManager.submit`` hands the work to one
  background thread and returns a ``GrammarState`` whose grammar is not ready yet; the
  scheduler keeps that request out of the waiting queue until ``ready`` (other requests run
  meanwhile).
- One compile per (constraint, whitespace mode) for the manager's tokenizer: later requests
  share the compiled grammar (``CompiledGrammar`` is immutable and thread-safe).
- A sequence's matcher has accepted exactly its output tokens so far. Preemption keeps it
  (sampled tokens are recomputed, never sampled again); a fork copies it.
- Speculation: proposals are cut at the first token the grammar rejects (``num_valid``);
  the sampler fills verification row j with the matcher advanced through the first j
  proposals (``fill_ahead``) and rolls it back once the batch's rows are filled
  (``settle``); the scheduler then accepts the tokens the sequence gained. Between steps
  the invariant above holds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagectl.engine.structured_outputs.params import (
    StructuredOutputsError,
    StructuredOutputsParams,
    backend_message,
    build_grammar,
    structural_tag_text,
)

# Compiled grammars kept (least recently submitted dropped first).
MAX_CACHED_GRAMMARS = 512


class GrammarState:
    """One sequence's constraint: the (future) compiled grammar and its matcher."""

    __slots__ = ("future", "matcher", "error", "ahead")

    def __init__(self, future: Future) -> None:
        self.future = future
        # Built on the engine thread once the grammar is ready (``activate``).
        self.matcher: Any = None
        # The compile's error message, when it failed.
        self.error: str | None = None
        # Proposals the matcher accepted beyond the sequence's tokens while the sampler
        # fills verification rows; empty outside the sampler's bitmask step.
        self.ahead: list[int] = []

    @property
    def ready(self) -> bool:
        return self.future.done()

    def activate(self) -> float | None:
        """Build the matcher from the finished compile. Returns the compile's seconds (None
        for a cache hit), or sets ``error`` and returns None when it failed."""
        import xgrammar as xgr

        try:
            compiled, seconds = self.future.result()
        except StructuredOutputsError as e:
            self.error = str(e)
            return None
        except Exception as e:  # a compile that fails must fail this request only
            self.error = f"{type(e).__name__}: {e}"
            return None
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(compiled)
        return seconds

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: Any, row: int) -> None:
        self.settle()
        self.matcher.fill_next_token_bitmask(bitmask, row)

    # -- speculation ----------------------------------------------------------------------

    def num_valid(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from the sequence's state (the
        matcher is rolled back: its state does not change)."""
        matcher = self.matcher
        n = 0
        for t in tokens:
            if matcher.is_terminated() or not matcher.accept_token(t):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def fill_ahead(self, bitmask: Any, row: int, tokens: list[int]) -> None:
        """Fill ``row`` with the tokens allowed after the sequence's tokens and then
        ``tokens`` (proposals that ``num_valid`` accepted). Rows of one sequence filled in
        order advance the matcher one token each."""
        ahead = self.ahead
        common = 0
        for a, t in zip(ahead, tokens):
            if a != t:
                break
            common += 1
        if len(ahead) > common:
            self.matcher.rollback(len(ahead) - common)
            del ahead[common:]
        for t in tokens[common:]:
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"proposal {t} does not fit the grammar")
            ahead.append(t)
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def settle(self) -> None:
        """Roll the matcher back to the sequence's own tokens."""
        if self.ahead:
            self.matcher.rollback(len(self.ahead))
            self.ahead.clear()

    def view_ahead(self, tokens: list[int]) -> GrammarAhead:
        return GrammarAhead(self, tokens)

    def fork(self) -> GrammarState:
        """A copy for a forked sequence: same grammar, its own matcher in the same state."""
        child = GrammarState(self.future)
        child.error = self.error
        if self.matcher is not None:
            child.matcher = self.matcher.fork()
        return child


class GrammarAhead:
    """A verification row's grammar: the sequence's matcher as if ``tokens`` (its first
    proposals) were already accepted. What the sampler's bitmask step calls."""

    __slots__ = ("state", "tokens")

    def __init__(self, state: GrammarState, tokens: list[int]) -> None:
        self.state = state
        self.tokens = tokens

    def fill(self, bitmask: Any, row: int) -> None:
        if self.tokens:
            self.state.fill_ahead(bitmask, row, self.tokens)
        else:
            self.state.fill(bitmask, row)

    def settle(self) -> None:
        self.state.settle()


def _relay(src: Future, dst: Future) -> None:
    """Complete ``dst`` like ``src``, but as a cache hit (no compile seconds)."""
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result((src.result()[0], None))


class StructuredOutputManager:
    """Compiles constraints for one tokenizer on a background thread, with a cache.

    Args:
        tokenizer: the Hugging Face tokenizer of the served model.
        vocab_size: the model's vocabulary (logits columns; may exceed the tokenizer's).
        stop_token_ids: the ids that end a sequence (allowed once the grammar is complete).
        disable_any_whitespace: the default when a request does not say.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...] | list[int],
        *,
        disable_any_whitespace: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.disable_any_whitespace = disable_any_whitespace
        # Built on the compile thread at the first compile (reading a large vocabulary
        # takes a while): never at start-up, never on the engine thread.
        self.compiler: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: dict[tuple, Future] = {}

    def submit(self, params: StructuredOutputsParams) -> GrammarState:
        """A ``GrammarState`` for ``params``; compiles in the background unless cached."""
        ws = params.disable_any_whitespace
        if ws is None:
            ws = self.disable_any_whitespace
        key = params.cache_key(ws)
        with self._lock:
            fut = self._cache.pop(key, None)
            if fut is not None and fut.done() and fut.exception() is not None:
                fut = None  # a failed compile is not cached
            if fut is None:
                fut = self._pool.submit(self._compile, params, ws)
                self._cache[key] = fut
                state = GrammarState(fut)
            else:
                # Compiled or compiling already: share it; only the first counts its time.
                self._cache[key] = fut
                shared: Future = Future()
                fut.add_done_callback(lambda f: _relay(f, shared))
                state = GrammarState(shared)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.pop(next(iter(self._cache)))
        return state

    def _compile(self, params: StructuredOutputsParams, disable_ws: bool) -> tuple[Any, float]:
        t0 = time.perf_counter()
        if params.kind == "structural_tag":
            # Compiled from its text by the compiler: a ``token`` format names tokens, which
            # only the compiler's tokenizer can resolve.
            grammar: Any = structural_tag_text(params, disable_ws)
        else:
            grammar = build_grammar(params, disable_ws)
        try:
            if self.compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                self.compiler = xgr.GrammarCompiler(info, max_threads=1)
            if isinstance(grammar, str):
                compiled = self.compiler.compile_structural_tag(grammar)
            else:
                compiled = self.compiler.compile_grammar(grammar)
        except Exception as e:
            raise StructuredOutputsError("structured_outputs", backend_message(e)) from None
        return compiled, time.perf_counter() - t0

    def wait_any(self, states: list[GrammarState], timeout: float) -> None:
        """Block up to ``timeout`` s for one of ``states`` to be ready (used only when the
        engine has nothing else to run)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        wait([s.future for s in states], timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
