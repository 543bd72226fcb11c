//! `PutPages` / `GetPages`: one page batch of a session against its tenant's store.
//!
//! Owns no state of its own: it turns a request's `(region, offset, len)` buffers into
//! [`CheckedBuffers`] against the session's mappings (the one bounds check each buffer gets),
//! runs the pages whose every buffer passed through the store, and records the session's and
//! tenant's counters.
//!
//! Invariants:
//! - A page with a bad buffer (unknown region, out of bounds, no memory behind it: issue 26)
//!   fails alone as [`ItemFailure::BadBuffer`], named in the result; the rest of the batch
//!   still runs. Every page's failure the store typed (a miss, a wrong length) goes back
//!   typed (issue 28).
//! - Every mapping a request uses is held (an `Arc` in the [`CheckedBuffers`]) until the
//!   store's call returns, so a concurrent unregister or session end cannot unmap it mid-copy.
//! - Error messages carry keys without the tenant namespace.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvtier_proto::server::{PageIo, ShmRef};
use kvtier_proto::{BatchResult as WireResult, ItemFailure};
use kvtier_store::store::CheckedBuffers;
use kvtier_store::{BatchResult, PageBatch};

use super::session::Session;
use crate::shm::{Mapping, ShmError};

/// Serve one page batch: check every buffer against the session's mappings, fail the pages
/// with a bad buffer (naming it), and run the rest through the tenant's store.
pub(super) fn page_io(session: &Session, io: &PageIo, is_put: bool) -> BatchResult {
    let pages = io.keys.page_keys.len();
    let comps = io.keys.suffixes.len();
    let mut result = BatchResult {
        ok: vec![false; pages],
        ..Default::default()
    };
    if pages == 0 {
        return result;
    }
    if comps == 0 {
        result.note_error("a page batch needs at least one component suffix".into());
        return result;
    }
    let regions = session.regions.read();
    let mut bufs = CheckedBuffers::with_capacity(pages * comps);
    let mut valid_pages: Vec<usize> = Vec::with_capacity(pages);
    let mut bytes = 0u64;
    let mut page_bytes: Vec<u64> = Vec::with_capacity(pages);
    for i in 0..pages {
        let page = &io.buffers[i * comps..(i + 1) * comps];
        let before = bufs.len();
        match check_page(&regions, page, &mut bufs) {
            Err(e) => {
                bufs.truncate(before);
                session
                    .counters
                    .rejected_buffers
                    .fetch_add(1, Ordering::Relaxed);
                result.set_failed(i, ItemFailure::BadBuffer);
                result.note_error(format!(
                    "{}: {e}",
                    String::from_utf8_lossy(&io.keys.page_keys[i])
                ));
            }
            Ok(()) => {
                valid_pages.push(i);
                let n = page.iter().map(|b| b.len).sum::<u64>();
                page_bytes.push(n);
                bytes += n;
            }
        }
    }
    drop(regions);
    if valid_pages.is_empty() {
        return result;
    }
    let prefix = session.ns(&io.keys.prefix);
    let all_valid = valid_pages.len() == pages;
    let subset: Vec<&[u8]>;
    let page_keys: Vec<&[u8]> = if all_valid {
        io.keys.page_keys.iter().map(Vec::as_slice).collect()
    } else {
        subset = valid_pages
            .iter()
            .map(|&i| io.keys.page_keys[i].as_slice())
            .collect();
        subset
    };
    let batch = PageBatch {
        prefix: &prefix,
        page_keys: &page_keys,
        suffixes: &io.keys.suffixes,
    };
    let store = &session.store;
    let inner = if is_put {
        let depths: Option<Vec<u32>> = io
            .depths
            .as_ref()
            .map(|d| valid_pages.iter().map(|&i| d[i]).collect());
        store.put_checked_pages(&batch, &bufs, depths.as_deref())
    } else {
        store.get_checked_pages(&batch, &bufs)
    };
    // The mappings this request used may be unmapped from here on.
    drop(bufs);
    count(session, is_put, &inner, bytes, &page_bytes);
    merge(&mut result, &valid_pages, inner, &session.namespace);
    result
}

/// Put the store's outcome for the pages it ran (`valid_pages[at]` is page `at` of `inner`)
/// into the batch's result: each page's failure as the store typed it, and its messages
/// with the tenant namespace stripped from the keys they name.
fn merge(result: &mut BatchResult, valid_pages: &[usize], inner: BatchResult, namespace: &[u8]) {
    for (at, &slot) in valid_pages.iter().enumerate() {
        match inner.failure(at) {
            None => result.ok[slot] = inner.ok.get(at).copied().unwrap_or(false),
            Some(failure) => result.set_failed(slot, failure),
        }
    }
    for e in inner.errors {
        let e = match std::str::from_utf8(namespace) {
            Ok(ns) if !ns.is_empty() => e.replacen(ns, "", 1),
            _ => e,
        };
        result.note_error(e);
    }
    result.suppressed_errors += inner.suppressed_errors;
}

/// Prove one page's buffers inside the session's mappings, appending them to `bufs`; the
/// first bad one names its component.
fn check_page(
    regions: &HashMap<u64, Arc<Mapping>>,
    page: &[ShmRef],
    bufs: &mut CheckedBuffers,
) -> Result<(), String> {
    for (j, r) in page.iter().enumerate() {
        let mapping = regions.get(&r.region).ok_or_else(|| {
            format!(
                "component {j}: region {} is not registered in this session",
                r.region
            )
        })?;
        bufs.push(mapping, r.offset, r.len).map_err(|e| {
            let e = ShmError::OutOfBounds {
                region: r.region,
                label: mapping.label().to_string(),
                region_len: e.region_len,
                offset: e.offset,
                len: e.len,
            };
            format!("component {j}: {e}")
        })?;
        // Issue 26: never commit memory for a client (a hole of a sparse memfd). A revoked
        // region (its memfd truncated) fails in the copy, which names the revocation.
        if !mapping.revoked() && !mapping.backed(r.offset, r.len) {
            return Err(format!(
                "component {j}: bytes {}+{} of region {} ({:?}) have no memory behind them \
                 (a hole of a sparse memfd, or swapped out): write or pre-fault the buffer \
                 first; the server does not allocate memory for a client",
                r.offset,
                r.len,
                r.region,
                mapping.label()
            ));
        }
    }
    Ok(())
}

/// The session's and the tenant's counters for one served batch: pages and bytes done.
fn count(session: &Session, is_put: bool, inner: &BatchResult, bytes: u64, page_bytes: &[u64]) {
    let done = inner.ok.iter().filter(|&&b| b).count() as u64;
    let done_bytes: u64 = inner
        .ok
        .iter()
        .zip(page_bytes)
        .filter_map(|(ok, n)| ok.then_some(*n))
        .sum();
    let m = &session.metrics;
    let c = &session.counters;
    if is_put {
        m.pages_put.increment(done);
        m.bytes_in.increment(done_bytes);
        c.pages_put.fetch_add(done, Ordering::Relaxed);
        c.bytes_put.fetch_add(bytes, Ordering::Relaxed);
    } else {
        m.pages_got.increment(done);
        m.bytes_out.increment(done_bytes);
        c.pages_got.fetch_add(done, Ordering::Relaxed);
        c.bytes_got.fetch_add(bytes, Ordering::Relaxed);
    }
}

pub(super) fn wire_result(result: BatchResult) -> WireResult {
    // One type since issue 16: the encoder carries `suppressed_errors`; only cut long messages.
    result.fit_messages()
}
