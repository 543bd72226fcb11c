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
//!
//! # The campaign as a state machine (issue 29 §4)
//!
//! Every decision of the campaign is in [`Campaign::step`], which does no I/O: it is told the
//! outcome of the last etcd operation ([`EtcdReply`]) and the time, updates [`Leadership`]
//! (and resets the directory on a win or a loss), and names the next operation ([`EtcdOp`]).
//! [`campaign`] is only its executor against a real etcd; the deterministic simulation
//! (`tests/sim.rs`) executes the same operations against a simulated etcd with a simulated
//! clock, network delays, losses, partitions and etcd restarts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn,
    TxnOp,
};
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
        self.is_leader_at(Instant::now())
    }

    /// Leader at `now` (the directory's clock): elected and the lease's last renewal still
    /// covers that instant.
    pub fn is_leader_at(&self, now: Instant) -> bool {
        self.is_leader.load(Ordering::Acquire)
            && self.lead_until.read().is_none_or(|until| now < until)
    }

    /// The etcd lease of the current campaign (the simulation checks the election key is
    /// bound to it while this master leads).
    pub fn lease(&self) -> Option<i64> {
        *self.lease.read()
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

/// The next etcd operation the campaign wants done ([`Campaign::step`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdOp {
    /// Open a new connection (the previous one, and its keep-alive stream, are dropped).
    Connect,
    /// The remaining TTL of this lease.
    LeaseTimeToLive(i64),
    /// A new lease with this TTL in seconds.
    LeaseGrant(i64),
    /// Open the keep-alive stream of this lease.
    OpenKeepAlive(i64),
    /// Send one keep-alive on the stream and wait up to the TTL for its answer.
    KeepAlive,
    /// Create the election key, bound to this lease, unless it exists.
    CreateKey(i64),
    /// Read the election key.
    GetKey,
    /// Wait this long, keeping the connection (the poll between keep-alives).
    Sleep(Duration),
    /// Drop the connection and wait this long (the campaign ended; the next one connects).
    Backoff(Duration),
}

/// The outcome of the last [`EtcdOp`], as [`Campaign::step`] takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdReply {
    /// Nothing done yet (the first step).
    Start,
    Connected,
    /// The lease's remaining TTL in seconds (`None` or `<= 0`: etcd no longer has it).
    LeaseTtl(Option<i64>),
    Granted(i64),
    KeepAliveOpened,
    /// A keep-alive's answer: the TTL granted (`None`: the stream ended or no answer within
    /// the TTL; `<= 0`: the lease is gone).
    KeepAliveTtl(Option<i64>),
    /// Whether the key was created.
    Created(bool),
    /// The election key's lease and value, if it exists.
    Key(Option<(i64, String)>),
    /// A [`EtcdOp::Sleep`] or [`EtcdOp::Backoff`] is over.
    Slept,
    /// The operation failed (etcd unreachable, restarted, timed out ...): the campaign ends.
    Failed(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Connecting,
    CheckingLease(i64),
    Granting,
    Opening,
    KeepingAlive,
    Creating,
    /// Reading the key after a create that did not succeed.
    Reading,
    /// The leader reading the key: still bound to our lease?
    Confirming,
    Polling,
    BackingOff,
}

/// The campaign's decisions, without I/O: see the module docs.
#[derive(Debug)]
pub struct Campaign {
    key: String,
    advertise: String,
    ttl_secs: i64,
    poll: Duration,
    phase: Phase,
    /// When the keep-alive being answered was sent.
    sent: Instant,
}

impl Campaign {
    pub fn new(key: &str, advertise: &str, ttl: Duration, now: Instant) -> Campaign {
        Campaign {
            key: key.to_string(),
            advertise: advertise.to_string(),
            ttl_secs: i64::try_from(ttl.as_secs().max(1)).unwrap_or(5),
            poll: (ttl / 4).max(Duration::from_millis(100)),
            phase: Phase::BackingOff,
            sent: now,
        }
    }

    /// The election key's name.
    pub fn key(&self) -> &str {
        &self.key
    }

    fn ttl(&self) -> Duration {
        Duration::from_secs(u64::try_from(self.ttl_secs).unwrap_or(1))
    }

    /// The campaign ended (`why`: an error, or `None` when the lease or the key went): a
    /// leader steps down and forgets its directory; connect again after a poll.
    fn end(&mut self, why: Option<&str>, leadership: &Leadership, directory: &Directory) -> EtcdOp {
        if leadership.is_leader.load(Ordering::Acquire) {
            tracing::warn!("kvtier master: lost leadership");
            leadership.set(false, "");
            // A follower serves no directory; the next win starts from the nodes' reports.
            directory.reset();
        }
        leadership.set(false, "");
        if let Some(e) = why {
            tracing::warn!("kvtier master: etcd campaign failed ({e}); retrying");
        }
        self.phase = Phase::BackingOff;
        EtcdOp::Backoff(self.poll)
    }

