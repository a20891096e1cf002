//! The part of sudoers(5) the broker honours: user specifications with `NOPASSWD`, read from
//! `/etc/sudoers` and the files it includes. Aliases and `Defaults` are ignored (a rule naming an
//! alias never matches), so the broker grants at most what sudo itself would.

use std::path::{Path, PathBuf};

/// One user specification: `WHO HOSTS=(RUNAS[:GROUPS]) [TAGS:] COMMANDS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    who: Vec<String>,
    runas: Vec<String>,
    nopasswd: bool,
    commands: Vec<String>,
}

/// What the policy says about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// A rule matches but needs a password, which the broker never asks for.
    NeedsPassword,
    Deny,
}

/// The caller, as the broker identified it from its socket's peer credentials.
pub struct Caller<'a> {
    pub name: &'a str,
    pub uid: u32,
    /// Names of the caller's groups (primary and supplementary).
    pub groups: &'a [String],
}

/// All rules of `/etc/sudoers` and its includes, in file order.
pub fn load() -> Vec<Rule> {
    let mut rules = Vec::new();
    load_file(Path::new("/etc/sudoers"), &mut rules, 0);
    rules
}

fn load_file(path: &Path, rules: &mut Vec<Rule>, depth: u32) {
    if depth > 8 {
        return;
    }
    let Ok(text) = std::fs::read_to_string(path) else {
        return;
    };
    let dir = path.parent().unwrap_or(Path::new("/"));
    for line in joined_lines(&text) {
        let l = line.trim();
        let include = |rest: &str| {
            let p = PathBuf::from(rest.trim());
            if p.is_absolute() {
                p
            } else {
                dir.join(p)
            }
        };
        if let Some(rest) = l
            .strip_prefix("@includedir ")
            .or_else(|| l.strip_prefix("#includedir "))
        {
            let Ok(rd) = std::fs::read_dir(include(rest)) else {
                continue;
            };
            let mut names: Vec<PathBuf> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| !n.contains('.') && !n.ends_with('~'))
                })
                .collect();
            names.sort();
            for p in names {
                load_file(&p, rules, depth + 1);
            }
        } else if let Some(rest) = l
            .strip_prefix("@include ")
            .or_else(|| l.strip_prefix("#include "))
        {
            load_file(&include(rest), rules, depth + 1);
        } else if let Some(r) = parse_rule(l) {
            rules.push(r);
        }
    }
}

/// Lines with `\` continuations joined and comments removed (`#include` kept).
fn joined_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for raw in text.lines() {
        let keep_hash = raw.trim_start().starts_with("#include");
        let line = match raw.find('#') {
            Some(i) if !keep_hash && !raw[i..].starts_with("#include") => &raw[..i],
            _ => raw,
        };
        if let Some(s) = line.strip_suffix('\\') {
            cur.push_str(s);
            cur.push(' ');
            continue;
        }
        cur.push_str(line);
        out.push(std::mem::take(&mut cur));
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(|x| x.trim().to_string())
        .filter(|x| !x.is_empty())
        .collect()
}

/// Parses one user specification (a single host/command group; `:`-separated further groups
/// are ignored, which can only grant less).
pub fn parse_rule(line: &str) -> Option<Rule> {
    let line = line.trim();
    if line.is_empty() || line.starts_with("Defaults") || line.contains("_Alias") {
        return None;
    }
    let eq = line.find('=')?;
    let (head, rest) = (&line[..eq], &line[eq + 1..]);
    let mut head_words = head.split_whitespace();
    let who_part = head_words.next()?;
    // Users may be a comma list with spaces after commas: everything but the last word (hosts).
    let mut who = split_list(who_part);
    let rest_words: Vec<&str> = head_words.collect();
    if rest_words.is_empty() {
        return None;
    }
    for w in &rest_words[..rest_words.len() - 1] {
        who.extend(split_list(w));
    }
    let mut rest = rest.trim();
    let mut runas = vec!["root".to_string()];
    if let Some(r) = rest.strip_prefix('(') {
        let close = r.find(')')?;
        let users = r[..close].split(':').next().unwrap_or("").trim();
        runas = if users.is_empty() {
            vec!["root".to_string()]
        } else {
            split_list(users)
        };
        rest = r[close + 1..].trim();
    }
    let mut nopasswd = false;
    while let Some((tag, after)) = rest.split_once(':') {
        let tag = tag.trim();
        if tag.is_empty() || !tag.bytes().all(|b| b.is_ascii_uppercase() || b == b'_') {
            break;
        }
        match tag {
            "NOPASSWD" => nopasswd = true,
            "PASSWD" => nopasswd = false,
            _ => {}
        }
        rest = after.trim();
    }
    let commands = split_list(rest);
    if commands.is_empty() {
        return None;
    }
    Some(Rule {
        who,
        runas,
        nopasswd,
        commands,
    })
}

