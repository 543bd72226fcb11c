//! End-to-end tests of `kvtier serve` in-process: a real listener, real clients in server
//! mode, memfd zero-copy registration, the staging-ring fallback, malformed frames, buffers
//! outside registered regions, and session teardown.
#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)] // test fixtures map shared memory and register raw regions

mod common;

use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Memfd;
use kvtier_client::config::ConfigSources;
use kvtier_client::{Client, KvtierConfig, MemRef, PageBatch};
use kvtier_proto::frame::{FrameHeader, FLAG_ERROR, HEADER_LEN, PROTOCOL_VERSION};
use kvtier_proto::server::{
    error_code, OpenSession, PageIo, PageKeys, RegionGrant, RegisterRegion, SessionTicket, ShmRef,
};
use kvtier_proto::{
    encode_frame, read_frame, BatchResult, Decode, Encode, ErrorReply, Handshake, ItemFailure,
    Opcode,
};
use kvtier_server::{RunningServer, Server, ServerConfig, ServerSources};
use serde_json::{json, Map, Value};

fn start(extra: &[(&str, Value)]) -> (tempfile::TempDir, RunningServer) {
    start_sized(extra, "64MiB")
}

fn start_sized(extra: &[(&str, Value)], dram: &str) -> (tempfile::TempDir, RunningServer) {
    let dir = tempfile::tempdir().unwrap();
    let mut flags = Map::new();
    flags.insert(
        "socket".into(),
        json!(dir.path().join("kvtier.sock").display().to_string()),
    );
    for (k, v) in extra {
        flags.insert((*k).into(), v.clone());
    }
    let mut engine_flags = Map::new();
    engine_flags.insert("dram_capacity_bytes".into(), json!(dram));
    engine_flags.insert("dram_prefault".into(), json!(false));
    let config = ServerConfig::load(ServerSources {
        file: None,
        env: Vec::new(),
        flags,
        engine_flags,
    })
    .unwrap();
    let server = Server::bind(config).unwrap().spawn();
    (dir, server)
}

