//! The peer data port and the TCP transport, in-process: a real listener over loopback,
//! authenticated pooled connections, pipelined batches, byte-exact transfers, and every
//! refusal (wrong token, unknown peer, size mismatch, miss) failing only its own items, and
//! every key outside the cluster namespace (a local tenant's) refused on every op.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_server::peer::DataPort;
use kvtier_server::server::TenantStore;
use kvtier_store::store::Store;
use kvtier_store::KvtierConfig;
use kvtier_transport::tcp::{TcpTransport, TcpTransportConfig};
use kvtier_transport::{GetItem, PutItem, Transport, TransportError};

fn store() -> Arc<TenantStore> {
    let config = KvtierConfig {
        engine: kvtier_engine::EngineConfig {
            dram_capacity_bytes: 64 << 20,
            dram_prefault: false,
            ..kvtier_engine::EngineConfig::default()
        },
        ..KvtierConfig::default()
    };
    Arc::new(TenantStore::open(config, "main").unwrap())
}

fn port(token: &[u8]) -> (DataPort, Arc<TenantStore>) {
    let store = store();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    (
        DataPort::start(addr, Arc::clone(&store), token.to_vec()).unwrap(),
        store,
    )
}

fn transport(token: &[u8]) -> TcpTransport {
    TcpTransport::new(TcpTransportConfig {
        token: token.to_vec(),
        end_to_end_checksums: true,
        name: "test".into(),
        connections_per_peer: 3,
        request_timeout: Duration::from_secs(2),
        down_backoff: Duration::from_millis(300),
    })
}

/// `name` in the cluster namespace `t` (as a cluster client with extra_backend_tag = "t"
/// names it).
fn ck(name: &str) -> Vec<u8> {
    let mut key = kvtier_proto::namespace::cluster_prefix("t");
    key.extend_from_slice(name.as_bytes());
    key
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7919)) as u8)
        .collect()
}

#[test]
fn batches_round_trip_byte_exact_over_several_connections() {
    let (port, node) = port(b"s3cret");
    let peer = port.local_addr().to_string();
    let t = transport(b"s3cret");
    // 40 objects of 512 KiB: enough bytes to be spread over 3 connections, more than one
    // pipeline window per connection; plus small odd-sized ones.
    let values: Vec<Vec<u8>> = (0..40)
        .map(|i| pattern(i, if i % 5 == 0 { 4097 + i } else { 512 << 10 }))
        .collect();
    let keys: Vec<Vec<u8>> = (0..40).map(|i| ck(&format!("page-{i}"))).collect();
    let items: Vec<PutItem<'_>> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| PutItem {
            key: k,
            value: v,
            depth: Some(1),
        })
        .collect();
    let put = t.put(&peer, &items);
    assert!(put.iter().all(Result::is_ok), "{put:?}");
    assert_eq!(port.counters().puts.load(Ordering::Relaxed), 40);
    assert_eq!(port.held().len(), 40);
    assert!(
        port.counters().connections.load(Ordering::Relaxed) >= 2,
        "large batch used one connection"
    );

    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    // A miss and a wrong-sized buffer in the middle of the batch fail only themselves.
    let missing = ck("no-such-page");
    let mut miss_buf = vec![0u8; 10];
    let mut short_buf = vec![0u8; 100];
    let mut items: Vec<GetItem<'_>> = Vec::new();
    let (first, rest) = bufs.split_at_mut(20);
    for (k, b) in keys[..20].iter().zip(first.iter_mut()) {
        items.push(GetItem { key: k, dst: b });
    }
    items.push(GetItem {
        key: &missing,
        dst: &mut miss_buf,
    });
    items.push(GetItem {
        key: &keys[1],
        dst: &mut short_buf,
    });
    for (k, b) in keys[20..].iter().zip(rest.iter_mut()) {
        items.push(GetItem { key: k, dst: b });
    }
    let got = t.get(&peer, &mut items);
    assert_eq!(got.len(), 42);
    assert!(
        matches!(got[20], Err(TransportError::NotFound { .. })),
        "{:?}",
        got[20]
    );
    assert!(
        matches!(got[21], Err(TransportError::SizeMismatch { .. })),
        "{:?}",
        got[21]
    );
    for (i, r) in got.iter().enumerate() {
        if i != 20 && i != 21 {
            assert!(r.is_ok(), "item {i}: {r:?}");
        }
    }
    drop(items);
    assert_eq!(bufs, values, "bytes differ after the round trip");

    // Remove through the port: gone from the node's store and from its held keys.
    let removed = t.remove(&peer, &[&keys[0][..], &ck("absent")]).unwrap();
    assert_eq!(removed, vec![true, false]);
    assert!(!node.exists_keys(&[&keys[0]])[0]);
    assert_eq!(port.held().len(), 39);
    port.shutdown();
}

