//! [`Directory::check_invariants`]: the invariants of the module docs (and of each part's
//! docs) as code, for the directory tests and the master's cost tests. It takes every lock in
//! the directory's order (repair, nodes, then each shard), so it sees one consistent state.

use super::*;

impl Directory {
    /// Check the directory's structural invariants; the first one broken is the error.
    ///
    /// - nodes: `nodes[i].index == i`, at most [`MAX_NODES`], node ids unique;
    /// - entries: each lives in the shard its hash picks, has at least one holder, no holder
    ///   twice, only registered node indexes, and wants 1 to [`MAX_REPLICAS`] copies;
    /// - repair: at most [`MAX_REPAIR_TASKS`] tasks, each task's source differs from its
    ///   target, and the per-source counts are exactly the tasks per source.
    pub fn check_invariants(&self) -> Result<(), String> {
        let repair = self.repair.lock();
        let nodes = self.nodes.read();
        if nodes.len() > MAX_NODES {
            return Err(format!("{} nodes, most {MAX_NODES}", nodes.len()));
        }
        let mut ids = std::collections::HashSet::new();
        for (i, n) in nodes.iter().enumerate() {
            if usize::from(n.index) != i {
                return Err(format!("node at {i} has index {}", n.index));
            }
            if !ids.insert(n.spec.node_id.as_str()) {
                return Err(format!("node id {:?} registered twice", n.spec.node_id));
            }
        }
        for (s, shard) in self.shards.iter().enumerate() {
            for (hash, r) in shard.read().iter() {
                if shard_index(*hash) != s {
                    return Err(format!(
                        "{hash:?} in shard {s}, belongs in {}",
                        shard_index(*hash)
                    ));
                }
                let holders: Vec<u16> = r.nodes().collect();
                if holders.is_empty() {
                    return Err(format!("{hash:?} has no holder"));
                }
                for (k, n) in holders.iter().enumerate() {
                    if holders[..k].contains(n) {
                        return Err(format!("{hash:?} lists node {n} twice"));
                    }
                    if usize::from(*n) >= nodes.len() {
                        return Err(format!("{hash:?} held by unregistered node {n}"));
                    }
                }
                if !(1..=MAX_REPLICAS).contains(&r.want()) {
                    return Err(format!("{hash:?} wants {} copies", r.want()));
                }
            }
        }
        if repair.tasks.len() > MAX_REPAIR_TASKS {
            return Err(format!(
                "{} repair tasks, most {MAX_REPAIR_TASKS}",
                repair.tasks.len()
            ));
        }
        let mut per_source: HashMap<u16, usize> = HashMap::new();
        for (hash, t) in &repair.tasks {
            if t.source == t.target {
                return Err(format!(
                    "{hash:?}: repair task copies node {} to itself",
                    t.source
                ));
            }
            *per_source.entry(t.source).or_insert(0) += 1;
        }
        if per_source != repair.per_source {
            return Err(format!(
                "per-source task counts {:?}, tasks say {per_source:?}",
                repair.per_source
            ));
        }
        Ok(())
    }
}
