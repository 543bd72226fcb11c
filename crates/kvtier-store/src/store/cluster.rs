//! The [`Store`] seam over [`ClusterStore`] (cluster mode). Thin: placement, transport and the
//! directory stay in `crate::cluster`; this file maps the trait's calls onto them and keeps
//! the per-page promise (see [`PAGE_ROLLBACK`]).

use kvtier_engine::{EngineError, PutOutcome};
use kvtier_proto::{ExistsV2Answer, ExistsV2Query};

use super::Store;
use crate::batch::{BatchResult, MemRef, PageBatch};
use crate::cluster::{ClusterStore, ObjectError};
use crate::error::ClientError;
use crate::memory::RegionRegistry;

/// The cluster store's per-page contract, stated once (the docs and the test
/// `cluster_page_rollback` refer to it): when a component of a page could not be stored, the
/// components this call committed for that page are forgotten at the master and removed from
/// the nodes holding them before the page's `false` is returned, so no exists or get sees a
/// partial page. Weaker than the embedded store's in one way: between the commit and the
/// rollback (one master round trip) another client may see, and read, those components; and
/// a rollback that cannot reach the master is logged, its components stay until evicted.
pub const PAGE_ROLLBACK: &str = "committed components of a failed page are forgotten and removed \
                                 after the batch's commit (best effort; briefly visible)";

impl Store for ClusterStore {
    fn mode(&self) -> &'static str {
        "cluster"
    }

    fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.page_io(
            regions,
            true,
            batch.prefix,
            batch.page_keys,
            batch.suffixes,
            buffers,
            depths,
        )
    }

    fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult {
        self.page_io(
            regions,
            false,
            batch.prefix,
            batch.page_keys,
            batch.suffixes,
            buffers,
            None,
        )
    }

    fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError> {
        let keys = [self.namespaced(key)];
        match self.put_objects(&keys, &[Ok(value)], &[depth]).remove(0) {
            Ok(()) => Ok(PutOutcome::Stored),
            Err(error) => Err(ClientError::object(key, error)),
        }
    }

    fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        let keys = [self.namespaced(key)];
        match self.get_objects(&keys, vec![Ok(dst)]).remove(0) {
            Ok(()) => Ok(()),
            // The miss every store answers (issue 28: typed, `is_miss`).
            Err(ObjectError::NotFound) => Err(ClientError::Engine(EngineError::NotFound)),
            Err(error) => Err(ClientError::object(key, error)),
        }
    }

    fn object_len(&self, _key: &[u8]) -> Option<u64> {
        // The directory does not keep sizes (its per-object budget); unknown here.
        None
    }

    fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        let full: Vec<Vec<u8>> = keys.iter().map(|k| self.namespaced(k.as_ref())).collect();
        self.exists_full_keys(&full).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "kvtier cluster: exists failed");
            vec![false; keys.len()]
        })
    }

    fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        let keys = self.compose_keys(batch.prefix, batch.page_keys, batch.suffixes);
        // compose_keys already namespaced them; look them up as whole keys.
        let found = self.exists_full_keys(&keys).unwrap_or_default();
        let comps = batch.components().max(1);
        found
            .chunks(comps)
            .position(|page| !page.iter().all(|&b| b))
            .unwrap_or(found.len() / comps)
    }

    fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(&self, batch: &PageBatch<'_, K, S>) -> usize {
        let keys = self.compose_keys(batch.prefix, batch.page_keys, batch.suffixes);
        self.demote_keys(&keys).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "kvtier: demote hint not delivered");
            0
        })
    }

    fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        self.exists_v2_at_master(query).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "kvtier cluster: exists_v2 failed");
            ExistsV2Answer::default()
        })
    }

    fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        let full: Vec<Vec<u8>> = keys.iter().map(|k| self.namespaced(k.as_ref())).collect();
        self.remove_full_keys(full).unwrap_or(0)
    }

    fn clear(&self) {
        if let Err(e) = self.clear_every_node() {
            tracing::warn!(error = %e, "kvtier cluster: clear did not reach every node");
        }
    }

    fn flush(&self) -> Result<(), ClientError> {
        // Nodes own their durability; an acknowledged put is already visible.
        Ok(())
    }

    fn close(&self) {}
}

impl ClusterStore {
    /// The rollback of [`PAGE_ROLLBACK`]: for every page (`comps` consecutive objects) with a
    /// failed component, forget and remove the components this call committed (`fresh`).
    /// Components that were already present belong to an earlier writer and stay.
    pub(crate) fn roll_back_failed_pages(
        &self,
        keys: &[Vec<u8>],
        results: &[Result<(), ObjectError>],
        fresh: &[bool],
        comps: usize,
    ) {
        let comps = comps.max(1);
        let mut undo: Vec<Vec<u8>> = Vec::new();
        for ((page_results, page_keys), page_fresh) in results
            .chunks(comps)
            .zip(keys.chunks(comps))
            .zip(fresh.chunks(comps))
        {
            if page_results.iter().all(Result::is_ok) {
                continue;
            }
            for (key, &new) in page_keys.iter().zip(page_fresh) {
                if new {
                    undo.push(key.clone());
                }
            }
        }
        if undo.is_empty() {
            return;
        }
        let count = undo.len();
        if let Err(e) = self.remove_full_keys(undo) {
            tracing::warn!(
                error = %e,
                objects = count,
                "kvtier cluster: rolling back the components of failed pages failed; they stay \
                 until evicted"
            );
        }
    }
}