fn client(server: &RunningServer, extra: Value) -> Client {
    let mut map = match extra {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    map.insert(
        "server_socket".into(),
        json!(server.socket().display().to_string()),
    );
    let config = KvtierConfig::load(ConfigSources {
        env: Vec::new(),
        extra: map,
    })
    .unwrap();
    Client::open(config).unwrap()
}

fn fill(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

const PAGE: usize = 64 << 10;

#[test]
fn zero_copy_and_staged_round_trips_are_byte_exact() {
    let (_dir, server) = start(&[]);
    let writer = client(&server, json!({}));
    let reader = client(&server, json!({}));
    assert_eq!(writer.mode(), "server");

    let mut src = Memfd::new(16 * PAGE, false);
    fill(src.bytes(), 7);
    // SAFETY: src outlives both clients' use of it.
    unsafe { writer.register_memfd(src.addr(), src.len, src.fd.as_fd(), 0, "pool") }.unwrap();
    assert_eq!(writer.zero_copy_regions(), 1);

    let keys: Vec<String> = (0..8).map(|i| format!("page{i}")).collect();
    let suffixes = [".k", ".v"];
    let batch = PageBatch {
        prefix: b"m/",
        page_keys: &keys,
        suffixes: &suffixes,
    };
    let bufs: Vec<MemRef> = (0..16)
        .map(|i| MemRef {
            ptr: src.addr() + i * PAGE,
            len: PAGE,
        })
        .collect();
    let put = writer.put_pages(&batch, &bufs, Some(&[0, 1, 2, 3, 4, 5, 6, 7]));
    assert_eq!(put.ok, vec![true; 8], "{:?}", put.errors);

    // The reader uses plain anonymous memory: its pages come through the staging ring.
    let mut dst = vec![0u8; 16 * PAGE];
    // SAFETY: dst outlives the reader's use of it.
    unsafe { reader.register_region(dst.as_mut_ptr() as usize, dst.len(), "anon") }.unwrap();
    let dbufs: Vec<MemRef> = (0..16)
        .map(|i| MemRef {
            ptr: dst.as_ptr() as usize + i * PAGE,
            len: PAGE,
        })
        .collect();
    let got = reader.get_pages(&batch, &dbufs);
    assert_eq!(got.ok, vec![true; 8], "{:?}", got.errors);
    assert_eq!(&dst[..], src.bytes(), "byte exact through the staging ring");

    let stats = reader.stats_json();
    assert_eq!(stats["mode"], "server");
    assert_eq!(stats["objects"], 16);
    assert!(stats["staged_bytes"].as_u64().unwrap() >= 16 * PAGE as u64);

    // Zero-copy reads into another memfd, and exists / len / v2 queries.
    let mut dst2 = Memfd::new(16 * PAGE, false);
    // SAFETY: dst2 outlives the writer's use of it.
    unsafe { writer.register_memfd(dst2.addr(), dst2.len, dst2.fd.as_fd(), 0, "pool2") }.unwrap();
    let dbufs2: Vec<MemRef> = (0..16)
        .map(|i| MemRef {
            ptr: dst2.addr() + i * PAGE,
            len: PAGE,
        })
        .collect();
    let got = writer.get_pages(&batch, &dbufs2);
    assert_eq!(got.ok, vec![true; 8]);
    let (a, b) = (dst2.bytes().to_vec(), src.bytes().to_vec());
    assert!(a == b);
    assert_eq!(writer.exists_pages_prefix(&batch), 8);
    assert_eq!(writer.object_len(b"m/page0.k"), Some(PAGE as u64));
    assert_eq!(
        reader.exists_keys(&["m/page3.v", "nope"]),
        vec![true, false]
    );

    // Legacy slice path through the ring.
    writer.put_slice(b"legacy", &[9u8; 1000], None).unwrap();
    let mut back = [0u8; 1000];
    reader.get_into_slice(b"legacy", &mut back).unwrap();
    assert_eq!(back, [9u8; 1000]);
    assert!(reader.get_into_slice(b"absent", &mut back).is_err());

    writer.close();
    reader.close();
    wait_for("sessions to end", || {
        let s = server.stats();
        s["server"]["sessions"] == 0 && s["server"]["live_mappings"] == 0
    });
    let report = server.shutdown(Duration::from_secs(5));
    assert_eq!(report["server"]["mapped_bytes"], 0);
}

#[test]
fn the_demote_hint_crosses_the_socket_and_superseded_state_goes_first() {
    let (_dir, server) = start_sized(&[], "1MiB");
    let c = client(&server, json!({}));
    let pages: Vec<String> = (0..4).map(|i| format!("p{i}")).collect();
    for p in &pages {
        c.put_slice(format!("{p}@f.kv").as_bytes(), &[1u8; 64 << 10], Some(0))
            .unwrap();
        c.put_slice(format!("{p}@f.swa").as_bytes(), &[2u8; 128 << 10], Some(0))
            .unwrap();
    }
    let swa = [String::from("@f.swa")];
    let batch = PageBatch {
        prefix: b"",
        page_keys: &pages[..2],
        suffixes: &swa,
    };
    assert_eq!(c.demote_pages(&batch), 2);
    let none = PageBatch {
        prefix: b"",
        page_keys: &["absent".to_string()],
        suffixes: &swa,
    };
    assert_eq!(c.demote_pages(&none), 0, "keys not stored are not marked");
    // 768 KiB used of 1 MiB: a 512 KiB put needs 256 KiB more; the two superseded go.
    c.put_slice(b"big@f.kv", &[3u8; 512 << 10], Some(0))
        .unwrap();
    let stats = c.stats_json();
    assert_eq!(stats["evictions_superseded"], 2);
    assert_eq!(stats["evictions_capacity"], 0);
    assert_eq!(
        c.exists_keys(&["p0@f.kv", "p0@f.swa", "p1@f.kv", "p1@f.swa", "p2@f.swa", "big@f.kv"]),
        vec![true, false, true, false, true, true]
    );
    c.close();
    server.shutdown(Duration::from_secs(5));
}

#[test]
fn tenants_are_isolated_and_quota_partitions_are_separate_stores() {
    let (_dir, server) = start(&[("tenant_dram_quota", json!({"small": "2MiB"}))]);
    let a = client(&server, json!({"extra_backend_tag": "a"}));
    let small = client(&server, json!({"extra_backend_tag": "small"}));
    let none = client(&server, json!({}));
    a.put_slice(b"k", b"tenant a", None).unwrap();
    assert!(
        none.exists_keys(&["k"]) == vec![false],
        "tenants do not see each other"
    );
    assert!(small.exists_keys(&["k"]) == vec![false]);
    // The partition cannot exceed its quota: 3 MiB of objects into 2 MiB evicts within it.
    for i in 0..3 {
        small
            .put_slice(format!("big{i}").as_bytes(), &vec![i as u8; 1 << 20], None)
            .unwrap();
    }
    let stats = server.stats();
    let part = &stats["stores"]["tenant:small"];
    assert!(part["bytes_used"].as_u64().unwrap() <= 2 << 20, "{part}");
    assert_eq!(
        stats["stores"]["main"]["objects"], 1,
        "only tenant a's object"
    );
    assert_eq!(a.exists_keys(&["k"]), vec![true]);
    server.shutdown(Duration::from_secs(5));
}

// ------------------------------------------------------------------------------ raw frames

struct Raw {
    stream: UnixStream,
    next: u64,
    body: Vec<u8>,
}

impl Raw {
    fn connect(server: &RunningServer) -> Raw {
        let stream = UnixStream::connect(server.socket()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw {
            stream,
            next: 1,
            body: Vec::new(),
        }
    }

    fn send(&mut self, opcode: Opcode, message: &dyn Encode) -> u64 {
        let id = self.next;
        self.next += 1;
        let mut out = Vec::new();
        encode_frame(&mut out, opcode, id, 0, message).unwrap();
        self.stream.write_all(&out).unwrap();
        id
    }

    /// Read one reply: Ok(body) or Err(error reply).
    fn reply(&mut self) -> Result<Vec<u8>, ErrorReply> {
        let header = read_frame(&mut self.stream, &mut self.body).unwrap();
        if header.flags & FLAG_ERROR != 0 {
            Err(ErrorReply::decode(&self.body).unwrap())
        } else {
            Ok(self.body.clone())
        }
    }

    fn call(&mut self, opcode: Opcode, message: &dyn Encode) -> Result<Vec<u8>, ErrorReply> {
        self.send(opcode, message);
        self.reply()
    }

    fn hello(&mut self) {
        self.call(
            Opcode::Handshake,
            &Handshake {
                version: PROTOCOL_VERSION,
                client_name: "raw".into(),
            },
        )
        .unwrap();
    }

    fn open(&mut self) -> SessionTicket {
        let body = self
            .call(
                Opcode::OpenSession,
                &OpenSession {
                    tenant: String::new(),
                    client_name: "raw".into(),
                    join: None,
                },
            )
            .unwrap();
        SessionTicket::decode(&body).unwrap()
    }

    fn register(&mut self, fd: &OwnedFd, len: u64) -> Result<u64, ErrorReply> {
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut out = Vec::new();
        let id = self.next;
        self.next += 1;
        encode_frame(
            &mut out,
            Opcode::RegisterRegion,
            id,
            0,
            &RegisterRegion {
                label: "raw".into(),
                fd_offset: 0,
                len,
            },
        )
        .unwrap();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [fd.as_fd()];
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let sent = sendmsg(
            &self.stream,
            &[IoSlice::new(&out)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        self.stream.write_all(&out[sent..]).unwrap();
        self.reply()
            .map(|b| RegionGrant::decode(&b).unwrap().region)
    }
}

struct EmptyBody;
impl Encode for EmptyBody {
    fn encode_fields(&self, _: &mut Vec<u8>) -> Result<(), kvtier_proto::ProtoError> {
        Ok(())
    }
}

struct Bytes(Vec<u8>);
impl Encode for Bytes {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), kvtier_proto::ProtoError> {
        out.extend_from_slice(&self.0);
        Ok(())
    }
}

#[test]
fn malformed_frames_get_error_replies_and_the_connection_and_server_stay_alive() {
    let (_dir, server) = start(&[]);
    let mut raw = Raw::connect(&server);
    // Before the handshake: an oversized body (limit 4 KiB) is skipped and answered.
    let header = FrameHeader::new(Opcode::Handshake, 77, 0, 8 << 10).encode();
    raw.stream.write_all(&header).unwrap();
    raw.stream.write_all(&vec![0xAB; 8 << 10]).unwrap();
    let err = raw.reply().unwrap_err();
    assert_eq!(err.code, error_code::MALFORMED);
    assert!(err.message.contains("exceeds"), "{}", err.message);
    raw.hello();
    // Garbage bodies for every request the server decodes.
    let mut rng = 0x1234_5678_9abc_def0u64;
    for opcode in Opcode::ALL {
        for len in [0usize, 1, 3, 17, 200] {
            let body: Vec<u8> = (0..len)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng as u8
                })
                .collect();
            if opcode == Opcode::Handshake {
                continue;
            }
            raw.send(opcode, &Bytes(body));
            let _ = raw.reply(); // an error reply or, by chance, a valid answer: never a hang
        }
    }
    // Unknown opcode: body read, error reply, connection alive.
    let header = FrameHeader {
        version: PROTOCOL_VERSION,
        opcode: 999,
        request_id: 5,
        flags: 0,
        body_len: 3,
    }
    .encode();
    raw.stream.write_all(&header).unwrap();
    raw.stream.write_all(&[1, 2, 3]).unwrap();
    let err = raw.reply().unwrap_err();
    assert_eq!(err.code, error_code::UNSUPPORTED);
    // Requests needing a session are refused, not crashed on.
    let err = raw.call(Opcode::Clear, &EmptyBody).unwrap_err();
    assert_eq!(err.code, error_code::NO_SESSION);
    raw.call(Opcode::Ping, &EmptyBody).unwrap();
    // A truncated structured body: a decode error reply naming the field.
    let err = raw
        .call(Opcode::OpenSession, &Bytes(vec![5, b'a']))
        .unwrap_err();
    assert_eq!(err.code, error_code::MALFORMED);
    assert!(err.message.contains("tenant"), "{}", err.message);
    raw.open();
    raw.call(Opcode::Ping, &EmptyBody).unwrap();
    // Bad magic: error reply, then the server closes this connection.
    let mut bad = FrameHeader::new(Opcode::Ping, 9, 0, 0).encode();
    bad[0] = b'X';
    raw.stream.write_all(&bad).unwrap();
    let err = raw.reply().unwrap_err();
    assert!(err.message.contains("magic"), "{}", err.message);
    let mut rest = [0u8; HEADER_LEN];
    assert_eq!(raw.stream.read(&mut rest).unwrap_or(0), 0, "closed");
    // The server is alive for everyone else.
    let mut other = Raw::connect(&server);
    other.hello();
    other.call(Opcode::Ping, &EmptyBody).unwrap();
    assert!(
        server.stats()["server"]["malformed_frames"]
            .as_u64()
            .unwrap()
            >= 3
    );
    server.shutdown(Duration::from_secs(5));
}

#[test]
fn buffers_outside_registered_regions_fail_that_key_with_a_clear_error() {
    let (_dir, server) = start(&[]);
    let mut raw = Raw::connect(&server);
    raw.hello();
    raw.open();
    let mut shm = Memfd::new(4 * PAGE, false);
    fill(shm.bytes(), 3);
    let region = raw.register(&shm.fd, 4 * PAGE as u64).unwrap();
    // A region larger than the memfd is refused.
    let err = raw.register(&shm.fd, 8 * PAGE as u64).unwrap_err();
    assert_eq!(err.code, error_code::REGISTRATION);
    assert!(err.message.contains("smaller"), "{}", err.message);
    // No descriptor at all.
    let err = raw
        .call(
            Opcode::RegisterRegion,
            &RegisterRegion {
                label: "nofd".into(),
                fd_offset: 0,
                len: 1,
            },
        )
        .unwrap_err();
    assert!(err.message.contains("memfd"), "{}", err.message);

    let io = PageIo {
        keys: PageKeys {
            prefix: Vec::new(),
            page_keys: vec![
                b"in".to_vec(),
                b"past-end".to_vec(),
                b"overflow".to_vec(),
                b"no-region".to_vec(),
            ],
            suffixes: vec![Vec::new()],
        },
        buffers: vec![
            ShmRef {
                region,
                offset: 0,
                len: PAGE as u64,
            },
            ShmRef {
                region,
                offset: 3 * PAGE as u64 + 1,
                len: PAGE as u64,
            },
            ShmRef {
                region,
                offset: u64::MAX - 2,
                len: 10,
            },
            ShmRef {
                region: region + 100,
                offset: 0,
                len: 8,
            },
        ],
        depths: None,
    };
    let reply = BatchResult::decode(&raw.call(Opcode::PutPages, &io).unwrap()).unwrap();
    assert_eq!(reply.ok, vec![true, false, false, false]);
    // Issue 28: each refused buffer's page says so, typed, on the wire.
    for i in 1..4 {
        assert_eq!(reply.failure(i), Some(ItemFailure::BadBuffer), "page {i}");
    }
    let text = reply.errors.join(" | ");
    assert!(
        text.contains("past-end") && text.contains("outside region"),
        "{text}"
    );
    assert!(
        text.contains("no-region") && text.contains("not registered"),
        "{text}"
    );
    // Gets are checked the same way and nothing was written for the bad keys.
    let reply = BatchResult::decode(&raw.call(Opcode::GetPages, &io).unwrap()).unwrap();
    assert_eq!(reply.ok, vec![true, false, false, false]);
    let doc = server.stats();
    assert_eq!(doc["stores"]["main"]["objects"], 1);
    assert!(doc["sessions"][0]["rejected_buffers"].as_u64().unwrap() >= 6);
    raw.call(Opcode::Ping, &EmptyBody).unwrap();
    drop(raw);
    wait_for("the session's mapping to go", || {
        server.stats()["server"]["live_mappings"] == 0
    });
    server.shutdown(Duration::from_secs(5));
}

/// Issue 28: every item-level outcome of a server-mode get arrives typed at the client's
/// Store API (a status byte per item on the wire, mapped once at each end), for single-key
/// gets (staging ring) and zero-copy page gets alike: a miss, a wrong length, a refused
/// buffer, and a server gone (connection lost). Nothing is matched on a message's text.
#[test]
fn server_mode_item_outcomes_arrive_typed() {
    let (_dir, server) = start(&[]);
    let c = client(&server, json!({}));
    let small = vec![5u8; 4096];
    c.put_slice(b"small", &small, None).unwrap();
    let mut shm = Memfd::new(3 * PAGE, false);
    fill(shm.bytes(), 9);
    // SAFETY: shm outlives the client's use of it (the client is closed first).
    unsafe { c.register_memfd(shm.addr(), shm.len, shm.fd.as_fd(), 0, "pool") }.unwrap();
    let base = shm.addr();
    let page = |i: usize| MemRef {
        ptr: base + i * PAGE,
        len: PAGE,
    };
    assert!(c.put_keys(&["whole"], &[page(0)], None).ok[0]);

    // Single-key gets through the staging ring.
    let mut dst = vec![0u8; 4096];
    let e = c.get_into_slice(b"absent", &mut dst).unwrap_err();
    assert_eq!(e.item_failure(), ItemFailure::Miss, "{e:?}");
    assert!(e.is_miss() && !e.is_infrastructure(), "{e:?}");
    let mut short = vec![0u8; 100];
    let e = c.get_into_slice(b"small", &mut short).unwrap_err();
    assert_eq!(e.item_failure(), ItemFailure::WrongLength, "{e:?}");
    c.get_into_slice(b"small", &mut dst).unwrap();
    assert!(dst == small);

    // A zero-copy page batch: a hit, a miss, a wrong length, a buffer outside any region.
    let outside = [0u8; 64];
    let got = c.get_keys(
        &["whole", "absent", "small", "whole"],
        &[
            page(1),
            page(2),
            page(2),
            MemRef {
                ptr: outside.as_ptr() as usize,
                len: outside.len(),
            },
        ],
    );
    assert_eq!(got.ok, vec![true, false, false, false], "{got:?}");
    assert_eq!(got.failure(0), None);
    assert_eq!(got.failure(1), Some(ItemFailure::Miss), "{got:?}");
    assert_eq!(got.failure(2), Some(ItemFailure::WrongLength), "{got:?}");
    assert_eq!(got.failure(3), Some(ItemFailure::BadBuffer), "{got:?}");
    let bytes = shm.bytes();
    assert!(bytes[PAGE..2 * PAGE] == bytes[..PAGE], "the hit's bytes");

    // The server gone: every item is unavailable (a fault of the infrastructure).
    server.shutdown(Duration::from_secs(5));
    let e = c.get_into_slice(b"small", &mut dst).unwrap_err();
    assert_eq!(e.item_failure(), ItemFailure::Unavailable, "{e:?}");
    assert!(e.is_infrastructure(), "{e:?}");
    let got = c.get_keys(&["whole", "small"], &[page(1), page(2)]);
    assert_eq!(got.ok, vec![false, false], "{got:?}");
    assert_eq!(got.failure(0), Some(ItemFailure::Unavailable), "{got:?}");
    assert_eq!(got.failure(1), Some(ItemFailure::Unavailable), "{got:?}");
    c.close();
}

#[test]
fn a_client_dying_mid_session_leaks_no_mapping_and_others_keep_working() {
    let (_dir, server) = start(&[]);
    let survivor = Arc::new(client(&server, json!({})));
    let mut shm = Memfd::new(32 * PAGE, false);
    fill(shm.bytes(), 1);
    {
        let doomed = client(&server, json!({}));
        // SAFETY: shm outlives the doomed client.
        unsafe { doomed.register_memfd(shm.addr(), shm.len, shm.fd.as_fd(), 0, "doomed") }.unwrap();
        let keys: Vec<String> = (0..32).map(|i| format!("d{i}")).collect();
        let bufs: Vec<MemRef> = (0..32)
            .map(|i| MemRef {
                ptr: shm.addr() + i * PAGE,
                len: PAGE,
            })
            .collect();
        let r = doomed.put_keys(&keys, &bufs, None);
        assert_eq!(r.succeeded(), 32);
        assert_eq!(server.stats()["server"]["live_mappings"], 1);
        // Dropped without close(): its sockets just close, as with SIGKILL.
    }
    wait_for("the dead client's mapping to go", || {
        let s = server.stats();
        s["server"]["live_mappings"] == 0 && s["server"]["sessions"] == 1
    });
    let mut back = vec![0u8; PAGE];
    survivor.get_into_slice(b"d5", &mut back).unwrap();
    assert_eq!(&back[..], &shm.bytes()[5 * PAGE..6 * PAGE]);
    let doc = server.stats();
    let main = &doc["stores"]["main"];
    assert_eq!(
        main["bytes_allocated"],
        main["bytes_used"]
            .as_u64()
            .map(|b| b.div_ceil(4096) * 4096)
            .unwrap_or(0),
        "no pinned leftovers: {main}"
    );
    server.shutdown(Duration::from_secs(5));
}

/// A server on a socket in `dir` with its SSD tier in `ssd`; `[DRAM, SSD, segment]` sizes
/// and extra server flags.
fn ssd_server(
    dir: &std::path::Path,
    ssd: &std::path::Path,
    [dram, capacity, segment]: [&str; 3],
    extra: &[(&str, Value)],
) -> RunningServer {
    let mut flags = Map::new();
    flags.insert(
        "socket".into(),
        json!(dir.join("kvtier.sock").display().to_string()),
    );
    for (k, v) in extra {
        flags.insert((*k).into(), v.clone());
    }
    let mut engine_flags = Map::new();
    engine_flags.insert("dram_capacity_bytes".into(), json!(dram));
    engine_flags.insert("dram_prefault".into(), json!(false));
    engine_flags.insert("ssd_enabled".into(), json!(true));
    engine_flags.insert("ssd_storage_dir".into(), json!(ssd.display().to_string()));
    engine_flags.insert("ssd_capacity_bytes".into(), json!(capacity));
    engine_flags.insert("ssd_segment_size_bytes".into(), json!(segment));
    let config = ServerConfig::load(ServerSources {
        file: None,
        env: Vec::new(),
        flags,
        engine_flags,
    })
    .unwrap();
    Server::bind(config).unwrap().spawn()
}

#[test]
fn a_restarted_server_serves_its_ssd_contents_again() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let open = || ssd_server(dir.path(), &ssd, ["16MiB", "256MiB", "16MiB"], &[]);
    let server = open();
    let c = client(&server, json!({}));
    let value: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    c.put_slice(b"warm", &value, None).unwrap();
    c.close();
    let report = server.shutdown(Duration::from_secs(10));
    assert_eq!(report["shutdown"]["flush_errors"], json!([]));
    drop(report);
    // Same directory, new process state: the SSD tier is scanned back in.
    let server = open();
    let c = client(&server, json!({}));
    let mut back = vec![0u8; value.len()];
    c.get_into_slice(b"warm", &mut back).unwrap();
    assert!(back == value, "warm restart serves the same bytes");
    server.shutdown(Duration::from_secs(10));
}

#[test]
fn tenant_partitions_get_their_own_ssd_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let server = ssd_server(
        dir.path(),
        &ssd,
        ["8MiB", "64MiB", "8MiB"],
        &[("tenant_dram_quota", json!({"team/a": "4MiB"}))],
    );
    let c = client(&server, json!({"extra_backend_tag": "team/a"}));
    c.put_slice(b"x", &[1u8; 5000], None).unwrap();
    c.flush().unwrap();
    // "team/a" is not a safe directory name: hex-encoded, inside the SSD directory.
    assert!(ssd.join("tenant-7465616d2f61").is_dir());
    c.close();
    server.shutdown(Duration::from_secs(10));
}
