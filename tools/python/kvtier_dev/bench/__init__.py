"""kvtier benchmarks.

``python -m kvtier_dev.bench sglang`` measures, in one run on one machine, this machine's memcpy
bandwidth and the same SGLang HiCache workloads (real SGLang host pools, real controller
methods) through kvtier's ``KvtierStore`` and SGLang's built-in ``HiCacheFile``, and reports
every figure as GB/s, pages/s, a ratio to the same run's memcpy and a kvtier/HiCacheFile ratio,
next to kvtier's targets. See ``python -m kvtier_dev.bench sglang --help``.
"""
