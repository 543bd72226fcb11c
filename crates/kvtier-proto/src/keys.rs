//! kvtier's object key schemes, the one definition every layer composes, parses and groups
//! keys with (issues 16, 28): the engine adapters (through `kvtier._native`), the engine's
//! eviction groups, the client's metrics and the KV-event publisher.
//!
//! **Schemes** ([`KeyScheme`]): every engine's keys are composed here, and each scheme says
//! explicitly what a key's eviction group is; nothing is guessed from a separator byte:
//! - [`KeyScheme::SGLang`] (below): several objects per page (pools, components, ranks), one
//!   group per page: `[tag "/"] page_hash "@"`;
//! - [`KeyScheme::Vllm`]: `vllm/<model>_<digest>/<block_hash hex>_g<kv group>`
//!   ([`vllm_key`]); one object per (block, KV cache group), each its own group;
//! - [`KeyScheme::LmCache`]: LMCache's own key strings under `lmcache/` (the MP L2 adapter,
//!   `<model>@<kv_rank>@<group>@<chunk_hash>[@salt]`) or `lmcache-v1/` (the legacy remote
//!   plugin, `CacheEngineKey.to_string()`: `<model>@<world>@<worker>@<hash>@<dtype>[@tags]`, plus
//!   a `.meta` sidecar)
//!   ([`lmcache_key`]); one group per chunk (the chunk and its sidecar), never per model;
//! - [`KeyScheme::Opaque`]: any other key; it is its own group.
//!
//! A stored key may carry a store namespace before the engine's key (`tenant 0x1f` or
//! `NUL 'C' tag 0x1f`, [`crate::namespace`]); [`group_of`] keeps it and groups what follows.
//! The schemes are disjoint by construction: an SGLang key has exactly one `@` and a
//! `fingerprint "." component` tail, an LMCache key its prefix and at least three `@`, a vLLM
//! key its prefix and no `@`. Composition is byte-for-byte what the adapters wrote before
//! issue 28, so objects already on SSD or in a cluster keep their names.
//!
//! **The SGLang scheme.** A key is `[tag "/"] page_hash "@" fingerprint rank_tag "." component`:
//! - `tag "/"` (optional): the tenant or namespace prefix (`extra_backend_tag`);
//! - `page_hash`: SGLang's page hash (hex), shared by every component of the page in every
//!   pool, so `[tag/]page_hash@` is the page's eviction group ([`group_of`]);
//! - `fingerprint`: 12 hex digits naming the pool layout and the key format version
//!   ([`KEY_FORMAT_VERSION`]): [`fingerprint::layout_fingerprint`] of the layout facts the
//!   SGLang adapter gathers;
//! - `rank_tag`: `.tpN` (absent for replicated pools), then `.ppN`, `.cpN`, `.dcpN` for the
//!   parallel dimensions of size above 1 ([`rank_tag`]);
//! - `component`: `k`, `v`, `kv`, `page`, `cN` (the KV pool) or `<pool>[.<part>]` for a side
//!   pool ([`component_names`], [`pool_of`]).
//!
//! Invariants: composing then parsing is the identity on every field ([`parse`]); nothing here
//! panics on arbitrary bytes (keys come from peers and callers).

use std::ops::Range;

pub mod fingerprint;

pub use fingerprint::{layout_fingerprint, FingerprintError, LayoutFact};

/// Version of the key and object format; part of every fingerprint.
pub const KEY_FORMAT_VERSION: u32 = 1;

/// Pool label of keys outside the scheme.
pub const OTHER_POOL: &str = "other";

/// Components of the KV pool (the anchor pool); every other component names a side pool.
const KV_COMPONENTS: [&str; 4] = ["k", "v", "kv", "page"];

/// Where a pool's pages sit in the parallel layout: one rank per dimension, and the size of
/// the dimensions that only show in keys above 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankLayout {
    /// TP rank, `None` for a replicated pool (every TP rank holds the same bytes).
    pub tp_rank: Option<u32>,
    pub pp_size: u32,
    pub pp_rank: u32,
    pub cp_size: u32,
    pub cp_rank: u32,
    pub dcp_size: u32,
    pub dcp_rank: u32,
}