    fn keep_alive(&mut self, now: Instant) -> EtcdOp {
        self.sent = now;
        self.phase = Phase::KeepingAlive;
        EtcdOp::KeepAlive
    }

    fn poll(&mut self) -> EtcdOp {
        self.phase = Phase::Polling;
        EtcdOp::Sleep(self.poll)
    }

    fn open(&mut self, lease: i64, leadership: &Leadership) -> EtcdOp {
        *leadership.lease.write() = Some(lease);
        self.phase = Phase::Opening;
        EtcdOp::OpenKeepAlive(lease)
    }

    fn win(&mut self, leadership: &Leadership, directory: &Directory) -> EtcdOp {
        directory.reset();
        leadership.set(true, &self.advertise);
        tracing::info!("kvtier master: elected leader ({})", self.advertise);
        self.poll()
    }

    /// Take the outcome of the last operation at `now` and name the next one.
    pub fn step(
        &mut self,
        reply: EtcdReply,
        now: Instant,
        leadership: &Leadership,
        directory: &Directory,
    ) -> EtcdOp {
        if let EtcdReply::Failed(e) = &reply {
            return self.end(Some(e), leadership, directory);
        }
        match (self.phase, reply) {
            (_, EtcdReply::Start) | (Phase::BackingOff, EtcdReply::Slept) => {
                self.phase = Phase::Connecting;
                EtcdOp::Connect
            }
            (Phase::Connecting, EtcdReply::Connected) => self.connected(leadership),
            (Phase::CheckingLease(id), EtcdReply::LeaseTtl(Some(ttl))) if ttl > 0 => {
                tracing::info!("kvtier master: campaigning again with etcd lease {id:x}");
                self.open(id, leadership)
            }
            (Phase::CheckingLease(_), EtcdReply::LeaseTtl(_)) => {
                self.phase = Phase::Granting;
                EtcdOp::LeaseGrant(self.ttl_secs)
            }
            (Phase::Granting, EtcdReply::Granted(id)) => self.open(id, leadership),
            (Phase::Opening, EtcdReply::KeepAliveOpened) | (Phase::Polling, EtcdReply::Slept) => {
                self.keep_alive(now)
            }
            (Phase::KeepingAlive, EtcdReply::KeepAliveTtl(Some(granted))) if granted > 0 => {
                self.kept_alive(granted, leadership, directory)
            }
            // The lease is gone, or the stream ended: start over.
            (Phase::KeepingAlive, EtcdReply::KeepAliveTtl(_)) => {
                self.end(None, leadership, directory)
            }
            (Phase::Creating, EtcdReply::Created(true)) => self.win(leadership, directory),
            (Phase::Creating, EtcdReply::Created(false)) => {
                self.phase = Phase::Reading;
                EtcdOp::GetKey
            }
            (Phase::Reading, EtcdReply::Key(kv)) => self.read_key(kv, leadership, directory),
            (Phase::Confirming, EtcdReply::Key(kv)) => {
                if kv.is_some_and(|(lease, _)| Some(lease) == leadership.lease()) {
                    self.poll()
                } else {
                    self.end(None, leadership, directory)
                }
            }
            (phase, reply) => {
                let why = format!("unexpected {reply:?} in {phase:?}");
                self.end(Some(&why), leadership, directory)
            }
        }
    }
    /// Connected: check the last campaign's lease while etcd may still have it (an election
    /// key bound to it is still ours; a new lease would wait for it to lapse), else grant one.
    fn connected(&mut self, leadership: &Leadership) -> EtcdOp {
        match leadership.lease() {
            Some(id) => {
                self.phase = Phase::CheckingLease(id);
                EtcdOp::LeaseTimeToLive(id)
            }
            None => {
                self.phase = Phase::Granting;
                EtcdOp::LeaseGrant(self.ttl_secs)
            }
        }
    }

    /// A keep-alive granted `granted` seconds (timed from when it was sent): a leader checks
    /// the key is still its own (an operator may have deleted it), a follower tries to take it.
    fn kept_alive(
        &mut self,
        granted: i64,
        leadership: &Leadership,
        directory: &Directory,
    ) -> EtcdOp {
        let granted = Duration::from_secs(u64::try_from(granted).unwrap_or(0));
        leadership.renewed(self.sent + granted.min(self.ttl()));
        let Some(lease) = leadership.lease() else {
            return self.end(Some("no lease"), leadership, directory);
        };
        if leadership.is_leader.load(Ordering::Acquire) {
            self.phase = Phase::Confirming;
            EtcdOp::GetKey
        } else {
            self.phase = Phase::Creating;
            EtcdOp::CreateKey(lease)
        }
    }

    /// The election key after a create that found it taken: ours already (a put whose reply
    /// was lost: lead, from an empty directory), or another master's (follow it and poll).
    fn read_key(
        &mut self,
        kv: Option<(i64, String)>,
        leadership: &Leadership,
        directory: &Directory,
    ) -> EtcdOp {
        match kv {
            Some((lease, _)) if Some(lease) == leadership.lease() => {
                self.win(leadership, directory)
            }
            other => {
                let leader = other.map(|(_, value)| value).unwrap_or_default();
                leadership.set(false, &leader);
                self.poll()
            }
        }
    }
}

