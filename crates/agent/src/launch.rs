//! `gtk-launch APPLICATION [URI...]` for the desktop template (the binary linked as
//! `/usr/local/bin/gtk-launch`): what `e2b-desktop`'s `launch(app, uri)` runs.
//!
//! GTK's own `gtk-launch` starts the application through GLib's spawn, which fails under gVisor
//! ("Failed to close file descriptor for child process (Invalid argument)", exit 3). This one
//! does what it does without GLib: it finds `APPLICATION.desktop` in `$XDG_DATA_HOME` and
//! `$XDG_DATA_DIRS` (each `…/applications`), expands the entry's `Exec=` line as the Desktop
//! Entry Specification says (quoting, `%f %F %u %U %i %c %k %%`), starts the program in a
//! session of its own (in `Path=` when set) and returns at once. Exit codes as GTK's: 1 usage,
//! 2 no such application, 3 the launch failed.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const USAGE: &str = "Usage:\n  gtk-launch APPLICATION [URI...] — launch an application\n\n\
    APPLICATION is the name of its desktop file, with or without .desktop";

/// The `[Desktop Entry]` group of a desktop file: its keys (unlocalised) and their values.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub keys: HashMap<String, String>,
}

impl Entry {
    /// Parses a desktop file's text; None when it has no `[Desktop Entry]` group.
    pub fn parse(text: &str) -> Option<Self> {
        let mut keys = HashMap::new();
        let mut group = None::<&str>;
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(g) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                group = Some(g);
                continue;
            }
            if group != Some("Desktop Entry") {
                continue;
            }
            if let Some((k, v)) = line.split_once('=') {
                let k = k.trim();
                // Localised keys (Name[de]) are not needed here.
                if !k.contains('[') {
                    keys.entry(k.to_string())
                        .or_insert_with(|| unescape_string(v.trim_start()));
                }
            }
        }
        group_seen(text).then_some(Self { keys })
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.keys.get(key).map(String::as_str)
    }
}

fn group_seen(text: &str) -> bool {
    text.lines().any(|l| l.trim() == "[Desktop Entry]")
}

/// The spec's escapes of a string value: `\s \n \t \r \\`.
fn unescape_string(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let mut it = v.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('s') => out.push(' '),
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('\\') => out.push('\\'),
            Some(o) => {
                out.push('\\');
                out.push(o);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// Splits an `Exec` value into arguments: spaces separate, double quotes group, and inside
/// quotes a backslash escapes `" ` $ \`.
pub fn split_exec(exec: &str) -> Result<Vec<String>, String> {
    let mut args = Vec::new();
    let mut cur = String::new();
    let mut in_arg = false;
    let mut it = exec.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '"' => {
                in_arg = true;
                loop {
                    match it.next() {
                        Some('"') => break,
                        Some('\\') => match it.next() {
                            Some(e @ ('"' | '`' | '$' | '\\')) => cur.push(e),
                            Some(o) => {
                                cur.push('\\');
                                cur.push(o);
                            }
                            None => return Err("unterminated escape in Exec".into()),
                        },
                        Some(o) => cur.push(o),
                        None => return Err("unterminated quote in Exec".into()),
                    }
                }
            }
            ' ' | '\t' => {
                if in_arg {
                    args.push(std::mem::take(&mut cur));
                    in_arg = false;
                }
            }
            o => {
                in_arg = true;
                cur.push(o);
            }
        }
    }
    if in_arg {
        args.push(cur);
    }
    if args.is_empty() {
        return Err("empty Exec".into());
    }
    Ok(args)
}