fn who_matches(who: &str, c: &Caller) -> bool {
    if who == "ALL" {
        true
    } else if let Some(g) = who.strip_prefix('%') {
        c.groups.iter().any(|n| n == g)
    } else if let Some(u) = who.strip_prefix('#') {
        u.parse::<u32>().ok() == Some(c.uid)
    } else {
        who == c.name
    }
}

fn command_matches(rule_cmd: &str, cmd: &Path) -> bool {
    if rule_cmd == "ALL" {
        return true;
    }
    // An absolute path without arguments matches that program with any arguments.
    let prog = rule_cmd.split_whitespace().next().unwrap_or("");
    prog.starts_with('/') && !rule_cmd.contains(char::is_whitespace) && Path::new(prog) == cmd
}

/// The verdict for `caller` running `cmd` (resolved path) as `target`: the last matching rule
/// decides, as in sudo; root may always.
pub fn check(rules: &[Rule], caller: &Caller, target: &str, cmd: &Path) -> Verdict {
    if caller.uid == 0 {
        return Verdict::Allow;
    }
    let mut verdict = Verdict::Deny;
    for r in rules {
        let runas_ok = r.runas.iter().any(|u| u == "ALL" || u == target)
            || (target == caller.name && r.runas.iter().any(|u| u == caller.name));
        if r.who.iter().any(|w| who_matches(w, caller))
            && runas_ok
            && r.commands.iter().any(|c| command_matches(c, cmd))
        {
            verdict = if r.nopasswd {
                Verdict::Allow
            } else {
                Verdict::NeedsPassword
            };
        }
    }
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller<'a>(name: &'a str, uid: u32, groups: &'a [String]) -> Caller<'a> {
        Caller { name, uid, groups }
    }

    #[test]
    fn parses_debian_and_kiln_rules() {
        let r = parse_rule("user ALL=(ALL:ALL) NOPASSWD: ALL").unwrap();
        assert_eq!(r.who, vec!["user"]);
        assert_eq!(r.runas, vec!["ALL"]);
        assert!(r.nopasswd);
        let r = parse_rule("%sudo\tALL=(ALL:ALL) ALL").unwrap();
        assert!(!r.nopasswd);
        assert_eq!(r.who, vec!["%sudo"]);
        let r = parse_rule("bob ALL = NOPASSWD: /usr/bin/apt-get, /bin/ls").unwrap();
        assert_eq!(r.runas, vec!["root"]);
        assert_eq!(r.commands, vec!["/usr/bin/apt-get", "/bin/ls"]);
        assert!(parse_rule("Defaults env_reset").is_none());
        assert!(parse_rule("User_Alias ADMINS = a, b").is_none());
        assert!(parse_rule("").is_none());
    }

    #[test]
    fn verdicts() {
        let rules: Vec<Rule> = [
            "root ALL=(ALL:ALL) ALL",
            "%sudo ALL=(ALL:ALL) ALL",
            "user ALL=(ALL:ALL) NOPASSWD: ALL",
            "bob ALL=(root) NOPASSWD: /usr/bin/apt-get",
        ]
        .iter()
        .filter_map(|l| parse_rule(l))
        .collect();
        let none: Vec<String> = vec![];
        let sudo_group = vec!["sudo".to_string()];
        let sh = Path::new("/bin/sh");
        let apt = Path::new("/usr/bin/apt-get");
        assert_eq!(
            check(&rules, &caller("user", 1000, &none), "root", sh),
            Verdict::Allow
        );
        assert_eq!(
            check(&rules, &caller("user", 1000, &none), "nobody", sh),
            Verdict::Allow
        );
        assert_eq!(
            check(&rules, &caller("eve", 1001, &none), "root", sh),
            Verdict::Deny
        );
        assert_eq!(
            check(&rules, &caller("carol", 1002, &sudo_group), "root", sh),
            Verdict::NeedsPassword
        );
        assert_eq!(
            check(&rules, &caller("bob", 1003, &none), "root", apt),
            Verdict::Allow
        );
        assert_eq!(
            check(&rules, &caller("bob", 1003, &none), "root", sh),
            Verdict::Deny
        );
        assert_eq!(
            check(&rules, &caller("bob", 1003, &none), "user", apt),
            Verdict::Deny
        );
        assert_eq!(
            check(&rules, &caller("root", 0, &none), "user", sh),
            Verdict::Allow
        );
    }

    #[test]
    fn includes_and_continuations() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sudoers.d")).unwrap();
        std::fs::write(
            d.path().join("sudoers"),
            "# comment\nDefaults env_reset\n@includedir sudoers.d\n",
        )
        .unwrap();
        std::fs::write(
            d.path().join("sudoers.d/a"),
            "alice ALL=(ALL) \\\n  NOPASSWD: ALL # trailing\n",
        )
        .unwrap();
        std::fs::write(
            d.path().join("sudoers.d/b.bak"),
            "eve ALL=(ALL) NOPASSWD: ALL\n",
        )
        .unwrap();
        let mut rules = Vec::new();
        load_file(&d.path().join("sudoers"), &mut rules, 0);
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].who, vec!["alice"]);
        assert!(rules[0].nopasswd);
    }
}
