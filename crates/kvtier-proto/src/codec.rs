//! kvtier's hand-written binary encoding of message bodies, and the [`Encode`] / [`Decode`]
//! traits every body type implements.
//!
//! # Format
//!
//! Primitives:
//! - `varint`: unsigned LEB128 (7 bits per byte, low group first, high bit = "more"). At most
//!   10 bytes; only the shortest form is accepted (no trailing `0x00` groups), so every value has
//!   exactly one encoding. Fixed-range integers (`u16`, `u32`) are varints checked against their
//!   range.
//! - `count` / `len`: a `varint` checked against a limit from [`crate::limits`].
//! - `bytes`: `len` then that many raw bytes. `str`: `bytes` that must be UTF-8.
//! - `bool`: one byte, `0x00` or `0x01`; anything else is an error.
//! - tags (enum variants, `Option`): one byte, listed below; unknown tags are an error.
//!
//! Messages (fields in order, `x*` = repeated `count` times):
//! ```text
//! ExistsV2Query  := bytes(key_prefix) count(pages) bytes(page_key)* kv count(pools) pool*
//! kv             := 0x00                               Logical
//!                 | 0x01 count bytes(suffix)*          Suffixes
//! pool           := str(name) count bytes(suffix)* policy
//! policy         := 0x00 | 0x01 varint(window) | 0x02 varint(group_pages)
//! ExistsV2Answer := varint(kv_hit_pages) count (str(name) varint(pages))*
//!                   count varint(delta)*               restorable prefixes, delta-coded
//! KeyBatch       := count(n) bytes(key)*n
//! PutBatchHeader := count(n) bytes(key)*n varint(size)*n (0x00 | 0x01 varint(depth)*n)
//! BatchResult    := count status* count str* varint(suppressed_errors)
//!                   (protocol 2: the count of distinct diagnostics left out is a number, not
//!                   a message to parse back)
//! status         := 0x01 ok | 0x00 failed | 0x02 miss | 0x03 wrong length | 0x04 integrity
//!                 | 0x05 unavailable | 0x06 bad buffer | 0x07 no room | 0x08 busy
//!                   (issue 28: an item's failure typed; the older bool form is its 0x00/0x01)
//! Handshake      := varint(version) str(client_name)
//! ErrorReply     := varint(code) str(message)
//! ```
//! `restorable_prefix_pages` is sent as differences from the previous entry (the first from 0),
//! each at least 1: the list is strictly ascending by construction, and typical lists
//! (`1, 2, 3, ...`) cost one byte per entry.
//!
//! # Invariants
//! - Decoding a body consumes all of it; trailing bytes are an error ([`Decode::decode`]).
//! - Canonical: if `decode(b)` succeeds with `v`, then `encode(v)` yields exactly `b`.
//! - Symmetric limits: [`Encode::encode`] fails on exactly the values decoding would reject, so
//!   whatever encodes also decodes.
//! - Bounded allocation: before reserving room for `n` items a decoder checks that the input still
//!   holds at least `n` times the smallest encoding of one item, so the memory a decode allocates
//!   is at most a small constant times the input length, whatever the counts claim.
//! - No panics on any input, and an answer the fold could not have produced is rejected
//!   ([`ProtoError::InvalidAnswer`]) because acting on it could restore missing pages.

use crate::error::ProtoError;
use crate::limits::{
    MAX_KEYS_PER_BATCH, MAX_KEY_LEN, MAX_MESSAGE_LEN, MAX_NAME_LEN, MAX_PAGES_PER_QUERY, MAX_POOLS,
    MAX_SUFFIXES_PER_POOL,
};
use crate::messages::{BatchResult, ErrorReply, Handshake, KeyBatch, PutBatchHeader};
use crate::query::{ExistsV2Answer, ExistsV2Query, HitPolicy, KvComponents, PoolQuery};

/// A value with a wire encoding.
pub trait Encode {
    /// Append this value's encoding to `out`, or fail without leaving anything: on error `out`
    /// is truncated back to its length on entry.
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let start = out.len();
        let result = self.encode_fields(out);
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    /// The encoding as a fresh vector.
    fn encode_to_vec(&self) -> Result<Vec<u8>, ProtoError> {
        let mut out = Vec::new();
        self.encode(&mut out)?;
        Ok(out)
    }

    /// Append the fields; may leave a partial encoding on error ([`Encode::encode`] cleans up).
    /// Implement this, call [`Encode::encode`].
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError>;
}

/// A value that can be read back from its wire encoding.
pub trait Decode: Sized {
    /// Read one value from the front of `reader`, leaving the rest.
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError>;

    /// Decode a whole body: exactly one value and nothing after it.
    fn decode(body: &[u8]) -> Result<Self, ProtoError> {
        let mut reader = Reader::new(body);
        let value = Self::read_from(&mut reader)?;
        reader.finish(std::any::type_name::<Self>())?;
        Ok(value)
    }
}

// ---------------------------------------------------------------------------------------------
// Primitives: writing.

/// Append `value` as a canonical LEB128 varint.
pub fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Append a length or count after checking it against `limit`.
pub fn put_len(
    out: &mut Vec<u8>,
    what: &'static str,
    len: usize,
    limit: usize,
) -> Result<(), ProtoError> {
    check_limit(what, len as u64, limit as u64)?;
    put_varint(out, len as u64);
    Ok(())
}

/// Append length-prefixed bytes after checking the length against `limit`.
pub fn put_bytes(
    out: &mut Vec<u8>,
    what: &'static str,
    bytes: &[u8],
    limit: usize,
) -> Result<(), ProtoError> {
    put_len(out, what, bytes.len(), limit)?;
    out.extend_from_slice(bytes);
    Ok(())
}

/// Append a boolean as `0x00` / `0x01`.
pub fn put_bool(out: &mut Vec<u8>, value: bool) {
    out.push(u8::from(value));
}

