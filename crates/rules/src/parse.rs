//! The condition language: tokens and a recursive-descent parser into an [`Expr`] tree whose
//! nodes keep the byte offset they start at (errors point into the condition text).
//!
//! ```text
//! expr     := or
//! or       := and ("or" and)*
//! and      := unary ("and" unary)*
//! unary    := "not" unary | primary
//! primary  := "(" expr ")" | MACRO | FIELD "exists" | FIELD op value | FIELD setop set
//! op       := "=" | "==" | "!=" | "<" | "<=" | ">" | ">=" | "contains" | "icontains"
//!           | "startswith" | "endswith" | "glob"
//! setop    := "in" | "pmatch"
//! set      := "(" item ("," item)* ")" | LIST
//! item     := value | LIST
//! value    := "quoted string" | 'quoted string' | NUMBER | BAREWORD
//! ```
//!
//! A bareword is any run of characters other than blanks, quotes, parentheses, commas and
//! `= ! < >`; fields, macro and list names, and unquoted values are barewords.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    Word(String),
    Str(String),
    LParen,
    RParen,
    Comma,
    Sym(&'static str),
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Word(w) => write!(f, "{w:?}"),
            Tok::Str(s) => write!(f, "string {s:?}"),
            Tok::LParen => f.write_str("\"(\""),
            Tok::RParen => f.write_str("\")\""),
            Tok::Comma => f.write_str("\",\""),
            Tok::Sym(s) => write!(f, "{s:?}"),
        }
    }
}

/// A syntax error at byte `offset` of the condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    pub offset: usize,
    pub msg: String,
}

fn err<T>(offset: usize, msg: impl Into<String>) -> Result<T, SyntaxError> {
    Err(SyntaxError {
        offset,
        msg: msg.into(),
    })
}

fn is_word_char(c: char) -> bool {
    !(c.is_whitespace() || "()\",'=!<>".contains(c))
}

/// Splits `src` into tokens with their byte offsets.
pub fn lex(src: &str) -> Result<Vec<(usize, Tok)>, SyntaxError> {
    let mut out = Vec::new();
    let mut it = src.char_indices().peekable();
    while let Some(&(i, c)) = it.peek() {
        if c.is_whitespace() {
            it.next();
            continue;
        }
        match c {
            '(' | ')' | ',' => {
                it.next();
                out.push((
                    i,
                    match c {
                        '(' => Tok::LParen,
                        ')' => Tok::RParen,
                        _ => Tok::Comma,
                    },
                ));
            }
            '"' | '\'' => {
                it.next();
                let mut s = String::new();
                let mut closed = false;
                while let Some((_, d)) = it.next() {
                    if d == c {
                        closed = true;
                        break;
                    }
                    if d == '\\' {
                        match it.next() {
                            Some((_, 'n')) => s.push('\n'),
                            Some((_, 't')) => s.push('\t'),
                            Some((_, e)) => s.push(e),
                            None => break,
                        }
                    } else {
                        s.push(d);
                    }
                }
                if !closed {
                    return err(i, "unterminated string (a quote is not closed)");
                }
                out.push((i, Tok::Str(s)));
            }
            '=' | '!' | '<' | '>' => {
                it.next();
                let next_eq = matches!(it.peek(), Some((_, '=')));
                let sym = match (c, next_eq) {
                    ('=', true) => "==",
                    ('=', false) => "=",
                    ('!', true) => "!=",
                    ('<', true) => "<=",
                    ('<', false) => "<",
                    ('>', true) => ">=",
                    ('>', false) => ">",
                    _ => return err(i, "\"!\" must be followed by \"=\" (use \"not\" to negate)"),
                };
                if next_eq {
                    it.next();
                }
                out.push((i, Tok::Sym(sym)));
            }
            _ => {
                let mut w = String::new();
                while let Some(&(_, d)) = it.peek() {
                    if !is_word_char(d) {
                        break;
                    }
                    w.push(d);
                    it.next();
                }
                out.push((i, Tok::Word(w)));
            }
        }
    }
    Ok(out)
}

/// A comparison operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Contains,
    IContains,
    StartsWith,
    EndsWith,
    Glob,
    In,
    PMatch,
    Exists,
}