/// The real etcd connection of [`campaign`].
#[derive(Default)]
struct EtcdLink {
    client: Option<Client>,
    stream: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

impl EtcdLink {
    /// Do `op` against etcd; every error becomes [`EtcdReply::Failed`].
    async fn execute(&mut self, op: EtcdOp, config: &ElectionConfig) -> EtcdReply {
        match self.try_execute(op, config).await {
            Ok(reply) => reply,
            Err(e) => EtcdReply::Failed(e.to_string()),
        }
    }

    fn client(&mut self) -> Result<&mut Client, etcd_client::Error> {
        self.client
            .as_mut()
            .ok_or_else(|| etcd_client::Error::InvalidArgs("not connected".into()))
    }

    /// One keep-alive on the open stream; a stream that stops answering must not stall the
    /// campaign (the lease lapses anyway), so the reply is awaited at most one TTL.
    async fn keep_alive(
        &mut self,
        config: &ElectionConfig,
    ) -> Result<EtcdReply, etcd_client::Error> {
        let Some((keeper, replies)) = self.stream.as_mut() else {
            return Ok(EtcdReply::KeepAliveTtl(None));
        };
        keeper.keep_alive().await?;
        match tokio::time::timeout(config.ttl.max(Duration::from_secs(1)), replies.message()).await
        {
            Ok(reply) => Ok(EtcdReply::KeepAliveTtl(reply?.map(|r| r.ttl()))),
            Err(_) => Ok(EtcdReply::KeepAliveTtl(None)),
        }
    }

    async fn try_execute(
        &mut self,
        op: EtcdOp,
        config: &ElectionConfig,
    ) -> Result<EtcdReply, etcd_client::Error> {
        Ok(match op {
            EtcdOp::Connect => {
                self.stream = None;
                self.client = None;
                let options = ConnectOptions::new()
                    .with_connect_timeout(Duration::from_secs(2))
                    .with_timeout(Duration::from_secs(2));
                self.client = Some(Client::connect(&config.endpoints, Some(options)).await?);
                EtcdReply::Connected
            }
            EtcdOp::LeaseTimeToLive(id) => {
                match self.client()?.lease_time_to_live(id, None).await {
                    Ok(r) => EtcdReply::LeaseTtl(Some(r.ttl())),
                    // "lease not found" and the like: take a new one.
                    Err(etcd_client::Error::GRpcStatus(_)) => EtcdReply::LeaseTtl(None),
                    Err(e) => return Err(e),
                }
            }
            EtcdOp::LeaseGrant(ttl) => {
                EtcdReply::Granted(self.client()?.lease_grant(ttl, None).await?.id())
            }
            EtcdOp::OpenKeepAlive(id) => {
                self.stream = Some(self.client()?.lease_keep_alive(id).await?);
                EtcdReply::KeepAliveOpened
            }
            EtcdOp::KeepAlive => self.keep_alive(config).await?,
            EtcdOp::CreateKey(lease) => {
                let txn = create_key_txn(config, lease);
                EtcdReply::Created(self.client()?.txn(txn).await?.succeeded())
            }
            EtcdOp::GetKey => {
                let current = self.client()?.get(config.key.clone(), None).await?;
                EtcdReply::Key(
                    current
                        .kvs()
                        .first()
                        .map(|kv| (kv.lease(), kv.value_str().unwrap_or("").to_string())),
                )
            }
            EtcdOp::Sleep(d) => {
                tokio::time::sleep(d).await;
                EtcdReply::Slept
            }
            EtcdOp::Backoff(d) => {
                self.stream = None;
                self.client = None;
                tokio::time::sleep(d).await;
                EtcdReply::Slept
            }
        })
    }
}

/// The election: create the key bound to `lease` only if nobody holds it.
fn create_key_txn(config: &ElectionConfig, lease: i64) -> Txn {
    Txn::new()
        .when([Compare::create_revision(
            config.key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then([TxnOp::put(
            config.key.clone(),
            config.advertise.clone(),
            Some(PutOptions::new().with_lease(lease)),
        )])
}

/// Campaign forever: lead while the lease lives, follow otherwise. Becoming leader resets the
/// directory (nodes re-register with what they hold). The decisions are [`Campaign::step`]'s;
/// this only executes its operations against etcd.
pub async fn campaign(
    config: ElectionConfig,
    leadership: Arc<Leadership>,
    directory: Arc<Directory>,
) {
    let mut machine = Campaign::new(&config.key, &config.advertise, config.ttl, directory.now());
    let mut link = EtcdLink::default();
    let mut reply = EtcdReply::Start;
    loop {
        let op = machine.step(reply, directory.now(), &leadership, &directory);
        reply = link.execute(op, &config).await;
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
