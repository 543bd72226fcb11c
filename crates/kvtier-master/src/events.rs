//! The cluster KV-event stream of `kvtier master` (issue 30): what the whole cluster holds, in
//! vLLM's KV-event wire protocol (the publisher, replay and snapshot of the `kvtier-events`
//! crate, the same as the host stream of `kvtier serve`).
//!
//! Owns: the side map from directory key hash to the block it belongs to (the directory
//! keeps only 128-bit hashes; the full keys arrive at registration and commit, and are mapped
//! through the key schemes there), the published blocks (one per engine page group, e.g. an
//! SGLang page whatever its components and side pools, a vLLM block of one KV group; named
//! by their group with its cluster namespace) with the holders each was last seen with, and
//! the leader-only rule. A key no engine event names (LMCache chunks, SGLang pages with a
//! hash shorter than 16 hex digits) is counted (`unmapped`), never published.
//!
//! Semantics: a block is **stored** when the directory first lists a live holder of one of
//! its objects (registration, `AddNodeKeys`, `CommitPuts`) and **removed** when it lists none
//! for any of them any more (`ReportDropped`, `Forget`, a node that leaves, dies or
//! re-registers without them). Every
//! change is read back from the directory under the stream's lock, so the stream converges
//! on the directory whatever the order of concurrent RPCs.
//!
//! **Holders**: each node holding a block is one residency, published under `ownership`
//! `kvtier:<node id>`: a block's holders are the union of its objects' holders, a node that
//! joins them (registration, a put, a copy made by re-replication or repair) is a
//! `BlockStored` for that node, one that leaves them (a drop, death, departure, a
//! re-registration without the block) a `BlockRemoved` for that node; within one change new
//! holders are published before lost ones. `medium` is nil: the directory knows nodes, not
//! their tiers. A snapshot lists each block once per current holder.
//!
//! **Leader only, with a reset.** A follower publishes nothing. A master that becomes leader
//! starts with a batch holding `AllBlocksCleared` and then a `BlockStored` for every block it
//! knew that its directory holds (after an election its directory starts empty: nodes
//! re-register, and their blocks follow as `BlockStored`; a lapse of the lease's renewal
//! keeps the directory, and the reset batch restates it), and a leader that loses the lead
//! publishes `AllBlocksCleared` too. Sequence numbers are per master process, so a router
//! subscribes to every master's endpoint and treats an `AllBlocksCleared` as "forget what
//! this stream said": after a failover the new leader's stream starts with one, so a
//! subscriber can tell a failover from a gap (a gap is a sequence jump on one stream, replayed
//! from the replay endpoint). The transition is noticed within one tick (50 ms) or by the
//! first RPC that changes the directory, whichever is first.
//!
//! A snapshot's prefix is matched against a block's engine group (`vllm/<model>_<digest>/`,
//! an SGLang tag `tag/`, or empty for everything), as on the host stream.
//!
//! Bounded: at most `max_blocks` blocks tracked, at most [`MAX_MEMBERS`] objects each (more
//! are counted as `untracked` and not published, so the stream never claims a block it could
//! not later remove), and the publisher's own bounds.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use kvtier_events::encode::{self, Event, Mapped};
use kvtier_events::{EventsError, HeldSet, Holder, Owned, Stream, StreamConfig, TICK};
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::directory::{key_hash, Directory, KeyHash};
use crate::election::Leadership;

/// Prometheus counters (`kvtier master --metrics-addr`): keys no engine event names, blocks
/// over the tracking bounds, and resets published on becoming leader.
pub const EVENTS_UNMAPPED: &str = "kvtier_master_events_unmapped_total";
pub const EVENTS_UNTRACKED: &str = "kvtier_master_events_untracked_total";
pub const EVENTS_RESETS: &str = "kvtier_master_events_resets_total";

/// Most objects (components, side pools) tracked per block.
pub const MAX_MEMBERS: usize = 64;
/// Most node ids interned as `ownership` strings before the interner restarts.
const MAX_OWNERS: usize = 4096;

/// The stream's settings (`kvtier master --events-*`).
#[derive(Clone, Debug)]
pub struct ClusterEventsConfig {
    /// The publisher's endpoints and bounds.
    pub stream: StreamConfig,
    /// Most blocks tracked (about 200 bytes each).
    pub max_blocks: usize,
}

