//! A Dockerfile as the steps of E2B's Template API, converted as the `e2b` SDK's
//! `from_dockerfile` converts one: `FROM` (one stage) is the base image; `RUN`, `COPY`/`ADD`
//! (local files, `--chown`, `--chmod`), `ENV`, `ARG`, `WORKDIR`, `USER` become steps, in a
//! build that starts as `root` in `/` and ends as `user` in `/home/user` unless the file chose;
//! `CMD`/`ENTRYPOINT` combine into the start command by Docker's rules. `$VAR`/`${VAR}` of
//! earlier `ARG`/`ENV` are expanded outside `RUN` (whose shell sees them as environment).

use std::collections::BTreeMap;

/// One step of the build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Run(String),
    Copy {
        src: String,
        dest: String,
        owner: Option<String>,
        mode: Option<String>,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

/// A converted Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Converted {
    pub from_image: String,
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("Dockerfile line {line}: {message}")]
pub struct DockerfileError {
    pub line: usize,
    pub message: String,
}

/// A command for `bash -c` from exec-form words.
fn shell_join(words: &[String]) -> String {
    let safe = |w: &str| {
        !w.is_empty()
            && w.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b))
    };
    words
        .iter()
        .map(|w| {
            if safe(w) {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Shell-like words: quotes group, backslash escapes.
fn words(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    let mut it = s.chars();
    while let Some(c) = it.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (Some('\''), c) => cur.push(c),
            (_, '\\') => {
                if let Some(n) = it.next() {
                    cur.push(n);
                }
                any = true;
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// `$VAR` and `${VAR}` of `vars` (unknown ones are empty, as Docker does).
fn expand(s: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let b: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < b.len() {
        if b[i] == '\\' && b.get(i + 1) == Some(&'$') {
            out.push('$');
            i += 2;
            continue;
        }
        if b[i] != '$' {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let (name, next) = if b.get(i + 1) == Some(&'{') {
            match b[i + 2..].iter().position(|c| *c == '}') {
                Some(end) => (
                    b[i + 2..i + 2 + end].iter().collect::<String>(),
                    i + 3 + end,
                ),
                None => (String::new(), b.len()),
            }
        } else {
            let n: String = b[i + 1..]
                .iter()
                .take_while(|c| c.is_ascii_alphanumeric() || **c == '_')
                .collect();
            let len = n.chars().count();
            (n, i + 1 + len)
        };
        if name.is_empty() {
            out.push('$');
            i += 1;
            continue;
        }
        let (key, default) = match name.split_once(":-") {
            Some((k, d)) => (k.to_string(), Some(d.to_string())),
            None => (name, None),
        };
        match vars.get(&key).filter(|v| !v.is_empty()) {
            Some(v) => out.push_str(v),
            None => out.push_str(&default.unwrap_or_default()),
        }
        i = next;
    }
    out
}

/// Instructions with their first line: continuation lines joined, comments dropped.
fn instructions(text: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.starts_with('#') || (line.is_empty() && cur.is_none()) {
            continue;
        }
        let (body, more) = match line.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (line, false),
        };
        let (start, mut acc) = cur.take().unwrap_or((n + 1, String::new()));
        if !acc.is_empty() {
            acc.push(' ');
        }
        acc.push_str(body.trim());
        if more {
            cur = Some((start, acc));
        } else if !acc.is_empty() {
            let (word, rest) = acc
                .split_once(char::is_whitespace)
                .unwrap_or((acc.as_str(), ""));
            out.push((start, word.to_ascii_uppercase(), rest.trim().to_string()));
        }
    }
    if let Some((start, acc)) = cur {
        let (word, rest) = acc
            .split_once(char::is_whitespace)
            .unwrap_or((acc.as_str(), ""));
        out.push((start, word.to_ascii_uppercase(), rest.trim().to_string()));
    }
    out
}

/// The exec form (`["a", "b"]`) of an instruction's arguments, when it has one.
fn exec_form(rest: &str) -> Option<Vec<String>> {
    rest.starts_with('[')
        .then(|| serde_json::from_str::<Vec<String>>(rest).ok())
        .flatten()
}

/// Leading `--name=value` flags of an instruction.
fn flags(rest: &str) -> (BTreeMap<String, String>, String) {
    let mut f = BTreeMap::new();
    let mut rest = rest.trim_start();
    while let Some(r) = rest.strip_prefix("--") {
        let (flag, after) = r.split_once(char::is_whitespace).unwrap_or((r, ""));
        let (k, v) = flag.split_once('=').unwrap_or((flag, ""));
        f.insert(k.to_string(), v.to_string());
        rest = after.trim_start();
    }
    (f, rest.to_string())
}

/// A `CMD` or `ENTRYPOINT`: whether it is in exec form, and its words (one for the shell form).
type ExecOrShell = (bool, Vec<String>);

/// Converts the Dockerfile `text`.
pub fn convert(text: &str) -> Result<Converted, DockerfileError> {
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut from = None;
    let mut steps = vec![Step::User("root".into()), Step::Workdir("/".into())];
    let (mut user_set, mut workdir_set) = (false, false);
    let (mut cmd, mut entrypoint): (Option<ExecOrShell>, Option<ExecOrShell>) = (None, None);
    for (line, name, rest) in instructions(text) {
        let err = |m: String| DockerfileError { line, message: m };
        if from.is_none() && !matches!(name.as_str(), "FROM" | "ARG") {
            return Err(err(format!("{name} must come after FROM")));
        }
        match name.as_str() {
            "FROM" => {
                if from.is_some() {
                    return Err(err("multi-stage Dockerfiles are not supported".into()));
                }
                let (_, r) = flags(&rest);
                let w = words(&r);
                if w.len() != 1 && !(w.len() == 3 && w[1].eq_ignore_ascii_case("as")) {
                    return Err(err("FROM takes an image (and `AS name`)".into()));
                }
                from = Some(expand(&w[0], &vars));
            }
            "RUN" => {
                let (_, r) = flags(&rest);
                let c = exec_form(&r).map(|w| shell_join(&w)).unwrap_or(r);
                if c.trim().is_empty() {
                    return Err(err("RUN needs a command".into()));
                }
                steps.push(Step::Run(c));
            }
            "COPY" | "ADD" => {
                let (f, r) = flags(&rest);
                if let Some(k) = f.keys().find(|k| !matches!(k.as_str(), "chown" | "chmod")) {
                    return Err(err(format!("{name} --{k} is not supported")));
                }
                let mut w: Vec<String> = exec_form(&r)
                    .unwrap_or_else(|| words(&r))
                    .iter()
                    .map(|x| expand(x, &vars))
                    .collect();
                if w.len() < 2 {
                    return Err(err(format!("{name} needs a source and a destination")));
                }
                let mut dest = w.pop().unwrap_or_default();
                if w.len() > 1 && !dest.ends_with('/') {
                    dest.push('/');
                }
                for src in w {
                    if src.contains("://") {
                        return Err(err(format!("{name} from a URL is not supported: {src}")));
                    }
                    steps.push(Step::Copy {
                        src,
                        dest: dest.clone(),
                        owner: f.get("chown").map(|o| expand(o, &vars)),
                        mode: f.get("chmod").cloned(),
                    });
                }
            }
            "ENV" => {
                let w = words(&rest);
                let pairs: Vec<(String, String)> = if w.first().is_some_and(|x| x.contains('=')) {
                    w.iter()
                        .map(|kv| {
                            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                            (k.to_string(), expand(v, &vars))
                        })
                        .collect()
                } else {
                    let (k, v) = rest
                        .split_once(char::is_whitespace)
                        .unwrap_or((rest.as_str(), ""));
                    vec![(k.to_string(), expand(v.trim(), &vars))]
                };
                if pairs.is_empty() || pairs.iter().any(|(k, _)| k.is_empty()) {
                    return Err(err("ENV needs NAME=value".into()));
                }
                vars.extend(pairs.iter().cloned());
                steps.push(Step::Env(pairs));
            }
            "ARG" => {
                let mut pairs = Vec::new();
                for a in words(&rest) {
                    let (k, v) = a.split_once('=').unwrap_or((&a, ""));
                    if k.is_empty() {
                        return Err(err("ARG needs a name".into()));
                    }
                    let v = vars.get(k).cloned().unwrap_or_else(|| expand(v, &vars));
                    vars.insert(k.to_string(), v.clone());
                    pairs.push((k.to_string(), v));
                }
                // As the SDK does: every ARG (also one before FROM) is the build's environment.
                if !pairs.is_empty() {
                    steps.push(Step::Env(pairs));
                }
            }
            "WORKDIR" => {
                workdir_set = true;
                steps.push(Step::Workdir(expand(&rest, &vars)));
            }
            "USER" => {
                user_set = true;
                steps.push(Step::User(expand(&rest, &vars)));
            }
            "CMD" | "ENTRYPOINT" => {
                let v = match exec_form(&rest) {
                    Some(w) => (true, w),
                    None => (false, vec![rest.clone()]),
                };
                if name == "CMD" {
                    cmd = Some(v);
                } else {
                    entrypoint = Some(v);
                }
            }
            "EXPOSE" | "LABEL" | "MAINTAINER" | "VOLUME" | "STOPSIGNAL" | "HEALTHCHECK"
            | "SHELL" | "ONBUILD" => {}
            other => return Err(err(format!("unknown instruction {other}"))),
        }
    }
    let from_image = from.ok_or(DockerfileError {
        line: 0,
        message: "the Dockerfile has no FROM".into(),
    })?;
    // Docker's rules: exec-form ENTRYPOINT + CMD's words; shell-form ENTRYPOINT alone.
    let start = match (entrypoint, cmd) {
        (Some((true, mut e)), c) => {
            match c {
                Some((true, w)) => e.extend(w),
                Some((false, w)) => e.extend(["/bin/sh".into(), "-c".into(), w[0].clone()]),
                None => {}
            }
            Some(shell_join(&e))
        }
        (Some((false, e)), _) => Some(e[0].clone()),
        (None, Some((true, w))) => Some(shell_join(&w)),
        (None, Some((false, w))) => Some(w[0].clone()),
        (None, None) => None,
    };
    if !user_set {
        steps.push(Step::User("user".into()));
    }
    if !workdir_set {
        steps.push(Step::Workdir("/home/user".into()));
    }
    Ok(Converted {
        from_image,
        steps,
        start_cmd: start.filter(|c| !c.trim().is_empty()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dockerfile_becomes_steps() {
        let c = convert(
            "ARG V=1\nFROM base AS b\n# note\nENV A=x B=\"y z\"\nWORKDIR /srv/$A\n\
             COPY --chown=user --chmod=0644 app/main.py lib ./\n\
             RUN echo $A && \\\n    echo v$V\nRUN [\"echo\", \"two words\"]\nUSER user\n\
             CMD [\"python3\", \"-m\", \"http.server\"]\n",
        )
        .unwrap();
        assert_eq!(c.from_image, "base");
        assert_eq!(
            c.steps,
            vec![
                Step::User("root".into()),
                Step::Workdir("/".into()),
                Step::Env(vec![("V".into(), "1".into())]),
                Step::Env(vec![("A".into(), "x".into()), ("B".into(), "y z".into())]),
                Step::Workdir("/srv/x".into()),
                Step::Copy {
                    src: "app/main.py".into(),
                    dest: "./".into(),
                    owner: Some("user".into()),
                    mode: Some("0644".into())
                },
                Step::Copy {
                    src: "lib".into(),
                    dest: "./".into(),
                    owner: Some("user".into()),
                    mode: Some("0644".into())
                },
                Step::Run("echo $A && echo v$V".into()),
                Step::Run("echo 'two words'".into()),
                Step::User("user".into()),
            ]
        );
        assert_eq!(c.start_cmd.as_deref(), Some("python3 -m http.server"));
    }

    #[test]
    fn entrypoint_and_cmd_follow_docker() {
        let c = convert("FROM x\nENTRYPOINT [\"run\"]\nCMD [\"--port\", \"1\"]\n").unwrap();
        assert_eq!(c.start_cmd.as_deref(), Some("run --port 1"));
        let c = convert("FROM x\nENTRYPOINT run it\nCMD ignored\n").unwrap();
        assert_eq!(c.start_cmd.as_deref(), Some("run it"));
        assert!(c.steps.ends_with(&[
            Step::User("user".into()),
            Step::Workdir("/home/user".into())
        ]));
    }

    #[test]
    fn bad_dockerfiles_name_the_line() {
        for (text, what) in [
            ("RUN x\n", "after FROM"),
            ("FROM a\nFROM b\n", "multi-stage"),
            ("FROM a\nADD https://example.invalid/x /x\n", "URL"),
            ("FROM a\nFROB x\n", "unknown instruction"),
            ("ENV A=1\n", "after FROM"),
        ] {
            let e = convert(text).unwrap_err().to_string();
            assert!(e.contains(what), "{text:?}: {e}");
        }
        assert!(convert("# nothing\n").is_err());
        assert_eq!(expand("${X:-d}/$Y\\$Z", &BTreeMap::new()), "d/$Z");
    }
}
