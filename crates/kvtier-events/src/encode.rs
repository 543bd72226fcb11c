//! What a KV-event stream says about a page group, and its msgpack encoding.
//!
//! Owns: the mapping of an engine page group to the block hash the engine's own events carry
//! for the same tokens ([`map_group`], through the key schemes of `kvtier_proto::keys`), and
//! the encoding of a batch as vLLM 0.34's `KVEventBatch` ([`encode_batch`], [`encode_owned`]).
//!
//! Hashes:
//! - a vLLM block (`vllm/<model>_<digest>/<block hash hex>_g<group>`): vLLM publishes
//!   `int.from_bytes(block_hash, "big") & (2**64 - 1)` (`maybe_convert_block_hash` with the
//!   default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), with `group_idx` the KV cache group;
//! - an SGLang page (`[tag/]page_hash@`): SGLang publishes the first 16 hex digits of the page
//!   hash as a signed int64 (`hash_str_to_int64`); a page hash shorter than that or not hex is
//!   unmappable;
//! - anything else (LMCache chunks, opaque keys) is unmappable: counted, never published.
//!
//! Wire shape (the one both engines' msgspec decoders read): the batch is the array
//! `[ts, events]`; each event a map whose first key is `type` (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`), with the fields vLLM's and SGLang's classes require (`parent_block_hash`,
//! `lora_id`, `lora_name` nil, `token_ids` empty, `block_size` 0: kvtier does not know the
//! tokens) plus `medium`, `group_idx` (vLLM blocks) and `ownership`. Unknown fields are ignored
//! by both decoders, so one stream serves both.
//!
//! Media ([`Medium`]): kvtier's DRAM tier is vLLM's `CPU`, its SSD tier vLLM's `STORAGE` (the
//! names vLLM's own secondary tiers publish, `MEDIUM_CPU` / `MEDIUM_STORAGE`); a holder whose
//! tier is not known (the cluster stream: the master's directory knows the node, not its
//! tier) publishes `medium` nil, which vLLM's and SGLang's classes read as "unknown". Each
//! (ownership, medium) is one residency, as in vLLM's `OffloadingEventsTracker`: a block moved
//! between media is a `BlockStored` with the new medium followed by a `BlockRemoved` with the
//! old one, so a router that counts residencies never sees the block absent in between.

use kvtier_proto::keys::{self, KeyScheme};
use kvtier_proto::namespace::{self, Owner};

/// A block hash as the engine publishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// vLLM's (an unsigned 64-bit integer).
    Unsigned(u64),
    /// SGLang's (a signed 64-bit integer).
    Signed(i64),
}

/// A page group as the stream names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mapped {
    pub hash: BlockHash,
    /// vLLM's KV cache group of the block (`None` for SGLang pages).
    pub group_idx: Option<u32>,
}

/// The tier a holder keeps a block on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// kvtier's DRAM tier (`CPU`).
    Dram,
    /// kvtier's SSD tier (`STORAGE`).
    Ssd,
}

impl Medium {
    /// The name vLLM's events use (`MEDIUM_CPU`, `MEDIUM_STORAGE`).
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Dram => "CPU",
            Medium::Ssd => "STORAGE",
        }
    }
}

/// Who holds the events' blocks and where: `ownership` (`kvtier:<node>`) and the medium
/// (`None`: not known, published as nil).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    pub ownership: std::sync::Arc<str>,
    pub medium: Option<Medium>,
}

impl Holder {
    pub fn new(ownership: std::sync::Arc<str>, medium: Option<Medium>) -> Holder {
        Holder { ownership, medium }
    }
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Stored(Vec<Mapped>),
    Removed(Vec<Mapped>),
    Cleared,
}

/// The engine key inside a stored key or group (its store namespace skipped): what a
/// snapshot's prefix is matched against.
pub fn engine_key(stored: &[u8]) -> &[u8] {
    inner(stored)
}

