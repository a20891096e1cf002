//! A YAML document as a tree whose every node knows where it starts (line and column), read
//! from yaml-rust2's event parser; and locating a position inside a scalar's text in the
//! source (so a condition's error points at its line and column in the file).

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// A place in the file: byte index, line and column (both 1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pos {
    pub index: usize,
    pub line: usize,
    pub col: usize,
}

impl From<Marker> for Pos {
    fn from(m: Marker) -> Pos {
        Pos {
            index: m.index(),
            line: m.line(),
            col: m.col() + 1,
        }
    }
}

#[derive(Debug, Clone)]
pub enum Node {
    Scalar {
        text: String,
        /// Quoted (so `null`, `true`, numbers are strings).
        quoted: bool,
        at: Pos,
    },
    Seq(Vec<Node>, Pos),
    Map(Vec<(Node, Node)>, Pos),
}

impl Node {
    pub fn at(&self) -> Pos {
        match self {
            Node::Scalar { at, .. } | Node::Seq(_, at) | Node::Map(_, at) => *at,
        }
    }

    pub fn str(&self) -> Option<&str> {
        match self {
            Node::Scalar { text, .. } => Some(text),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Node::Scalar { text, quoted: false, .. } if text.is_empty() || text == "~" || text == "null")
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Node::Scalar { .. } => "a scalar",
            Node::Seq(..) => "a list",
            Node::Map(..) => "a mapping",
        }
    }
}

/// A YAML syntax error.
#[derive(Debug, Clone)]
pub struct YamlError {
    pub at: Pos,
    pub msg: String,
}