pub(crate) fn check_limit(what: &'static str, value: u64, limit: u64) -> Result<(), ProtoError> {
    if value > limit {
        return Err(ProtoError::LimitExceeded { what, value, limit });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Primitives: reading.

/// A cursor over a message body. Every read names the field it is reading (`what`) so errors say
/// where decoding stopped; no read panics or allocates more than the bytes it consumes justify.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader over the whole of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// Succeed only if every byte was consumed; `what` names the complete message.
    pub fn finish(self, what: &'static str) -> Result<(), ProtoError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::TrailingBytes {
                what,
                count: self.rest.len(),
            })
        }
    }

    /// The next `len` raw bytes, borrowed from the input.
    pub fn read_raw(&mut self, what: &'static str, len: usize) -> Result<&'a [u8], ProtoError> {
        if len > self.rest.len() {
            return Err(ProtoError::Truncated {
                what,
                needed: len as u64,
                available: self.rest.len(),
            });
        }
        let (taken, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok(taken)
    }

    /// One byte.
    pub fn read_u8(&mut self, what: &'static str) -> Result<u8, ProtoError> {
        let (&byte, rest) = self.rest.split_first().ok_or(ProtoError::Truncated {
            what,
            needed: 1,
            available: 0,
        })?;
        self.rest = rest;
        Ok(byte)
    }

    /// A canonical LEB128 varint.
    pub fn read_varint(&mut self, what: &'static str) -> Result<u64, ProtoError> {
        let mut value: u64 = 0;
        for index in 0..10u32 {
            let byte = self.read_u8(what)?;
            let group = u64::from(byte & 0x7f);
            // The tenth byte may only carry the single top bit of a u64.
            if index == 9 && byte > 0x01 {
                return Err(ProtoError::BadVarint {
                    what,
                    reason: "value does not fit 64 bits",
                });
            }
            value |= group << (7 * index);
            if byte & 0x80 == 0 {
                // A zero final group after the first byte means a shorter form existed.
                if index > 0 && byte == 0 {
                    return Err(ProtoError::BadVarint {
                        what,
                        reason: "overlong (non-canonical) encoding",
                    });
                }
                return Ok(value);
            }
        }
        Err(ProtoError::BadVarint {
            what,
            reason: "value does not fit 64 bits",
        })
    }

    /// A varint that must not exceed `limit` (a protocol limit or the target type's range).
    pub fn read_varint_at_most(
        &mut self,
        what: &'static str,
        limit: u64,
    ) -> Result<u64, ProtoError> {
        let value = self.read_varint(what)?;
        check_limit(what, value, limit)?;
        Ok(value)
    }

    /// A `u16` sent as a varint.
    pub fn read_u16(&mut self, what: &'static str) -> Result<u16, ProtoError> {
        let value = self.read_varint_at_most(what, u64::from(u16::MAX))?;
        Ok(u16::try_from(value).unwrap_or(u16::MAX))
    }

    /// A `u32` sent as a varint, at most `limit`.
    pub fn read_u32_at_most(&mut self, what: &'static str, limit: u32) -> Result<u32, ProtoError> {
        let value = self.read_varint_at_most(what, u64::from(limit))?;
        Ok(u32::try_from(value).unwrap_or(limit))
    }

    /// A `u32` sent as a varint.
    pub fn read_u32(&mut self, what: &'static str) -> Result<u32, ProtoError> {
        self.read_u32_at_most(what, u32::MAX)
    }

    /// A count of items that each take at least `min_item_len` bytes (at least 1), at most
    /// `limit`. Checking the count against the bytes left before anyone reserves memory for it
    /// is what bounds allocation by the input size.
    pub fn read_count(
        &mut self,
        what: &'static str,
        limit: usize,
        min_item_len: usize,
    ) -> Result<usize, ProtoError> {
        let count = self.read_varint_at_most(what, limit as u64)?;
        let needed = count.saturating_mul(min_item_len.max(1) as u64);
        if needed > self.rest.len() as u64 {
            return Err(ProtoError::Truncated {
                what,
                needed,
                available: self.rest.len(),
            });
        }
        // count <= limit, which is a usize.
        Ok(usize::try_from(count).unwrap_or(limit))
    }

    /// Length-prefixed bytes of at most `limit`, borrowed from the input.
    pub fn read_bytes(&mut self, what: &'static str, limit: usize) -> Result<&'a [u8], ProtoError> {
        let len = self.read_varint_at_most(what, limit as u64)?;
        // len <= limit, which is a usize.
        self.read_raw(what, usize::try_from(len).unwrap_or(limit))
    }

    /// A length-prefixed UTF-8 string of at most `limit` bytes.
    pub fn read_string(&mut self, what: &'static str, limit: usize) -> Result<String, ProtoError> {
        let bytes = self.read_bytes(what, limit)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| ProtoError::InvalidUtf8 { what })
    }

    /// A strict boolean byte.
    pub fn read_bool(&mut self, what: &'static str) -> Result<bool, ProtoError> {
        match self.read_u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(ProtoError::InvalidTag { what, tag }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared list helpers.

pub(crate) fn put_key_list(
    out: &mut Vec<u8>,
    count_what: &'static str,
    item_what: &'static str,
    keys: &[Vec<u8>],
    count_limit: usize,
    key_limit: usize,
) -> Result<(), ProtoError> {
    put_len(out, count_what, keys.len(), count_limit)?;
    put_key_items(out, item_what, keys, key_limit)
}

pub(crate) fn put_key_items(
    out: &mut Vec<u8>,
    what: &'static str,
    keys: &[Vec<u8>],
    limit: usize,
) -> Result<(), ProtoError> {
    keys.iter()
        .try_for_each(|key| put_bytes(out, what, key, limit))
}

pub(crate) fn read_key_items(
    reader: &mut Reader<'_>,
    what: &'static str,
    count: usize,
    limit: usize,
) -> Result<Vec<Vec<u8>>, ProtoError> {
    let mut keys = Vec::with_capacity(count);
    for _ in 0..count {
        keys.push(reader.read_bytes(what, limit)?.to_vec());
    }
    Ok(keys)
}

pub(crate) fn read_key_list(
    reader: &mut Reader<'_>,
    count_what: &'static str,
    item_what: &'static str,
    count_limit: usize,
    key_limit: usize,
) -> Result<Vec<Vec<u8>>, ProtoError> {
    // Each key is at least its one-byte length.
    let count = reader.read_count(count_what, count_limit, 1)?;
    read_key_items(reader, item_what, count, key_limit)
}

/// A request's page keys as the wire carries them: the key prefix, then the page-key list
/// (each key and the prefix within [`MAX_KEY_LEN`]). One encoding, declared once, for the
/// existence query and for page batches ([`crate::server::PageKeys`]); only the count bound
/// differs.
pub(crate) fn put_page_keys(
    out: &mut Vec<u8>,
    prefix: &[u8],
    page_keys: &[Vec<u8>],
    max_pages: usize,
) -> Result<(), ProtoError> {
    put_bytes(out, "key prefix", prefix, MAX_KEY_LEN)?;
    put_key_list(
        out,
        "page count",
        "page key",
        page_keys,
        max_pages,
        MAX_KEY_LEN,
    )
}

/// Read what [`put_page_keys`] wrote: `(prefix, page_keys)`.
pub(crate) fn read_page_keys(
    reader: &mut Reader<'_>,
    max_pages: usize,
) -> Result<(Vec<u8>, Vec<Vec<u8>>), ProtoError> {
    let prefix = reader.read_bytes("key prefix", MAX_KEY_LEN)?.to_vec();
    let page_keys = read_key_list(reader, "page count", "page key", max_pages, MAX_KEY_LEN)?;
    Ok((prefix, page_keys))
}

/// Length of the longest key of `keys` (0 for none).
pub(crate) fn longest(keys: &[Vec<u8>]) -> usize {
    keys.iter().map(Vec::len).max().unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// The existence query.

const KV_LOGICAL: u8 = 0;
const KV_SUFFIXES: u8 = 1;
const POLICY_ALL_PAGES: u8 = 0;
const POLICY_TRAILING_PAGES: u8 = 1;
const POLICY_BLOCK_GROUPS: u8 = 2;
const OPTION_NONE: u8 = 0;
const OPTION_SOME: u8 = 1;

/// Smallest encoding of one pool: empty name, zero suffixes, a tag-only policy.
const MIN_POOL_LEN: usize = 3;

impl Encode for HitPolicy {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        match *self {
            HitPolicy::AllPages => out.push(POLICY_ALL_PAGES),
            HitPolicy::TrailingPages { window } => {
                out.push(POLICY_TRAILING_PAGES);
                put_varint(out, u64::from(window));
            }
            HitPolicy::BlockGroups { group_pages } => {
                out.push(POLICY_BLOCK_GROUPS);
                put_varint(out, u64::from(group_pages));
            }
        }
        Ok(())
    }
}

impl Decode for HitPolicy {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        match reader.read_u8("hit policy tag")? {
            POLICY_ALL_PAGES => Ok(HitPolicy::AllPages),
            POLICY_TRAILING_PAGES => Ok(HitPolicy::TrailingPages {
                window: reader.read_u32("trailing-pages window")?,
            }),
            POLICY_BLOCK_GROUPS => Ok(HitPolicy::BlockGroups {
                group_pages: reader.read_u32("block-groups group size")?,
            }),
            tag => Err(ProtoError::InvalidTag {
                what: "hit policy tag",
                tag,
            }),
        }
    }
}

impl Encode for KvComponents {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        match self {
            KvComponents::Logical => out.push(KV_LOGICAL),
            KvComponents::Suffixes(suffixes) => {
                out.push(KV_SUFFIXES);
                put_key_list(
                    out,
                    "kv suffix count",
                    "kv suffix",
                    suffixes,
                    MAX_SUFFIXES_PER_POOL,
                    MAX_KEY_LEN,
                )?;
            }
        }
        Ok(())
    }
}

impl Decode for KvComponents {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        match reader.read_u8("kv components tag")? {
            KV_LOGICAL => Ok(KvComponents::Logical),
            KV_SUFFIXES => Ok(KvComponents::Suffixes(read_key_list(
                reader,
                "kv suffix count",
                "kv suffix",
                MAX_SUFFIXES_PER_POOL,
                MAX_KEY_LEN,
            )?)),
            tag => Err(ProtoError::InvalidTag {
                what: "kv components tag",
                tag,
            }),
        }
    }
}

impl Encode for PoolQuery {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "pool name", self.name.as_bytes(), MAX_NAME_LEN)?;
        put_key_list(
            out,
            "pool suffix count",
            "pool suffix",
            &self.suffixes,
            MAX_SUFFIXES_PER_POOL,
            MAX_KEY_LEN,
        )?;
        self.policy.encode_fields(out)
    }
}