/// A published block.
struct Block {
    mapped: Mapped,
    /// Its tracked objects and the holders the directory lists for each (never empty).
    members: HashMap<KeyHash, Vec<Arc<str>>>,
    /// The holders published as holding the block (sorted): the union of the members'.
    holders: Vec<Arc<str>>,
}

/// What the stream has published as held (the side map of the module doc).
pub struct ClusterHeld {
    /// Engine group (with its cluster namespace) -> the block.
    blocks: HashMap<Arc<[u8]>, Block>,
    /// Directory key hash -> its block's group.
    members: HashMap<KeyHash, Arc<[u8]>>,
    /// Node id -> its `ownership` (`kvtier:<node id>`), interned.
    owners: HashMap<String, Arc<str>>,
    leading: bool,
    max_blocks: usize,
}

impl HeldSet for ClusterHeld {
    fn snapshot(&self, prefix: &[u8]) -> Vec<(Holder, Mapped)> {
        if !self.leading {
            // A follower vouches for nothing (its last batch was a reset).
            return Vec::new();
        }
        self.blocks
            .iter()
            .filter(|(g, _)| encode::engine_key(g).starts_with(prefix))
            .flat_map(|(_, b)| {
                b.holders
                    .iter()
                    .map(|h| (Holder::new(Arc::clone(h), None), b.mapped))
            })
            .collect()
    }
}

/// Append `m` to the last event when it has the same kind and holder, else a new event. The
/// medium is not known to the master (nil).
fn push(out: &mut Vec<Owned>, owner: &Arc<str>, stored: bool, m: Mapped) {
    match out.last_mut() {
        Some((h, Event::Stored(v))) if stored && h.ownership == *owner => v.push(m),
        Some((h, Event::Removed(v))) if !stored && h.ownership == *owner => v.push(m),
        _ => out.push((
            Holder::new(Arc::clone(owner), None),
            if stored {
                Event::Stored(vec![m])
            } else {
                Event::Removed(vec![m])
            },
        )),
    }
}

