"""Test doubles for the daemon (no pytest imports; usable by any test suite). No pagectl
module imports this package; the engine process loads ``fake_engine`` only when
``--engine-factory`` names it.

- ``fake_engine``: a deterministic fake model behind a real ``EngineCore`` (engine factory).
- ``in_process``: ``InProcessEngine``, the engine client over an in-process ``EngineCore``.
- ``daemon_process``: ``DaemonProcess``, a real ``pagectl daemon`` subprocess.
"""