fn inner(stored: &[u8]) -> &[u8] {
    match namespace::owner(stored) {
        Owner::Tenant { key, .. } | Owner::Cluster { key, .. } => key,
        Owner::Unknown => stored,
    }
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The stream's name of an engine page group, or `None` when no engine event names it.
pub fn map_group(group: &[u8]) -> Option<Mapped> {
    if let Some(page) = keys::sglang_page_hash(group) {
        if page.len() < 16 {
            return None;
        }
        let mut v: u64 = 0;
        for &b in &page[..16] {
            v = (v << 4) | u64::from(hex_val(b)?);
        }
        return Some(Mapped {
            hash: BlockHash::Signed(v as i64),
            group_idx: None,
        });
    }
    let key = inner(group);
    if KeyScheme::of(key) != KeyScheme::Vllm {
        return None;
    }
    let hex = KeyScheme::Vllm.page_hash(key)?;
    if hex.is_empty() || hex.len() % 2 != 0 {
        return None;
    }
    let last = key.rsplit(|&b| b == b'_').next()?;
    let idx = last.strip_prefix(b"g")?;
    if idx.is_empty() || !idx.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let group_idx: u32 = std::str::from_utf8(idx).ok()?.parse().ok()?;
    // The low 64 bits of the big-endian integer: its last (up to) 8 bytes.
    let mut v: u64 = 0;
    let bytes = hex.len() / 2;
    for i in bytes.saturating_sub(8)..bytes {
        let hi = hex_val(hex[2 * i])?;
        let lo = hex_val(hex[2 * i + 1])?;
        v = (v << 8) | u64::from((hi << 4) | lo);
    }
    // Every digit must be hex, also the ones above the low 64 bits.
    if !hex.iter().all(|&b| hex_val(b).is_some()) {
        return None;
    }
    Some(Mapped {
        hash: BlockHash::Unsigned(v),
        group_idx: Some(group_idx),
    })
}

// Writing msgpack into a Vec cannot fail; the results are dropped on purpose.
fn w_str(out: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(out, s);
}

fn w_hashes(out: &mut Vec<u8>, blocks: &[Mapped]) {
    let _ = rmp::encode::write_array_len(out, blocks.len() as u32);
    for b in blocks {
        match b.hash {
            BlockHash::Unsigned(v) => {
                let _ = rmp::encode::write_uint(out, v);
            }
            BlockHash::Signed(v) => {
                let _ = rmp::encode::write_sint(out, v);
            }
        }
    }
}

/// Split `blocks` into runs of one `group_idx` (an event carries one).
fn runs(blocks: &[Mapped]) -> Vec<&[Mapped]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=blocks.len() {
        if i == blocks.len() || blocks[i].group_idx != blocks[start].group_idx {
            if i > start {
                out.push(&blocks[start..i]);
            }
            start = i;
        }
    }
    out
}

fn w_event(out: &mut Vec<u8>, stored: bool, blocks: &[Mapped], holder: &Holder) {
    let group = blocks.first().and_then(|b| b.group_idx);
    let n = if stored { 9 } else { 4 } + u32::from(group.is_some());
    let _ = rmp::encode::write_map_len(out, n);
    w_str(out, "type");
    w_str(
        out,
        if stored {
            "BlockStored"
        } else {
            "BlockRemoved"
        },
    );
    w_str(out, "block_hashes");
    w_hashes(out, blocks);
    if stored {
        w_str(out, "parent_block_hash");
        let _ = rmp::encode::write_nil(out);
        w_str(out, "token_ids");
        let _ = rmp::encode::write_array_len(out, 0);
        w_str(out, "block_size");
        let _ = rmp::encode::write_uint(out, 0);
        w_str(out, "lora_id");
        let _ = rmp::encode::write_nil(out);
        w_str(out, "lora_name");
        let _ = rmp::encode::write_nil(out);
    }
    w_str(out, "medium");
    match holder.medium {
        Some(m) => w_str(out, m.as_str()),
        None => {
            let _ = rmp::encode::write_nil(out);
        }
    }
    if let Some(g) = group {
        w_str(out, "group_idx");
        let _ = rmp::encode::write_uint(out, u64::from(g));
    }
    w_str(out, "ownership");
    w_str(out, &holder.ownership);
}