/// Parses `src` (one document; an empty file is an empty list).
pub fn load(src: &str) -> Result<Node, YamlError> {
    let mut p = Parser::new_from_str(src);
    let mut stack: Vec<Node> = Vec::new();
    // For mappings being built: a key waiting for its value.
    let mut keys: Vec<Option<Node>> = Vec::new();
    let mut root: Option<Node> = None;
    let mut docs = 0;
    loop {
        let (ev, m) = p.next_token().map_err(|e| YamlError {
            at: Pos::from(*e.marker()),
            msg: e.info().to_string(),
        })?;
        let at = Pos::from(m);
        let node = match ev {
            Event::StreamEnd => break,
            Event::DocumentStart => {
                docs += 1;
                if docs > 1 {
                    return Err(YamlError {
                        at,
                        msg: "a rules file holds one YAML document (found a second \"---\")".into(),
                    });
                }
                continue;
            }
            Event::Alias(_) => {
                return Err(YamlError {
                    at,
                    msg: "YAML aliases (*name) are not supported in rules files".into(),
                })
            }
            Event::SequenceStart(..) => {
                stack.push(Node::Seq(Vec::new(), at));
                keys.push(None);
                continue;
            }
            Event::MappingStart(..) => {
                stack.push(Node::Map(Vec::new(), at));
                keys.push(None);
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => {
                keys.pop();
                stack.pop().expect("balanced events")
            }
            Event::Scalar(text, style, ..) => Node::Scalar {
                quoted: !matches!(style, TScalarStyle::Plain),
                text,
                at,
            },
            _ => continue,
        };
        match stack.last_mut() {
            None => root = Some(node),
            Some(Node::Seq(items, _)) => items.push(node),
            Some(Node::Map(pairs, map_at)) => {
                let k = keys.last_mut().expect("a key slot per open node");
                match k.take() {
                    None => {
                        // The parser marks a block mapping where its first key ends; the
                        // mapping starts where that key does.
                        if pairs.is_empty() {
                            *map_at = node.at();
                        }
                        *k = Some(node)
                    }
                    Some(key) => pairs.push((key, node)),
                }
            }
            Some(Node::Scalar { .. }) => unreachable!("scalars are never open"),
        }
    }
    Ok(root.unwrap_or(Node::Seq(Vec::new(), Pos::default())))
}

/// Where byte `offset` of a scalar's text (the scalar starting at `at`) is in `src`: walks the
/// source from the scalar's start, matching its characters and skipping what YAML removed
/// (quotes, a block header, line breaks and indentation).
pub fn locate(src: &str, at: Pos, text: &str, offset: usize) -> Pos {
    let mut pos = at;
    let mut s = src.get(at.index..).unwrap_or("").chars().peekable();
    let want = text.get(..offset.min(text.len())).unwrap_or(text);
    let mut vals = want.chars().peekable();
    let mut budget = 4 * (want.len() + 64) + 1024;
    let step = |c: char, pos: &mut Pos| {
        pos.index += c.len_utf8();
        if c == '\n' {
            pos.line += 1;
            pos.col = 1;
        } else {
            pos.col += 1;
        }
    };
    while let Some(&v) = vals.peek() {
        let Some(&c) = s.peek() else { break };
        budget = budget.saturating_sub(1);
        if budget == 0 {
            break;
        }
        if c == v {
            vals.next();
            s.next();
            step(c, &mut pos);
        } else if v == ' ' && c == '\n' || v == '\n' && c.is_whitespace() {
            // A folded line break: YAML's one character stands for the source's break and
            // the next line's indentation.
            vals.next();
            s.next();
            step(c, &mut pos);
            while let Some(&w) = s.peek() {
                if w == ' ' || w == '\t' {
                    s.next();
                    step(w, &mut pos);
                } else {
                    break;
                }
            }
        } else {
            s.next();
            step(c, &mut pos);
        }
    }
    // Past the skipped characters to the one the offset names.
    while let Some(&c) = s.peek() {
        let skippable = matches!(c, ' ' | '\t' | '\n' | '"' | '\'' | '|' | '>' | '-' | '+')
            && !text[offset.min(text.len())..].starts_with(c);
        if !skippable {
            break;
        }
        s.next();
        step(c, &mut pos);
    }
    pos
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_with_positions() {
        let src = "- rule: a\n  condition: x = 1\n- list: l\n  items: [a, \"b\"]\n";
        let Node::Seq(items, _) = load(src).unwrap() else {
            panic!()
        };
        let Node::Map(pairs, at) = &items[0] else {
            panic!()
        };
        assert_eq!((at.line, at.col), (1, 3));
        let (k, v) = &pairs[1];
        assert_eq!(k.str(), Some("condition"));
        assert_eq!((v.at().line, v.at().col), (2, 14));
        let Node::Map(p2, _) = &items[1] else {
            panic!()
        };
        let Node::Seq(l, _) = &p2[1].1 else { panic!() };
        assert!(matches!(&l[1], Node::Scalar { quoted: true, .. }));
    }

    #[test]
    fn syntax_errors_have_positions() {
        let e = load("- rule: a\n  condition: [x\n").unwrap_err();
        assert!(e.at.line >= 2, "{e:?}");
        assert!(load("a: 1\n---\nb: 2\n").is_err());
        assert!(matches!(load("").unwrap(), Node::Seq(v, _) if v.is_empty()));
    }

    #[test]
    fn locating_inside_scalars() {
        let src = "- rule: a\n  condition: kind = x and (\n";
        let Node::Seq(items, _) = load(src).unwrap() else {
            panic!()
        };
        let Node::Map(p, _) = &items[0] else { panic!() };
        let v = &p[1].1;
        let t = v.str().unwrap();
        let at = locate(src, v.at(), t, t.find("and").unwrap());
        assert_eq!((at.line, at.col), (2, 23));
        let src = "- condition: >\n    kind = x\n    and bad bad\n";
        let Node::Seq(items, _) = load(src).unwrap() else {
            panic!()
        };
        let Node::Map(p, _) = &items[0] else { panic!() };
        let v = &p[0].1;
        let t = v.str().unwrap();
        let at = locate(src, v.at(), t, t.find("bad").unwrap());
        assert_eq!((at.line, at.col), (3, 9));
        let src = "- condition: \"a = 1 b\"\n";
        let Node::Seq(items, _) = load(src).unwrap() else {
            panic!()
        };
        let Node::Map(p, _) = &items[0] else { panic!() };
        let v = &p[0].1;
        let at = locate(src, v.at(), v.str().unwrap(), 6);
        assert_eq!((at.line, at.col), (1, 21));
    }
}
