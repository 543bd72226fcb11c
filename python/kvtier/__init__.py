"""kvtier: a tiered KV-cache page store for LLM serving.

``kvtier.sglang.KvtierStore`` is the SGLang HiCache backend; ``kvtier._native.Store`` is the
store itself (Rust), usable directly for tools and tests.
"""

from kvtier._native import BusyError, Store, UnavailableError, __version__

# Issue 29: UnavailableError (the cluster could not serve: no leader, a node down, no room,
# a timeout) and BusyError (another writer's claim) are RuntimeErrors; a caller's mistake is
# a ValueError or a plain RuntimeError.
__all__ = ["BusyError", "Store", "UnavailableError", "__version__"]
