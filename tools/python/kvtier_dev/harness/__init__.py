"""Real SGLang 0.5.23 host pools built on CPU, and the controller's own call sequences.

``pools`` builds MHA, MLA and DeepSeek-V4 (``HostPoolGroup`` with a logical anchor) host pools
with ``pin_memory=False``; ``flows`` drives any ``HiCacheStorage`` backend through SGLang's real
controller methods (backup, hit query, prefetch). kvtier's tests, demo and benchmarks use both,
so they ship with the package; they need torch and SGLang installed.
"""
