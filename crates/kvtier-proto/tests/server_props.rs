//! Property and fuzz tests of the local-server bodies (`kvtier_proto::server`): round trips,
//! canonical re-encoding, bounded allocation, and no panic on random bytes, truncations or
//! mutations of valid encodings, for every decoder.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Instant;

use common::{allocation_is_justified, bytes, text, HeapFootprint, XorShift};
use kvtier_proto::server::{
    Count, InspectQuery, ObjectLens, OpenSession, PageIo, PageKeys, RegionGrant, RegisterRegion,
    SessionTicket, ShmRef, TextReply,
};
use kvtier_proto::{Decode, Encode};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

fn vec_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

impl HeapFootprint for SessionTicket {
    fn heap_bytes(&self) -> usize {
        0
    }
}
impl HeapFootprint for OpenSession {
    fn heap_bytes(&self) -> usize {
        self.tenant.capacity() + self.client_name.capacity()
    }
}
impl HeapFootprint for RegisterRegion {
    fn heap_bytes(&self) -> usize {
        self.label.capacity()
    }
}
impl HeapFootprint for RegionGrant {
    fn heap_bytes(&self) -> usize {
        0
    }
}
impl HeapFootprint for ShmRef {
    fn heap_bytes(&self) -> usize {
        0
    }
}
impl HeapFootprint for Count {
    fn heap_bytes(&self) -> usize {
        0
    }
}
impl HeapFootprint for PageKeys {
    fn heap_bytes(&self) -> usize {
        self.prefix.heap_bytes() + self.page_keys.heap_bytes() + self.suffixes.heap_bytes()
    }
}
impl HeapFootprint for PageIo {
    fn heap_bytes(&self) -> usize {
        self.keys.heap_bytes()
            + vec_bytes(&self.buffers)
            + self.depths.as_ref().map(vec_bytes).unwrap_or(0)
    }
}
impl HeapFootprint for ObjectLens {
    fn heap_bytes(&self) -> usize {
        vec_bytes(&self.lens)
    }
}
impl HeapFootprint for InspectQuery {
    fn heap_bytes(&self) -> usize {
        self.keys.heap_bytes() + self.prefix.as_ref().map(|p| p.capacity()).unwrap_or(0)
    }
}
impl HeapFootprint for TextReply {
    fn heap_bytes(&self) -> usize {
        self.text.capacity()
    }
}

fn ticket() -> impl Strategy<Value = SessionTicket> {
    (any::<u64>(), any::<u64>()).prop_map(|(session_id, token)| SessionTicket { session_id, token })
}

fn open_session() -> impl Strategy<Value = OpenSession> {
    (text(), text(), option::of(ticket())).prop_map(|(tenant, client_name, join)| OpenSession {
        tenant,
        client_name,
        join,
    })
}

fn register_region() -> impl Strategy<Value = RegisterRegion> {
    (text(), any::<u64>(), any::<u64>()).prop_map(|(label, fd_offset, len)| RegisterRegion {
        label,
        fd_offset,
        len,
    })
}

fn shm_ref() -> impl Strategy<Value = ShmRef> {
    (0..4u64, prop_oneof![0..5000u64, any::<u64>()], any::<u64>()).prop_map(
        |(region, offset, len)| ShmRef {
            region,
            offset,
            len,
        },
    )
}

fn page_keys() -> impl Strategy<Value = PageKeys> {
    (bytes(12), vec(bytes(16), 0..12), vec(bytes(6), 0..4)).prop_map(
        |(prefix, page_keys, suffixes)| PageKeys {
            prefix,
            page_keys,
            suffixes,
        },
    )
}

fn page_io() -> impl Strategy<Value = PageIo> {
    (page_keys(), any::<bool>(), any::<u64>()).prop_flat_map(|(keys, with_depths, _)| {
        let objects = keys.objects();
        let pages = keys.page_keys.len();
        (
            Just(keys),
            vec(shm_ref(), objects..=objects),
            vec(any::<u32>(), pages..=pages),
            Just(with_depths),
        )
            .prop_map(|(keys, buffers, depths, with)| PageIo {
                keys,
                buffers,
                depths: with.then_some(depths),
            })
    })
}

fn object_lens() -> impl Strategy<Value = ObjectLens> {
    vec(option::of(any::<u64>()), 0..40).prop_map(|lens| ObjectLens { lens })
}

fn check_decode<T>(bytes: &[u8]) -> Result<(), TestCaseError>
where
    T: Decode + Encode + HeapFootprint + std::fmt::Debug,
{
    if let Ok(value) = T::decode(bytes) {
        let again = value
            .encode_to_vec()
            .map_err(|e| TestCaseError::fail(format!("decoded value must re-encode: {e}")))?;
        prop_assert_eq!(again.as_slice(), bytes, "encoding is canonical");
        prop_assert!(allocation_is_justified(value.heap_bytes(), bytes.len()));
    }
    Ok(())
}

