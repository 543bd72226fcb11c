#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)]
//! Ranged gets and gathered puts (issue 18, SGLang's direct linker) over an embedded store:
//! exact bytes at any offset across the object's extents, destinations checked against the
//! registered regions, out-of-range and wrong-length requests refused without writing.

use kvtier_client::config::ConfigSources;
use kvtier_client::ranged::{put_gathered, RangeCopy, RangedReader};
use kvtier_client::{Client, ClientError, KvtierConfig, MemRef};
use serde_json::json;

fn client() -> Client {
    let serde_json::Value::Object(extra) =
        json!({"dram_capacity_bytes": "16MiB", "dram_prefault": false})
    else {
        panic!("object")
    };
    Client::open(
        KvtierConfig::load(ConfigSources {
            env: Vec::new(),
            extra,
        })
        .unwrap(),
    )
    .unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A registered destination of `len` bytes (zeroed).
fn destination(c: &Client, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: every test keeps `buf` alive and unresized while the client is used.
    unsafe { c.register_region(buf.as_mut_ptr() as usize, len, "dst") }.unwrap();
    buf
}

#[test]
fn ranges_across_extents_are_exact() {
    let c = client();
    // Several 4 KiB DRAM blocks, so ranges cross extent boundaries.
    let object = pattern(3 * 4096 + 123, 7);
    c.put_slice(b"obj", &object, None).unwrap();
    let mut dst = destination(&c, 3 * 4096 + 123);
    let base = dst.as_mut_ptr() as usize;
    let ranges = [(0u64, 10usize), (4090, 20), (8191, 4097), (12288, 123)];
    let copies: Vec<RangeCopy> = ranges
        .iter()
        .map(|&(offset, len)| RangeCopy {
            offset,
            dst: base + offset as usize,
            len,
        })
        .collect();
    let mut reader = RangedReader::new(&c);
    reader
        .copy_ranges(b"obj", object.len() as u64, &copies)
        .unwrap();
    // A second call on the same object reuses its pin.
    reader
        .copy_ranges(
            b"obj",
            object.len() as u64,
            &[RangeCopy {
                offset: 20,
                dst: base + 20,
                len: 4000,
            }],
        )
        .unwrap();
    assert_eq!(reader.held_objects(), 1);
    for &(offset, len) in ranges.iter().chain([(20u64, 4000usize)].iter()) {
        let at = offset as usize;
        assert_eq!(
            dst[at..at + len],
            object[at..at + len],
            "range {offset}+{len}"
        );
    }
    assert!(dst[10..20].iter().all(|&b| b == 0), "untouched bytes stay");
}

#[test]
fn bad_requests_are_refused_without_writing() {
    let c = client();
    let object = pattern(5000, 3);
    c.put_slice(b"obj", &object, None).unwrap();
    let mut dst = destination(&c, 5000);
    let base = dst.as_mut_ptr() as usize;
    let mut reader = RangedReader::new(&c);
    let past_end = RangeCopy {
        offset: 4990,
        dst: base,
        len: 20,
    };
    assert!(matches!(
        reader.copy_ranges(b"obj", 5000, &[past_end]),
        Err(ClientError::BatchShape(_))
    ));
    let ok = RangeCopy {
        offset: 0,
        dst: base,
        len: 10,
    };
    assert!(matches!(
        reader.copy_ranges(b"obj", 4096, &[ok]),
        Err(ClientError::BatchShape(_))
    ));
    let outside = RangeCopy {
        offset: 0,
        dst: 4096,
        len: 10,
    };
    assert!(matches!(
        reader.copy_ranges(b"obj", 5000, &[outside]),
        Err(ClientError::OutsideRegisteredMemory { .. })
    ));
    assert!(matches!(
        reader.copy_ranges(b"absent", 5000, &[ok]),
        Err(ClientError::Engine(_))
    ));
    assert!(dst.iter().all(|&b| b == 0));
}

#[test]
fn gathered_put_stores_pieces_in_order_or_nothing() {
    let c = client();
    let mut src = pattern(3000, 9);
    let base = src.as_mut_ptr() as usize;
    // SAFETY: `src` outlives the client's use below and is not resized.
    unsafe { c.register_region(base, src.len(), "src") }.unwrap();
    let pieces = [
        MemRef {
            ptr: base + 2000,
            len: 1000,
        },
        MemRef {
            ptr: base,
            len: 500,
        },
    ];
    put_gathered(&c, b"gathered", &pieces, None).unwrap();
    let mut back = vec![0u8; 1500];
    c.get_into_slice(b"gathered", &mut back).unwrap();
    assert_eq!(back[..1000], src[2000..3000]);
    assert_eq!(back[1000..], src[..500]);

    let bad = [MemRef { ptr: base, len: 10 }, MemRef { ptr: 4096, len: 10 }];
    assert!(put_gathered(&c, b"half", &bad, None).is_err());
    assert_eq!(
        c.object_len(b"half"),
        None,
        "nothing half-assembled is stored"
    );
}