#[test]
fn a_wrong_token_is_refused_counted_and_serves_nothing() {
    let (port, node) = port(b"right");
    let peer = port.local_addr().to_string();
    let bad = transport(b"wrong");
    let value = pattern(1, 1000);
    let k = ck("k");
    let r = bad.put(
        &peer,
        &[PutItem {
            key: &k,
            value: &value,
            depth: None,
        }],
    );
    // The node's proof does not verify under the wrong token: the client refuses the node
    // before it proves anything itself.
    assert!(
        matches!(r[0], Err(TransportError::NotAuthentic { .. })),
        "{r:?}"
    );
    assert!(
        !node.exists_keys(&[&k])[0],
        "an unauthenticated put was stored"
    );
    // The right token still works on the same port.
    let good = transport(b"right");
    let r = good.put(
        &peer,
        &[PutItem {
            key: &k,
            value: &value,
            depth: None,
        }],
    );
    assert!(r[0].is_ok(), "{r:?}");
    // A raw client that skips the hello gets nothing either.
    use std::io::{Read, Write};
    let mut raw = std::net::TcpStream::connect(port.local_addr()).unwrap();
    let mut frame = Vec::new();
    let get = kvtier_proto::peer::PeerGet {
        key: k.clone(),
        expected_len: 1000,
    };
    kvtier_proto::encode_frame(&mut frame, kvtier_proto::Opcode::PeerGet, 1, 0, &get).unwrap();
    raw.write_all(&frame).unwrap();
    let mut reply = Vec::new();
    raw.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = raw.read_to_end(&mut reply);
    let header = kvtier_proto::FrameHeader::decode(&reply).unwrap();
    assert!(header.is_error());
    assert!(reply.len() < 200, "object bytes were sent before the hello");
    assert_eq!(
        port.counters().refused_unauthorized.load(Ordering::Relaxed),
        1
    );
    port.shutdown();
}

#[test]
fn a_dead_peer_fails_fast_and_others_keep_working() {
    let (port, _node) = port(b"t");
    let live = port.local_addr().to_string();
    // A port nothing listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let t = transport(b"t");
    let value = pattern(2, 4096);
    let x = ck("x");
    let item = [PutItem {
        key: &x,
        value: &value,
        depth: None,
    }];
    let r = t.put(&dead, &item);
    assert!(
        r[0].as_ref().is_err_and(TransportError::is_unreachable),
        "{r:?}"
    );
    // Marked down: the next call fails at once, without a connect attempt.
    let start = Instant::now();
    let r = t.put(&dead, &item);
    assert!(
        matches!(r[0], Err(TransportError::PeerDown { .. })),
        "{r:?}"
    );
    assert!(start.elapsed() < Duration::from_millis(50));
    assert!(t.put(&live, &item)[0].is_ok());
    let r = t.put("not-an-address", &item);
    assert!(matches!(r[0], Err(TransportError::Connect { .. })), "{r:?}");
    port.shutdown();
}