impl Op {
    fn from_tok(t: &Tok) -> Option<Op> {
        Some(match t {
            Tok::Sym("=") | Tok::Sym("==") => Op::Eq,
            Tok::Sym("!=") => Op::Ne,
            Tok::Sym("<") => Op::Lt,
            Tok::Sym("<=") => Op::Le,
            Tok::Sym(">") => Op::Gt,
            Tok::Sym(">=") => Op::Ge,
            Tok::Word(w) => match w.as_str() {
                "contains" => Op::Contains,
                "icontains" => Op::IContains,
                "startswith" => Op::StartsWith,
                "endswith" => Op::EndsWith,
                "glob" => Op::Glob,
                "in" => Op::In,
                "pmatch" => Op::PMatch,
                "exists" => Op::Exists,
                _ => return None,
            },
            _ => return None,
        })
    }
}

/// One value on the right of an operator; `Word` may name a list (inside sets).
#[derive(Debug, Clone, PartialEq)]
pub enum Val {
    Str(String),
    Word(String),
}

impl Val {
    pub fn text(&self) -> &str {
        match self {
            Val::Str(s) | Val::Word(s) => s,
        }
    }
}

/// A parsed condition; `at` is the byte offset of the node's first token.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Not(Box<Expr>),
    /// A macro's name (expanded when the rule set is compiled).
    Macro {
        name: String,
        at: usize,
    },
    Cmp {
        field: String,
        at: usize,
        op: Op,
        /// One value, or the set's items for `in`/`pmatch`; empty for `exists`.
        vals: Vec<(usize, Val)>,
    },
}

struct P {
    toks: Vec<(usize, Tok)>,
    pos: usize,
    end: usize,
}

const KEYWORDS: &[&str] = &["and", "or", "not"];

