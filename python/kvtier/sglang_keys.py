"""SGLang's key layout and hit-policy translation, shared by the HiCache adapter
(``kvtier.sglang.KvtierStore``) and the direct linker (``kvtier.sglang_linker``) (issue 28).

Owns: the SGLang facts a key is composed of (ranks and parallel sizes, model, tenant tag) in
:class:`KeyLayout`, and the translation of SGLang's ``PoolHitPolicy`` to kvtier's
``exists_v2`` pool queries in :func:`pool_query`. The key scheme itself (composition, parsing,
fingerprints, eviction groups) is Rust's, ``kvtier_proto::keys`` through ``kvtier._native``;
this module only gathers SGLang's facts and passes them on, so both SGLang paths compose
byte-identical keys and give the same verdicts.

Key scheme: ``[tag "/"] page_hash "@" fingerprint [".tp"N] [".pp"N] [".cp"N] [".dcp"N] "."
component``. The fingerprint hashes what makes bytes incompatible (model, pool type, layout,
dtype, page size, per-component byte sizes, pp size, and tp size for TP-sharded objects).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, List, Optional, Sequence, Tuple

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName

from kvtier import _native

# Version of the key and object format; part of every fingerprint.
KEY_FORMAT_VERSION = _native.key_format_version()

# SGLang's pool hit policies as kvtier's exists_v2 names them.
POLICY_NAMES = {
    PoolHitPolicy.ALL_PAGES: "all_pages",
    PoolHitPolicy.TRAILING_PAGES: "trailing_pages",
    PoolHitPolicy.BLOCK_GROUPS: "block_groups",
}


@dataclass(frozen=True)
class KeyLayout:
    """The facts of one SGLang rank that its keys are composed of."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    is_mla: bool = False
    model: str = ""
    split_heads: bool = False
    tp_lcm: int = 1
    # The tenant tag (``extra_backend_tag``); keys start with ``prefix`` (``tag/``).
    tag: Optional[str] = None

    @classmethod
    def of(cls, cfg: Any, tag: Optional[str]) -> "KeyLayout":
        """The layout of a ``HiCacheStorageConfig`` (``None``: a single unsharded rank)."""
        if cfg is None:
            return cls(tag=tag or None)
        tp_size = cfg.tp_size
        return cls(
            tp_rank=cfg.tp_rank,
            tp_size=tp_size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
            cp_rank=getattr(cfg, "attn_cp_rank", 0),
            cp_size=getattr(cfg, "attn_cp_size", 1),
            dcp_rank=getattr(cfg, "dcp_rank", 0),
            dcp_size=getattr(cfg, "dcp_size", 1),
            is_mla=bool(cfg.is_mla_model),
            model="-".join(cfg.model_name.split("/")) if cfg.model_name else "",
            split_heads=bool(getattr(cfg, "should_split_heads", False)),
            tp_lcm=getattr(cfg, "tp_lcm_size", None) or tp_size,
            tag=tag or None,
        )

    @cached_property
    def prefix(self) -> str:
        """What every page key starts with: ``tag/``, or nothing without a tag."""
        return _native.key_sglang_prefix(self.tag)

    def rank_tag(self, replicated: bool, tp_rank: Optional[int] = None) -> str:
        """The rank part of a suffix (``.tp0.pp1``); no TP rank for a replicated pool."""
        tp = None if replicated else (self.tp_rank if tp_rank is None else tp_rank)
        return _native.key_rank_tag(
            tp,
            self.pp_size,
            self.pp_rank,
            self.cp_size,
            self.cp_rank,
            self.dcp_size,
            self.dcp_rank,
        )

    def fingerprint_facts(
        self, name: str, pool: Any, sizes: Sequence[int], replicated: bool, mode: str
    ) -> tuple:
        """The SGLang facts a pool's key fingerprint names (its layout, the model, the
        parallel sizes that change what a page holds, the key format version)."""
        tp_part = None if replicated else (self.tp_lcm if self.split_heads else self.tp_size)
        return (
            KEY_FORMAT_VERSION,
            mode,
            self.model,
            name,
            type(pool).__name__,
            getattr(pool, "storage_format_tag", None),
            getattr(pool, "layout", None),
            str(getattr(pool, "dtype", None)),
            getattr(pool, "page_size", None),
            tuple(int(s) for s in sizes),
            self.pp_size,
            tp_part,
            self.dcp_size,
        )

    def fingerprint(
        self, name: str, pool: Any, sizes: Sequence[int], replicated: bool, mode: str
    ) -> str:
        # Hashed in Rust (kvtier_proto::keys::fingerprint), to the same value
        # hashlib.blake2b(repr(facts).encode(), digest_size=6) gave before.
        return _native.key_fingerprint(self.fingerprint_facts(name, pool, sizes, replicated, mode))

    @staticmethod
    def component_names(base: Optional[str], count: int, pool: Any = None) -> List[str]:
        """Readable names for a page's components, in get_page_buffer_meta order."""
        mamba = None
        if base == PoolName.MAMBA.value and pool is not None:
            # Mamba pages are the temporal (SSM) state, when the model has one, then conv_i.
            conv = len(getattr(pool, "conv_buffer", None) or [])
            mamba = (conv, getattr(pool, "temporal_state_elem_size", 0) > 0)
        return _native.key_component_names(base, count, mamba)

    @staticmethod
    def suffix(fingerprint: str, rank_tag: str, component: str) -> str:
        """``@fingerprint rank_tag . component``."""
        return _native.key_suffix(fingerprint, rank_tag, component)

    def key(self, page_key: str, suffix: str) -> str:
        """A whole object key: ``prefix page_key suffix``."""
        return _native.key_compose(self.prefix, page_key, suffix)


PoolQuery = Tuple[str, List[str], str, int]


def pool_query(
    name: str,
    hit_policy: Any,
    suffixes: Sequence[str],
    keys: Optional[Sequence[Any]],
    group_pages: Optional[int],
) -> Tuple[PoolQuery, Optional[str]]:
    """One side pool's ``exists_v2`` query for SGLang's ``hit_policy``, and the problem to log
    when the transfer cannot be judged (then the query asks for no objects: the pool is a
    miss, never a verdict the engine did not ask for):

    - ``ALL_PAGES``: every page's objects;
    - ``TRAILING_PAGES``: the last ``len(keys)`` pages (at least one);
    - ``BLOCK_GROUPS``: whole groups of ``group_pages``; without a positive size, a miss;
    - an unknown policy: a miss.
    """
    policy = POLICY_NAMES.get(hit_policy)
    if policy is None:
        problem = f"pool {name} has unknown hit policy {hit_policy!r}; treating it as a miss"
        return (name, [], "all_pages", 0), problem
    if hit_policy == PoolHitPolicy.TRAILING_PAGES:
        return (name, list(suffixes), policy, max(1, len(keys) if keys else 1)), None
    if hit_policy == PoolHitPolicy.BLOCK_GROUPS:
        size = int(group_pages or 0)
        if size <= 0:
            problem = f"pool {name} BLOCK_GROUPS without group_pages; treating it as a miss"
            return (name, [], policy, 1), problem
        return (name, list(suffixes), policy, size), None
    return (name, list(suffixes), policy, 0), None