/// Issue 26: a member of the cluster (it holds the token) cannot reach a local tenant's keys
/// in the node's store over the data port: get, put, remove, demote, clear and UCX lease and
/// reserve naming such a key are refused whole (a typed code, counted), nothing is touched,
/// and the same connection keeps serving cluster keys.
#[test]
fn keys_outside_the_cluster_namespace_are_refused_on_every_op() {
    use kvtier_proto::peer::peer_error_code::OUTSIDE_CLUSTER_NAMESPACE;
    use kvtier_proto::peer_ucx::{
        UcxLeaseReply, UcxLeaseRequest, UcxReserveReply, UcxReserveRequest,
    };
    use kvtier_proto::Opcode;

    let (port, node) = port(b"tok");
    let peer = port.local_addr().to_string();
    // A local session of tenant team-a stored this (the server's own namespacing).
    let mut local = kvtier_proto::namespace::tenant_prefix("team-a");
    local.extend_from_slice(b"secret-page");
    let secret = pattern(9, 4096);
    node.put_slice(&local, &secret, None).unwrap();
    let member = transport(b"tok");
    let refused = |e: &TransportError| {
        matches!(e, TransportError::Refused { code, message, .. }
            if *code == OUTSIDE_CLUSTER_NAMESPACE && message.contains("outside the cluster namespace"))
    };

    // get (with the trailer's length and without), put over it, plant a new one.
    let mut dst = vec![0u8; secret.len()];
    let r = member.get(
        &peer,
        &mut [GetItem {
            key: &local,
            dst: &mut dst,
        }],
    );
    assert!(r[0].as_ref().is_err_and(refused), "{r:?}");
    let forged = pattern(10, 4096);
    let planted = [&local[..], b"-new"].concat();
    for key in [&local, &planted, &b"raw-key".to_vec()] {
        let r = member.put(
            &peer,
            &[PutItem {
                key,
                value: &forged,
                depth: None,
            }],
        );
        assert!(r[0].as_ref().is_err_and(refused), "{r:?}");
    }
    // remove and demote: a batch with one such key is refused whole (the cluster key in it
    // too).
    let cluster_key = ck("mine");
    assert!(member.put(
        &peer,
        &[PutItem {
            key: &cluster_key,
            value: &forged,
            depth: None
        }]
    )[0]
    .is_ok());
    let e = member.remove(&peer, &[&cluster_key, &local]).unwrap_err();
    assert!(refused(&e), "{e:?}");
    let e = member.demote(&peer, &[&local]).unwrap_err();
    assert!(refused(&e), "{e:?}");
    // clear (and its listing) of the tenant's prefix, of everything, of a non-cluster prefix.
    for prefix in [&b"team-a\x1f"[..], b"", b"\x1f", b"\0"] {
        let e = member.clear_prefix(&peer, prefix).unwrap_err();
        assert!(refused(&e), "{prefix:?}: {e:?}");
    }
    // UCX lease and reservation of the key (refused before the UCX plane is asked).
    let e = member
        .control::<UcxLeaseReply>(
            &peer,
            Opcode::PeerUcxLease,
            &UcxLeaseRequest {
                objects: vec![(local.clone(), 4096 + 16)],
            },
        )
        .unwrap_err();
    assert!(refused(&e), "{e:?}");
    let e = member
        .control::<UcxReserveReply>(
            &peer,
            Opcode::PeerUcxReserve,
            &UcxReserveRequest {
                objects: vec![(planted.clone(), 4096 + 16, None)],
            },
        )
        .unwrap_err();
    assert!(refused(&e), "{e:?}");

    // Nothing touched: the tenant's object is intact, nothing planted, nothing held.
    let mut back = vec![0u8; secret.len()];
    node.get_into_slice(&local, &mut back).unwrap();
    assert_eq!(back, secret);
    assert!(!node.exists_keys(&[&planted])[0]);
    assert_eq!(
        port.counters()
            .refused_outside_namespace
            .load(Ordering::Relaxed),
        12
    );
    // The member's own cluster objects are still served, and its clear lists only them.
    let mut dst = vec![0u8; forged.len()];
    let r = member.get(
        &peer,
        &mut [GetItem {
            key: &cluster_key,
            dst: &mut dst,
        }],
    );
    assert!(r[0].is_ok(), "{r:?}");
    assert_eq!(dst, forged);
    let cleared = member
        .clear_prefix(&peer, &kvtier_proto::namespace::cluster_prefix(""))
        .unwrap();
    assert!(cleared.is_empty(), "the untagged clear took {cleared:?}");
    let cleared = member
        .clear_prefix(&peer, kvtier_proto::namespace::CLUSTER_MARK)
        .unwrap();
    assert_eq!(cleared, vec![cluster_key]);
    node.get_into_slice(&local, &mut back).unwrap();
    assert_eq!(back, secret);
    port.shutdown();
}

/// Stopping the port waits for its connection threads: each holds the port's state (and with
/// it the store and, on a node, the UCX node), which must be gone when `shutdown` returns so
/// that nothing of it is torn down during the process's exit (a UCX node's teardown racing
/// exit aborted a stopped node). Authenticated connections, a request in flight and raw
/// half-open ones are all open when it stops.
#[test]
fn shutdown_returns_after_every_connection_thread_has_ended() {
    for round in 0..5 {
        let (port, node) = port(b"s3cret");
        let peer = port.local_addr().to_string();
        let t = transport(b"s3cret");
        let value = pattern(round, 256 << 10);
        let key = ck(&format!("stop-{round}"));
        let put = t.put(
            &peer,
            &[PutItem {
                key: &key,
                value: &value,
                depth: None,
            }],
        );
        assert!(put.iter().all(Result::is_ok), "{put:?}");
        // Raw connections that never finish a handshake.
        let raw: Vec<std::net::TcpStream> = (0..4)
            .map(|_| std::net::TcpStream::connect(&peer).unwrap())
            .collect();
        // A reader busy with gets while the port stops.
        let reader = {
            let peer = peer.clone();
            let key = key.clone();
            std::thread::spawn(move || {
                let mut buffer = vec![0u8; 256 << 10];
                for _ in 0..50 {
                    let _ = t.get(
                        &peer,
                        &mut [GetItem {
                            key: &key,
                            dst: &mut buffer,
                        }],
                    );
                }
            })
        };
        let deadline = Instant::now() + Duration::from_secs(3);
        while port.open_connections() < 5 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        port.shutdown();
        assert_eq!(
            Arc::strong_count(&node),
            1,
            "round {round}: a connection thread still holds the port's state after shutdown"
        );
        reader.join().unwrap();
        drop(raw);
    }
}
