//! Fuzz-style smoke test: 100k random and mutated buffers through every decoder and the frame
//! reader. Must finish in well under a second; any panic fails the test.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Cursor;
use std::time::Instant;

use common::{allocation_is_justified, HeapFootprint, XorShift};
use kvtier_proto::frame::HEADER_LEN;
use kvtier_proto::{
    read_frame_limited, BatchResult, Decode, Encode, ErrorReply, ExistsV2Answer, ExistsV2Query,
    FrameHeader, Handshake, HitPolicy, KeyBatch, KvComponents, Opcode, PoolQuery, PutBatchHeader,
};

const BUFFERS: usize = 100_000;

/// Valid encodings to mutate: mutants of real messages get much further into a decoder than
/// uniform noise does.
fn corpus() -> Vec<Vec<u8>> {
    let query = ExistsV2Query {
        key_prefix: b"model/r0/".to_vec(),
        page_keys: (0..6).map(|i| format!("{i:016x}").into_bytes()).collect(),
        kv: KvComponents::Suffixes(vec![b"_k".to_vec(), b"_v".to_vec()]),
        pools: vec![
            PoolQuery {
                name: "swa".into(),
                suffixes: vec![b"_swa".to_vec()],
                policy: HitPolicy::TrailingPages { window: 4 },
            },
            PoolQuery {
                name: "c4".into(),
                suffixes: vec![b"_c4".to_vec(), b"_c4s".to_vec()],
                policy: HitPolicy::BlockGroups { group_pages: 300 },
            },
        ],
    };
    let answer = ExistsV2Answer {
        kv_hit_pages: 200,
        pool_hit_pages: vec![("kv".into(), 6), ("swa".into(), 5)],
        restorable_prefix_pages: vec![1, 2, 3, 200],
    };
    let put = PutBatchHeader {
        keys: vec![b"a".to_vec(), b"bb".to_vec()],
        sizes: vec![2 << 20, 1 << 40],
        depths: Some(vec![0, 70_000]),
    };
    let mut corpus = vec![
        query.encode_to_vec(),
        answer.encode_to_vec(),
        KeyBatch {
            keys: vec![b"k1".to_vec(), vec![], vec![0xff; 130]],
        }
        .encode_to_vec(),
        put.encode_to_vec(),
        BatchResult {
            ok: vec![true, false, true],
            errors: vec!["disk full".into()],
            suppressed_errors: 2,
            ..Default::default()
        }
        .encode_to_vec(),
        Handshake {
            version: 1,
            client_name: "sglang-tp0".into(),
        }
        .encode_to_vec(),
        ErrorReply {
            code: 503,
            message: "überlastet".into(),
        }
        .encode_to_vec(),
    ]
    .into_iter()
    .collect::<Result<Vec<_>, _>>()
    .unwrap_or_default();
    assert_eq!(corpus.len(), 7, "the corpus encodes");
    // Framed copies, for the frame reader.
    let framed: Vec<Vec<u8>> = corpus
        .iter()
        .map(|body| {
            let mut frame = FrameHeader::new(Opcode::ExistsV2, 7, 0, body.len() as u32)
                .encode()
                .to_vec();
            frame.extend_from_slice(body);
            frame
        })
        .collect();
    corpus.extend(framed);
    corpus
}

fn decode_checked<T: Decode + HeapFootprint>(bytes: &[u8]) -> bool {
    match T::decode(bytes) {
        Ok(value) => {
            assert!(
                allocation_is_justified(value.heap_bytes(), bytes.len()),
                "{} heap bytes for {} input bytes",
                value.heap_bytes(),
                bytes.len()
            );
            true
        }
        Err(_) => false,
    }
}

#[test]
fn hundred_thousand_random_buffers_decode_without_panicking() {
    let corpus = corpus();
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut buffer = Vec::with_capacity(512);
    let mut body = Vec::new();
    let mut accepted = 0usize;
    let started = Instant::now();
    for round in 0..BUFFERS {
        buffer.clear();
        if round % 2 == 0 {
            let len = rng.below(96);
            buffer.extend((0..len).map(|_| rng.next_u64() as u8));
        } else {
            buffer.extend_from_slice(&corpus[rng.below(corpus.len())]);
            for _ in 0..1 + rng.below(3) {
                let at = rng.below(buffer.len());
                match rng.below(4) {
                    0 if !buffer.is_empty() => buffer[at] = rng.next_u64() as u8,
                    1 if !buffer.is_empty() => buffer[at] ^= 1 << rng.below(8),
                    2 if !buffer.is_empty() => {
                        buffer.remove(at);
                    }
                    _ => buffer.insert(at, rng.next_u64() as u8),
                }
            }
        }
        accepted += usize::from(decode_checked::<ExistsV2Query>(&buffer));
        accepted += usize::from(decode_checked::<ExistsV2Answer>(&buffer));
        accepted += usize::from(decode_checked::<KeyBatch>(&buffer));
        accepted += usize::from(decode_checked::<PutBatchHeader>(&buffer));
        accepted += usize::from(decode_checked::<BatchResult>(&buffer));
        accepted += usize::from(decode_checked::<Handshake>(&buffer));
        accepted += usize::from(decode_checked::<ErrorReply>(&buffer));
        let _ = FrameHeader::decode(&buffer);
        if let Ok(header) = read_frame_limited(&mut Cursor::new(&buffer), &mut body, 1024) {
            assert!(HEADER_LEN + header.body_len as usize <= buffer.len());
        }
        assert!(body.capacity() <= 1024);
    }
    let elapsed = started.elapsed();
    // Some mutants must still decode, or the mutation half tests nothing beyond the first byte.
    assert!(accepted > 1_000, "only {accepted} buffers decoded");
    assert!(
        elapsed.as_secs() < 10,
        "{BUFFERS} buffers took {elapsed:?}; a decoder has become slow"
    );
}
