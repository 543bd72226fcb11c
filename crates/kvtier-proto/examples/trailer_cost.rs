//! Cost of the end-to-end integrity trailer of cluster objects
//! ([`kvtier_proto::auth::ObjectIntegrity`]: GMAC as a universal hash, keyed BLAKE3 as the PRF
//! over it) against the two checks before it: the unkeyed XXH3-64 checksum, and BLAKE3 keyed
//! over the whole object (issue 26's first keyed trailer). One thread, objects of 4 KiB to
//! 2 MiB, data cold in cache (a working set of 64 MiB per size, as pages arriving from the
//! network are) and hot (one object hashed again and again).
//!
//! `cargo run --release -p kvtier-proto --example trailer_cost` prints GB/s per size.

use std::time::Instant;

use kvtier_proto::auth::ObjectIntegrity;

fn xxh3(key: &[u8], value: &[u8]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&(key.len() as u64).to_le_bytes());
    hasher.update(key);
    hasher.update(value);
    hasher.digest()
}

/// The v1 keyed trailer: BLAKE3 keyed over len(key), key and the whole value.
fn blake3_keyed(secret: &[u8; 32], key: &[u8], value: &[u8]) -> u8 {
    let mut hasher = blake3::Hasher::new_keyed(secret);
    hasher.update(&(key.len() as u64).to_le_bytes());
    hasher.update(key);
    hasher.update(value);
    hasher.finalize().as_bytes()[0]
}

/// GB/s of `f` over every object of `objects`, best of `rounds` passes.
fn rate(objects: &[Vec<u8>], rounds: usize, mut f: impl FnMut(&[u8]) -> u8) -> f64 {
    let mut best = f64::MAX;
    let mut sink = 0u8;
    for _ in 0..rounds {
        let start = Instant::now();
        for o in objects {
            sink ^= f(o);
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    let bytes: usize = objects.iter().map(Vec::len).sum();
    bytes as f64 / best / 1e9
}

fn main() {
    let seal = ObjectIntegrity::from_token(b"bench-token");
    let v1 = blake3::derive_key("kvtier cluster object integrity v1", b"bench-token");
    let key = b"\0Cprod\x1f0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef@fp.kv";
    println!("size      cache  xxh3-64 GB/s  blake3-keyed GB/s  trailer GB/s  trailer/xxh3");
    for size in [4usize << 10, 64 << 10, 512 << 10, 1 << 20, 2 << 20] {
        for (label, count) in [("cold", (64usize << 20) / size), ("hot", 1)] {
            let objects: Vec<Vec<u8>> = (0..count)
                .map(|i| (0..size).map(|j| (j * 31 + i * 7) as u8).collect())
                .collect();
            let rounds = if count == 1 { (400 << 20) / size } else { 6 };
            let x = rate(&objects, rounds, |o| xxh3(key, o) as u8);
            let b = rate(&objects, rounds, |o| blake3_keyed(&v1, key, o));
            let t = rate(&objects, rounds, |o| seal.trailer(key, o)[0]);
            println!(
                "{:>4} KiB  {label:<5}  {x:>12.2}  {b:>17.2}  {t:>12.2}  {:>12.2}",
                size >> 10,
                t / x
            );
        }
    }
}