/// The rank part of a suffix: `.tpN` (unless replicated), then `.ppN` / `.cpN` / `.dcpN` for
/// each dimension of size above 1. Empty for a replicated pool without other parallelism.
pub fn rank_tag(layout: &RankLayout) -> String {
    let mut out = String::new();
    if let Some(tp) = layout.tp_rank {
        out.push_str(&format!(".tp{tp}"));
    }
    for (name, size, rank) in [
        ("pp", layout.pp_size, layout.pp_rank),
        ("cp", layout.cp_size, layout.cp_rank),
        ("dcp", layout.dcp_size, layout.dcp_rank),
    ] {
        if size > 1 {
            out.push_str(&format!(".{name}{rank}"));
        }
    }
    out
}

/// The Mamba pool's page shape, as far as names go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MambaShape {
    /// Conv state buffers (`conv0..`).
    pub conv: usize,
    /// Whether the model has a temporal (SSM) state, which comes first.
    pub temporal: bool,
}

/// Readable names for a page's `count` components, in `get_page_buffer_meta` order: the
/// Mamba pool's `[temporal] conv0..` when `mamba` matches `count`; else one component is the
/// pool itself (`kv` for the anchor), two are `k`, `v`, more are `c0..`. Side pools prefix
/// their `base` name (`swa.k`).
pub fn component_names(base: Option<&str>, count: usize, mamba: Option<MambaShape>) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    if let Some(shape) = mamba {
        if shape.temporal {
            names.push("temporal".into());
        }
        names.extend((0..shape.conv).map(|i| format!("conv{i}")));
    }
    if names.len() != count {
        if count == 1 {
            let own = base.filter(|b| !b.is_empty()).unwrap_or("kv");
            return vec![own.to_string()];
        }
        names = if count == 2 {
            vec!["k".into(), "v".into()]
        } else {
            (0..count).map(|i| format!("c{i}")).collect()
        };
    }
    match base {
        Some(b) if !b.is_empty() => names.into_iter().map(|n| format!("{b}.{n}")).collect(),
        _ => names,
    }
}

/// The suffix of one component: `@fingerprint rank_tag . component`.
pub fn suffix(fingerprint: &str, rank_tag: &str, component: &str) -> String {
    format!("@{fingerprint}{rank_tag}.{component}")
}

/// `prefix ++ page_key ++ suffix` into `out` (cleared first). The one definition of a kvtier
/// object key, shared by every batch call so that puts and lookups always agree.
pub fn compose(prefix: &[u8], page_key: &[u8], suffix: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(prefix.len() + page_key.len() + suffix.len());
    out.extend_from_slice(prefix);
    out.extend_from_slice(page_key);
    out.extend_from_slice(suffix);
}

/// The engine key schemes kvtier knows (see the module doc). A scheme says how its keys are
/// composed ([`vllm_key`], [`lmcache_key`], [`compose`]), what a key's eviction group is
/// ([`KeyScheme::group`]) and its page facts ([`KeyScheme::facts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyScheme {
    /// SGLang HiCache and the direct linker: `[tag "/"] page_hash "@" fingerprint rank_tag
    /// "." component`.
    SGLang,
    /// vLLM's offloading tier: `vllm/<model>_<digest>/<block_hash hex>_g<kv group>`.
    Vllm,
    /// LMCache (both plugin kinds): its own key strings under [`LMCACHE_PREFIX`] or
    /// [`LMCACHE_LEGACY_PREFIX`].
    LmCache,
    /// Any other key (a caller's own names): one object, its own group.
    Opaque,
}

/// What a scheme's keys say about pages, for the layers that rank or report them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchemeFacts {
    /// Name of the scheme (`sglang`, `vllm`, `lmcache`, `opaque`), e.g. for logs.
    pub name: &'static str,
    /// Several objects (pools, components, TP ranks) make up one page and share its group;
    /// otherwise every object is a page of its own.
    pub objects_per_page: ObjectsPerPage,
    /// Pages form prefix chains whose depth the adapter passes at put time (`PutMeta::depth`,
    /// from SGLang's `prefix_keys`). The depth is never read from the key.
    pub depth_at_put: bool,
}