/// How many wire events `events` become (runs of one `group_idx` are split).
fn wire_len(events: &[Event]) -> usize {
    events
        .iter()
        .map(|e| match e {
            Event::Stored(b) | Event::Removed(b) => runs(b).len(),
            Event::Cleared => 1,
        })
        .sum()
}

/// A `KVEventBatch` (`[ts, events]`) as msgpack, every event held by `holder`.
pub fn encode_batch(ts: f64, events: &[Event], holder: &Holder) -> Vec<u8> {
    let owned: Vec<(&Holder, &Event)> = events.iter().map(|e| (holder, e)).collect();
    encode_owned(ts, &owned)
}

/// A `KVEventBatch` whose events each name their own holder (ownership and medium).
pub fn encode_owned(ts: f64, events: &[(&Holder, &Event)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 24 * events.len());
    let _ = rmp::encode::write_array_len(&mut out, 2);
    let _ = rmp::encode::write_f64(&mut out, ts);
    let wire: usize = events
        .iter()
        .map(|(_, e)| wire_len(std::slice::from_ref(*e)))
        .sum();
    let _ = rmp::encode::write_array_len(&mut out, wire as u32);
    for (holder, e) in events {
        match e {
            Event::Stored(b) | Event::Removed(b) => {
                for run in runs(b) {
                    let stored = matches!(e, Event::Stored(_));
                    w_event(&mut out, stored, run, holder);
                }
            }
            Event::Cleared => {
                let _ = rmp::encode::write_map_len(&mut out, 1);
                w_str(&mut out, "type");
                w_str(&mut out, "AllBlocksCleared");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_groups_map_to_their_engines_hashes() {
        let key = keys::vllm_key("vllm/m_0123456789abcdef", &[0xAB; 32], 3);
        let m = map_group(key.as_bytes()).unwrap();
        assert_eq!(m.hash, BlockHash::Unsigned(0xABAB_ABAB_ABAB_ABAB));
        assert_eq!(m.group_idx, Some(3));
        // With a tenant namespace in front.
        let stored = [b"team\x1f".as_slice(), key.as_bytes()].concat();
        assert_eq!(map_group(&stored), Some(m));
        let g = b"ffffffffffffffff0000@";
        assert_eq!(
            map_group(g).unwrap().hash,
            BlockHash::Signed(-1),
            "first 16 hex digits as a signed int64"
        );
        assert_eq!(
            map_group(b"tag/0000000000000001aa@").unwrap().hash,
            BlockHash::Signed(1)
        );
        for bad in [
            &b"short@"[..],
            b"zzzzzzzzzzzzzzzzzz@",
            b"lmcache/m@0@0@0a",
            b"plain",
            b"vllm/m_0123/abc_g1",
            b"vllm/m_0123/abcd_gx",
        ] {
            assert_eq!(map_group(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn batches_split_runs_by_group() {
        let a = Mapped {
            hash: BlockHash::Unsigned(1),
            group_idx: Some(0),
        };
        let b = Mapped {
            hash: BlockHash::Unsigned(2),
            group_idx: Some(1),
        };
        let events = [Event::Stored(vec![a, a, b]), Event::Cleared];
        assert_eq!(wire_len(&events), 3);
        let h = Holder::new("kvtier".into(), Some(Medium::Ssd));
        let bytes = encode_batch(1.5, &events, &h);
        assert_eq!(bytes[0], 0x92); // fixarray of 2
        let has = |s: &[u8]| bytes.windows(s.len()).any(|w| w == s);
        assert!(has(b"STORAGE") && !has(b"CPU"));
        // An unknown medium is nil (0xc0) right after the `medium` key.
        let bytes = encode_batch(1.5, &events, &Holder::new("kvtier".into(), None));
        let at = bytes.windows(7).position(|w| w == b"\xa6medium").unwrap();
        assert_eq!(bytes[at + 7], 0xc0);
    }
}
