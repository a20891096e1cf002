//! Shell-style wildcard matching for `glob`: `*` any run of characters (slashes included),
//! `?` one character, `[abc]`/`[a-z]`/`[!x]` one character of a class; `\` escapes.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Lit(char),
    Any,
    Star,
    Class { neg: bool, items: Vec<(char, char)> },
}

/// A compiled pattern, with its longest literal run (text every match contains: checked
/// first, so most non-matches cost one substring search).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob(Vec<Tok>, String);

impl Glob {
    pub fn new(pat: &str) -> Glob {
        let mut out = Vec::new();
        let mut it = pat.chars().peekable();
        while let Some(c) = it.next() {
            match c {
                '*' => {
                    if out.last() != Some(&Tok::Star) {
                        out.push(Tok::Star);
                    }
                }
                '?' => out.push(Tok::Any),
                '\\' => out.push(Tok::Lit(it.next().unwrap_or('\\'))),
                '[' => {
                    let rest: String = it.clone().collect();
                    match rest.find(']').filter(|i| *i > 0 || rest.len() > 1) {
                        Some(end) => {
                            let body: Vec<char> = rest[..end].chars().collect();
                            for _ in 0..=body.len() {
                                it.next();
                            }
                            let (neg, body) = match body.first() {
                                Some('!') | Some('^') => (true, &body[1..]),
                                _ => (false, &body[..]),
                            };
                            let mut items = Vec::new();
                            let mut i = 0;
                            while i < body.len() {
                                if i + 2 < body.len() && body[i + 1] == '-' {
                                    items.push((body[i], body[i + 2]));
                                    i += 3;
                                } else {
                                    items.push((body[i], body[i]));
                                    i += 1;
                                }
                            }
                            out.push(Tok::Class { neg, items });
                        }
                        None => out.push(Tok::Lit('[')),
                    }
                }
                c => out.push(Tok::Lit(c)),
            }
        }
        let mut best = String::new();
        let mut run = String::new();
        for t in &out {
            match t {
                Tok::Lit(c) => run.push(*c),
                _ => {
                    if run.len() > best.len() {
                        best = std::mem::take(&mut run);
                    }
                    run.clear();
                }
            }
        }
        if run.len() > best.len() {
            best = run;
        }
        Glob(out, best)
    }

    pub fn matches(&self, s: &str) -> bool {
        if !s.contains(self.1.as_str()) {
            return false;
        }
        if s.is_ascii() {
            self.matches_in(s.as_bytes(), |b| b as char)
        } else {
            let chars: Vec<char> = s.chars().collect();
            self.matches_in(&chars, |c| c)
        }
    }

    fn matches_in<T: Copy>(&self, s: &[T], ch: impl Fn(T) -> char) -> bool {
        let p = &self.0;
        // Iterative matching with one backtrack point for the last star.
        let (mut pi, mut si) = (0, 0);
        let mut star: Option<(usize, usize)> = None;
        while si < s.len() {
            let c = ch(s[si]);
            let ok = match p.get(pi) {
                Some(Tok::Lit(l)) => *l == c,
                Some(Tok::Any) => true,
                Some(Tok::Class { neg, items }) => {
                    items.iter().any(|(a, b)| (*a..=*b).contains(&c)) != *neg
                }
                Some(Tok::Star) => {
                    star = Some((pi, si));
                    pi += 1;
                    continue;
                }
                None => false,
            };
            if ok {
                pi += 1;
                si += 1;
            } else if let Some((sp, ss)) = star {
                pi = sp + 1;
                si = ss + 1;
                star = Some((sp, ss + 1));
            } else {
                return false;
            }
        }
        p[pi..].iter().all(|t| *t == Tok::Star)
    }
}

#[cfg(test)]
mod tests {
    use super::Glob;

    #[test]
    fn globs() {
        let m = |p: &str, s: &str| Glob::new(p).matches(s);
        assert!(m("/etc/sudoers*", "/etc/sudoers.d/x"));
        assert!(m("/home/*/.ssh/id_*", "/home/user/.ssh/id_rsa"));
        assert!(!m("/home/*/.ssh/id_*", "/home/user/.ssh/known_hosts"));
        assert!(m("/proc/[0-9]*/environ", "/proc/42/environ"));
        assert!(!m("/proc/[0-9]*/environ", "/proc/self/environ"));
        assert!(m("a?c", "abc") && !m("a?c", "ac"));
        assert!(m("*", "") && m("**x", "yyx"));
        assert!(m("[!a]b", "cb") && !m("[!a]b", "ab"));
        assert!(m("a\\*", "a*") && !m("a\\*", "ab"));
        assert!(m("*/.ssh/id_*", "/home/ü/.ssh/id_rsa"), "non-ASCII input");
        assert!(!m("*/.ssh/id_*", "/home/ü/.ssh/known"));
        assert!(m("[à-ÿ]x", "üx"));
        assert!(m("*/.ssh/id_*", "/home/ü/.ssh/id_rsa"), "non-ASCII input");
        assert!(!m("*/.ssh/id_*", "/home/ü/.ssh/known"));
    }
}
