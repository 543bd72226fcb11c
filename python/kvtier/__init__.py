"""kvtier: a tiered KV-cache page store for LLM serving.

``kvtier.sglang.KvtierStore`` is the SGLang HiCache backend; ``kvtier._native.Store`` is the
store itself (Rust), usable directly for tools and tests.
"""

from kvtier._native import Store, __version__

__all__ = ["Store", "__version__"]