/// How many objects one page of a scheme is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectsPerPage {
    /// One object per page (vLLM blocks, opaque keys).
    One,
    /// A chunk and its optional metadata sidecar (LMCache's legacy plugin).
    ChunkAndSidecar,
    /// A page's components in every pool and rank (SGLang).
    Many,
}

/// The prefix of every vLLM key (the tier's namespace starts with it).
pub const VLLM_PREFIX: &str = "vllm/";
/// The prefix of LMCache's MP L2 adapter keys.
pub const LMCACHE_PREFIX: &str = "lmcache/";
/// The prefix of LMCache's legacy remote-plugin keys.
pub const LMCACHE_LEGACY_PREFIX: &str = "lmcache-v1/";
/// The sidecar suffix of an LMCache legacy chunk's metadata object.
pub const LMCACHE_META_SUFFIX: &str = ".meta";
/// Fewest `@` in an LMCache key (`<model>@<kv_rank>@<group>@<hash>`; the legacy key has more).
const LMCACHE_MIN_ATS: usize = 3;

impl KeyScheme {
    /// The scheme of an engine key (without a store namespace prefix; [`group_of`] takes a
    /// stored key). Every scheme's grammar is checked, not one byte: see the module doc.
    pub fn of(key: &[u8]) -> KeyScheme {
        let ats = key.iter().filter(|&&b| b == b'@').count();
        if ats == 1 && is_sglang_shaped(key) {
            return KeyScheme::SGLang;
        }
        if ats >= LMCACHE_MIN_ATS
            && (key.starts_with(LMCACHE_PREFIX.as_bytes())
                || key.starts_with(LMCACHE_LEGACY_PREFIX.as_bytes()))
        {
            return KeyScheme::LmCache;
        }
        if ats == 0 && key.starts_with(VLLM_PREFIX.as_bytes()) {
            return KeyScheme::Vllm;
        }
        KeyScheme::Opaque
    }

    /// The eviction group of `key` (an engine key of this scheme, no store namespace): always
    /// a prefix of the key. SGLang: `[tag/]page_hash@`; LMCache legacy: the chunk key (its
    /// `.meta` sidecar joins the chunk's group); every other key: itself.
    pub fn group(self, key: &[u8]) -> &[u8] {
        match self {
            KeyScheme::SGLang => match key.iter().position(|&b| b == b'@') {
                Some(at) => &key[..=at],
                None => key,
            },
            KeyScheme::LmCache if key.starts_with(LMCACHE_LEGACY_PREFIX.as_bytes()) => key
                .strip_suffix(LMCACHE_META_SUFFIX.as_bytes())
                .unwrap_or(key),
            KeyScheme::LmCache | KeyScheme::Vllm | KeyScheme::Opaque => key,
        }
    }

    /// The page (block, chunk) hash a key names, when its scheme has one: SGLang's page hash,
    /// vLLM's block hash (hex), LMCache's chunk hash (its fourth `@` field).
    pub fn page_hash(self, key: &[u8]) -> Option<&[u8]> {
        match self {
            KeyScheme::SGLang => Some(page_hash_of(key)),
            KeyScheme::Vllm => {
                let last = &key[key.iter().rposition(|&b| b == b'/')? + 1..];
                let cut = last.windows(2).rposition(|w| w == b"_g")?;
                Some(&last[..cut])
            }
            KeyScheme::LmCache => key.split(|&b| b == b'@').nth(3),
            KeyScheme::Opaque => None,
        }
    }

    /// The scheme's page facts.
    pub fn facts(self) -> SchemeFacts {
        let (name, objects_per_page, depth_at_put) = match self {
            KeyScheme::SGLang => ("sglang", ObjectsPerPage::Many, true),
            KeyScheme::Vllm => ("vllm", ObjectsPerPage::One, false),
            KeyScheme::LmCache => ("lmcache", ObjectsPerPage::ChunkAndSidecar, false),
            KeyScheme::Opaque => ("opaque", ObjectsPerPage::One, false),
        };
        SchemeFacts {
            name,
            objects_per_page,
            depth_at_put,
        }
    }
}

