//! Issue 29 §3: a cluster put or get that fails says what happened, typed. Real processes:
//! one `kvtier master` (lease 1 s), one `kvtier serve --master` node (64 MiB), a cluster
//! client in this process.
//!
//! Under faults clients saw "malformed batch: no live node ... has room" and "malformed
//! batch: peer ... is marked down": nothing was malformed. Now each failure is a
//! [`ClientError::Object`] naming the key, with an [`ObjectError`] that says which part
//! failed, and [`ClientError::is_infrastructure`] tells the cluster's faults (no room, a node
//! down, no master) from the caller's (a buffer of the wrong size), in that order here: no
//! room, a caller's mistake, a node SIGKILLed, the master SIGKILLed. Issue 28: each also says,
//! typed, what it means for the item ([`ClientError::item_failure`]): a wrong length, a miss,
//! unavailable.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::TcpStream;
use std::time::Duration;

use common::{free_port, spawn_master, wait_alive, wait_for, NodeOpts};
use kvtier_client::cluster::ObjectError;
use kvtier_client::error::ItemFailure;
use kvtier_client::{Client, ClientError, KvtierConfig};

fn assert_not_malformed(e: &ClientError) {
    let text = e.to_string();
    assert!(!text.contains("malformed"), "{text}");
}

#[test]
fn cluster_failures_are_typed_and_named_for_what_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let mut master_proc = spawn_master(&master, 1000, &[]);
    wait_for(Duration::from_secs(10), "the master", || {
        TcpStream::connect(&master).is_ok()
    });
    let node = NodeOpts::new(dir.path(), &master, "node-a", "127.0.0.2");
    let mut node_proc = node.spawn();
    // Gives up on the master after 1 s (the shared config retries 5 s).
    let client = Client::open(KvtierConfig {
        cluster_master_retry_ms: 1000,
        ..common::cluster_config(&master, None)
    })
    .unwrap();
    wait_alive(&client, 1);

    // No room: the only node has 64 MiB.
    let big = vec![7u8; 80 << 20];
    let e = client.put_slice(b"too-big", &big, None).unwrap_err();
    eprintln!("test: no room: {e}");
    assert!(
        matches!(&e, ClientError::Object { key, error: ObjectError::NoRoom } if key == "too-big"),
        "{e:?}"
    );
    assert!(e.is_infrastructure(), "{e:?}");
    assert!(e.to_string().contains("no room"), "{e}");
    assert_not_malformed(&e);
    drop(big);

    // The caller's mistake: a buffer shorter than the object. Not the cluster's fault.
    let value = common::object_bytes(3, 4096);
    client.put_slice(b"small", &value, None).unwrap();
    let mut short = vec![0u8; 100];
    let e = client.get_into_slice(b"small", &mut short).unwrap_err();
    eprintln!("test: caller's buffer: {e}");
    // Issue 28: typed as a wrong length (it was a "malformed batch" text before).
    assert!(
        matches!(&e, ClientError::Object { key, error: ObjectError::WrongLength(_) } if key == "small"),
        "{e:?}"
    );
    assert_eq!(e.item_failure(), ItemFailure::WrongLength);
    assert!(!e.is_infrastructure(), "{e:?}");
    let mut whole = vec![0u8; value.len()];
    client.get_into_slice(b"small", &mut whole).unwrap();
    assert!(whole == value);
    // A miss is a miss, typed, and not a fault.
    let e = client.get_into_slice(b"absent", &mut whole).unwrap_err();
    assert_eq!(e.item_failure(), ItemFailure::Miss, "{e:?}");
    assert!(e.is_miss() && !e.is_infrastructure(), "{e:?}");

    // A node down (its lease has not lapsed yet): the node is named, as unavailable.
    node_proc.kill();
    let e = client.get_into_slice(b"small", &mut whole).unwrap_err();
    eprintln!("test: node down: {e}");
    assert!(
        matches!(&e, ClientError::Object { key, error: ObjectError::Node(_) } if key == "small"),
        "{e:?}"
    );
    assert!(e.is_infrastructure(), "{e:?}");
    // Issue 28: the lost connection is typed for the item: unavailable.
    assert_eq!(e.item_failure(), ItemFailure::Unavailable, "{e:?}");
    assert!(e.to_string().contains("node unavailable"), "{e}");
    assert_not_malformed(&e);

    // No master: a put says so.
    master_proc.kill();
    let e = client.put_slice(b"no-master", &value, None).unwrap_err();
    eprintln!("test: master down: {e}");
    assert!(
        matches!(
            &e,
            ClientError::Object {
                error: ObjectError::Master(_),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_infrastructure(), "{e:?}");
    assert!(e.to_string().contains("master unavailable"), "{e}");
    assert_not_malformed(&e);
}

/// Issue 29 (found by the chaos soak): a master with no live node registered (right after a
/// takeover, before the nodes' next heartbeat) answers a put as an unavailable cluster, not as
/// "no room": nothing is full.
#[test]
fn a_put_before_any_node_registered_is_unavailable_not_no_room() {
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _master_proc = spawn_master(&master, 1000, &[]);
    wait_for(Duration::from_secs(10), "the master", || {
        TcpStream::connect(&master).is_ok()
    });
    let client = Client::open(KvtierConfig {
        cluster_master_retry_ms: 500,
        ..common::cluster_config(&master, None)
    })
    .unwrap();
    let e = client
        .put_slice(b"early", &common::object_bytes(1, 4096), None)
        .unwrap_err();
    eprintln!("test: no node registered: {e}");
    assert!(e.is_infrastructure(), "{e:?}");
    assert!(e.to_string().contains("no live node is registered"), "{e}");
    assert!(!e.to_string().contains("no room"), "{e}");
    assert_not_malformed(&e);
}