/// A local path for `%f`/`%F`: `file://` URIs become paths (percent-decoded).
fn to_path(uri: &str) -> String {
    match uri.strip_prefix("file://") {
        Some(rest) => {
            let path = rest.find('/').map_or(rest, |i| &rest[i..]);
            percent_decode(path)
        }
        None => uri.to_string(),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The command lines to run for `uris`: one, or one per URI when the entry takes a single
/// file or URI (`%f`, `%u`) and several were given. Entries without a file or URI field code
/// get the URIs appended (as xdg-open does).
pub fn expand(
    entry: &Entry,
    desktop_file: &Path,
    uris: &[String],
) -> Result<Vec<Vec<String>>, String> {
    let exec = entry
        .get("Exec")
        .ok_or("the desktop file has no Exec key")?;
    let template = split_exec(exec)?;
    let single = template
        .iter()
        .any(|a| a.contains("%f") || a.contains("%u"));
    let groups: Vec<&[String]> = if single && uris.len() > 1 {
        uris.chunks(1).collect()
    } else {
        vec![uris]
    };
    let mut out = Vec::new();
    for group in groups {
        let mut argv = Vec::new();
        let mut took = false;
        for arg in &template {
            match arg.as_str() {
                "%F" | "%U" => {
                    took = true;
                    let conv = arg == "%F";
                    argv.extend(
                        group
                            .iter()
                            .map(|u| if conv { to_path(u) } else { u.clone() }),
                    );
                }
                "%i" => {
                    if let Some(icon) = entry.get("Icon").filter(|i| !i.is_empty()) {
                        argv.push("--icon".into());
                        argv.push(icon.into());
                    }
                }
                // A lone single-URI code with nothing to put there disappears.
                "%f" | "%u" if group.is_empty() => took = true,
                // Deprecated codes are removed.
                "%d" | "%D" | "%n" | "%N" | "%v" | "%m" => {}
                _ => argv.push(expand_codes(arg, entry, desktop_file, group, &mut took)),
            }
        }
        if !took {
            argv.extend(group.iter().cloned());
        }
        out.push(argv);
    }
    Ok(out)
}

fn expand_codes(arg: &str, entry: &Entry, file: &Path, uris: &[String], took: &mut bool) -> String {
    let mut out = String::new();
    let mut it = arg.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('%') => out.push('%'),
            Some('f') => {
                *took = true;
                out.push_str(&uris.first().map(|u| to_path(u)).unwrap_or_default());
            }
            Some('u') => {
                *took = true;
                out.push_str(uris.first().map(String::as_str).unwrap_or_default());
            }
            Some('c') => out.push_str(entry.get("Name").unwrap_or_default()),
            Some('k') => out.push_str(&file.to_string_lossy()),
            // Deprecated and list codes inside a word are dropped, as the spec allows.
            Some(_) | None => {}
        }
    }
    out
}

/// Where desktop files are looked up: `$XDG_DATA_HOME` (default `~/.local/share`), then
/// `$XDG_DATA_DIRS` (default `/usr/local/share:/usr/share`), each with `applications`.
pub fn search_dirs(env: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let non_empty = |k: &str| env(k).filter(|v| !v.is_empty());
    let home = non_empty("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| non_empty("HOME").map(|h| Path::new(&h).join(".local/share")));
    let system = non_empty("XDG_DATA_DIRS").unwrap_or_else(|| "/usr/local/share:/usr/share".into());
    home.into_iter()
        .chain(
            system
                .split(':')
                .filter(|d| !d.is_empty())
                .map(PathBuf::from),
        )
        .map(|d| d.join("applications"))
        .collect()
}

/// The desktop file of `app` (`name` or `name.desktop`; `vendor-name` also as `vendor/name`).
pub fn find(app: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    let name = app.strip_suffix(".desktop").unwrap_or(app);
    if name.is_empty() || name.contains('/') {
        return None;
    }
    let file = format!("{name}.desktop");
    let nested = file.replacen('-', "/", 1);
    dirs.iter()
        .flat_map(|d| [d.join(&file), d.join(&nested)])
        .find(|p| p.is_file())
}

/// The shim's entry point; returns the exit code.
pub fn main() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(app) = args.first().filter(|a| !a.starts_with('-')) else {
        let help = args.first().is_some_and(|a| a == "-h" || a == "--help");
        eprintln!("{USAGE}");
        return if help { 0 } else { 1 };
    };
    let dirs = search_dirs(&|k| std::env::var(k).ok());
    let Some(file) = find(app, &dirs) else {
        eprintln!("gtk-launch: no such application {app}");
        return 2;
    };
    let entry = std::fs::read_to_string(&file)
        .map_err(|e| e.to_string())
        .and_then(|t| Entry::parse(&t).ok_or_else(|| "not a desktop file".to_string()));
    let result = entry.and_then(|entry| {
        let cwd = entry
            .get("Path")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        for argv in expand(&entry, &file, &args[1..])? {
            spawn(&argv, cwd.as_deref()).map_err(|e| format!("{}: {e}", argv[0]))?;
        }
        Ok(())
    });
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("gtk-launch: error launching application: {e}");
            3
        }
    }
}