macro_rules! server_codec_properties {
    ($module:ident, $ty:ty, $strategy:expr) => {
        mod $module {
            use super::*;

            proptest! {
                #[test]
                fn round_trips(value in $strategy) {
                    let bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(<$ty>::decode(&bytes).ok(), Some(value));
                }

                #[test]
                fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..256)) {
                    check_decode::<$ty>(&bytes)?;
                }

                #[test]
                fn every_strict_prefix_is_rejected(value in $strategy) {
                    let bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    for cut in 0..bytes.len() {
                        prop_assert!(<$ty>::decode(&bytes[..cut]).is_err(), "prefix of {} bytes decoded", cut);
                    }
                }

                #[test]
                fn trailing_bytes_are_rejected(value in $strategy, extra in vec(any::<u8>(), 1..8)) {
                    let mut bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    bytes.extend_from_slice(&extra);
                    prop_assert!(<$ty>::decode(&bytes).is_err());
                }

                #[test]
                fn mutations_never_panic(value in $strategy, at in any::<usize>(), byte in any::<u8>(), insert in any::<bool>()) {
                    let mut bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    if insert || bytes.is_empty() {
                        let at = at % (bytes.len() + 1);
                        bytes.insert(at, byte);
                    } else {
                        let at = at % bytes.len();
                        bytes[at] = byte;
                    }
                    check_decode::<$ty>(&bytes)?;
                }
            }
        }
    };
}

server_codec_properties!(session_ticket_body, SessionTicket, ticket());
server_codec_properties!(open_session_body, OpenSession, open_session());
server_codec_properties!(register_region_body, RegisterRegion, register_region());
server_codec_properties!(
    region_grant_body,
    RegionGrant,
    any::<u64>().prop_map(|region| RegionGrant { region })
);
server_codec_properties!(shm_ref_body, ShmRef, shm_ref());
server_codec_properties!(page_keys_body, PageKeys, page_keys());
server_codec_properties!(page_io_body, PageIo, page_io());
server_codec_properties!(
    count_body,
    Count,
    any::<u64>().prop_map(|value| Count { value })
);
server_codec_properties!(object_lens_body, ObjectLens, object_lens());
server_codec_properties!(
    inspect_query_body,
    InspectQuery,
    (vec(bytes(16), 0..8), option::of(bytes(12)), any::<u64>()).prop_map(
        |(keys, prefix, limit)| InspectQuery {
            keys,
            prefix,
            limit
        }
    )
);
server_codec_properties!(
    text_reply_body,
    TextReply,
    text().prop_map(|text| TextReply { text })
);

/// 100k random and mutated buffers through every server decoder; any panic fails.
#[test]
fn hundred_thousand_random_buffers_through_server_decoders() {
    let io = PageIo {
        keys: PageKeys {
            prefix: b"tenant/".to_vec(),
            page_keys: vec![b"0123456789abcdef".to_vec(), b"fedcba9876543210".to_vec()],
            suffixes: vec![b"@fp.k".to_vec(), b"@fp.v".to_vec()],
        },
        buffers: (0..4)
            .map(|i| ShmRef {
                region: i % 2,
                offset: i << 20,
                len: 256 << 10,
            })
            .collect(),
        depths: Some(vec![0, 1]),
    };
    let corpus: Vec<Vec<u8>> = [
        io.encode_to_vec(),
        io.keys.encode_to_vec(),
        OpenSession {
            tenant: "a".into(),
            client_name: "tp0".into(),
            join: Some(SessionTicket {
                session_id: 3,
                token: u64::MAX,
            }),
        }
        .encode_to_vec(),
        RegisterRegion {
            label: "kv".into(),
            fd_offset: 4096,
            len: 1 << 30,
        }
        .encode_to_vec(),
        ObjectLens {
            lens: vec![None, Some(7), Some(1 << 40)],
        }
        .encode_to_vec(),
        TextReply {
            text: "{\"objects\": 3}".into(),
        }
        .encode_to_vec(),
        InspectQuery {
            keys: vec![b"page0@fp.c4".to_vec()],
            prefix: Some(b"page".to_vec()),
            limit: 100,
        }
        .encode_to_vec(),
    ]
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap_or_default();
    assert_eq!(corpus.len(), 7);
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let mut buffer = Vec::new();
    let mut accepted = 0usize;
    let started = Instant::now();
    for round in 0..100_000 {
        buffer.clear();
        if round % 2 == 0 {
            let len = rng.below(96);
            buffer.extend((0..len).map(|_| rng.next_u64() as u8));
        } else {
            buffer.extend_from_slice(&corpus[rng.below(corpus.len())]);
            for _ in 0..1 + rng.below(3) {
                let at = rng.below(buffer.len());
                match rng.below(3) {
                    0 if !buffer.is_empty() => buffer[at] = rng.next_u64() as u8,
                    1 if !buffer.is_empty() => {
                        buffer.remove(at);
                    }
                    _ => buffer.insert(at, rng.next_u64() as u8),
                }
            }
        }
        macro_rules! try_decode {
            ($($ty:ty),*) => {$(
                if let Ok(v) = <$ty>::decode(&buffer) {
                    assert!(allocation_is_justified(v.heap_bytes(), buffer.len()));
                    accepted += 1;
                }
            )*};
        }
        try_decode!(
            SessionTicket,
            OpenSession,
            RegisterRegion,
            RegionGrant,
            ShmRef,
            PageKeys,
            PageIo,
            Count,
            ObjectLens,
            TextReply,
            InspectQuery
        );
    }
    assert!(accepted > 1_000, "only {accepted} buffers decoded");
    assert!(started.elapsed().as_secs() < 10);
}
