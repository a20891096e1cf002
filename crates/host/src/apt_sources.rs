//! The Debian archive this host already uses, read from its own apt sources.
//!
//! kiln never names a package mirror itself: the template builder (mmdebstrap) and the runsc
//! fetcher both take the mirror from `KILN_DEBIAN_MIRROR` when set, else from the host's apt
//! configuration (`/etc/apt/sources.list.d/*.sources` in deb822 form, `/etc/apt/sources.list`
//! one-line form). Only entries of the Debian archive itself count (not `debian-security`,
//! not third-party repositories).

use std::path::PathBuf;

/// Environment variable naming the Debian mirror (a URI) kiln should use instead of the host's.
pub const MIRROR_ENV: &str = "KILN_DEBIAN_MIRROR";

/// Where the host keeps its apt sources.
pub const SOURCES_LIST: &str = "/etc/apt/sources.list";
pub const SOURCES_DIR: &str = "/etc/apt/sources.list.d";

/// `KILN_DEBIAN_MIRROR` when set and not empty.
pub fn mirror_override() -> Option<String> {
    std::env::var(MIRROR_ENV)
        .ok()
        .filter(|m| !m.trim().is_empty())
}

/// The host's apt source files, deb822 files first (sorted), then the one-line list.
fn host_source_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(SOURCES_DIR)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "sources" || x == "list"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files.push(PathBuf::from(SOURCES_LIST));
    files
}

/// True when `uri` looks like a Debian archive root (`…/debian`), not the security archive or a
/// third-party repository.
fn is_debian_archive(uri: &str) -> bool {
    let u = uri.trim_end_matches('/');
    u.starts_with("http") && (u.ends_with("/debian") || u.ends_with("/debian-archive/debian"))
}

/// The Debian archive URIs in one source file's text (deb822 `URIs:` fields of `Types: deb`
/// stanzas, or `deb [opts] URI suite …` lines).
pub fn archive_uris_in(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    // One-line format.
    for line in text.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("deb ") {
            let rest = rest.trim_start();
            let rest = match rest.strip_prefix('[') {
                Some(r) => r.split_once(']').map(|(_, r)| r).unwrap_or(""),
                None => rest,
            };
            if let Some(uri) = rest.split_whitespace().next() {
                out.push(uri.to_string());
            }
        }
    }
    // deb822 stanzas: blank-line separated, `Types:` must include `deb`.
    for stanza in text.split("\n\n") {
        let mut types_deb = false;
        let mut uris = Vec::new();
        let mut enabled = true;
        for line in stanza.lines().filter(|l| !l.trim_start().starts_with('#')) {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            match k.trim().to_ascii_lowercase().as_str() {
                "types" => types_deb = v.split_whitespace().any(|t| t == "deb"),
                "uris" => uris.extend(v.split_whitespace().map(str::to_string)),
                "enabled" => enabled = !v.trim().eq_ignore_ascii_case("no"),
                _ => {}
            }
        }
        if types_deb && enabled {
            out.extend(uris);
        }
    }
    out.retain(|u| is_debian_archive(u));
    out.dedup();
    out
}

/// The Debian archive URI kiln uses: `KILN_DEBIAN_MIRROR`, else the first Debian archive URI in
/// the host's apt sources. `None` when neither exists.
pub fn debian_mirror_uri() -> Option<String> {
    if let Some(m) = mirror_override() {
        return Some(m.trim().trim_end_matches('/').to_string());
    }
    host_source_files()
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|t| archive_uris_in(&t))
        .map(|u| u.trim_end_matches('/').to_string())
        .next()
}

/// The host source file that mentions the Debian archive (given to mmdebstrap as-is, which
/// reads both formats), if any.
pub fn host_debian_sources_file() -> Option<PathBuf> {
    host_source_files().into_iter().find(|p| {
        std::fs::read_to_string(p)
            .map(|t| !archive_uris_in(&t).is_empty())
            .unwrap_or(false)
    })
}

/// The command line that tells a user how to set the mirror by hand.
pub fn how_to_set_mirror() -> String {
    format!(
        "set {MIRROR_ENV} to your Debian mirror (the URI of a `deb` line in {SOURCES_LIST} or a `URIs:` field in {SOURCES_DIR}/*.sources)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_takes_only_the_debian_archive() {
        let t = "Types: deb\n# comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\nTypes: deb-src\nURIs: http://src.example/debian\n";
        assert_eq!(archive_uris_in(t), vec!["http://mirror.example/debian"]);
    }

    #[test]
    fn disabled_deb822_stanzas_do_not_count() {
        let t = "Types: deb\nURIs: http://a.example/debian\nEnabled: no\n";
        assert!(archive_uris_in(t).is_empty());
    }

    #[test]
    fn one_line_format_with_options() {
        let t = "# deb http://old.example/debian bookworm main\ndeb [signed-by=/k.gpg arch=amd64] https://m.example/debian/ bookworm main\ndeb http://m.example/debian-security bookworm-security main\ndeb http://other.example/repo stable main\n";
        assert_eq!(archive_uris_in(t), vec!["https://m.example/debian/"]);
    }

    #[test]
    fn override_wins() {
        // Only this test touches the variable in this process.
        std::env::set_var(MIRROR_ENV, "http://override.example/debian/");
        assert_eq!(
            debian_mirror_uri().as_deref(),
            Some("http://override.example/debian")
        );
        std::env::remove_var(MIRROR_ENV);
    }
}
