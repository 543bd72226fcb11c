//! `kvtier._native` key-scheme functions: the Python face of `kvtier_proto::keys` (issues 16,
//! 28): the SGLang, vLLM and LMCache adapters compose their keys only through these.
//!
//! The SGLang adapter gathers SGLang's facts (ranks, pool names, component counts, the layout
//! facts of the fingerprint) and composes and parses keys only through these functions, so the
//! adapter, the engine's eviction groups, the metrics and the KV events agree on one
//! definition. Every function is pure and takes plain values; none can fail on odd input (a
//! key outside the scheme parses to `None` / pool `other`) except [`key_fingerprint`], which
//! raises `ValueError` for facts nested too deep and passes on an error of a fact's `__repr__`.

use kvtier_proto::keys::fingerprint::MAX_FACT_DEPTH;
use kvtier_proto::keys::{self, LayoutFact, MambaShape, RankLayout};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyString, PyTuple};

/// `(tag, page_hash, fingerprint, [rank parts], component)` of a parsed key.
type ParsedReply = (Option<String>, String, String, Vec<String>, String);

/// The key format version every fingerprint includes.
#[pyfunction]
fn key_format_version() -> u32 {
    keys::KEY_FORMAT_VERSION
}

/// The rank part of a suffix (`.tp0.pp1`); `tp_rank=None` for a replicated pool.
#[pyfunction]
#[pyo3(signature = (tp_rank, pp_size=1, pp_rank=0, cp_size=1, cp_rank=0, dcp_size=1, dcp_rank=0))]
fn key_rank_tag(
    tp_rank: Option<u32>,
    pp_size: u32,
    pp_rank: u32,
    cp_size: u32,
    cp_rank: u32,
    dcp_size: u32,
    dcp_rank: u32,
) -> String {
    keys::rank_tag(&RankLayout {
        tp_rank,
        pp_size,
        pp_rank,
        cp_size,
        cp_rank,
        dcp_size,
        dcp_rank,
    })
}

/// Component names of a page (`mamba=(conv_buffers, has_temporal)` for the Mamba pool).
#[pyfunction]
#[pyo3(signature = (base, count, mamba=None))]
fn key_component_names(
    base: Option<&str>,
    count: usize,
    mamba: Option<(usize, bool)>,
) -> Vec<String> {
    let shape = mamba.map(|(conv, temporal)| MambaShape { conv, temporal });
    keys::component_names(base, count, shape)
}

/// `@fingerprint rank_tag . component`.
#[pyfunction]
fn key_suffix(fingerprint: &str, rank_tag: &str, component: &str) -> String {
    keys::suffix(fingerprint, rank_tag, component)
}

/// `prefix ++ page_key ++ suffix`.
#[pyfunction]
fn key_compose(prefix: &str, page_key: &str, suffix: &str) -> String {
    format!("{prefix}{page_key}{suffix}")
}

/// The eviction group of a key, as its scheme names it (`[tag/]page_hash@` of an SGLang key,
/// the key itself for a vLLM block, an LMCache chunk or an opaque key; issue 28).
#[pyfunction]
fn key_group_of(key: &str) -> String {
    String::from_utf8_lossy(keys::group_of(key.as_bytes())).into_owned()
}

/// The scheme of a key (`sglang`, `vllm`, `lmcache`, `opaque`; a store namespace prefix is
/// skipped).
#[pyfunction]
fn key_scheme_of(key: &str) -> &'static str {
    keys::scheme_of(key.as_bytes()).facts().name
}

/// The tier's vLLM key namespace `vllm/<model with '/' as '_'>_<digest>`.
#[pyfunction]
fn key_vllm_namespace(model: &str, digest: &str) -> String {
    keys::vllm_namespace(model, digest)
}

/// A vLLM key: `namespace/<block hash hex>_g<kv group>`.
#[pyfunction]
fn key_vllm(namespace: &str, block_hash: &[u8], kv_group: u32) -> String {
    keys::vllm_key(namespace, block_hash, kv_group)
}

/// LMCache MP L2 adapter keys: each of LMCache's strings under `lmcache/`.
#[pyfunction]
fn key_lmcache_l2(lmcache_keys: Vec<String>) -> Vec<String> {
    lmcache_keys
        .iter()
        .map(|k| keys::lmcache_key(keys::LmCachePlugin::L2, k, false))
        .collect()
}

/// An LMCache legacy-plugin key (`lmcache-v1/<key>`, `.meta` appended for the sidecar).
#[pyfunction]
#[pyo3(signature = (lmcache_key, sidecar=false))]
fn key_lmcache_legacy(lmcache_key: &str, sidecar: bool) -> String {
    keys::lmcache_key(keys::LmCachePlugin::Legacy, lmcache_key, sidecar)
}

/// The SGLang tenant prefix of page keys: `tag/`, empty without a tag.
#[pyfunction]
#[pyo3(signature = (tag=None))]
fn key_sglang_prefix(tag: Option<&str>) -> String {
    keys::sglang_tag_prefix(tag)
}

