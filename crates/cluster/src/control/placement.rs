//! Where a new sandbox goes: best of k. Of the live nodes that can take one more sandbox
//! (not leaving, reachable, under their own cap, with memory for it), `k` are sampled at
//! random and the one with the most free memory per sandbox it would then run is chosen (free
//! CPU breaks ties), so load spreads without every replica piling onto the same "best" node
//! at once.

use crate::nodes::NodeInfo;

/// How many candidates are compared.
pub const DEFAULT_K: usize = 2;

/// Whether `n` can take a sandbox of `memory_mb`.
pub fn eligible(n: &NodeInfo, memory_mb: u64) -> bool {
    !n.leaving && !n.address.is_empty() && room(n, memory_mb, 1) == 1
}

/// How many of `want` sandboxes of `memory_mb` node `n` has room for: under its own cap, and
/// within its free memory (a node that reports none is not limited by it).
pub fn room(n: &NodeInfo, memory_mb: u64, want: u32) -> u32 {
    let mut room = want;
    if n.capacity.max_sandboxes > 0 {
        room = room.min(n.capacity.max_sandboxes.saturating_sub(n.load.sandboxes));
    }
    if n.load.free_memory_mb > 0 && memory_mb > 0 {
        room = room.min(u32::try_from(n.load.free_memory_mb / memory_mb).unwrap_or(u32::MAX));
    }
    room
}

/// The higher, the better a home for one more sandbox: free memory per sandbox it would run,
/// then free CPU.
pub fn score(n: &NodeInfo) -> (u64, u32) {
    let free = if n.load.free_memory_mb > 0 {
        n.load.free_memory_mb
    } else {
        n.capacity.memory_mb
    };
    (
        free / (u64::from(n.load.sandboxes) + 1),
        n.load.free_cpu_milli,
    )
}

/// The node for a sandbox of `memory_mb` among `nodes`: the best of `k` sampled with
/// `pick(n)` (a random index below `n`). None when no node is eligible.
pub fn place(
    nodes: &[NodeInfo],
    memory_mb: u64,
    k: usize,
    mut pick: impl FnMut(usize) -> usize,
) -> Option<&NodeInfo> {
    let mut pool: Vec<&NodeInfo> = nodes.iter().filter(|n| eligible(n, memory_mb)).collect();
    let mut best: Option<&NodeInfo> = None;
    for _ in 0..k.max(1) {
        if pool.is_empty() {
            break;
        }
        let c = pool.swap_remove(pick(pool.len()) % pool.len());
        if best.is_none_or(|b| score(c) > score(b)) {
            best = Some(c);
        }
    }
    best
}

/// A random index below `n`.
pub fn random_index(n: usize) -> usize {
    let r = u64::from_le_bytes(
        uuid::Uuid::new_v4().as_bytes()[..8]
            .try_into()
            .unwrap_or_default(),
    );
    (r % n.max(1) as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::{NodeCapacity, NodeLoad};

    fn node(name: &str, free: u64, sandboxes: u32) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            address: format!("{name}:1"),
            capacity: NodeCapacity {
                cpus: 2,
                memory_mb: 8192,
                disk_mb: 0,
                max_sandboxes: 10,
            },
            load: NodeLoad {
                free_memory_mb: free,
                sandboxes,
                free_cpu_milli: 1000,
            },
            joined_at_ms: 0,
            leaving: false,
            templates: Vec::new(),
            objects: false,
            builds: false,
            lease_id: 1,
        }
    }

    #[test]
    fn room_is_the_tighter_of_the_cap_and_the_memory() {
        let uncapped = |free, running| {
            let mut n = node("n", free, running);
            n.capacity.max_sandboxes = 0;
            n
        };
        assert_eq!(room(&uncapped(0, 0), 512, 5), 5, "no cap, no reading: all");
        assert_eq!(room(&node("n", 0, 8), 512, 5), 2, "cap 10, 8 running");
        assert_eq!(room(&node("n", 0, 12), 512, 5), 0, "over its cap");
        assert_eq!(room(&uncapped(1100, 3), 512, 5), 2);
        let mut capped = node("n", 1100, 1);
        capped.capacity.max_sandboxes = 4;
        assert_eq!(room(&capped, 512, 5), 2);
        assert_eq!(room(&uncapped(100, 0), 512, 5), 0);
    }

    #[test]
    fn the_better_of_the_sampled_wins() {
        let nodes = [node("a", 1000, 4), node("b", 4000, 1), node("c", 8000, 0)];
        // Sampling a then b: b is better.
        let mut seq = [0usize, 0].into_iter();
        let got = place(&nodes, 256, 2, |_| seq.next().unwrap_or(0)).unwrap();
        assert_eq!(
            got.name, "c",
            "swap_remove puts c at index 0 after a is taken"
        );
        let all = place(&nodes, 256, 3, random_index).unwrap();
        assert_eq!(all.name, "c", "with k = every node, the best one is chosen");
    }

    #[test]
    fn ineligible_nodes_are_never_chosen() {
        let mut full = node("full", 8000, 10);
        full.capacity.max_sandboxes = 10;
        let mut leaving = node("leaving", 8000, 0);
        leaving.leaving = true;
        let mut hidden = node("hidden", 8000, 0);
        hidden.address.clear();
        let small = node("small", 100, 0);
        let nodes = [full, leaving, hidden, small, node("ok", 500, 3)];
        for _ in 0..50 {
            assert_eq!(place(&nodes, 256, 2, random_index).unwrap().name, "ok");
        }
        assert!(place(&nodes[..4], 256, 2, random_index).is_none());
        assert!(place(&[], 256, 2, random_index).is_none());
    }

    #[test]
    fn free_cpu_breaks_a_tie_in_memory() {
        let mut busy = node("busy", 4000, 1);
        busy.load.free_cpu_milli = 100;
        let nodes = [busy, node("idle", 4000, 1)];
        assert_eq!(place(&nodes, 256, 2, random_index).unwrap().name, "idle");
    }

    #[test]
    fn load_spreads_over_equal_nodes() {
        let mut nodes = vec![node("a", 8000, 0), node("b", 8000, 0)];
        for _ in 0..20 {
            let name = place(&nodes, 256, 2, random_index).unwrap().name.clone();
            let n = nodes.iter_mut().find(|n| n.name == name).unwrap();
            n.load.sandboxes += 1;
            n.load.free_memory_mb -= 256;
        }
        let (a, b) = (nodes[0].load.sandboxes, nodes[1].load.sandboxes);
        assert_eq!(a + b, 20);
        assert!(a.abs_diff(b) <= 1, "a={a} b={b}");
    }
}