impl Decode for PoolQuery {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(PoolQuery {
            name: reader.read_string("pool name", MAX_NAME_LEN)?,
            suffixes: read_key_list(
                reader,
                "pool suffix count",
                "pool suffix",
                MAX_SUFFIXES_PER_POOL,
                MAX_KEY_LEN,
            )?,
            policy: HitPolicy::read_from(reader)?,
        })
    }
}

/// The longest key `query` can compose must itself be a legal key, so a server can look every
/// composed key up under the same rule as a batch key.
fn check_composed_key_len(query: &ExistsV2Query) -> Result<(), ProtoError> {
    let kv_suffix = match &query.kv {
        KvComponents::Logical => 0,
        KvComponents::Suffixes(suffixes) => longest(suffixes),
    };
    let pool_suffix = query
        .pools
        .iter()
        .map(|pool| longest(&pool.suffixes))
        .max()
        .unwrap_or(0);
    let composed = query
        .key_prefix
        .len()
        .saturating_add(longest(&query.page_keys))
        .saturating_add(kv_suffix.max(pool_suffix));
    check_limit(
        "longest composed object key (prefix + page key + suffix)",
        composed as u64,
        MAX_KEY_LEN as u64,
    )
}

impl Encode for ExistsV2Query {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        check_composed_key_len(self)?;
        self.check_work()?;
        put_page_keys(out, &self.key_prefix, &self.page_keys, MAX_PAGES_PER_QUERY)?;
        self.kv.encode_fields(out)?;
        put_len(out, "pool count", self.pools.len(), MAX_POOLS)?;
        self.pools
            .iter()
            .try_for_each(|pool| pool.encode_fields(out))
    }
}

impl Decode for ExistsV2Query {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let (key_prefix, page_keys) = read_page_keys(reader, MAX_PAGES_PER_QUERY)?;
        let kv = KvComponents::read_from(reader)?;
        let pool_count = reader.read_count("pool count", MAX_POOLS, MIN_POOL_LEN)?;
        let mut pools = Vec::with_capacity(pool_count);
        for _ in 0..pool_count {
            pools.push(PoolQuery::read_from(reader)?);
        }
        let query = ExistsV2Query {
            key_prefix,
            page_keys,
            kv,
            pools,
        };
        check_composed_key_len(&query)?;
        query.check_work()?;
        Ok(query)
    }
}

