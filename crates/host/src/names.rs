//! Sandbox host names on the host itself: `sandbox.get_host(port)` is `{port}-{id}.{domain}`,
//! and with the default domain `localhost` (RFC 6761) browsers and curl resolve such names to
//! loopback by themselves, but the C library's resolver (Python's, and every program using
//! `getaddrinfo`) does so only through NSS's `myhostname` module. [`prepare`] installs
//! Debian's `libnss-myhostname` and puts `myhostname` on the `hosts` line of
//! `/etc/nsswitch.conf`; [`check`] says whether a sandbox name resolves (`kiln doctor`).

use std::net::{IpAddr, ToSocketAddrs};
use std::path::Path;

/// The NSS configuration file.
const NSSWITCH: &str = "/etc/nsswitch.conf";
/// The Debian package with NSS's `myhostname` module.
pub const PACKAGE: &str = "libnss-myhostname";

/// A name of the form the SDK makes for `domain` (the agent's port of a sandbox `probe`).
pub fn sample_name(domain: &str) -> String {
    format!("49983-kilnprobe.{}", domain.trim_matches('.'))
}

/// The addresses `name` resolves to through the C library (getaddrinfo), as any program on
/// the host would see them; Err with the resolver's message.
pub fn resolve(name: &str) -> Result<Vec<IpAddr>, String> {
    (name, 80)
        .to_socket_addrs()
        .map(|a| a.map(|s| s.ip()).collect())
        .map_err(|e| e.to_string())
}

fn is_localhost(domain: &str) -> bool {
    domain.trim_matches('.').eq_ignore_ascii_case("localhost")
}

/// Whether the `hosts` line of `conf` asks `myhostname` before `dns` (so a `*.localhost`
/// name is answered on the host and never sent to a DNS server).
pub fn myhostname_first(conf: &str) -> bool {
    conf.lines()
        .rev()
        .find_map(|l| l.trim_start().strip_prefix("hosts:"))
        .is_some_and(|rest| {
            let w: Vec<&str> = rest.split_whitespace().collect();
            match (
                w.iter().position(|x| *x == "myhostname"),
                w.iter().position(|x| *x == "dns"),
            ) {
                (Some(m), Some(d)) => m < d,
                (Some(_), None) => true,
                _ => false,
            }
        })
}

/// Whether sandbox names under `domain` resolve on this host; the detail says to what, or
/// what to do. For `localhost` the name is only looked up when NSS answers it locally
/// (`myhostname` before `dns`): such a lookup never leaves the host.
pub fn check(domain: &str) -> (bool, String) {
    let name = sample_name(domain);
    let local = std::fs::read_to_string(NSSWITCH).is_ok_and(|c| myhostname_first(&c));
    let looked_up = if is_localhost(domain) && !(local && module_installed()) {
        Err("not answered on this host".to_string())
    } else {
        resolve(&name)
    };
    match looked_up {
        Ok(addrs) if !addrs.is_empty() => {
            let list: Vec<String> = addrs.iter().map(IpAddr::to_string).collect();
            (true, format!("{name} resolves to {}", list.join(", ")))
        }
        _ if is_localhost(domain) => (
            false,
            format!(
                "{name} does not resolve (Python's resolver fails on sandbox.get_host()): \
                 install {PACKAGE} and put `myhostname` on the hosts line of {NSSWITCH} \
                 (`kiln serve` does both when run as root)"
            ),
        ),
        _ => (
            false,
            format!(
                "{name} does not resolve: point *.{domain} at this host in DNS (or use the \
                 default domain localhost)"
            ),
        ),
    }
}