impl ClusterHeld {
    /// The `ownership` of each node index in `holders` (sorted, no duplicates). An index
    /// with no node any more (it left between the two directory reads) holds nothing: the
    /// watcher's rescan settles it.
    fn holders(&mut self, holders: &[u16], names: &[String]) -> Vec<Arc<str>> {
        let mut out: Vec<Arc<str>> = holders
            .iter()
            .filter_map(|&n| names.get(usize::from(n)).filter(|id| !id.is_empty()))
            .map(|id| {
                let id = id.as_str();
                if let Some(o) = self.owners.get(id) {
                    return Arc::clone(o);
                }
                if self.owners.len() >= MAX_OWNERS {
                    self.owners.clear();
                }
                let o: Arc<str> = format!("kvtier:{id}").into();
                self.owners.insert(id.to_string(), Arc::clone(&o));
                o
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Forget everything (a reset).
    fn clear(&mut self) {
        self.blocks.clear();
        self.members.clear();
        self.owners.clear();
    }
}

/// The running cluster stream; [`ClusterEvents::stop`] ends its threads.
pub struct ClusterEvents {
    stream: Stream<ClusterHeld>,
    directory: Arc<Directory>,
    leadership: Arc<Leadership>,
    rescan: AtomicBool,
    untracked: AtomicU64,
    resets: AtomicU64,
    watcher: Mutex<Option<JoinHandle<()>>>,
}

impl ClusterEvents {
    /// Bind the endpoints and start the watcher (leadership changes, node drops).
    pub fn start(
        config: ClusterEventsConfig,
        directory: Arc<Directory>,
        leadership: Arc<Leadership>,
    ) -> Result<Arc<ClusterEvents>, EventsError> {
        let stream = Stream::start(
            config.stream,
            ClusterHeld {
                blocks: HashMap::new(),
                members: HashMap::new(),
                owners: HashMap::new(),
                leading: false,
                max_blocks: config.max_blocks,
            },
        )?;
        let events = Arc::new(ClusterEvents {
            stream,
            directory,
            leadership,
            rescan: AtomicBool::new(false),
            untracked: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            watcher: Mutex::new(None),
        });
        let e = Arc::clone(&events);
        let watcher = kvtier_events::stream::spawn("kvtier-cluster-events", move || e.watch())?;
        *events.watcher.lock() = Some(watcher);
        Ok(events)
    }

    /// The bound PUB address.
    pub fn endpoint(&self) -> SocketAddr {
        self.stream.endpoint()
    }

    /// The bound replay address.
    pub fn replay_endpoint(&self) -> Option<SocketAddr> {
        self.stream.replay_endpoint()
    }

    /// Bring the held set in line with the leadership: a change publishes a reset. Becoming
    /// leader, the reset is followed by what the directory holds of the blocks this master
    /// knew (after a failover the directory starts empty: nothing; after a lapse of the
    /// etcd lease's renewal that did not cost the lead, everything still held).
    fn sync_leadership(&self, held: &mut ClusterHeld) -> Vec<Owned> {
        let leader = self.leadership.is_leader();
        if leader == held.leading {
            return Vec::new();
        }
        held.leading = leader;
        tracing::info!(
            "kvtier master: cluster KV events: {} (AllBlocksCleared published)",
            if leader {
                "leading"
            } else {
                "no longer leading"
            }
        );
        let mut out = vec![(Holder::new("".into(), None), Event::Cleared)];
        if leader {
            self.resets.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(EVENTS_RESETS).increment(1);
            self.republish(held, &mut out);
        }
        out
    }

    /// Forget what was published and publish again the known blocks the directory holds.
    fn republish(&self, held: &mut ClusterHeld, out: &mut Vec<Owned>) {
        let members = std::mem::take(&mut held.members);
        let blocks = std::mem::take(&mut held.blocks);
        held.clear();
        let hashes: Vec<KeyHash> = members.keys().copied().collect();
        let holders = self.directory.locate_hashes(&hashes);
        let names = self.node_names();
        for (hash, nodes) in hashes.iter().zip(&holders) {
            let Some(group) = members.get(hash) else {
                continue;
            };
            if let Some(b) = blocks.get(group) {
                self.check(held, *hash, Some((group, b.mapped)), nodes, &names, out);
            }
        }
    }

    /// Keys whose holders may have changed (after the directory changed them): each is read
    /// back from the directory and published as stored or removed when that changed.
    pub fn touched<K: AsRef<[u8]>>(&self, keys: &[K]) {
        let mut mapped = Vec::with_capacity(keys.len());
        for key in keys {
            let key = key.as_ref();
            let group = kvtier_proto::keys::group_of(key);
            match encode::map_group(group) {
                Some(m) => mapped.push((key, (group, m))),
                None => {
                    self.stream.count_unmapped(1);
                    metrics::counter!(EVENTS_UNMAPPED).increment(1);
                }
            }
        }
        if mapped.is_empty() {
            return;
        }
        self.stream.update(|held| {
            let mut out = self.sync_leadership(held);
            if held.leading {
                let keys: Vec<&[u8]> = mapped.iter().map(|(k, _)| *k).collect();
                let holders = self.directory.locate_many(&keys);
                let names = self.node_names();
                for ((key, block), nodes) in mapped.iter().zip(&holders) {
                    self.check(held, key_hash(key), Some(*block), nodes, &names, &mut out);
                }
            }
            (out, ())
        });
    }

    /// A node dropped, left or re-registered: every tracked block is re-checked by the
    /// watcher within one tick.
    pub fn nodes_changed(&self) {
        self.rescan.store(true, Ordering::SeqCst);
    }

    /// Publish a change of one object's holders (`nodes`, from the directory): the block's
    /// holders are the union of its objects' holders, and each holder that joined it is a
    /// `BlockStored` under that holder's `ownership`, each that left a `BlockRemoved` (stored
    /// first: a move between nodes never shows the block absent). `new` names the block of
    /// an object not tracked yet (its group and name); without it such an object is ignored.
    fn check(
        &self,
        held: &mut ClusterHeld,
        hash: KeyHash,
        new: Option<(&[u8], Mapped)>,
        nodes: &[u16],
        names: &[String],
        out: &mut Vec<Owned>,
    ) {
        let holders = held.holders(nodes, names);
        let group = match held.members.get(&hash) {
            Some(g) => Arc::clone(g),
            None => {
                let Some((group, mapped)) = new.filter(|_| !holders.is_empty()) else {
                    return;
                };
                let g = if let Some((g, b)) = held.blocks.get_key_value(group) {
                    if b.members.len() >= MAX_MEMBERS {
                        self.count_untracked();
                        return;
                    }
                    Arc::clone(g)
                } else {
                    if held.blocks.len() >= held.max_blocks {
                        self.count_untracked();
                        return;
                    }
                    let g: Arc<[u8]> = group.into();
                    let block = Block {
                        mapped,
                        members: HashMap::new(),
                        holders: Vec::new(),
                    };
                    held.blocks.insert(Arc::clone(&g), block);
                    g
                };
                held.members.insert(hash, Arc::clone(&g));
                g
            }
        };
        let Some(b) = held.blocks.get_mut(&group) else {
            return;
        };
        if holders.is_empty() {
            b.members.remove(&hash);
            held.members.remove(&hash);
        } else {
            b.members.insert(hash, holders);
        }
        let mut union: Vec<Arc<str>> = b.members.values().flatten().cloned().collect();
        union.sort_unstable();
        union.dedup();
        for h in union.iter().filter(|h| !b.holders.contains(h)) {
            push(out, h, true, b.mapped);
        }
        for h in b.holders.iter().filter(|h| !union.contains(h)) {
            push(out, h, false, b.mapped);
        }
        b.holders = union;
        if b.members.is_empty() {
            held.blocks.remove(&group);
        }
    }

    fn count_untracked(&self) {
        self.untracked.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(EVENTS_UNTRACKED).increment(1);
    }

    /// Node index -> node id.
    fn node_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for n in self.directory.nodes() {
            let i = usize::from(n.index);
            if names.len() <= i {
                names.resize(i + 1, String::new());
            }
            names[i] = n.spec.node_id;
        }
        names
    }

    /// Re-check every tracked block against the directory.
    fn rescan_all(&self) {
        self.stream.update(|held| {
            let mut out = self.sync_leadership(held);
            if held.leading {
                let hashes: Vec<KeyHash> = held.members.keys().copied().collect();
                let holders = self.directory.locate_hashes(&hashes);
                let names = self.node_names();
                for (hash, nodes) in hashes.iter().zip(&holders) {
                    self.check(held, *hash, None, nodes, &names, &mut out);
                }
            }
            (out, ())
        });
    }

    fn watch(&self) {
        while !self.stream.stopping() {
            if self.rescan.swap(false, Ordering::SeqCst) {
                self.rescan_all();
            } else {
                self.stream.update(|held| (self.sync_leadership(held), ()));
            }
            std::thread::sleep(TICK);
        }
    }

    /// The stream's counters (`kvtier master`'s log and tests).
    pub fn stats(&self) -> Value {
        let mut m = self.stream.stats();
        m.insert(
            "untracked".into(),
            json!(self.untracked.load(Ordering::Relaxed)),
        );
        m.insert("resets".into(), json!(self.resets.load(Ordering::Relaxed)));
        Value::Object(m)
    }

    /// Stop the watcher and the publisher's threads.
    pub fn stop(&self) {
        self.stream.request_stop();
        if let Some(w) = self.watcher.lock().take() {
            let _ = w.join();
        }
        self.stream.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_events::encode::BlockHash;

    #[test]
    fn cluster_keys_of_one_sglang_page_name_one_block() {
        let page = "0123456789abcdef0123456789abcdef";
        for tag in ["", "ha"] {
            let mut groups = Vec::new();
            for component in ["k", "v", "swa"] {
                let mut key = kvtier_proto::namespace::cluster_prefix(tag);
                key.extend_from_slice(format!("{page}@feedface.{component}").as_bytes());
                let group = kvtier_proto::keys::group_of(&key);
                let m = encode::map_group(group).expect("an SGLang page maps");
                assert_eq!(m.hash, BlockHash::Signed(0x0123_4567_89ab_cdef));
                groups.push(group.to_vec());
            }
            groups.dedup();
            assert_eq!(groups.len(), 1, "one group for every component");
        }
    }

    fn spec(id: &str) -> crate::NodeSpec {
        crate::NodeSpec {
            node_id: id.into(),
            data_address: format!("{id}:1"),
            capacity_bytes: 1 << 30,
            free_bytes: 1 << 30,
            tags: Vec::new(),
        }
    }

    fn page_keys(page: &str) -> Vec<Vec<u8>> {
        ["k", "v"]
            .iter()
            .map(|c| {
                let mut key = kvtier_proto::namespace::cluster_prefix("");
                key.extend_from_slice(format!("{page}@feedface.{c}").as_bytes());
                key
            })
            .collect()
    }

    /// (owner, hash) of every held block, once per holder.
    fn held(events: &ClusterEvents) -> Vec<(String, BlockHash)> {
        let mut v: Vec<(String, BlockHash)> = events
            .stream
            .update(|h| (Vec::new(), h.snapshot(b"")))
            .into_iter()
            .map(|(o, m)| (o.ownership.to_string(), m.hash))
            .collect();
        v.sort_by_key(|(o, h)| (o.clone(), format!("{h:?}")));
        v
    }

    /// The watcher re-checks within a tick; a loaded machine gets 10 s.
    fn wait_held(events: &ClusterEvents, want: &[(String, BlockHash)]) {
        for _ in 0..200 {
            if held(events) == want {
                return;
            }
            std::thread::sleep(TICK);
        }
        assert_eq!(held(events), want);
    }

    #[test]
    fn blocks_follow_the_directory_and_a_node_drop() {
        let directory = Arc::new(Directory::new(
            std::time::Duration::from_secs(60),
            std::time::Duration::from_secs(60),
        ));
        let leadership = Arc::new(Leadership::single("127.0.0.1:1"));
        let config = ClusterEventsConfig {
            stream: StreamConfig {
                name: "kvtier master",
                endpoint_key: "--events-endpoint",
                replay_key: "--events-replay-endpoint",
                endpoint: "127.0.0.1:0".parse().unwrap(),
                replay_endpoint: None,
                topic: String::new(),
                buffer_batches: 16,
                max_subscribers: 1,
                subscriber_queue: 1,
            },
            max_blocks: 2,
        };
        let events = ClusterEvents::start(config, Arc::clone(&directory), leadership).unwrap();
        let (p1, p2, p3) = ("1".repeat(32), "2".repeat(32), "3".repeat(32));
        let a = directory.register(spec("a"), &page_keys(&p1)).unwrap();
        events.touched(&page_keys(&p1));
        directory.register(spec("b"), &page_keys(&p2)).unwrap();
        events.touched(&page_keys(&p2));
        let one = BlockHash::Signed(0x1111_1111_1111_1111);
        let two = BlockHash::Signed(0x2222_2222_2222_2222);
        assert_eq!(
            held(&events),
            vec![("kvtier:a".to_string(), one), ("kvtier:b".to_string(), two)]
        );
        // Over max_blocks: counted, not published; an unmappable key: counted.
        directory.add_keys(a, &page_keys(&p3)).unwrap();
        events.touched(&page_keys(&p3));
        events.touched(&[b"opaque".to_vec()]);
        assert_eq!(events.untracked.load(Ordering::Relaxed), 2);
        assert_eq!(events.stats()["unmapped"], 1);
        // One component dropped: the page is still held; both: removed.
        let p1_keys = page_keys(&p1);
        directory.drop_keys(a, &p1_keys[..1]);
        events.touched(&p1_keys[..1]);
        assert_eq!(held(&events).len(), 2);
        directory.drop_keys(a, &p1_keys[1..]);
        events.touched(&p1_keys[1..]);
        assert_eq!(held(&events), vec![("kvtier:b".to_string(), two)]);
        // A second holder is a second residency; a node that leaves is noticed by the watcher.
        directory.add_keys(a, &page_keys(&p2)).unwrap();
        events.touched(&page_keys(&p2));
        assert_eq!(
            held(&events),
            vec![("kvtier:a".to_string(), two), ("kvtier:b".to_string(), two)]
        );
        assert!(directory.leave("b"));
        events.nodes_changed();
        wait_held(&events, &[("kvtier:a".to_string(), two)]);
        assert!(directory.leave("a"));
        events.nodes_changed();
        wait_held(&events, &[]);
        let stats = events.stats();
        // The reset; a's p1, b's p2, a's copy of p2; and their three removals.
        assert_eq!(stats["published_stored"], 3);
        assert_eq!(stats["published_removed"], 3);
        assert_eq!(stats["published_cleared"], 1);
        events.stop();
    }
}
