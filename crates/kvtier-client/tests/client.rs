//! The client over an embedded engine: page batches, region checks, rollback, and batches
//! split across copy threads.
#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)] // test fixtures map shared memory and register raw regions

use kvtier_client::config::ConfigSources;
use kvtier_client::{Client, KvtierConfig, MemRef, PageBatch};
use serde_json::json;

fn client(extra: serde_json::Value) -> Client {
    let serde_json::Value::Object(extra) = extra else {
        panic!("object")
    };
    let config = KvtierConfig::load(ConfigSources {
        env: Vec::new(),
        extra,
    })
    .expect("config");
    Client::open(config).expect("open")
}

fn pattern(page: usize, comp: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + page * 7 + comp * 13) % 251) as u8)
        .collect()
}

/// `pages x 2` objects of `len` bytes in one registered buffer, each filled with its pattern.
fn source(c: &Client, pages: usize, len: usize) -> (Vec<u8>, Vec<MemRef>) {
    let mut buf = vec![0u8; pages * 2 * len];
    for p in 0..pages {
        for j in 0..2 {
            let at = (p * 2 + j) * len;
            buf[at..at + len].copy_from_slice(&pattern(p, j, len));
        }
    }
    let base = buf.as_mut_ptr() as usize;
    // SAFETY: `buf` outlives every use of the client in the calling test and is not resized.
    unsafe { c.register_region(base, buf.len(), "src") }.expect("register");
    let refs = (0..pages * 2)
        .map(|i| MemRef {
            ptr: base + i * len,
            len,
        })
        .collect();
    (buf, refs)
}

fn keys(pages: usize) -> Vec<String> {
    (0..pages).map(|p| format!("page{p:04}")).collect()
}

#[test]
fn large_batches_split_across_threads_keep_order_and_bytes() {
    for threads in [1, 2, 3] {
        let c = client(json!({"dram_capacity_bytes": "256MiB", "copy_threads": threads}));
        let (pages, len) = (40, 1 << 20); // 80 MiB: several threads' worth
        let (_src, refs) = source(&c, pages, len);
        let page_keys = keys(pages);
        let suffixes = [".k", ".v"];
        let batch = PageBatch {
            prefix: b"t/",
            page_keys: &page_keys,
            suffixes: &suffixes,
        };
        let put = c.put_pages(&batch, &refs, None);
        assert_eq!(put.ok, vec![true; pages], "{:?}", put.errors);

        let mut dst = vec![0u8; pages * 2 * len];
        let base = dst.as_mut_ptr() as usize;
        // SAFETY: `dst` outlives the client calls below.
        unsafe { c.register_region(base, dst.len(), "dst") }.expect("register");
        let out: Vec<MemRef> = (0..pages * 2)
            .map(|i| MemRef {
                ptr: base + i * len,
                len,
            })
            .collect();
        // Page 30 asks for a key nobody wrote: only it fails, in its place.
        let mut wanted = page_keys.clone();
        wanted[30] = "missing".into();
        let batch = PageBatch {
            prefix: b"t/",
            page_keys: &wanted,
            suffixes: &suffixes,
        };
        let got = c.get_pages(&batch, &out);
        let mut expect = vec![true; pages];
        expect[30] = false;
        assert_eq!(got.ok, expect, "threads={threads}");
        for p in (0..pages).filter(|&p| p != 30) {
            for j in 0..2 {
                let at = (p * 2 + j) * len;
                assert!(
                    dst[at..at + len] == pattern(p, j, len)[..],
                    "page {p} comp {j}"
                );
            }
        }
    }
}

#[test]
fn a_failing_page_in_a_split_batch_rolls_back_only_itself() {
    let c = client(json!({"dram_capacity_bytes": "256MiB", "copy_threads": 2}));
    let (pages, len) = (24, 1 << 20);
    let (_src, mut refs) = source(&c, pages, len);
    let stray = vec![0u8; len];
    refs[2 * 20 + 1] = MemRef {
        ptr: stray.as_ptr() as usize,
        len,
    }; // page 20's V: unregistered
    let page_keys = keys(pages);
    let suffixes = [".k", ".v"];
    let batch = PageBatch {
        prefix: b"",
        page_keys: &page_keys,
        suffixes: &suffixes,
    };
    let put = c.put_pages(&batch, &refs, None);
    let mut expect = vec![true; pages];
    expect[20] = false;
    assert_eq!(put.ok, expect);
    assert!(put
        .errors
        .iter()
        .any(|e| e.contains("outside every registered memory region")));
    assert_eq!(
        c.exists_keys(&["page0020.k", "page0020.v", "page0019.v"]),
        vec![false, false, true]
    );
    assert_eq!(c.stats().engine.objects, 2 * 23);
}

#[test]
fn copy_threads_is_range_checked() {
    let serde_json::Value::Object(extra) = json!({"copy_threads": 0}) else {
        unreachable!()
    };
    let err = KvtierConfig::load(ConfigSources {
        env: Vec::new(),
        extra,
    })
    .unwrap_err();
    assert_eq!(err.key, "copy_threads");
}

#[test]
fn ssd_tier_survives_reopening_the_client() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = json!({
        "dram_capacity_bytes": "64MiB",
        "ssd_enabled": true,
        "ssd_storage_dir": dir.path().to_str().expect("utf8"),
        "ssd_storage_subdir": "tp0",
        "ssd_capacity_bytes": "256MiB",
        "ssd_segment_size_bytes": "16MiB",
        "ssd_durability_mode": "strict",
    });
    let len = 256 << 10;
    let page_keys = keys(8);
    let suffixes = [".k", ".v"];
    let first = client(cfg.clone());
    let (_src, refs) = source(&first, 8, len);
    let batch = PageBatch {
        prefix: b"",
        page_keys: &page_keys,
        suffixes: &suffixes,
    };
    assert_eq!(first.put_pages(&batch, &refs, None).ok, vec![true; 8]);
    first.flush().expect("flush");
    // Closing releases the segment directory even while the first client object lives on.
    first.close();
    assert!(first.put_pages(&batch, &refs, None).errors[0].contains("closed"));
    assert!(dir.path().join("tp0").is_dir());
    let c = client(cfg);
    let mut dst = vec![0u8; 8 * 2 * len];
    let base = dst.as_mut_ptr() as usize;
    // SAFETY: `dst` outlives the client calls below.
    unsafe { c.register_region(base, dst.len(), "dst") }.expect("register");
    let out: Vec<MemRef> = (0..16)
        .map(|i| MemRef {
            ptr: base + i * len,
            len,
        })
        .collect();
    let batch = PageBatch {
        prefix: b"",
        page_keys: &page_keys,
        suffixes: &suffixes,
    };
    assert_eq!(c.get_pages(&batch, &out).ok, vec![true; 8]);
    for p in 0..8 {
        for j in 0..2 {
            let at = (p * 2 + j) * len;
            assert!(
                dst[at..at + len] == pattern(p, j, len)[..],
                "page {p} comp {j}"
            );
        }
    }
}