/// An SGLang key or suffix: one `@`, then a non-empty alphanumeric fingerprint, a `.` and a
/// non-empty rest (rank parts and component). Looser than [`parse`] (which wants a hex
/// fingerprint) so that grouping does not depend on the fingerprint's alphabet.
fn is_sglang_shaped(key: &[u8]) -> bool {
    let Some(at) = key.iter().position(|&b| b == b'@') else {
        return false;
    };
    let tail = &key[at + 1..];
    let Some(dot) = tail.iter().position(|&b| b == b'.') else {
        return false;
    };
    dot > 0 && dot + 1 < tail.len() && tail[..dot].iter().all(u8::is_ascii_alphanumeric)
}

/// The store namespace prefix of a stored key (`tenant 0x1f`, `NUL 'C' tag 0x1f`), empty for
/// a raw key: its length.
fn namespace_len(stored: &[u8]) -> usize {
    match crate::namespace::owner(stored) {
        crate::namespace::Owner::Tenant { key, .. }
        | crate::namespace::Owner::Cluster { key, .. } => stored.len() - key.len(),
        crate::namespace::Owner::Unknown => 0,
    }
}

/// The scheme of a stored key (store namespace prefix skipped).
pub fn scheme_of(stored: &[u8]) -> KeyScheme {
    KeyScheme::of(&stored[namespace_len(stored)..])
}

/// The eviction group of a stored key: its store namespace prefix (if any) followed by the
/// group its scheme names ([`KeyScheme::group`]). Always a prefix of `stored`; a key of no
/// known scheme is its own group.
pub fn group_of(stored: &[u8]) -> &[u8] {
    let ns = namespace_len(stored);
    let inner = &stored[ns..];
    let group = KeyScheme::of(inner).group(inner);
    &stored[..ns + group.len()]
}

/// The SGLang page hash of a stored key or of an SGLang group (`[tag/]page_hash@`, as the
/// engine's events name it), its store namespace skipped; `None` for any other scheme's key or
/// group (a vLLM block or an LMCache chunk is no SGLang page, so no SGLang KV event names it).
pub fn sglang_page_hash(stored: &[u8]) -> Option<&[u8]> {
    let inner = &stored[namespace_len(stored)..];
    let ats = inner.iter().filter(|&&b| b == b'@').count();
    let group = ats == 1 && inner.last() == Some(&b'@');
    (group || KeyScheme::of(inner) == KeyScheme::SGLang).then(|| page_hash_of(inner))
}

/// A vLLM key: `namespace "/" block_hash_hex "_g" group` (`namespace` is the tier's
/// `vllm/<model>_<digest>`, see [`vllm_namespace`]).
pub fn vllm_key(namespace: &str, block_hash: &[u8], kv_group: u32) -> String {
    let mut out = String::with_capacity(namespace.len() + 2 * block_hash.len() + 8);
    out.push_str(namespace);
    out.push('/');
    for b in block_hash {
        out.push_str(&format!("{b:02x}"));
    }
    out.push_str(&format!("_g{kv_group}"));
    out
}

/// The vLLM tier's namespace: `vllm/<model with '/' as '_'>_<digest>`.
pub fn vllm_namespace(model: &str, digest: &str) -> String {
    format!("{VLLM_PREFIX}{}_{digest}", model.replace('/', "_"))
}

/// Which LMCache plugin a key belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LmCachePlugin {
    /// The MP L2 adapter (`KvtierL2Connector`).
    L2,
    /// The legacy remote-storage plugin (`KvtierRemoteConnector`).
    Legacy,
}

/// An LMCache key: LMCache's own string under its plugin's prefix, with the `.meta` sidecar
/// suffix for a legacy chunk's metadata object.
pub fn lmcache_key(plugin: LmCachePlugin, lmcache_key: &str, sidecar: bool) -> String {
    let prefix = match plugin {
        LmCachePlugin::L2 => LMCACHE_PREFIX,
        LmCachePlugin::Legacy => LMCACHE_LEGACY_PREFIX,
    };
    let suffix = if sidecar { LMCACHE_META_SUFFIX } else { "" };
    format!("{prefix}{lmcache_key}{suffix}")
}

/// The SGLang tenant prefix of a page key (`extra_backend_tag "/"`, empty without a tag).
pub fn sglang_tag_prefix(tag: Option<&str>) -> String {
    match tag {
        Some(t) if !t.is_empty() => format!("{t}/"),
        _ => String::new(),
    }
}

