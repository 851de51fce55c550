"""What every handler shares: the server's settings and its state (``app[STATE]``).

Its own module so that the app factory, the route table and the handlers all import it and
none of them imports another's module for it (no import circle).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from pagectl.engine_process import wire
from pagectl.engine_process.client import EngineClientProtocol
from pagectl.server.chat import ChatSettings
from pagectl.server.connections import ConnectionLimits
from pagectl.server.errors import APIError
from pagectl.server.formatting import TokenText
from pagectl.server.metrics import Metrics
from pagectl.server.offload import Offload
from pagectl.server.validation import ModelFacts

DEFAULT_AUTH_ALLOW = ("/health", "/metrics")
DEFAULT_MAX_BODY_SIZE = 8 * 1024 * 1024
DEFAULT_MAX_PROMPT_BYTES = 2 * 1024 * 1024


@dataclass
class ServerSettings:
    """HTTP-side options of the daemon."""

    # Name the API reports and accepts (None: the engine's model name).
    served_model_name: str | None = None
    # Further names the API accepts for the same model (--served-model-name A B C).
    served_model_aliases: tuple[str, ...] = ()
    # CORS: origins allowed to call from a browser ("*": any); empty: no CORS headers.
    allowed_origins: tuple[str, ...] = ()
    # Accepted API keys (empty: no authentication).
    api_keys: list[str] = field(default_factory=list)
    # Paths reachable without a key when keys are set.
    auth_allow: tuple[str, ...] = DEFAULT_AUTH_ALLOW
    # Most requests queued for the engine (submitted, no output yet); past it: 503.
    max_num_queued_requests: int | None = None
    # Largest request body in bytes; past it: 413.
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    # Seconds a client is told to wait after a 503 for overload.
    retry_after_s: int = 1
    # A local tokenizer directory to start loading before the engine's handshake names it.
    tokenizer_hint: str | None = None
    # Largest text prompt in UTF-8 bytes (all of one request's prompts or messages); past
    # it: 400, before any tokenization.
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    # Seconds without any message from the engine after which /health answers 503 (0: off).
    # The engine reports at the telemetry rate between steps, so this must exceed the
    # longest step.
    health_stall_timeout: float = 30.0
    # Timeouts and the connection cap (server/connections.py).
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    # Chat templates, tool-call and reasoning parsers (--chat-template and friends).
    chat: ChatSettings = field(default_factory=ChatSettings)


@dataclass
class ServerState:
    """Everything the handlers share. Owned by the event loop thread."""

    settings: ServerSettings
    # The engine-core process's client in the daemon; an in-process engine in tests.
    engine: EngineClientProtocol
    metrics: Metrics
    ready: wire.EngineReady | None = None
    facts: ModelFacts | None = None
    token_text: TokenText | None = None
    # Set on SIGTERM: new requests get 503, /health 503.
    draining: bool = False
    # HTTP generation requests being served (drain waits for them).
    num_active: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    start_time: float = field(default_factory=time.time)
    # Tokenization, templates, big JSON bodies: off the event loop, bounded.
    offload: Offload = field(default_factory=Offload)

    # Set once the engine has started (before the server listens); handlers use these.
    @property
    def model(self) -> ModelFacts:
        assert self.facts is not None, "the engine has not started"
        return self.facts

    @property
    def engine_ready(self) -> wire.EngineReady:
        assert self.ready is not None, "the engine has not started"
        return self.ready

    @property
    def tokens(self) -> TokenText:
        assert self.token_text is not None, "the engine has not started"
        return self.token_text

    def check_admission(self) -> None:
        """503 (with Retry-After when overloaded) unless a new request may go in."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.dead is not None:
            raise APIError(
                503, f"the engine is not running: {self.engine.dead}", code="engine_dead"
            )
        limit = self.settings.max_num_queued_requests
        if limit is not None and self.engine.num_unstarted >= limit:
            raise APIError(
                503,
                f"the server is overloaded: {limit} requests are already queued; retry later",
                code="overloaded",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )

    def begin(self) -> None:
        self.num_active += 1
        self.idle.clear()

    def end(self) -> None:
        self.num_active -= 1
        if not self.num_active:
            self.idle.set()


STATE = web.AppKey("state", ServerState)
