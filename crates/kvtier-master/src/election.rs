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
//! A leader fences itself by time: it counts as leader only until `sent + TTL` of its last
//! keep-alive that etcd answered (`sent` = when this master sent it, so no later than etcd's
//! own expiry of the lease). A leader cut off from etcd therefore stops answering before its
//! lease can lapse and a follower can win, and two masters never both act as leader (up to
//! clock-rate drift between the hosts).
//!
//! A campaign that ends (the keep-alive stream broke: etcd restarted or was unreachable)
//! starts again with the same lease while etcd still has it (issue 29). etcd keeps leases
//! across its restart and re-arms them with their full TTL, so the election key stays bound to
//! the leader's lease: a leader that took a new lease could not win until the old one lapsed
//! (4-5.5 s with no leader after etcd was back for 0.5 s, with a 2 s TTL and its re-arm). With
//! the lease reused, the leader finds the key still its own and leads again within a poll of
//! etcd's return; a lease etcd no longer has is replaced by a new one.
//!
//! Without etcd, [`Leadership::single`] makes the one master the leader for good.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp};
use parking_lot::RwLock;

use crate::directory::Directory;

/// Whether this master leads, and who does.
#[derive(Debug, Default)]
pub struct Leadership {
    is_leader: AtomicBool,
    leader_address: RwLock<String>,
    /// Leads only until then (the etcd lease may lapse after it); `None`: no bound (single
    /// master).
    lead_until: RwLock<Option<Instant>>,
    /// Issue 27: the etcd lease of the current campaign, revoked by [`resign`] at a graceful
    /// stop so the election key goes at once instead of after the TTL.
    lease: RwLock<Option<i64>>,
}

impl Leadership {
    /// The single-master mode: this master leads for good.
    pub fn single(address: &str) -> Leadership {
        Leadership {
            is_leader: AtomicBool::new(true),
            leader_address: RwLock::new(address.to_string()),
            lead_until: RwLock::new(None),
            lease: RwLock::new(None),
        }
    }

    /// Leader now: elected and the lease's last renewal still covers this instant.
    pub fn is_leader(&self) -> bool {
        self.is_leader.load(Ordering::Acquire)
            && self
                .lead_until
                .read()
                .is_none_or(|until| Instant::now() < until)
    }

    /// The lease is known to live until at least `until`.
    fn renewed(&self, until: Instant) {
        *self.lead_until.write() = Some(until);
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
        if leadership.is_leader.load(Ordering::Acquire) {
            tracing::warn!("kvtier master: lost leadership");
            leadership.set(false, "");
            // A follower serves no directory; the next win starts from the nodes' reports.
            directory.reset();
        }
        leadership.set(false, "");
        if let Err(e) = result {
            tracing::warn!("kvtier master: etcd campaign failed ({e}); retrying");
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
    // The last campaign's lease, while etcd still has it: an election key bound to it is
    // still ours (a new lease would wait for it to lapse).
    let previous = *leadership.lease.read();
    let reused = match previous {
        Some(id) => match client.lease_time_to_live(id, None).await {
            Ok(r) if r.ttl() > 0 => Some(id),
            Ok(_) => None,
            // "lease not found" and the like: take a new one.
            Err(etcd_client::Error::GRpcStatus(_)) => None,
            Err(e) => return Err(e),
        },
        None => None,
    };
    let lease = match reused {
        Some(id) => {
            tracing::info!("kvtier master: campaigning again with etcd lease {id:x}");
            id
        }
        None => client.lease_grant(ttl_secs, None).await?.id(),
    };
    *leadership.lease.write() = Some(lease);
    let (mut keeper, mut replies) = client.lease_keep_alive(lease).await?;
    let ttl = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(1));
    loop {
        let sent = Instant::now();
        keeper.keep_alive().await?;
        // A stream that stops answering must not stall the campaign: the lease lapses anyway.
        match tokio::time::timeout(ttl, replies.message()).await {
            Ok(reply) => match reply? {
                Some(reply) if reply.ttl() > 0 => {
                    let granted = Duration::from_secs(u64::try_from(reply.ttl()).unwrap_or(0));
                    leadership.renewed(sent + granted.min(ttl));
                }
                _ => return Ok(()), // the lease is gone: start over with a new one
            },
            Err(_) => return Ok(()),
        }
        if !leadership.is_leader.load(Ordering::Acquire) {
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
                tracing::info!("kvtier master: elected leader ({})", config.advertise);
            } else {
                let current = client.get(config.key.clone(), None).await?;
                let kv = current.kvs().first();
                if kv.is_some_and(|kv| kv.lease() == lease) {
                    // Ours already (a put whose reply was lost): lead, from an empty directory.
                    directory.reset();
                    leadership.set(true, &config.advertise);
                    tracing::info!("kvtier master: elected leader ({})", config.advertise);
                } else {
                    let leader = kv
                        .and_then(|kv| kv.value_str().ok())
                        .unwrap_or("")
                        .to_string();
                    leadership.set(false, &leader);
                }
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

/// Issue 27: step down at a graceful stop (the campaign task already ended): stop answering
/// as leader, and revoke the campaign's etcd lease, which deletes the election key, so a
/// follower's next campaign poll (TTL / 4) wins instead of waiting out the TTL. Bounded by
/// 2 s; if etcd cannot be reached the lease simply lapses after the TTL.
pub async fn resign(endpoints: &[String], leadership: &Leadership) {
    let was_leader = leadership.is_leader.load(Ordering::Acquire);
    leadership.set(false, "");
    let Some(lease) = leadership.lease.write().take() else {
        return;
    };
    let revoke = async {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(1));
        let mut client = Client::connect(endpoints, Some(options)).await?;
        client.lease_revoke(lease).await
    };
    match tokio::time::timeout(Duration::from_secs(2), revoke).await {
        Ok(Ok(_)) if was_leader => {
            tracing::info!("kvtier master: resigned leadership (etcd lease {lease:x} revoked)")
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(
            "kvtier master: could not revoke the etcd lease {lease:x} ({e}); a follower leads \
             once it lapses"
        ),
        Err(_) => tracing::warn!(
            "kvtier master: etcd did not answer the lease revocation within 2 s; a follower \
             leads once the lease lapses"
        ),
    }
}
