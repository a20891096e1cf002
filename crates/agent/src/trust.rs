//! The sandbox's extra trusted CAs, installed by `/init` (`kilnExtraCas`): every certificate
//! in one file ([`TRUST_EXTRA_FILE`], which Node's `NODE_EXTRA_CA_CERTS` reads), and those the
//! system bundle ([`TRUST_BUNDLE`]) lacks appended to it. Done here, in the agent, the server's
//! create needs no file round trips for it. The extra file is written last, so once it holds
//! the list the bundle has them too: an `/init` that gives the same list again (a restored
//! snapshot, a second `/init`) reads only that small file and writes nothing.

use std::io;
use std::path::Path;

pub use kiln_proto::envd::{TRUST_BUNDLE, TRUST_EXTRA_FILE};

/// Installs `certs` (PEM blocks) under the root directory `root` (`/` in a sandbox).
pub fn install(root: &Path, certs: &[String]) -> io::Result<()> {
    if certs.is_empty() {
        return Ok(());
    }
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let extra: String = certs
        .iter()
        .map(|c| format!("{}\n", c.trim()))
        .collect::<String>();
    let extra_path = at(TRUST_EXTRA_FILE);
    if std::fs::read(&extra_path).is_ok_and(|old| old == extra.as_bytes()) {
        return Ok(());
    }

    let bundle_path = at(TRUST_BUNDLE);
    let mut bundle = match std::fs::read(&bundle_path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e),
    };
    let have = String::from_utf8_lossy(&bundle).replace("\r\n", "\n");
    let missing: Vec<&String> = certs.iter().filter(|c| !have.contains(c.trim())).collect();
    if !missing.is_empty() {
        if !bundle.is_empty() && !bundle.ends_with(b"\n") {
            bundle.push(b'\n');
        }
        for c in missing {
            bundle.extend_from_slice(c.trim().as_bytes());
            bundle.push(b'\n');
        }
        replace(&bundle_path, &bundle)?;
    }
    replace(&extra_path, extra.as_bytes())
}

/// Writes `data` to `path` through a temporary file and a rename (a reader sees the old file
/// or the new one), creating its directory.
fn replace(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no parent directory"))?;
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.kiln-tmp"));
    std::fs::write(&tmp, data)?;
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pem(n: u8) -> String {
        format!("-----BEGIN CERTIFICATE-----\nQUJD{n}\n-----END CERTIFICATE-----\n")
    }

    #[test]
    fn certificates_go_to_the_extra_file_and_once_into_the_bundle() {
        let root = tempfile::tempdir().unwrap();
        let bundle = root.path().join(TRUST_BUNDLE.trim_start_matches('/'));
        std::fs::create_dir_all(bundle.parent().unwrap()).unwrap();
        // A bundle without a final newline that already holds the first certificate.
        std::fs::write(&bundle, format!("{}\nroots", pem(1).trim())).unwrap();

        install(root.path(), &[pem(1), pem(2)]).unwrap();
        let extra =
            std::fs::read_to_string(root.path().join(TRUST_EXTRA_FILE.trim_start_matches('/')))
                .unwrap();
        assert_eq!(extra.matches("BEGIN CERTIFICATE").count(), 2);
        let b = std::fs::read_to_string(&bundle).unwrap();
        assert_eq!(b.matches(pem(1).trim()).count(), 1, "{b}");
        assert_eq!(b.matches(pem(2).trim()).count(), 1, "{b}");
        assert!(b.contains("roots\n-----BEGIN"), "{b}");

        // Given again: nothing changes, nothing is duplicated.
        let before = std::fs::metadata(&bundle).unwrap().modified().unwrap();
        install(root.path(), &[pem(1), pem(2)]).unwrap();
        assert_eq!(std::fs::read_to_string(&bundle).unwrap(), b);
        assert_eq!(
            std::fs::metadata(&bundle).unwrap().modified().unwrap(),
            before
        );
    }

    #[test]
    fn a_missing_bundle_is_created_and_an_empty_list_touches_nothing() {
        let root = tempfile::tempdir().unwrap();
        install(root.path(), &[]).unwrap();
        assert!(std::fs::read_dir(root.path()).unwrap().next().is_none());
        install(root.path(), &[pem(3)]).unwrap();
        let b = std::fs::read_to_string(root.path().join(TRUST_BUNDLE.trim_start_matches('/')))
            .unwrap();
        assert_eq!(b, pem(3));
    }
}
