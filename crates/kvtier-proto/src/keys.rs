//! kvtier's object key scheme, the one definition every layer composes and parses with
//! (issue 16): the SGLang adapter (through `kvtier._native`), the engine's eviction groups,
//! the client's metrics and the KV-event publisher.
//!
//! A key is `[tag "/"] page_hash "@" fingerprint rank_tag "." component`:
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

/// The page group of `key`: the bytes up to and including its first `@` (tenant tag and page
/// hash), or the whole key when it has no `@`.
pub fn group_of(key: &[u8]) -> &[u8] {
    match key.iter().position(|&b| b == b'@') {
        Some(at) => &key[..=at],
        None => key,
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
}