/// Starts `argv` in a session of its own, its output discarded, not waited for (the agent,
/// PID 1, reaps it).
fn spawn(argv: &[String], cwd: Option<&Path>) -> std::io::Result<()> {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOTEPAD: &str = "[Desktop Entry]\nType=Application\nName=Note pad\nName[de]=Notizblock\n\
        Icon=accessories-text-editor\nExec=kiln-notepad %f\n\n[Desktop Action new]\nExec=other\n";

    fn entry(exec: &str) -> Entry {
        Entry::parse(&format!(
            "[Desktop Entry]\nName=App\nIcon=ic\nExec={exec}\n"
        ))
        .unwrap()
    }

    fn run(exec: &str, uris: &[&str]) -> Vec<Vec<String>> {
        let uris: Vec<String> = uris.iter().map(|s| s.to_string()).collect();
        expand(&entry(exec), Path::new("/a/app.desktop"), &uris).unwrap()
    }

    #[test]
    fn parses_the_desktop_entry_group_only() {
        let e = Entry::parse(NOTEPAD).unwrap();
        assert_eq!(e.get("Exec"), Some("kiln-notepad %f"));
        assert_eq!(e.get("Name"), Some("Note pad"));
        assert!(Entry::parse("[Other]\nExec=x\n").is_none());
        let e = Entry::parse("[Desktop Entry]\nExec=a\\sb\\\\c\n").unwrap();
        assert_eq!(e.get("Exec"), Some("a b\\c"));
    }

    #[test]
    fn splits_exec_with_quotes_and_escapes() {
        assert_eq!(split_exec("a  b\tc").unwrap(), ["a", "b", "c"]);
        assert_eq!(
            split_exec(r#""/opt/my app/run" --x="1 2" "q\"\$\\""#).unwrap(),
            ["/opt/my app/run", "--x=1 2", "q\"$\\"]
        );
        assert_eq!(split_exec(r#"a """#).unwrap(), ["a", ""]);
        assert!(split_exec("\"open").is_err());
        assert!(split_exec("   ").is_err());
    }

    #[test]
    fn expands_field_codes() {
        assert_eq!(
            run("ed %f", &["/tmp/a b.txt"]),
            [vec!["ed", "/tmp/a b.txt"]]
        );
        assert_eq!(
            run("ed %f", &["file:///tmp/a%20b.txt"]),
            [vec!["ed", "/tmp/a b.txt"]]
        );
        assert_eq!(run("ed %f", &[]), [vec!["ed"]]);
        assert_eq!(
            run("ed %f", &["/x", "/y"]),
            [vec!["ed", "/x"], vec!["ed", "/y"]]
        );
        assert_eq!(
            run("br %U --n", &["http://a/", "file:///b"]),
            [vec!["br", "http://a/", "file:///b", "--n"]]
        );
        assert_eq!(run("v %F", &["file:///b", "/c"]), [vec!["v", "/b", "/c"]]);
        assert_eq!(
            run("v --url=%u", &["http://a/"]),
            [vec!["v", "--url=http://a/"]]
        );
        assert_eq!(
            run("v %i %c %k 100%%", &[]),
            [vec!["v", "--icon", "ic", "App", "/a/app.desktop", "100%"]]
        );
        // No file code: the URIs are appended; deprecated codes vanish.
        assert_eq!(run("v %d", &["/f"]), [vec!["v", "/f"]]);
        assert_eq!(run("v", &["/f", "/g"]), [vec!["v", "/f", "/g"]]);
    }

    #[test]
    fn finds_desktop_files_in_xdg_dirs() {
        let d = tempfile::tempdir().unwrap();
        let home = d.path().join("home");
        let sys = d.path().join("sys");
        std::fs::create_dir_all(home.join(".local/share/applications")).unwrap();
        std::fs::create_dir_all(sys.join("applications/vendor")).unwrap();
        std::fs::write(home.join(".local/share/applications/a.desktop"), NOTEPAD).unwrap();
        std::fs::write(sys.join("applications/a.desktop"), NOTEPAD).unwrap();
        std::fs::write(sys.join("applications/vendor/b.desktop"), NOTEPAD).unwrap();
        let env = |k: &str| match k {
            "HOME" => Some(home.to_string_lossy().into_owned()),
            "XDG_DATA_DIRS" => Some(format!("{}:", sys.display())),
            _ => None,
        };
        let dirs = search_dirs(&env);
        assert_eq!(dirs.len(), 2);
        assert_eq!(
            find("a", &dirs).unwrap(),
            home.join(".local/share/applications/a.desktop")
        );
        assert_eq!(
            find("vendor-b.desktop", &dirs).unwrap(),
            sys.join("applications/vendor/b.desktop")
        );
        assert!(find("missing", &dirs).is_none());
        assert!(find("../a", &dirs).is_none());
        let default = search_dirs(&|_| None);
        assert_eq!(
            default,
            [
                PathBuf::from("/usr/local/share/applications"),
                PathBuf::from("/usr/share/applications")
            ]
        );
    }
}
