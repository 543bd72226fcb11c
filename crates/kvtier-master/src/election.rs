//! Leadership among several masters, decided by etcd.
//!
//! Each master holds an etcd lease (TTL `election_ttl`) kept alive while the process runs, and
//! campaigns by creating the election key with that lease in a transaction that succeeds only
//! if the key does not exist (`create_revision == 0`). The winner is the leader; the key's value
//! is its advertised RPC address, which followers read and report. When the leader dies its
//! lease lapses, etcd deletes the key and the next campaign of a follower wins.
//!
//! The directory is not kept in etcd: a new leader starts empty and every node re-registers
//! (its heartbeat is answered `known = false`) with the keys it holds, so the directory is
//! rebuilt from the nodes, which hold the bytes anyway. That keeps etcd off the put path (a
//! put costs one master round trip, not an etcd write), and an object is only ever listed
//! where a node reported it.
//!
//! Without etcd, [`Leadership::single`] makes the one master the leader for good.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp};
use parking_lot::RwLock;

use crate::directory::Directory;

/// Whether this master leads, and who does.
#[derive(Debug, Default)]
pub struct Leadership {
    is_leader: AtomicBool,
    leader_address: RwLock<String>,
}

impl Leadership {
    /// The single-master mode: this master leads for good.
    pub fn single(address: &str) -> Leadership {
        Leadership {
            is_leader: AtomicBool::new(true),
            leader_address: RwLock::new(address.to_string()),
        }
    }

    pub fn is_leader(&self) -> bool {
        self.is_leader.load(Ordering::Acquire)
    }

    pub fn leader_address(&self) -> String {
        self.leader_address.read().clone()
    }

    fn set(&self, leader: bool, address: &str) {
        *self.leader_address.write() = address.to_string();
        self.is_leader.store(leader, Ordering::Release);
    }
}

/// Settings of the etcd campaign.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    pub endpoints: Vec<String>,
    pub key: String,
    pub ttl: Duration,
    /// This master's RPC address as clients reach it.
    pub advertise: String,
}

/// Campaign forever: lead while the lease lives, follow otherwise. Becoming leader resets the
/// directory (nodes re-register with what they hold).
pub async fn campaign(
    config: ElectionConfig,
    leadership: Arc<Leadership>,
    directory: Arc<Directory>,
) {
    let ttl_secs = i64::try_from(config.ttl.as_secs().max(1)).unwrap_or(5);
    let poll = (config.ttl / 4).max(Duration::from_millis(100));
    loop {
        let result = campaign_once(&config, ttl_secs, poll, &leadership, &directory).await;
        if leadership.is_leader() {
            eprintln!("kvtier master: lost leadership");
        }
        leadership.set(false, "");
        if let Err(e) = result {
            eprintln!("kvtier master: etcd campaign failed ({e}); retrying");
        }
        tokio::time::sleep(poll).await;
    }
}

async fn campaign_once(
    config: &ElectionConfig,
    ttl_secs: i64,
    poll: Duration,
    leadership: &Leadership,
    directory: &Directory,
) -> Result<(), etcd_client::Error> {
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(2));
    let mut client = Client::connect(&config.endpoints, Some(options)).await?;
    let lease = client.lease_grant(ttl_secs, None).await?.id();
    let (mut keeper, mut replies) = client.lease_keep_alive(lease).await?;
    loop {
        keeper.keep_alive().await?;
        match replies.message().await? {
            Some(reply) if reply.ttl() > 0 => {}
            _ => return Ok(()), // the lease is gone: start over with a new one
        }
        if !leadership.is_leader() {
            let txn = Txn::new()
                .when([Compare::create_revision(
                    config.key.clone(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then([TxnOp::put(
                    config.key.clone(),
                    config.advertise.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            if client.txn(txn).await?.succeeded() {
                directory.reset();
                leadership.set(true, &config.advertise);
                eprintln!("kvtier master: elected leader ({})", config.advertise);
            } else {
                let current = client.get(config.key.clone(), None).await?;
                let leader = current
                    .kvs()
                    .first()
                    .and_then(|kv| kv.value_str().ok())
                    .unwrap_or("")
                    .to_string();
                leadership.set(false, &leader);
            }
        } else {
            // Still ours? (An operator may have deleted the key.)
            let current = client.get(config.key.clone(), None).await?;
            let ours = current.kvs().first().is_some_and(|kv| kv.lease() == lease);
            if !ours {
                return Ok(());
            }
        }
        tokio::time::sleep(poll).await;
    }
}
