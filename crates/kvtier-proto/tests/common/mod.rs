//! Strategies and helpers shared by the codec property and fuzz tests.
#![allow(dead_code)]

use kvtier_proto::limits::MAX_PAGES_PER_QUERY;
use kvtier_proto::{
    BatchResult, ErrorReply, ExistsV2Answer, ExistsV2Query, Handshake, HitPolicy, KeyBatch,
    KvComponents, PoolQuery, PutBatchHeader,
};
use proptest::collection::{btree_set, vec};
use proptest::option;
use proptest::prelude::*;

pub fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..=max)
}

/// Any Unicode text, short enough for every name and message limit.
pub fn text() -> impl Strategy<Value = String> {
    ".{0,16}"
}

pub fn hit_policy() -> impl Strategy<Value = HitPolicy> {
    prop_oneof![
        Just(HitPolicy::AllPages),
        prop_oneof![0..8u32, any::<u32>()].prop_map(|window| HitPolicy::TrailingPages { window }),
        prop_oneof![0..8u32, any::<u32>()]
            .prop_map(|group_pages| HitPolicy::BlockGroups { group_pages }),
    ]
}

pub fn kv_components() -> impl Strategy<Value = KvComponents> {
    prop_oneof![
        Just(KvComponents::Logical),
        vec(bytes(8), 0..4).prop_map(KvComponents::Suffixes),
    ]
}

pub fn pool_query() -> impl Strategy<Value = PoolQuery> {
    (text(), vec(bytes(8), 0..4), hit_policy()).prop_map(|(name, suffixes, policy)| PoolQuery {
        name,
        suffixes,
        policy,
    })
}

pub fn exists_query() -> impl Strategy<Value = ExistsV2Query> {
    (
        bytes(16),
        vec(bytes(16), 0..40),
        kv_components(),
        vec(pool_query(), 0..6),
    )
        .prop_map(|(key_prefix, page_keys, kv, pools)| ExistsV2Query {
            key_prefix,
            page_keys,
            kv,
            pools,
        })
}

/// Any answer the fold could produce: strictly ascending prefixes, kv hit = the largest.
pub fn exists_answer() -> impl Strategy<Value = ExistsV2Answer> {
    let max = MAX_PAGES_PER_QUERY as u32;
    (
        vec((text(), 0..=max), 0..8),
        prop_oneof![btree_set(1..=max, 0..20), btree_set(1..=40u32, 0..40),],
    )
        .prop_map(|(pool_hit_pages, restorable)| {
            let restorable_prefix_pages: Vec<u32> = restorable.into_iter().collect();
            ExistsV2Answer {
                kv_hit_pages: restorable_prefix_pages.last().copied().unwrap_or(0),
                pool_hit_pages,
                restorable_prefix_pages,
            }
        })
}

pub fn key_batch() -> impl Strategy<Value = KeyBatch> {
    vec(bytes(24), 0..32).prop_map(|keys| KeyBatch { keys })
}

pub fn put_batch_header() -> impl Strategy<Value = PutBatchHeader> {
    (
        vec((bytes(24), any::<u64>(), any::<u32>()), 0..32),
        any::<bool>(),
    )
        .prop_map(|(entries, with_depths)| PutBatchHeader {
            keys: entries.iter().map(|e| e.0.clone()).collect(),
            sizes: entries.iter().map(|e| e.1).collect(),
            depths: with_depths.then(|| entries.iter().map(|e| e.2).collect()),
        })
}

/// Issue 28: items succeed or fail with any typed failure (status bytes 0..=8).
pub fn batch_result() -> impl Strategy<Value = BatchResult> {
    (vec(0u8..=8, 0..64), vec(text(), 0..6), 0usize..3).prop_map(
        |(statuses, errors, suppressed_errors)| {
            let mut result = BatchResult {
                errors,
                suppressed_errors,
                ..Default::default()
            };
            for status in statuses {
                match kvtier_proto::ItemFailure::from_code(status) {
                    Some(failure) => result.push_failed(failure),
                    None => result.push_ok(),
                }
            }
            result
        },
    )
}

pub fn handshake() -> impl Strategy<Value = Handshake> {
    (any::<u16>(), text()).prop_map(|(version, client_name)| Handshake {
        version,
        client_name,
    })
}

pub fn error_reply() -> impl Strategy<Value = ErrorReply> {
    (any::<u16>(), option::of(text())).prop_map(|(code, message)| ErrorReply {
        code,
        message: message.unwrap_or_default(),
    })
}

/// Heap bytes a decoded value holds (capacities, not lengths): what its decode allocated.
pub trait HeapFootprint {
    fn heap_bytes(&self) -> usize;
}

fn vec_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

impl HeapFootprint for Vec<u8> {
    fn heap_bytes(&self) -> usize {
        self.capacity()
    }
}

impl HeapFootprint for String {
    fn heap_bytes(&self) -> usize {
        self.capacity()
    }
}

impl HeapFootprint for Vec<Vec<u8>> {
    fn heap_bytes(&self) -> usize {
        vec_bytes(self) + self.iter().map(HeapFootprint::heap_bytes).sum::<usize>()
    }
}

impl HeapFootprint for ExistsV2Query {
    fn heap_bytes(&self) -> usize {
        let kv = match &self.kv {
            KvComponents::Logical => 0,
            KvComponents::Suffixes(s) => s.heap_bytes(),
        };
        self.key_prefix.heap_bytes()
            + self.page_keys.heap_bytes()
            + kv
            + vec_bytes(&self.pools)
            + self
                .pools
                .iter()
                .map(|p| p.name.heap_bytes() + p.suffixes.heap_bytes())
                .sum::<usize>()
    }
}

impl HeapFootprint for ExistsV2Answer {
    fn heap_bytes(&self) -> usize {
        vec_bytes(&self.pool_hit_pages)
            + self
                .pool_hit_pages
                .iter()
                .map(|(n, _)| n.heap_bytes())
                .sum::<usize>()
            + vec_bytes(&self.restorable_prefix_pages)
    }
}

impl HeapFootprint for KeyBatch {
    fn heap_bytes(&self) -> usize {
        self.keys.heap_bytes()
    }
}

impl HeapFootprint for PutBatchHeader {
    fn heap_bytes(&self) -> usize {
        self.keys.heap_bytes()
            + vec_bytes(&self.sizes)
            + self.depths.as_ref().map(vec_bytes).unwrap_or(0)
    }
}

impl HeapFootprint for BatchResult {
    fn heap_bytes(&self) -> usize {
        vec_bytes(&self.ok)
            + vec_bytes(&self.failures)
            + vec_bytes(&self.errors)
            + self.errors.iter().map(String::heap_bytes).sum::<usize>()
    }
}

impl HeapFootprint for Handshake {
    fn heap_bytes(&self) -> usize {
        self.client_name.heap_bytes()
    }
}

impl HeapFootprint for ErrorReply {
    fn heap_bytes(&self) -> usize {
        self.message.heap_bytes()
    }
}

/// The bound every decode must meet: at most this many heap bytes per input byte, plus slack.
/// The largest item-to-minimal-encoding ratio is a `PoolQuery` (56 bytes in memory, 3 on the
/// wire) or a key (24 bytes of `Vec` header per 1-byte length).
pub const HEAP_BYTES_PER_INPUT_BYTE: usize = 32;

pub fn allocation_is_justified(heap_bytes: usize, input_len: usize) -> bool {
    heap_bytes <= HEAP_BYTES_PER_INPUT_BYTE * input_len + 64
}

/// A tiny deterministic PRNG (xorshift64*), so the fuzz test needs no extra dependency.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}
