"""Test doubles for the daemon (no pytest imports; usable by any test suite); the daemon
itself never imports this package.

- ``fake_engine``: a deterministic fake model behind a real ``EngineCore`` (engine factory).
- ``in_process``: ``InProcessEngine``, the engine client over an in-process ``EngineCore``.
- ``daemon_process``: ``DaemonProcess``, a real ``pagectl daemon`` subprocess.
"""
