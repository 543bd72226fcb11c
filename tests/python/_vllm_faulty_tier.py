"""A fault-injecting KvtierTier for the vLLM server tests (issue 31).

``FaultyKvtierTier`` is ``kvtier.vllm.KvtierTier`` unchanged except that, while the file named
by its ``fault_file`` key exists, its calls into kvtier raise: every lookup probe, store and
load submission and store-completed bookkeeping (the call that killed vLLM 0.32's engine
before issue 31), and every other completion poll (a poll that fails leaves the batches
queued; the next one reports them). It plays a store
that breaks in every way at once inside a real vLLM engine process, to show that the tier's
boundary turns each error into a miss or a failed job and the engine keeps serving. Imported by
vLLM's tier factory through ``module_path`` (tests/python on the server's PYTHONPATH).
"""

from __future__ import annotations

import os

from kvtier.vllm import KvtierTier


class InjectedFault(RuntimeError):
    pass


class _Faulty:
    """Proxies an object; the named methods raise while the fault file exists."""

    def __init__(self, inner, fault_file: str, methods: tuple[str, ...], every: int = 1):
        self._inner = inner
        self._fault_file = fault_file
        self._methods = methods
        self._every = every
        self._calls = 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self._methods:
            return attr

        def call(*args, **kwargs):
            if os.path.exists(self._fault_file):
                self._calls += 1
                if self._calls % self._every == 0:
                    raise InjectedFault(f"injected fault in {name}")
            return attr(*args, **kwargs)

        return call


class FaultyKvtierTier(KvtierTier):
    def __init__(self, *args, fault_file: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._store = _Faulty(self._store, fault_file, ("exists_keys",))
        queue = self._queue
        self._queue = _Faulty(queue, fault_file, ("submit_put_ptrs", "submit_get_ptrs"))
        self._queue.drain = _Faulty(queue, fault_file, ("drain",), every=2).drain
        self._lookup.stored = _Faulty(self._lookup, fault_file, ("stored",)).stored