impl P {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.1)
    }
    fn at(&self) -> usize {
        self.toks.get(self.pos).map_or(self.end, |t| t.0)
    }
    fn next(&mut self) -> Option<(usize, Tok)> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }
    fn word_is(&self, w: &str) -> bool {
        matches!(self.peek(), Some(Tok::Word(x)) if x == w)
    }

    fn or(&mut self) -> Result<Expr, SyntaxError> {
        let mut l = self.and()?;
        while self.word_is("or") {
            self.pos += 1;
            let r = self.and()?;
            l = Expr::Or(Box::new(l), Box::new(r));
        }
        Ok(l)
    }

    fn and(&mut self) -> Result<Expr, SyntaxError> {
        let mut l = self.unary()?;
        while self.word_is("and") {
            self.pos += 1;
            let r = self.unary()?;
            l = Expr::And(Box::new(l), Box::new(r));
        }
        Ok(l)
    }

    fn unary(&mut self) -> Result<Expr, SyntaxError> {
        if self.word_is("not") {
            self.pos += 1;
            return Ok(Expr::Not(Box::new(self.unary()?)));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, SyntaxError> {
        let at = self.at();
        match self.next() {
            Some((_, Tok::LParen)) => {
                let e = self.or()?;
                match self.next() {
                    Some((_, Tok::RParen)) => Ok(e),
                    Some((a, t)) => err(a, format!("expected \")\", found {t}")),
                    None => err(self.end, "expected \")\" before the end of the condition"),
                }
            }
            Some((_, Tok::Word(w))) if KEYWORDS.contains(&w.as_str()) => err(
                at,
                format!("expected a field, a macro or \"(\", found {w:?}"),
            ),
            Some((_, Tok::Word(w))) => {
                let op = self.peek().and_then(Op::from_tok);
                let Some(op) = op else {
                    return match self.peek() {
                        None | Some(Tok::RParen) => Ok(Expr::Macro { name: w, at }),
                        Some(Tok::Word(k)) if KEYWORDS.contains(&k.as_str()) => {
                            Ok(Expr::Macro { name: w, at })
                        }
                        Some(t) => err(
                            self.at(),
                            format!("expected an operator after {w:?}, found {t}"),
                        ),
                    };
                };
                self.pos += 1;
                let vals = match op {
                    Op::Exists => Vec::new(),
                    Op::In | Op::PMatch => self.set()?,
                    _ => vec![self.value()?],
                };
                Ok(Expr::Cmp {
                    field: w,
                    at,
                    op,
                    vals,
                })
            }
            Some((a, t)) => err(a, format!("expected a field, a macro or \"(\", found {t}")),
            None => err(
                self.end,
                "the condition ends where a field or \"(\" is expected",
            ),
        }
    }

    fn value(&mut self) -> Result<(usize, Val), SyntaxError> {
        match self.next() {
            Some((a, Tok::Str(s))) => Ok((a, Val::Str(s))),
            Some((a, Tok::Word(w))) if !KEYWORDS.contains(&w.as_str()) => Ok((a, Val::Word(w))),
            Some((a, t)) => err(a, format!("expected a value, found {t}")),
            None => err(self.end, "the condition ends where a value is expected"),
        }
    }

    fn set(&mut self) -> Result<Vec<(usize, Val)>, SyntaxError> {
        if !matches!(self.peek(), Some(Tok::LParen)) {
            // A list's name alone.
            return match self.next() {
                Some((a, Tok::Word(w))) => Ok(vec![(a, Val::Word(w))]),
                Some((a, t)) => err(a, format!("expected \"(\" or a list name, found {t}")),
                None => err(self.end, "the condition ends where \"(\" is expected"),
            };
        }
        self.pos += 1;
        let mut items = Vec::new();
        if matches!(self.peek(), Some(Tok::RParen)) {
            self.pos += 1;
            return Ok(items);
        }
        loop {
            items.push(self.value()?);
            match self.next() {
                Some((_, Tok::Comma)) => continue,
                Some((_, Tok::RParen)) => return Ok(items),
                Some((a, t)) => return err(a, format!("expected \",\" or \")\", found {t}")),
                None => return err(self.end, "a set is not closed with \")\""),
            }
        }
    }
}

/// Parses a condition.
pub fn parse(src: &str) -> Result<Expr, SyntaxError> {
    let toks = lex(src)?;
    if toks.is_empty() {
        return err(0, "the condition is empty");
    }
    let mut p = P {
        toks,
        pos: 0,
        end: src.trim_end().len(),
    };
    let e = p.or()?;
    if let Some((a, t)) = p.next() {
        return err(
            a,
            format!("unexpected {t} (expected \"and\", \"or\" or the end)"),
        );
    }
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_and_sets() {
        let e = parse("not a = 1 or b in (x, \"y z\", L) and c exists").unwrap();
        let Expr::Or(l, r) = e else { panic!() };
        assert!(matches!(*l, Expr::Not(_)));
        let Expr::And(b, c) = *r else { panic!() };
        match *b {
            Expr::Cmp { ref vals, op, .. } => {
                assert_eq!(op, Op::In);
                assert_eq!(vals.len(), 3);
                assert_eq!(vals[1].1, Val::Str("y z".into()));
            }
            _ => panic!(),
        }
        assert!(matches!(*c, Expr::Cmp { op: Op::Exists, .. }));
    }

    #[test]
    fn macros_and_parens() {
        let e = parse("(m1 and not m2) or x != '3'").unwrap();
        assert!(matches!(e, Expr::Or(..)));
        assert!(matches!(parse("m").unwrap(), Expr::Macro { .. }));
    }

    #[test]
    fn errors_point_at_the_offending_token() {
        let e = parse("a = 1 and (b = 2").unwrap_err();
        assert_eq!(e.offset, 16);
        let e = parse("a = 1 b = 2").unwrap_err();
        assert_eq!(e.offset, 6, "{e:?}");
        let e = parse("a = \"x").unwrap_err();
        assert_eq!(e.offset, 4);
        assert!(e.msg.contains("unterminated"));
        let e = parse("a in (1, 2").unwrap_err();
        assert!(e.msg.contains("not closed"), "{e:?}");
        let e = parse("and a = 1").unwrap_err();
        assert_eq!(e.offset, 0);
        let e = parse("a ! b").unwrap_err();
        assert_eq!(e.offset, 2);
        assert!(parse("  ").is_err());
    }
}