// ---------------------------------------------------------------------------------------------
// The existence answer.

/// Smallest encoding of one pool hit: empty name and a one-byte page count.
const MIN_POOL_HIT_LEN: usize = 2;

/// The shape the fold guarantees (see [`crate::query::evaluate`]): every page count within
/// [`MAX_PAGES_PER_QUERY`] (a pool boundary may be 0), restorable prefixes strictly ascending from
/// at least 1, and `kv_hit_pages` equal to the largest of them (0 when there are none).
fn check_answer(answer: &ExistsV2Answer) -> Result<(), ProtoError> {
    check_limit(
        "kv hit pages",
        u64::from(answer.kv_hit_pages),
        MAX_PAGES_PER_QUERY as u64,
    )?;
    check_limit(
        "pool hit count",
        answer.pool_hit_pages.len() as u64,
        MAX_POOLS as u64 + 1,
    )?;
    for (name, pages) in &answer.pool_hit_pages {
        check_limit("pool name", name.len() as u64, MAX_NAME_LEN as u64)?;
        check_limit(
            "pool hit pages",
            u64::from(*pages),
            MAX_PAGES_PER_QUERY as u64,
        )?;
    }
    let restorable = &answer.restorable_prefix_pages;
    check_limit(
        "restorable prefix count",
        restorable.len() as u64,
        MAX_PAGES_PER_QUERY as u64,
    )?;
    let mut previous = 0u32;
    for &prefix in restorable {
        if prefix <= previous {
            return Err(ProtoError::InvalidAnswer(
                "restorable prefixes must be strictly ascending and at least 1",
            ));
        }
        previous = prefix;
    }
    if previous != answer.kv_hit_pages {
        return Err(ProtoError::InvalidAnswer(
            "kv hit pages must equal the largest restorable prefix (0 when there is none)",
        ));
    }
    Ok(())
}

impl Encode for ExistsV2Answer {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        check_answer(self)?;
        put_varint(out, u64::from(self.kv_hit_pages));
        put_varint(out, self.pool_hit_pages.len() as u64);
        for (name, pages) in &self.pool_hit_pages {
            put_bytes(out, "pool name", name.as_bytes(), MAX_NAME_LEN)?;
            put_varint(out, u64::from(*pages));
        }
        put_varint(out, self.restorable_prefix_pages.len() as u64);
        let mut previous = 0u32;
        for &prefix in &self.restorable_prefix_pages {
            // check_answer guarantees prefix > previous.
            put_varint(out, u64::from(prefix.saturating_sub(previous)));
            previous = prefix;
        }
        Ok(())
    }
}

impl Decode for ExistsV2Answer {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let max_pages = MAX_PAGES_PER_QUERY as u32;
        let kv_hit_pages = reader.read_u32_at_most("kv hit pages", max_pages)?;
        let hit_count = reader.read_count("pool hit count", MAX_POOLS + 1, MIN_POOL_HIT_LEN)?;
        let mut pool_hit_pages = Vec::with_capacity(hit_count);
        for _ in 0..hit_count {
            let name = reader.read_string("pool name", MAX_NAME_LEN)?;
            let pages = reader.read_u32_at_most("pool hit pages", max_pages)?;
            pool_hit_pages.push((name, pages));
        }
        let restorable_count =
            reader.read_count("restorable prefix count", MAX_PAGES_PER_QUERY, 1)?;
        let mut restorable_prefix_pages = Vec::with_capacity(restorable_count);
        let mut previous = 0u32;
        for _ in 0..restorable_count {
            let delta = reader.read_u32_at_most("restorable prefix delta", max_pages)?;
            if delta == 0 {
                return Err(ProtoError::InvalidAnswer(
                    "restorable prefixes must be strictly ascending and at least 1",
                ));
            }
            // Both are <= MAX_PAGES_PER_QUERY, so the sum cannot overflow; the limit check
            // below catches a sum past the page limit.
            previous = previous.saturating_add(delta);
            check_limit(
                "restorable prefix",
                u64::from(previous),
                MAX_PAGES_PER_QUERY as u64,
            )?;
            restorable_prefix_pages.push(previous);
        }
        let answer = ExistsV2Answer {
            kv_hit_pages,
            pool_hit_pages,
            restorable_prefix_pages,
        };
        check_answer(&answer)?;
        Ok(answer)
    }
}

// ---------------------------------------------------------------------------------------------
// Batch bodies.

impl Encode for KeyBatch {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_key_list(
            out,
            "key count",
            "key",
            &self.keys,
            MAX_KEYS_PER_BATCH,
            MAX_KEY_LEN,
        )
    }
}

impl Decode for KeyBatch {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(KeyBatch {
            keys: read_key_list(reader, "key count", "key", MAX_KEYS_PER_BATCH, MAX_KEY_LEN)?,
        })
    }
}

impl Encode for PutBatchHeader {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let count = self.keys.len();
        if self.sizes.len() != count {
            return Err(ProtoError::LengthMismatch {
                what: "put sizes",
                expected: count,
                found: self.sizes.len(),
            });
        }
        if let Some(depths) = &self.depths {
            if depths.len() != count {
                return Err(ProtoError::LengthMismatch {
                    what: "put depths",
                    expected: count,
                    found: depths.len(),
                });
            }
        }
        put_key_list(
            out,
            "put key count",
            "put key",
            &self.keys,
            MAX_KEYS_PER_BATCH,
            MAX_KEY_LEN,
        )?;
        for &size in &self.sizes {
            put_varint(out, size);
        }
        match &self.depths {
            None => out.push(OPTION_NONE),
            Some(depths) => {
                out.push(OPTION_SOME);
                for &depth in depths {
                    put_varint(out, u64::from(depth));
                }
            }
        }
        Ok(())
    }
}