/// The page hash of a key or of a group (`[tag/]page_hash@...`): the part between the last
/// `/` before the first `@` and that `@` (the whole text up to the `@` without a tag; the
/// whole key after its last `/` when it has no `@`).
pub fn page_hash_of(key: &[u8]) -> &[u8] {
    let head = match key.iter().position(|&b| b == b'@') {
        Some(at) => &key[..at],
        None => key,
    };
    match head.iter().rposition(|&b| b == b'/') {
        Some(slash) => &head[slash + 1..],
        None => head,
    }
}

/// A key split into the scheme's fields (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedKey<'a> {
    /// The tag without its `/` (`None` without one).
    pub tag: Option<&'a str>,
    pub page_hash: &'a str,
    pub fingerprint: &'a str,
    /// The rank parts, each without its dot (`tp0`, `pp1`).
    pub ranks: Vec<&'a str>,
    /// The component after the rank parts (`k`, `swa.k`, `mamba.conv0`).
    pub component: &'a str,
}

fn is_rank(part: &str) -> bool {
    ["dcp", "tp", "pp", "cp"].iter().any(|tag| {
        part.strip_prefix(tag)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Parse a whole key, or a suffix (`@fp.tp0.k`, page hash empty). `None` outside the scheme:
/// no `@`, a fingerprint that is not hex, no component, or bytes that are not UTF-8.
pub fn parse(key: &[u8]) -> Option<ParsedKey<'_>> {
    let text = std::str::from_utf8(key).ok()?;
    let at = text.rfind('@')?;
    let (head, rest) = (&text[..at], &text[at + 1..]);
    let (tag, page_hash) = match head.rfind('/') {
        Some(slash) => (Some(&head[..slash]), &head[slash + 1..]),
        None => (None, head),
    };
    let mut parts = rest.splitn(2, '.');
    let fingerprint = parts.next()?;
    if fingerprint.is_empty() || !fingerprint.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut tail = parts.next()?;
    let mut ranks = Vec::new();
    loop {
        let (part, more) = match tail.split_once('.') {
            Some((p, m)) => (p, Some(m)),
            None => (tail, None),
        };
        if !is_rank(part) {
            break;
        }
        ranks.push(part);
        tail = more?;
    }
    if tail.is_empty() {
        return None;
    }
    Some(ParsedKey {
        tag,
        page_hash,
        fingerprint,
        ranks,
        component: tail,
    })
}

/// The pool a key or suffix belongs to: `kv` for the KV pool's components (`k`, `v`, `kv`,
/// `page`, `cN`), the side pool's name (its component's first part) otherwise, `other` for
/// keys outside the scheme or pool names unfit for a label ([`pool_label`]).
pub fn pool_of(suffix_or_key: &[u8]) -> &str {
    let Some(parsed) = parse(suffix_or_key) else {
        return OTHER_POOL;
    };
    let first = parsed.component.split('.').next().unwrap_or("");
    let kv_part = KV_COMPONENTS.contains(&first)
        || (first.len() > 1
            && first.starts_with('c')
            && first[1..].bytes().all(|b| b.is_ascii_digit()));
    if kv_part {
        "kv"
    } else {
        pool_label(first)
    }
}

/// `name` as a `pool` label value: itself when it is 1 to 64 ASCII letters, digits, `_` or
/// `-`, else `other` (label values must not carry arbitrary caller bytes).
pub fn pool_label(name: &str) -> &str {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        name
    } else {
        OTHER_POOL
    }
}

/// The chain pages whose window state a backup superseded: after storing `new_pages` pages
/// that continue a chain of `prefix_pages`, a trailing-window pool of `window` pages only
/// still needs the last `window` pages of the new end; the pages
/// `[prefix_pages - window, prefix_pages + new_pages - window)` (clamped at 0) were the window
/// of an older end. `None` when that range is empty.
pub fn superseded_range(
    prefix_pages: usize,
    new_pages: usize,
    window: usize,
) -> Option<Range<usize>> {
    let start = prefix_pages.saturating_sub(window);
    let stop = (prefix_pages.saturating_add(new_pages)).saturating_sub(window);
    (stop > start).then_some(start..stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compose_then_parse_is_the_identity() {
        let layout = RankLayout {
            tp_rank: Some(3),
            pp_size: 2,
            pp_rank: 1,
            cp_size: 1,
            cp_rank: 0,
            dcp_size: 4,
            dcp_rank: 2,
        };
        let tag = rank_tag(&layout);
        assert_eq!(tag, ".tp3.pp1.dcp2");
        for name in component_names(
            Some("mamba"),
            3,
            Some(MambaShape {
                conv: 2,
                temporal: true,
            }),
        ) {
            let s = suffix("0123456789ab", &tag, &name);
            let mut key = Vec::new();
            compose(b"team/", b"deadbeef", s.as_bytes(), &mut key);
            let p = parse(&key).unwrap();
            assert_eq!(p.tag, Some("team"));
            assert_eq!(p.page_hash, "deadbeef");
            assert_eq!(p.fingerprint, "0123456789ab");
            assert_eq!(p.ranks, vec!["tp3", "pp1", "dcp2"]);
            assert_eq!(p.component, name);
            assert_eq!(pool_of(&key), "mamba");
            assert_eq!(group_of(&key), b"team/deadbeef@");
            assert_eq!(page_hash_of(&key), b"deadbeef");
            assert_eq!(page_hash_of(group_of(&key)), b"deadbeef");
        }
    }

    #[test]
    fn names_and_ranges() {
        assert_eq!(component_names(None, 1, None), vec!["kv"]);
        assert_eq!(component_names(None, 2, None), vec!["k", "v"]);
        assert_eq!(
            component_names(Some("swa"), 3, None),
            vec!["swa.c0", "swa.c1", "swa.c2"]
        );
        assert_eq!(component_names(Some("indexer"), 1, None), vec!["indexer"]);
        assert_eq!(rank_tag(&RankLayout::default()), "");
        assert_eq!(superseded_range(10, 4, 3), Some(7..11));
        assert_eq!(superseded_range(1, 1, 3), None);
        assert_eq!(superseded_range(0, 8, 3), Some(0..5));
        for junk in [
            &b""[..],
            b"@",
            b"x@zz.k",
            b"x@0a",
            b"x@0a.tp0",
            b"\xff@0a.k",
        ] {
            assert!(parse(junk).is_none());
            assert_eq!(pool_of(junk), "other");
        }
    }

    /// Issue 28: LMCache keys (`<model>@<kv_rank>@<group>@<hash>`) used to be one group per
    /// model (everything up to the first `@`), so a full store refused every later put.
    #[test]
    fn each_scheme_names_its_own_groups() {
        // LMCache MP L2: one group per chunk, not per model.
        let a = lmcache_key(LmCachePlugin::L2, "Qwen/Qwen3-0.6B@0@0@00aa", false);
        let b = lmcache_key(LmCachePlugin::L2, "Qwen/Qwen3-0.6B@0@0@00bb@salt", false);
        assert_eq!(a, "lmcache/Qwen/Qwen3-0.6B@0@0@00aa");
        for k in [&a, &b] {
            assert_eq!(KeyScheme::of(k.as_bytes()), KeyScheme::LmCache);
            assert_eq!(group_of(k.as_bytes()), k.as_bytes());
        }
        assert_ne!(group_of(a.as_bytes()), group_of(b.as_bytes()));
        assert_eq!(
            KeyScheme::LmCache.page_hash(a.as_bytes()),
            Some(&b"00aa"[..])
        );
        // LMCache legacy: the chunk and its .meta sidecar are one group.
        let chunk = lmcache_key(LmCachePlugin::Legacy, "m@1@0@0abc@bfloat16", false);
        let meta = lmcache_key(LmCachePlugin::Legacy, "m@1@0@0abc@bfloat16", true);
        assert_eq!(meta, "lmcache-v1/m@1@0@0abc@bfloat16.meta");
        assert_eq!(group_of(meta.as_bytes()), chunk.as_bytes());
        assert_eq!(group_of(chunk.as_bytes()), chunk.as_bytes());
        // vLLM: byte-for-byte the tier's former f-string; each block and KV group alone.
        let ns = vllm_namespace("Qwen/Qwen3-0.6B", "0123456789abcdef");
        assert_eq!(ns, "vllm/Qwen_Qwen3-0.6B_0123456789abcdef");
        let v = vllm_key(&ns, &[0x00, 0xab, 0xff], 2);
        assert_eq!(v, "vllm/Qwen_Qwen3-0.6B_0123456789abcdef/00abff_g2");
        assert_eq!(KeyScheme::of(v.as_bytes()), KeyScheme::Vllm);
        assert_eq!(group_of(v.as_bytes()), v.as_bytes());
        assert_eq!(
            KeyScheme::Vllm.page_hash(v.as_bytes()),
            Some(&b"00abff"[..])
        );
        // SGLang: one group per page across pools; an SGLang tag that spells another
        // engine's prefix is still SGLang (one `@`).
        for key in [&b"lmcache/abc@0123456789ab.tp0.k"[..], b"vllm/abc@fp.swa"] {
            assert_eq!(KeyScheme::of(key), KeyScheme::SGLang);
            assert!(group_of(key).ends_with(b"abc@"));
        }
        assert_eq!(sglang_tag_prefix(Some("team")), "team/");
        assert_eq!(sglang_tag_prefix(None), "");
        // Opaque keys are their own group, whatever bytes they hold.
        for key in [
            &b"plain"[..],
            b"@x",
            b"a@b@c",
            b"x@.k",
            b"x@fp.",
            b"lmcache/a@b",
        ] {
            assert_eq!(KeyScheme::of(key), KeyScheme::Opaque, "{key:?}");
            assert_eq!(group_of(key), key);
        }
        assert_eq!(
            KeyScheme::SGLang.facts().objects_per_page,
            ObjectsPerPage::Many
        );
        assert!(KeyScheme::SGLang.facts().depth_at_put);
        assert_eq!(sglang_page_hash(b"t/abc@0123456789ab.k"), Some(&b"abc"[..]));
        assert_eq!(sglang_page_hash(b"t/abc@"), Some(&b"abc"[..]));
        assert_eq!(sglang_page_hash(b"team\x1ft/abc@"), Some(&b"abc"[..]));
        assert_eq!(sglang_page_hash(v.as_bytes()), None);
        assert_eq!(sglang_page_hash(a.as_bytes()), None);
        assert_eq!(sglang_page_hash(b"plain"), None);
        assert_eq!(KeyScheme::LmCache.facts().name, "lmcache");
    }

    /// The store namespace (a local tenant, a cluster tag) stays in front of the group.
    #[test]
    fn groups_keep_the_store_namespace() {
        use crate::namespace::{cluster_prefix, tenant_prefix};
        for ns in [
            tenant_prefix("team-a"),
            cluster_prefix("prod"),
            cluster_prefix(""),
        ] {
            let key = [&ns[..], b"t/abc@0123456789ab.tp0.k"].concat();
            assert_eq!(group_of(&key), [&ns[..], b"t/abc@"].concat());
            assert_eq!(scheme_of(&key), KeyScheme::SGLang);
            let lm = [&ns[..], b"lmcache/m@0@0@01"].concat();
            assert_eq!(group_of(&lm), &lm[..]);
            assert_eq!(scheme_of(&lm), KeyScheme::LmCache);
        }
        // A tenant name with an `@` no longer cuts the group inside the tenant.
        let key = [&tenant_prefix("a@b")[..], b"h@fp.k"].concat();
        assert_eq!(group_of(&key), [&tenant_prefix("a@b")[..], b"h@"].concat());
    }

    /// Grouping never panics and always names a prefix of the key (keys come from peers).
    #[test]
    fn group_of_is_a_prefix_of_any_bytes() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let alphabet = b"@./_\x1f\0Clmcache-v1vllmgtp0k";
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 24) as usize;
            let key: Vec<u8> = (0..len)
                .map(|i| alphabet[((state >> (i % 8 * 8)) as usize + i) % alphabet.len()])
                .collect();
            let group = group_of(&key);
            assert!(key.starts_with(group), "{key:?}");
            assert!(!group.is_empty() || key.is_empty());
            let _ = KeyScheme::of(&key).page_hash(&key);
        }
    }
}
