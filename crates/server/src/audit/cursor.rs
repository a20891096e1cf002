//! Where a reader of the audit log (or the alerts) stands: [`Cursor`], the text of a page's
//! `nextCursor`. One host's log has one position, the cursor of the last record read (a
//! number). A cluster's records are kept by its nodes, each numbering its own, so a cluster's
//! cursor is each node's position at once ([`Cursor::Nodes`], written as base64url JSON): a
//! page merged from several nodes moves each node's position only past what it returned, so
//! nothing a node stores late is skipped.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde::{Deserialize, Serialize};

/// A position in the log: after this record (one host), or after these records (one per node).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Cursor {
    At(i64),
    Nodes(BTreeMap<String, i64>),
}

impl Cursor {
    /// One host's position (None: a cluster's cursor).
    pub fn local(&self) -> Option<i64> {
        match self {
            Cursor::At(n) => Some(*n),
            Cursor::Nodes(_) => None,
        }
    }

    /// A node's position in a cluster's cursor (0: nothing of that node read yet).
    pub fn of_node(&self, node: &str) -> i64 {
        match self {
            Cursor::Nodes(m) => m.get(node).copied().unwrap_or(0),
            Cursor::At(_) => 0,
        }
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cursor::At(n) => write!(f, "{n}"),
            Cursor::Nodes(m) => {
                let json = serde_json::to_vec(m).map_err(|_| fmt::Error)?;
                f.write_str(&URL_SAFE_NO_PAD.encode(json))
            }
        }
    }
}

impl FromStr for Cursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid cursor {s:?} (pass the nextCursor of an earlier page)");
        if let Ok(n) = s.parse::<i64>() {
            return if n >= 0 {
                Ok(Cursor::At(n))
            } else {
                Err(bad())
            };
        }
        let json = URL_SAFE_NO_PAD.decode(s).map_err(|_| bad())?;
        let m: BTreeMap<String, i64> = serde_json::from_slice(&json).map_err(|_| bad())?;
        if m.values().any(|n| *n < 0) {
            return Err(bad());
        }
        Ok(Cursor::Nodes(m))
    }
}

/// One page of a log and the cursor that follows it (present even when the page is empty, so
/// a poller resumes from it).
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Cursor,
}

impl<T> Page<T> {
    /// A page of one host's log: the position of its last item, else where it started.
    pub fn local(items: Vec<T>, after: Option<&Cursor>, pos: impl Fn(&T) -> i64) -> Self {
        let start = after.and_then(Cursor::local).unwrap_or(0);
        let next = Cursor::At(items.last().map(pos).unwrap_or(start));
        Self { items, next }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_read_back_as_written() {
        assert_eq!("17".parse::<Cursor>(), Ok(Cursor::At(17)));
        assert_eq!(Cursor::At(17).to_string(), "17");
        let c = Cursor::Nodes(BTreeMap::from([("n1".into(), 4), ("n2".into(), 90)]));
        let text = c.to_string();
        assert!(
            !text.contains(['+', '/', '=', '&']),
            "safe in a query: {text}"
        );
        assert_eq!(text.parse::<Cursor>(), Ok(c.clone()));
        assert_eq!((c.of_node("n2"), c.of_node("n3")), (90, 0));
        assert_eq!(c.local(), None);
    }

    #[test]
    fn bad_cursors_say_what_to_pass() {
        for bad in ["-1", "x!", "bm90IGpzb24", "eyJuMSI6LTF9"] {
            let e = bad.parse::<Cursor>().unwrap_err();
            assert!(e.contains("nextCursor"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_local_page_moves_to_its_last_item_or_stays() {
        let p = Page::local(vec![3, 5], Some(&Cursor::At(2)), |n| *n);
        assert_eq!(p.next, Cursor::At(5));
        let p = Page::local(Vec::<i64>::new(), Some(&Cursor::At(9)), |n| *n);
        assert_eq!(p.next, Cursor::At(9));
        let p = Page::local(Vec::<i64>::new(), None, |n| *n);
        assert_eq!(p.next, Cursor::At(0));
    }
}