impl Decode for PutBatchHeader {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        // Each entry costs at least a key length byte and a size byte.
        let count = reader.read_count("put key count", MAX_KEYS_PER_BATCH, 2)?;
        let keys = read_key_items(reader, "put key", count, MAX_KEY_LEN)?;
        let mut sizes = Vec::with_capacity(count);
        for _ in 0..count {
            sizes.push(reader.read_varint("put size")?);
        }
        let depths = match reader.read_u8("put depths tag")? {
            OPTION_NONE => None,
            OPTION_SOME => {
                // Re-check against what is left: the depths come after the keys and sizes.
                if count > reader.remaining() {
                    return Err(ProtoError::Truncated {
                        what: "put depths",
                        needed: count as u64,
                        available: reader.remaining(),
                    });
                }
                let mut depths = Vec::with_capacity(count);
                for _ in 0..count {
                    depths.push(reader.read_u32("put depth")?);
                }
                Some(depths)
            }
            tag => {
                return Err(ProtoError::InvalidTag {
                    what: "put depths tag",
                    tag,
                })
            }
        };
        Ok(PutBatchHeader {
            keys,
            sizes,
            depths,
        })
    }
}

impl Encode for BatchResult {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(out, "result count", self.ok.len(), MAX_KEYS_PER_BATCH)?;
        for i in 0..self.ok.len() {
            out.push(self.failure(i).map_or(1, crate::ItemFailure::code));
        }
        put_len(out, "error count", self.errors.len(), MAX_KEYS_PER_BATCH)?;
        self.errors.iter().try_for_each(|error| {
            put_bytes(out, "error message", error.as_bytes(), MAX_MESSAGE_LEN)
        })?;
        put_varint(out, self.suppressed_errors.min(u32::MAX as usize) as u64);
        Ok(())
    }
}

impl Decode for BatchResult {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let ok_count = reader.read_count("result count", MAX_KEYS_PER_BATCH, 1)?;
        let mut ok = Vec::with_capacity(ok_count);
        let mut failures = Vec::new();
        for i in 0..ok_count {
            let status = reader.read_u8("result status")?;
            if status == 1 {
                ok.push(true);
                continue;
            }
            let failure = crate::ItemFailure::from_code(status).ok_or(ProtoError::InvalidTag {
                what: "result status",
                tag: status,
            })?;
            ok.push(false);
            // Only typed failures make the list (canonical: an untyped one is the default).
            if failure != crate::ItemFailure::Failed {
                failures.resize(i, crate::ItemFailure::Failed);
                failures.push(failure);
            }
        }
        if !failures.is_empty() {
            failures.resize(ok_count, crate::ItemFailure::Failed);
        }
        let error_count = reader.read_count("error count", MAX_KEYS_PER_BATCH, 1)?;
        let mut errors = Vec::with_capacity(error_count);
        for _ in 0..error_count {
            errors.push(reader.read_string("error message", MAX_MESSAGE_LEN)?);
        }
        // Only a count for the log: bounded by its type, it reserves nothing.
        let suppressed_errors = reader.read_u32("suppressed error count")? as usize;
        Ok(BatchResult {
            ok,
            errors,
            suppressed_errors,
            failures,
        })
    }
}

impl Encode for Handshake {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, u64::from(self.version));
        put_bytes(
            out,
            "client name",
            self.client_name.as_bytes(),
            MAX_NAME_LEN,
        )
    }
}

impl Decode for Handshake {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(Handshake {
            version: reader.read_u16("handshake version")?,
            client_name: reader.read_string("client name", MAX_NAME_LEN)?,
        })
    }
}

impl Encode for ErrorReply {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, u64::from(self.code));
        put_bytes(
            out,
            "error message",
            self.message.as_bytes(),
            MAX_MESSAGE_LEN,
        )
    }
}

impl Decode for ErrorReply {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ErrorReply {
            code: reader.read_u16("error code")?,
            message: reader.read_string("error message", MAX_MESSAGE_LEN)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(value: u64) -> Vec<u8> {
        let mut out = Vec::new();
        put_varint(&mut out, value);
        out
    }

    fn sample_query() -> ExistsV2Query {
        ExistsV2Query {
            key_prefix: b"m/".to_vec(),
            page_keys: vec![b"p0".to_vec(), b"p1".to_vec()],
            kv: KvComponents::Suffixes(vec![b"_k".to_vec(), b"_v".to_vec()]),
            pools: vec![PoolQuery {
                name: "swa".into(),
                suffixes: vec![b"_swa".to_vec()],
                policy: HitPolicy::TrailingPages { window: 4 },
            }],
        }
    }

    fn sample_answer() -> ExistsV2Answer {
        ExistsV2Answer {
            kv_hit_pages: 4,
            pool_hit_pages: vec![("kv".into(), 5), ("swa".into(), 4)],
            restorable_prefix_pages: vec![2, 4],
        }
    }

    #[test]
    fn varint_encodes_known_values() {
        assert_eq!(varint(0), [0x00]);
        assert_eq!(varint(127), [0x7f]);
        assert_eq!(varint(128), [0x80, 0x01]);
        assert_eq!(varint(300), [0xac, 0x02]);
        assert_eq!(varint(u64::MAX).len(), 10);
        for value in [0, 1, 127, 128, 16_383, 16_384, u32::MAX as u64, u64::MAX] {
            let bytes = varint(value);
            let mut reader = Reader::new(&bytes);
            assert_eq!(reader.read_varint("v").unwrap(), value);
            reader.finish("v").unwrap();
        }
    }

    #[test]
    fn varint_rejects_overlong_forms() {
        for bytes in [
            &[0x80, 0x00][..],
            &[0xff, 0x80, 0x00],
            &[0x81, 0x80, 0x80, 0x00],
        ] {
            let err = Reader::new(bytes).read_varint("len").unwrap_err();
            assert!(
                matches!(err, ProtoError::BadVarint { reason, .. } if reason.contains("overlong")),
                "{err}"
            );
        }
    }

    #[test]
    fn varint_rejects_values_past_64_bits() {
        let mut too_big = vec![0xff; 9];
        too_big.push(0x02);
        let err = Reader::new(&too_big).read_varint("len").unwrap_err();
        assert!(matches!(err, ProtoError::BadVarint { .. }), "{err}");
        let eleven = [0x80u8; 11];
        assert!(matches!(
            Reader::new(&eleven).read_varint("len"),
            Err(ProtoError::BadVarint { .. })
        ));
    }

    #[test]
    fn varint_truncated_in_the_middle() {
        let err = Reader::new(&[0x80, 0x80])
            .read_varint("key length")
            .unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::Truncated {
                    what: "key length",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("key length"));
    }