/// `hosts` line of an nsswitch.conf with `myhostname` added after `files` (or first), or
/// None when it is there already.
pub fn with_myhostname(conf: &str) -> Option<String> {
    let mut out = String::with_capacity(conf.len() + 16);
    let mut changed = false;
    let mut seen_hosts = false;
    for line in conf.split_inclusive('\n') {
        let body = line.trim_end_matches('\n');
        let Some(rest) = body.trim_start().strip_prefix("hosts:") else {
            out.push_str(line);
            continue;
        };
        seen_hosts = true;
        let words: Vec<&str> = rest.split_whitespace().collect();
        if words.contains(&"myhostname") {
            out.push_str(line);
            continue;
        }
        let at = words
            .iter()
            .position(|w| *w == "files")
            .map_or(0, |i| i + 1);
        let mut new = words.clone();
        new.insert(at, "myhostname");
        out.push_str(&format!("hosts:          {}", new.join(" ")));
        if line.ends_with('\n') {
            out.push('\n');
        }
        changed = true;
    }
    if !seen_hosts {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str("hosts:          files myhostname dns\n");
        changed = true;
    }
    changed.then_some(out)
}

fn module_installed() -> bool {
    ["/lib", "/usr/lib", "/lib64", "/usr/lib64"]
        .iter()
        .any(|d| {
            std::fs::read_dir(d).is_ok_and(|rd| {
                rd.flatten().any(|e| {
                    let p = e.path();
                    p.join("libnss_myhostname.so.2").exists()
                        || p.file_name().is_some_and(|n| n == "libnss_myhostname.so.2")
                })
            })
        })
}

/// Makes sandbox names under `domain` resolve on this host when they do not: for
/// `localhost`, installs [`PACKAGE`] with apt (as root) and enables it in nsswitch.conf.
/// Ok(Some(what was done)), Ok(None) when nothing was needed, Err(what to do) otherwise.
pub fn prepare(domain: &str) -> Result<Option<String>, String> {
    if check(domain).0 {
        return Ok(None);
    }
    if !is_localhost(domain) {
        return Err(check(domain).1);
    }
    let mut done = Vec::new();
    if !module_installed() {
        crate::prereq::install_packages(&[PACKAGE]).map_err(|e| e.to_string())?;
        done.push(format!("installed {PACKAGE}"));
    }
    let conf = std::fs::read_to_string(NSSWITCH).unwrap_or_default();
    if let Some(new) = with_myhostname(&conf) {
        write_atomically(Path::new(NSSWITCH), &new)
            .map_err(|e| format!("cannot update {NSSWITCH}: {e}"))?;
        done.push(format!("added myhostname to the hosts line of {NSSWITCH}"));
    }
    match check(domain) {
        (true, detail) => Ok(Some(format!("{}; {detail}", done.join(", ")))),
        (false, detail) => Err(detail),
    }
}

fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = path.with_extension("conf.kiln-tmp");
    std::fs::write(&tmp, text)?;
    let mode = std::fs::metadata(path).map_or(0o644, |m| m.permissions().mode());
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_myhostname_after_files_once() {
        let debian = "passwd:         files\nhosts:          files dns\nnetworks:       files\n";
        let new = with_myhostname(debian).unwrap();
        assert_eq!(
            new,
            "passwd:         files\nhosts:          files myhostname dns\nnetworks:       files\n"
        );
        assert_eq!(with_myhostname(&new), None);
        assert_eq!(
            with_myhostname("hosts: dns").unwrap(),
            "hosts:          myhostname dns"
        );
        assert_eq!(
            with_myhostname("passwd: files").unwrap(),
            "passwd: files\nhosts:          files myhostname dns\n"
        );
    }

    #[test]
    fn plain_localhost_resolves_and_the_probe_name_has_the_sdk_form() {
        assert_eq!(sample_name("localhost."), "49983-kilnprobe.localhost");
        assert!(resolve("localhost").is_ok_and(|a| a.iter().all(|ip| ip.is_loopback())));
        assert!(myhostname_first("hosts: files myhostname dns"));
        assert!(!myhostname_first("hosts: files dns myhostname"));
        assert!(!myhostname_first("hosts: files dns"));
    }
}
