"""kvtier's development tools, kept out of the ``kvtier`` wheel.

``kvtier_dev.harness`` builds real SGLang host pools and drives SGLang's own controller code
(the Python tests use it); ``kvtier_dev.bench`` is ``python -m kvtier_dev.bench
sglang|profile|workload``; ``kvtier_dev.demo`` is the README's demo; ``kvtier_dev.vllm_server`` runs
vLLM's real server on CPU with kvtier (issue 31: CPU copy spec, model generator, launcher,
HTTP benchmark). They import the
installed ``kvtier`` and SGLang; ``scripts/setup.sh`` makes this directory importable in the
venv (a ``kvtier_dev.pth`` in its site-packages) and ``tests/python/conftest.py`` puts it on
``sys.path`` for the tests.
"""