    #[test]
    fn fixed_range_integers_are_checked() {
        let err = Handshake::decode(&[0x80, 0x80, 0x04, 0x00]).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::LimitExceeded {
                    what: "handshake version",
                    value: 65_536,
                    limit: 65_535
                }
            ),
            "{err}"
        );
        let mut bytes = vec![POLICY_TRAILING_PAGES];
        put_varint(&mut bytes, u64::from(u32::MAX) + 1);
        assert!(matches!(
            HitPolicy::decode(&bytes),
            Err(ProtoError::LimitExceeded { .. })
        ));
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = sample_query().encode_to_vec().unwrap();
        bytes.push(0);
        let err = ExistsV2Query::decode(&bytes).unwrap_err();
        assert!(
            matches!(err, ProtoError::TrailingBytes { count: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("ExistsV2Query"));
    }

    #[test]
    fn empty_input_is_truncated_for_every_message() {
        assert!(matches!(
            ExistsV2Query::decode(&[]),
            Err(ProtoError::Truncated { .. })
        ));
        assert!(matches!(
            ExistsV2Answer::decode(&[]),
            Err(ProtoError::Truncated { .. })
        ));
        assert!(matches!(
            KeyBatch::decode(&[]),
            Err(ProtoError::Truncated { .. })
        ));
        assert!(matches!(
            PutBatchHeader::decode(&[]),
            Err(ProtoError::Truncated { .. })
        ));
        assert!(matches!(
            BatchResult::decode(&[]),
            Err(ProtoError::Truncated { .. })
        ));
        assert!(matches!(
            Handshake::decode(&[]),
            Err(ProtoError::Truncated { .. })
        ));
        assert!(matches!(
            ErrorReply::decode(&[]),
            Err(ProtoError::Truncated { .. })
        ));
    }

    #[test]
    fn counts_beyond_the_remaining_input_fail_before_allocating() {
        // 65536 keys claimed, 3 bytes present: rejected by the count check, not by running out
        // of input 65536 allocations later.
        let mut bytes = varint(MAX_KEYS_PER_BATCH as u64);
        bytes.extend_from_slice(&[1, b'a', 0]);
        let err = KeyBatch::decode(&bytes).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::Truncated {
                    what: "key count",
                    needed: 65_536,
                    available: 3
                }
            ),
            "{err}"
        );
        let mut bytes = varint(1_000);
        bytes.extend_from_slice(&[0; 10]);
        assert!(matches!(
            PutBatchHeader::decode(&bytes),
            Err(ProtoError::Truncated {
                what: "put key count",
                needed: 2_000,
                ..
            })
        ));
    }

    #[test]
    fn batch_count_limit() {
        let bytes = varint(MAX_KEYS_PER_BATCH as u64 + 1);
        let err = KeyBatch::decode(&bytes).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::LimitExceeded {
                    what: "key count",
                    ..
                }
            ),
            "{err}"
        );
        let too_many = KeyBatch {
            keys: vec![Vec::new(); MAX_KEYS_PER_BATCH + 1],
        };
        assert!(matches!(
            too_many.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "key count",
                ..
            })
        ));
        let at_limit = KeyBatch {
            keys: vec![Vec::new(); MAX_KEYS_PER_BATCH],
        };
        let bytes = at_limit.encode_to_vec().unwrap();
        assert_eq!(KeyBatch::decode(&bytes).unwrap(), at_limit);
    }

    #[test]
    fn key_length_limit() {
        let at_limit = KeyBatch {
            keys: vec![vec![7; MAX_KEY_LEN]],
        };
        let bytes = at_limit.encode_to_vec().unwrap();
        assert_eq!(KeyBatch::decode(&bytes).unwrap(), at_limit);

        let over = KeyBatch {
            keys: vec![vec![7; MAX_KEY_LEN + 1]],
        };
        assert!(matches!(
            over.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "key",
                value: 4097,
                limit: 4096
            })
        ));
        let mut bytes = varint(1);
        put_varint(&mut bytes, MAX_KEY_LEN as u64 + 1);
        bytes.resize(bytes.len() + MAX_KEY_LEN + 1, 0);
        assert!(matches!(
            KeyBatch::decode(&bytes),
            Err(ProtoError::LimitExceeded { what: "key", .. })
        ));
    }

    #[test]
    fn key_bytes_shorter_than_their_length() {
        let err = KeyBatch::decode(&[1, 5, b'a', b'b']).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::Truncated {
                    what: "key",
                    needed: 5,
                    available: 2
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn pool_count_limit() {
        let mut query = sample_query();
        query.pools = vec![query.pools[0].clone(); MAX_POOLS + 1];
        assert!(matches!(
            query.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "pool count",
                ..
            })
        ));
        query.pools.truncate(MAX_POOLS);
        let bytes = query.encode_to_vec().unwrap();
        assert_eq!(ExistsV2Query::decode(&bytes).unwrap(), query);
    }

    #[test]
    fn page_count_limit() {
        let mut query = sample_query();
        query.page_keys = vec![Vec::new(); MAX_PAGES_PER_QUERY + 1];
        assert!(matches!(
            query.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "page count",
                ..
            })
        ));
        let mut bytes = vec![0];
        put_varint(&mut bytes, MAX_PAGES_PER_QUERY as u64 + 1);
        assert!(matches!(
            ExistsV2Query::decode(&bytes),
            Err(ProtoError::LimitExceeded {
                what: "page count",
                ..
            })
        ));
    }

    #[test]
    fn suffix_count_limit() {
        let mut query = sample_query();
        query.kv = KvComponents::Suffixes(vec![b"x".to_vec(); MAX_SUFFIXES_PER_POOL + 1]);
        assert!(matches!(
            query.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "kv suffix count",
                ..
            })
        ));
    }

    #[test]
    fn composed_key_must_fit_the_key_limit() {
        let mut query = sample_query();
        query.key_prefix = vec![b'p'; MAX_KEY_LEN - 2 - 4]; // page "p0", longest suffix "_swa"
        let bytes = query.encode_to_vec().unwrap();
        assert_eq!(ExistsV2Query::decode(&bytes).unwrap(), query);

        query.key_prefix.push(b'p');
        let err = query.encode_to_vec().unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::LimitExceeded {
                    value: 4097,
                    limit: 4096,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("composed object key"));
        // The same bytes built by hand are rejected by the decoder too.
        let mut bytes = Vec::new();
        put_bytes(&mut bytes, "", &query.key_prefix, MAX_KEY_LEN).unwrap();
        put_key_list(&mut bytes, "", "", &query.page_keys, 10, 10).unwrap();
        query.kv.encode_fields(&mut bytes).unwrap();
        put_varint(&mut bytes, 1);
        query.pools[0].encode_fields(&mut bytes).unwrap();
        assert!(matches!(
            ExistsV2Query::decode(&bytes),
            Err(ProtoError::LimitExceeded { value: 4097, .. })
        ));
    }

    #[test]
    fn pool_name_limit_and_utf8() {
        let mut query = sample_query();
        query.pools[0].name = "n".repeat(MAX_NAME_LEN + 1);
        assert!(matches!(
            query.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "pool name",
                ..
            })
        ));
        // Pool with a non-UTF-8 name.
        let mut pool = vec![2, 0xff, 0xfe];
        pool.extend_from_slice(&[0, POLICY_ALL_PAGES]);
        let err = PoolQuery::decode(&pool).unwrap_err();
        assert!(
            matches!(err, ProtoError::InvalidUtf8 { what: "pool name" }),
            "{err}"
        );
    }

    #[test]
    fn invalid_tags_are_named() {
        let err = KvComponents::decode(&[2]).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::InvalidTag {
                    what: "kv components tag",
                    tag: 2
                }
            ),
            "{err}"
        );
        let err = HitPolicy::decode(&[3]).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::InvalidTag {
                    what: "hit policy tag",
                    tag: 3
                }
            ),
            "{err}"
        );
        // One key "a", size 1, depths tag 7.
        let err = PutBatchHeader::decode(&[1, 1, b'a', 1, 7]).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::InvalidTag {
                    what: "put depths tag",
                    tag: 7
                }
            ),
            "{err}"
        );
        let err = BatchResult::decode(&[1, 9, 0]).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::InvalidTag {
                    what: "result status",
                    tag: 9
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn put_header_lengths_must_agree() {
        let header = PutBatchHeader {
            keys: vec![b"a".to_vec(), b"b".to_vec()],
            sizes: vec![1],
            depths: None,
        };
        let mut out = vec![0xaa];
        let err = header.encode(&mut out).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::LengthMismatch {
                    what: "put sizes",
                    expected: 2,
                    found: 1
                }
            ),
            "{err}"
        );
        assert_eq!(out, [0xaa], "a failed encode leaves the buffer as it was");
        let header = PutBatchHeader {
            sizes: vec![1, 2],
            depths: Some(vec![0]),
            ..header
        };
        assert!(matches!(
            header.encode_to_vec(),
            Err(ProtoError::LengthMismatch {
                what: "put depths",
                ..
            })
        ));
    }

    #[test]
    fn put_header_depths_truncated() {
        // Two keys and sizes, depths present but only one of them.
        let err = PutBatchHeader::decode(&[2, 1, b'a', 1, b'b', 9, 9, 1, 0]).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::Truncated {
                    what: "put depths",
                    needed: 2,
                    available: 1
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn failed_encode_leaves_the_buffer_untouched() {
        let mut query = sample_query();
        query.pools.push(PoolQuery {
            name: "x".repeat(MAX_NAME_LEN + 1),
            suffixes: vec![],
            policy: HitPolicy::AllPages,
        });
        let mut out = b"keep".to_vec();
        assert!(query.encode(&mut out).is_err());
        assert_eq!(out, b"keep");
    }

    #[test]
    fn answer_invariants_are_enforced_both_ways() {
        let good = sample_answer();
        let bytes = good.encode_to_vec().unwrap();
        assert_eq!(ExistsV2Answer::decode(&bytes).unwrap(), good);
        assert!(ExistsV2Answer::default().encode_to_vec().is_ok());
        // A pool that holds none of the span is a verdict of 0, sent as such.
        let zero = ExistsV2Answer {
            pool_hit_pages: vec![("swa".into(), 0)],
            ..sample_answer()
        };
        let bytes = zero.encode_to_vec().unwrap();
        assert_eq!(ExistsV2Answer::decode(&bytes).unwrap(), zero);

        let cases = [
            ExistsV2Answer {
                kv_hit_pages: 5,
                ..sample_answer()
            },
            ExistsV2Answer {
                restorable_prefix_pages: vec![4, 2],
                ..sample_answer()
            },
            ExistsV2Answer {
                restorable_prefix_pages: vec![0, 4],
                ..sample_answer()
            },
            ExistsV2Answer {
                restorable_prefix_pages: vec![],
                ..sample_answer()
            },
        ];
        for bad in cases {
            let err = bad.encode_to_vec().unwrap_err();
            assert!(
                matches!(err, ProtoError::InvalidAnswer(_)),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn answer_decoder_rejects_impossible_answers() {
        // kv_hit 4, no pool hits, restorable [2, 2] (zero delta).
        let err = ExistsV2Answer::decode(&[4, 0, 2, 2, 0]).unwrap_err();
        assert!(matches!(err, ProtoError::InvalidAnswer(_)), "{err}");
        // kv_hit 4, restorable [3]: kv hit does not match.
        let err = ExistsV2Answer::decode(&[4, 0, 1, 3]).unwrap_err();
        assert!(matches!(err, ProtoError::InvalidAnswer(_)), "{err}");
        // kv_hit past the page limit.
        let mut bytes = varint(MAX_PAGES_PER_QUERY as u64 + 1);
        bytes.extend_from_slice(&[0, 0]);
        assert!(matches!(
            ExistsV2Answer::decode(&bytes),
            Err(ProtoError::LimitExceeded {
                what: "kv hit pages",
                ..
            })
        ));
        // Deltas summing past the page limit.
        let mut bytes = varint(MAX_PAGES_PER_QUERY as u64);
        bytes.extend_from_slice(&[0, 2]);
        put_varint(&mut bytes, MAX_PAGES_PER_QUERY as u64);
        put_varint(&mut bytes, 1);
        assert!(matches!(
            ExistsV2Answer::decode(&bytes),
            Err(ProtoError::LimitExceeded {
                what: "restorable prefix",
                ..
            })
        ));
        // Too many pool hits.
        let bytes = [0, (MAX_POOLS + 2) as u8];
        assert!(matches!(
            ExistsV2Answer::decode(&bytes),
            Err(ProtoError::LimitExceeded {
                what: "pool hit count",
                ..
            })
        ));
    }

    #[test]
    fn message_length_limit() {
        let reply = ErrorReply {
            code: 7,
            message: "m".repeat(MAX_MESSAGE_LEN + 1),
        };
        assert!(matches!(
            reply.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "error message",
                ..
            })
        ));
        let result = BatchResult {
            ok: vec![true],
            errors: vec!["e".repeat(MAX_MESSAGE_LEN + 1)],
            suppressed_errors: 0,
            ..Default::default()
        };
        assert!(matches!(
            result.encode_to_vec(),
            Err(ProtoError::LimitExceeded {
                what: "error message",
                ..
            })
        ));
        let err = ErrorReply::decode(&[1, 2, 0xc3, 0x28]).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::InvalidUtf8 {
                    what: "error message"
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn handshake_and_error_reply_known_bytes() {
        let hello = Handshake {
            version: 1,
            client_name: "tp0".into(),
        };
        assert_eq!(hello.encode_to_vec().unwrap(), [1, 3, b't', b'p', b'0']);
        let reply = ErrorReply {
            code: 300,
            message: "no".into(),
        };
        assert_eq!(reply.encode_to_vec().unwrap(), [0xac, 0x02, 2, b'n', b'o']);
    }

    #[test]
    fn query_known_bytes() {
        let bytes = sample_query().encode_to_vec().unwrap();
        #[rustfmt::skip]
        let expected = [
            2, b'm', b'/',                  // key prefix
            2, 2, b'p', b'0', 2, b'p', b'1', // page keys
            1, 2, 2, b'_', b'k', 2, b'_', b'v', // kv suffixes
            1,                              // one pool
            3, b's', b'w', b'a', 1, 4, b'_', b's', b'w', b'a', // name, suffixes
            1, 4,                           // TrailingPages { window: 4 }
        ];
        assert_eq!(bytes, expected);
    }

    #[test]
    fn answer_restorable_prefixes_are_delta_coded() {
        let answer = ExistsV2Answer {
            kv_hit_pages: 300,
            pool_hit_pages: vec![],
            restorable_prefix_pages: vec![1, 2, 300],
        };
        assert_eq!(
            answer.encode_to_vec().unwrap(),
            [0xac, 0x02, 0, 3, 1, 1, 0xaa, 0x02]
        );
    }

    /// Issue 28: every item failure crosses the wire typed, as its status byte; `0x00` / `0x01`
    /// are an untyped failure / a success.
    #[test]
    fn batch_result_carries_typed_failures() {
        use crate::messages::ItemFailure;
        let mut result = BatchResult::with_capacity(ItemFailure::ALL.len() + 1);
        result.push_ok();
        for failure in ItemFailure::ALL {
            result.push_failed(failure);
        }
        let bytes = result.encode_to_vec().unwrap();
        let decoded = BatchResult::decode(&bytes).unwrap();
        assert_eq!(decoded, result);
        assert_eq!(decoded.failure(0), None);
        for (i, failure) in ItemFailure::ALL.into_iter().enumerate() {
            assert_eq!(decoded.failure(i + 1), Some(failure));
            assert_eq!(ItemFailure::from_code(failure.code()), Some(failure));
        }
        assert_eq!(ItemFailure::from_code(1), None, "1 is success");
        // Untyped outcomes only: no typed failure, and decoding then encoding gives the same
        // bytes.
        let plain = BatchResult::flags(vec![true, false]);
        let bytes = plain.encode_to_vec().unwrap();
        assert_eq!(bytes, [2, 1, 0, 0, 0]);
        let back = BatchResult::decode(&bytes).unwrap();
        assert!(back.failures.is_empty());
        assert_eq!(back.failure(1), Some(ItemFailure::Failed));
        // A status no version defines is refused.
        assert!(matches!(
            BatchResult::decode(&[1, 9, 0, 0]),
            Err(ProtoError::InvalidTag { tag: 9, .. })
        ));
    }

    /// Issue 16: one `BatchResult`; its suppressed-error count survives the wire (as a number
    /// since protocol 2, issue 28), and no message text is read as a count.
    #[test]
    fn batch_result_carries_suppressed_errors() {
        use crate::messages::MAX_ERRORS_PER_BATCH;
        let result = BatchResult {
            ok: vec![false, true],
            errors: vec!["disk full".into()],
            suppressed_errors: 7,
            ..Default::default()
        };
        let bytes = result.encode_to_vec().unwrap();
        assert_eq!(BatchResult::decode(&bytes).unwrap(), result);
        // The count is a number on the wire: a message that reads like the old marker stays
        // a message, and the count travels beside it.
        let lookalike = BatchResult {
            ok: vec![false],
            errors: vec!["... and 7 more distinct errors".into()],
            suppressed_errors: 3,
            ..Default::default()
        };
        let decoded = BatchResult::decode(&lookalike.encode_to_vec().unwrap()).unwrap();
        assert_eq!(decoded, lookalike);
        assert_eq!((decoded.errors.len(), decoded.suppressed_errors), (1, 3));
        // A reply without the count (protocol 1) is truncated, not read as something else.
        let mut short = result.encode_to_vec().unwrap();
        short.pop();
        assert!(BatchResult::decode(&short).is_err());
        // note_error keeps MAX_ERRORS_PER_BATCH distinct messages and counts every later
        // message it did not keep (a repeat of a dropped one counts again: it is not stored).
        let mut r = BatchResult::with_capacity(0);
        for i in 0..MAX_ERRORS_PER_BATCH + 3 {
            r.note_error(format!("e{i}"));
            r.note_error(format!("e{i}"));
        }
        assert_eq!(
            (r.errors.len(), r.suppressed_errors),
            (MAX_ERRORS_PER_BATCH, 6)
        );
        let long = BatchResult::all_failed(1, "é".repeat(MAX_MESSAGE_LEN)).fit_messages();
        assert!(long.errors[0].len() <= MAX_MESSAGE_LEN);
        long.encode_to_vec().unwrap();
    }
}