/// The SGLang page hash of a key or group (store namespace skipped); empty for a key or group
/// of another scheme (a vLLM block, an LMCache chunk), which names no SGLang page (issue 28).
#[pyfunction]
fn key_page_hash(key: &str) -> String {
    keys::sglang_page_hash(key.as_bytes())
        .map(|h| String::from_utf8_lossy(h).into_owned())
        .unwrap_or_default()
}

/// The metrics pool label of a key or suffix (`kv`, a side pool, `other`).
#[pyfunction]
fn key_pool_of(key: &str) -> String {
    keys::pool_of(key.as_bytes()).to_string()
}

/// The fields of a key, or `None` outside the scheme.
#[pyfunction]
fn key_parse(key: &str) -> Option<ParsedReply> {
    keys::parse(key.as_bytes()).map(|p| {
        (
            p.tag.map(str::to_string),
            p.page_hash.to_string(),
            p.fingerprint.to_string(),
            p.ranks.iter().map(|r| r.to_string()).collect(),
            p.component.to_string(),
        )
    })
}

/// `(start, stop)` of the chain pages a backup superseded, or `None` (see
/// `kvtier_proto::keys::superseded_range`).
#[pyfunction]
fn key_superseded_range(
    prefix_pages: usize,
    new_pages: usize,
    window: usize,
) -> Option<(usize, usize)> {
    keys::superseded_range(prefix_pages, new_pages, window).map(|r| (r.start, r.end))
}

/// The layout fingerprint of a tuple of facts: what
/// `hashlib.blake2b(repr(facts).encode(), digest_size=6).hexdigest()` gives (see
/// `kvtier_proto::keys::fingerprint`). Exactly-typed `None`, `int` and ASCII `str` values and
/// tuples of them are rendered in Rust; anything else (non-ASCII `str`, `bool`, `float`, enums,
/// `str` / `int` subclasses, other objects) is rendered by its own `repr` here, since only
/// the running interpreter knows what that gives.
#[pyfunction]
fn key_fingerprint(facts: &Bound<'_, PyTuple>) -> PyResult<String> {
    let facts = facts
        .iter()
        .map(|fact| fact_of(&fact, 1))
        .collect::<PyResult<Vec<_>>>()?;
    keys::layout_fingerprint(&facts).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `value` as a typed fact (see [`key_fingerprint`]); `depth` counts the enclosing tuples.
fn fact_of(value: &Bound<'_, PyAny>, depth: usize) -> PyResult<LayoutFact> {
    if value.is_none() {
        return Ok(LayoutFact::None);
    }
    if let Ok(text) = value.cast_exact::<PyString>() {
        if let Ok(text) = text.to_str() {
            if text.is_ascii() {
                return Ok(LayoutFact::Text(text.to_string()));
            }
        }
    } else if let Ok(int) = value.cast_exact::<PyInt>() {
        if let Ok(int) = int.extract::<i128>() {
            return Ok(LayoutFact::Int(int));
        }
    } else if let Ok(tuple) = value.cast_exact::<PyTuple>() {
        if depth >= MAX_FACT_DEPTH {
            return Err(PyValueError::new_err(format!(
                "layout facts nest deeper than {MAX_FACT_DEPTH} tuples"
            )));
        }
        return tuple
            .iter()
            .map(|item| fact_of(&item, depth + 1))
            .collect::<PyResult<Vec<_>>>()
            .map(LayoutFact::Tuple);
    }
    Ok(LayoutFact::Rendered(value.repr()?.to_str()?.to_string()))
}

/// Register the functions on the `_native` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(key_format_version, m)?)?;
    m.add_function(wrap_pyfunction!(key_rank_tag, m)?)?;
    m.add_function(wrap_pyfunction!(key_component_names, m)?)?;
    m.add_function(wrap_pyfunction!(key_suffix, m)?)?;
    m.add_function(wrap_pyfunction!(key_compose, m)?)?;
    m.add_function(wrap_pyfunction!(key_group_of, m)?)?;
    m.add_function(wrap_pyfunction!(key_page_hash, m)?)?;
    m.add_function(wrap_pyfunction!(key_scheme_of, m)?)?;
    m.add_function(wrap_pyfunction!(key_vllm_namespace, m)?)?;
    m.add_function(wrap_pyfunction!(key_vllm, m)?)?;
    m.add_function(wrap_pyfunction!(key_lmcache_l2, m)?)?;
    m.add_function(wrap_pyfunction!(key_lmcache_legacy, m)?)?;
    m.add_function(wrap_pyfunction!(key_sglang_prefix, m)?)?;
    // The store namespace separator (`tenant 0x1f key`), declared once in kvtier_proto.
    m.add("NAMESPACE_SEPARATOR", kvtier_proto::namespace::SEPARATOR)?;
    m.add_function(wrap_pyfunction!(key_pool_of, m)?)?;
    m.add_function(wrap_pyfunction!(key_parse, m)?)?;
    m.add_function(wrap_pyfunction!(key_superseded_range, m)?)?;
    m.add_function(wrap_pyfunction!(key_fingerprint, m)?)?;
    Ok(())
}
