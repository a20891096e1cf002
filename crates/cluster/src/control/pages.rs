//! One page of a log several nodes keep (the audit records and the alerts of a cluster):
//! each node's page is read after that node's position in the reader's [`Cursor`], the pages
//! are merged oldest first, and the cursor that follows moves each node only past what the
//! merged page returned. A node's records arrive in its own order (a record a replica hands
//! over late comes after newer ones), so a merge by time alone could skip some; positions
//! per node never do.

use std::collections::{BTreeMap, VecDeque};

use kiln_server::audit::cursor::{Cursor, Page};
use kiln_server::store::{Result, StoreError};

/// Each node's position in `after` (none: from the start). One host's number is refused: a
/// cluster numbers nothing itself.
pub(super) fn positions(after: Option<&Cursor>) -> Result<BTreeMap<String, i64>> {
    match after {
        None | Some(Cursor::At(0)) => Ok(BTreeMap::new()),
        Some(Cursor::Nodes(m)) => Ok(m.clone()),
        Some(Cursor::At(_)) => Err(StoreError::Invalid(
            "this cursor is a number, and a kiln cluster's cursors are not: pass the \
             nextCursor of one of its pages (a record's own cursor is its node's)"
                .into(),
        )),
    }
}

/// Merges `pages` (a node's name and its items in its own order, each read after its
/// position in `start`) into at most `limit` items, taking the oldest front item each time
/// by `order` (its time and its position in its node's log; ties: the node first by name);
/// the cursor that follows.
pub(super) fn merge<T>(
    pages: Vec<(String, Vec<T>)>,
    mut start: BTreeMap<String, i64>,
    limit: usize,
    order: impl Fn(&T) -> (i64, i64),
) -> Page<T> {
    let mut fronts: Vec<(String, VecDeque<T>)> = pages
        .into_iter()
        .map(|(n, items)| (n, VecDeque::from(items)))
        .collect();
    fronts.sort_by(|a, b| a.0.cmp(&b.0));
    let mut items = Vec::new();
    while items.len() < limit {
        let oldest = fronts
            .iter()
            .enumerate()
            .filter_map(|(i, (_, q))| q.front().map(|t| (order(t).0, i)))
            .min();
        let Some((_, i)) = oldest else { break };
        let (node, q) = &mut fronts[i];
        let Some(t) = q.pop_front() else { break };
        start.insert(node.clone(), order(&t).1);
        items.push(t);
    }
    Page {
        items,
        next: Cursor::Nodes(start),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (ts, position) items.
    fn page(node: &str, items: &[(i64, i64)]) -> (String, Vec<(i64, i64)>) {
        (node.to_string(), items.to_vec())
    }

    fn read(
        logs: &BTreeMap<&str, Vec<(i64, i64)>>,
        after: &BTreeMap<String, i64>,
        limit: usize,
    ) -> Page<(i64, i64)> {
        let pages = logs
            .iter()
            .map(|(n, items)| {
                let from = after.get(*n).copied().unwrap_or(0);
                let rest: Vec<_> = items.iter().copied().filter(|i| i.1 > from).collect();
                page(n, &rest[..rest.len().min(limit)])
            })
            .collect();
        merge(pages, after.clone(), limit, |i| *i)
    }

    #[test]
    fn pages_are_oldest_first_and_move_each_node_past_what_they_returned() {
        let p = merge(
            vec![
                page("n2", &[(5, 1), (9, 2)]),
                page("n1", &[(7, 10), (8, 11)]),
            ],
            BTreeMap::from([("n3".to_string(), 4)]),
            3,
            |i| *i,
        );
        assert_eq!(p.items, vec![(5, 1), (7, 10), (8, 11)]);
        let Cursor::Nodes(m) = p.next else {
            panic!("a cluster's cursor")
        };
        // n2 moved past its first only; n3, not read, keeps its position.
        assert_eq!(
            m,
            BTreeMap::from([("n1".into(), 11), ("n2".into(), 1), ("n3".into(), 4)])
        );
    }

    #[test]
    fn paging_through_nodes_returns_every_item_once_even_those_stored_late() {
        // n1 stored a record of time 1 after one of time 50 (handed over late).
        let mut logs = BTreeMap::from([
            ("n1", vec![(10, 1), (50, 2), (1, 3), (60, 4)]),
            ("n2", vec![(20, 1), (30, 2), (40, 3)]),
        ]);
        let mut after = BTreeMap::new();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let p = read(&logs, &after, 2);
            seen.extend(p.items);
            let Cursor::Nodes(m) = p.next else { panic!() };
            after = m;
        }
        // More arrives on n2 while the reader pages.
        logs.get_mut("n2").unwrap().push((5, 4));
        loop {
            let p = read(&logs, &after, 2);
            if p.items.is_empty() {
                break;
            }
            seen.extend(p.items);
            let Cursor::Nodes(m) = p.next else { panic!() };
            after = m;
        }
        let mut want: Vec<_> = logs.values().flatten().copied().collect();
        want.sort();
        seen.sort();
        assert_eq!(seen, want, "every item once");
    }

    #[test]
    fn a_number_is_not_a_clusters_cursor() {
        assert!(positions(None).unwrap().is_empty());
        assert!(positions(Some(&Cursor::At(0))).unwrap().is_empty());
        let e = positions(Some(&Cursor::At(12))).unwrap_err().to_string();
        assert!(e.contains("nextCursor"), "{e}");
    }
}
