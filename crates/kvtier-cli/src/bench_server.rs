//! `kvtier bench server`: batch put/get through the socket with shared memory, against the
//! same run's in-process memcpy and memfd-copy baselines, plus the one-round-trip latency of a
//! 128-page x 4-pool `batch_exists_v2`.

use std::time::{Duration, Instant};

use kvtier_client::config::ConfigSources;
use kvtier_client::memory::StagingMap;
use kvtier_client::{Client, KvtierConfig, MemRef};
use kvtier_proto::{ExistsV2Query, HitPolicy, KvComponents, PoolQuery};
use serde_json::{json, Map, Value};

use kvtier_client::client::register_own_memfd;
use kvtier_server::config::{ServerConfig, ServerSources};
use kvtier_server::server::Server;

/// Options of `kvtier bench server`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchServerArgs {
    /// Object sizes in KiB (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = [256u64, 1024, 2048])]
    pub object_kib: Vec<u64>,
    /// Objects per batch.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Timed batches per figure (the median batch is reported).
    #[arg(long, default_value_t = 40)]
    pub rounds: usize,
    /// batch_exists_v2 round trips to time.
    #[arg(long, default_value_t = 3000)]
    pub exists_rounds: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Make the host pool a memfd without MFD_ALLOW_SEALING (as SGLang's): the server then
    /// copies through its SIGBUS-guarded path instead of a sealed mapping.
    #[arg(long)]
    pub unsealed_pool: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let at = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(at).copied().unwrap_or(0.0)
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

fn touch(buf: &mut [u8], seed: u8) {
    for (i, chunk) in buf.chunks_mut(4096).enumerate() {
        chunk.fill((i as u8).wrapping_add(seed));
    }
}

/// Run the benchmark; returns the report and prints it.
pub fn bench_server_main(args: BenchServerArgs) -> Result<Value, String> {
    let batch = args.batch.max(1);
    let rounds = args.rounds.max(3);
    let max_obj = args.object_kib.iter().copied().max().unwrap_or(256) as usize * 1024;
    let batch_bytes = max_obj * batch;
    // Room for several batches so put/get rotate through memory that is not in cache.
    let slots = 8usize;
    let arena = (batch_bytes * (slots + 2))
        .next_power_of_two()
        .max(64 << 20) as u64;

    let dir = std::env::temp_dir().join(format!("kvtier-bench-server-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("kvtier.sock");
    let mut flags = Map::new();
    flags.insert("socket".into(), json!(socket.display().to_string()));
    let mut engine_flags = Map::new();
    engine_flags.insert("dram_capacity_bytes".into(), json!(arena));
    engine_flags.insert("dram_prefault".into(), json!(true));
    let config = ServerConfig::load(ServerSources {
        file: None,
        env: Vec::new(),
        flags,
        engine_flags: engine_flags.clone(),
    })
    .map_err(|e| e.to_string())?;
    let server = Server::bind(config).map_err(|e| e.to_string())?.spawn();

    let mut client_extra = Map::new();
    client_extra.insert("server_socket".into(), json!(socket.display().to_string()));
    let remote = Client::open(
        KvtierConfig::load(ConfigSources {
            env: Vec::new(),
            extra: client_extra,
        })
        .map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let embedded = Client::open(
        KvtierConfig::load(ConfigSources {
            env: Vec::new(),
            extra: engine_flags,
        })
        .map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;

    // Client memory: `slots` batches in one memfd (the "host pool"), zero-copy registered.
    let pool_len = batch_bytes * slots;
    let mut pool = if args.unsealed_pool {
        StagingMap::create_unsealed(pool_len, "bench-pool")
    } else {
        StagingMap::create(pool_len, "bench-pool")
    }
    .map_err(|e| e.to_string())?;
    let mut fill = vec![0u8; pool_len];
    touch(&mut fill, 3);
    pool.write(0, &fill).map_err(|e| e.to_string())?;
    let remote_region = register_own_memfd(&remote, &pool, "pool").map_err(|e| e.to_string())?;
    let embedded_region =
        register_own_memfd(&embedded, &pool, "pool").map_err(|e| e.to_string())?;
    // Baseline memory: a second memfd and plain buffers of the same size.
    let mut other = StagingMap::create(pool_len, "bench-other").map_err(|e| e.to_string())?;
    other.write(0, &fill).map_err(|e| e.to_string())?;
    let mut plain_src = vec![0u8; pool_len];
    touch(&mut plain_src, 5);
    let mut plain_dst = vec![0u8; pool_len];
    touch(&mut plain_dst, 7);
    let mut scratch = vec![0u8; batch_bytes];
    touch(&mut scratch, 9);

    let mut sizes = Vec::new();
    for &kib in &args.object_kib {
        let obj = kib as usize * 1024;
        let bytes = obj * batch;
        let bufs_of = |slot: usize| -> Vec<MemRef> {
            (0..batch)
                .map(|i| MemRef {
                    ptr: pool.addr() + slot * batch_bytes + i * obj,
                    len: obj,
                })
                .collect()
        };
        let mut memcpy = Vec::new();
        let mut memfd_copy = Vec::new();
        let mut set = Vec::new();
        let mut get = Vec::new();
        let mut emb_set = Vec::new();
        let mut emb_get = Vec::new();
        for round in 0..rounds + 2 {
            let slot = round % slots;
            let next = (round + 3) % slots;
            // memcpy: one batch of objects between plain buffers.
            let t = Instant::now();
            for i in 0..batch {
                let (s, d) = (slot * batch_bytes + i * obj, next * batch_bytes + i * obj);
                plain_dst[d..d + obj].copy_from_slice(&plain_src[s..s + obj]);
            }
            let memcpy_s = t.elapsed().as_secs_f64();
            // memfd copy: one batch out of a memfd mapping.
            let t = Instant::now();
            for i in 0..batch {
                let s = slot * batch_bytes + i * obj;
                other
                    .read(s, &mut scratch[i * obj..(i + 1) * obj])
                    .map_err(|e| e.to_string())?;
            }
            let memfd_s = t.elapsed().as_secs_f64();
            // Through the server: put a fresh batch, then get it back into another slot.
            let keys: Vec<String> = (0..batch).map(|i| format!("k{kib}-{round}-{i}")).collect();
            let t = Instant::now();
            let put = remote.put_keys(&keys, &bufs_of(slot), None);
            let set_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let got = remote.get_keys(&keys, &bufs_of(next));
            let get_s = t.elapsed().as_secs_f64();
            if put.succeeded() != batch || got.succeeded() != batch {
                return Err(format!(
                    "server batch failed: put {:?} get {:?}",
                    put.errors, got.errors
                ));
            }
            // Embedded engine, same memory, for reference.
            let t = Instant::now();
            let eput = embedded.put_keys(&keys, &bufs_of(slot), None);
            let emb_set_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let eget = embedded.get_keys(&keys, &bufs_of(next));
            let emb_get_s = t.elapsed().as_secs_f64();
            if eput.succeeded() != batch || eget.succeeded() != batch {
                return Err("embedded batch failed".into());
            }
            remote.remove_keys(&keys);
            embedded.remove_keys(&keys);
            if round >= 2 {
                memcpy.push(memcpy_s);
                memfd_copy.push(memfd_s);
                set.push(set_s);
                get.push(get_s);
                emb_set.push(emb_set_s);
                emb_get.push(emb_get_s);
            }
        }
        let memcpy_gbps = gbps(bytes, median(memcpy));
        let row = json!({
            "object_kib": kib,
            "batch": batch,
            "memcpy_gbps": memcpy_gbps,
            "memfd_copy_gbps": gbps(bytes, median(memfd_copy)),
            "server_set_gbps": gbps(bytes, median(set.clone())),
            "server_get_gbps": gbps(bytes, median(get.clone())),
            "embedded_set_gbps": gbps(bytes, median(emb_set)),
            "embedded_get_gbps": gbps(bytes, median(emb_get)),
            "server_set_vs_memcpy": gbps(bytes, median(set)) / memcpy_gbps,
            "server_get_vs_memcpy": gbps(bytes, median(get)) / memcpy_gbps,
        });
        sizes.push(row);
    }

    // batch_exists_v2: 128 pages x (KV + 4 side pools), every object present.
    let pages = 128usize;
    let page_keys: Vec<Vec<u8>> = (0..pages)
        .map(|i| format!("{i:016x}").into_bytes())
        .collect();
    let pools: Vec<(String, Vec<Vec<u8>>, HitPolicy)> = vec![
        (
            "swa".into(),
            vec![b".swa".to_vec()],
            HitPolicy::TrailingPages { window: 4 },
        ),
        ("c4".into(), vec![b".c4".to_vec()], HitPolicy::AllPages),
        (
            "c4_indexer".into(),
            vec![b".c4i".to_vec()],
            HitPolicy::AllPages,
        ),
        (
            "c128".into(),
            vec![b".c128".to_vec(), b".c128s".to_vec()],
            HitPolicy::BlockGroups { group_pages: 4 },
        ),
    ];
    let mut all_keys = Vec::new();
    for pk in &page_keys {
        for suffix in [&b".k"[..], b".v"]
            .into_iter()
            .chain(pools.iter().flat_map(|p| p.1.iter().map(Vec::as_slice)))
        {
            let mut key = b"bench/".to_vec();
            key.extend_from_slice(pk);
            key.extend_from_slice(suffix);
            all_keys.push(key);
        }
    }
    for key in &all_keys {
        remote
            .put_slice(key, &[1u8; 64], None)
            .map_err(|e| e.to_string())?;
        embedded
            .put_slice(key, &[1u8; 64], None)
            .map_err(|e| e.to_string())?;
    }
    let query = ExistsV2Query {
        key_prefix: b"bench/".to_vec(),
        page_keys,
        kv: KvComponents::Suffixes(vec![b".k".to_vec(), b".v".to_vec()]),
        pools: pools
            .into_iter()
            .map(|(name, suffixes, policy)| PoolQuery {
                name,
                suffixes,
                policy,
            })
            .collect(),
    };
    let mut lat = Vec::with_capacity(args.exists_rounds);
    for i in 0..args.exists_rounds + 50 {
        let t = Instant::now();
        let answer = remote.exists_v2(&query);
        let us = t.elapsed().as_secs_f64() * 1e6;
        if answer.kv_hit_pages as usize != pages {
            return Err(format!("exists_v2 answered {} pages", answer.kv_hit_pages));
        }
        if i >= 50 {
            lat.push(us);
        }
    }
    let mut emb_lat = Vec::new();
    for _ in 0..500 {
        let t = Instant::now();
        let _ = embedded.exists_v2(&query);
        emb_lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let exists = json!({
        "pages": pages,
        "pools": 4,
        "objects_per_query": all_keys.len(),
        "server_p50_us": percentile(&lat, 0.5),
        "server_p99_us": percentile(&lat, 0.99),
        "embedded_p50_us": percentile(&emb_lat, 0.5),
    });
    remote.unregister_region(remote_region);
    embedded.unregister_region(embedded_region);
    remote.close();
    let _ = server.shutdown(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&dir);

    let report = json!({ "copy": sizes, "exists_v2": exists });
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else {
        println!(
            "kvtier bench server: batches of {batch} objects, median of {rounds} batches, same-run baselines"
        );
        println!(
            "{:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9}",
            "obj KiB",
            "memcpy",
            "memfd cpy",
            "srv set",
            "srv get",
            "set/mc",
            "get/mc",
            "emb set",
            "emb get"
        );
        for r in report["copy"].as_array().into_iter().flatten() {
            println!(
                "{:>8} {:>7.2}G {:>9.2}G {:>8.2}G {:>8.2}G {:>7.0}% {:>7.0}% {:>8.2}G {:>8.2}G",
                r["object_kib"],
                r["memcpy_gbps"].as_f64().unwrap_or(0.0),
                r["memfd_copy_gbps"].as_f64().unwrap_or(0.0),
                r["server_set_gbps"].as_f64().unwrap_or(0.0),
                r["server_get_gbps"].as_f64().unwrap_or(0.0),
                100.0 * r["server_set_vs_memcpy"].as_f64().unwrap_or(0.0),
                100.0 * r["server_get_vs_memcpy"].as_f64().unwrap_or(0.0),
                r["embedded_set_gbps"].as_f64().unwrap_or(0.0),
                r["embedded_get_gbps"].as_f64().unwrap_or(0.0),
            );
        }
        let e = &report["exists_v2"];
        println!(
            "batch_exists_v2 {} pages x 4 pools ({} objects) one round trip: p50 {:.1} us, p99 {:.1} us (embedded p50 {:.1} us)",
            e["pages"],
            e["objects_per_query"],
            e["server_p50_us"].as_f64().unwrap_or(0.0),
            e["server_p99_us"].as_f64().unwrap_or(0.0),
            e["embedded_p50_us"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(report)
}
