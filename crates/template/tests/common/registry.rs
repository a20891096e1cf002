//! A real registry for tests: Debian's `docker-registry` (the CNCF distribution registry) on a
//! loopback port with filesystem storage, optionally behind Basic auth (a bcrypt htpasswd entry
//! made by `htpasswd -B`) or a bearer-token issuer ([`super::token`]), and pushes with Debian's `skopeo` from an OCI layout directory.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether the registry tests run here (root, to keep file owners; the registry and its tools,
/// which scripts/test.sh installs), under the skip policy of [`kiln_testkit`].
pub fn runs_here() -> bool {
    kiln_testkit::needs()
        .root("image tests (they keep file owners)")
        .tools(&[
            "docker-registry",
            "skopeo",
            "htpasswd",
            "openssl",
            "mkfs.ext4",
        ])
        .ok()
}

/// A running registry; stopped (and its storage removed) on drop.
pub struct Registry {
    child: Child,
    pub addr: String,
    pub creds: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Registry {
    /// Starts a registry; with `creds`, every request needs them (Basic auth).
    pub fn start(creds: Option<(&str, &str)>) -> Registry {
        Registry::start_with(creds, None)
    }

    /// Starts a registry behind a bearer-token issuer (`auth` is its `auth:` section); `creds`
    /// are what skopeo pushes with.
    pub fn start_token(auth: String, creds: (&str, &str)) -> Registry {
        Registry::start_with(Some(creds), Some(auth))
    }

    fn start_with(creds: Option<(&str, &str)>, token_auth: Option<String>) -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let port = kiln_testkit::host::free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        if let Some(auth) = token_auth {
            config.push_str(&auth);
        } else if let Some((u, p)) = creds {
            let out = Command::new("htpasswd")
                .args(["-Bbn", u, p])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "htpasswd: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let file = dir.path().join("htpasswd");
            std::fs::write(&file, &out.stdout).unwrap();
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: kiln-test\n    path: {}\n",
                file.display()
            ));
        }
        let cfg = dir.path().join("config.yml");
        std::fs::write(&cfg, config).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("registry.log")).unwrap())
            .spawn()
            .expect("starting docker-registry");
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "docker-registry did not listen on {addr}: {}",
                std::fs::read_to_string(dir.path().join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Registry {
            child,
            addr,
            creds: creds.map(|(u, p)| (u.to_string(), p.to_string())),
            _dir: dir,
        }
    }

    /// Pushes tag `tag` of the OCI layout `layout` as `repo:tag` with skopeo (`extra`: e.g.
    /// `--all` for an index, `--format v2s2` for a Docker schema 2 manifest).
    pub fn push(&self, layout: &Path, tag: &str, repo: &str, extra: &[&str]) {
        let mut cmd = Command::new("skopeo");
        cmd.args([
            "--insecure-policy",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
        ]);
        if !extra.contains(&"--format") {
            cmd.arg("--preserve-digests");
        }
        if let Some((u, p)) = &self.creds {
            cmd.arg(format!("--dest-creds={u}:{p}"));
        }
        cmd.args(extra)
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/{repo}:{tag}", self.addr));
        let out = cmd.output().expect("running skopeo");
        assert!(
            out.status.success(),
            "skopeo push of {repo}:{tag} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The base template's rootfs (built by `kiln template build base` before the tests run).
pub fn base_rootfs() -> PathBuf {
    let store = kiln_template::Store::open_default().unwrap();
    match store.lookup("base") {
        Ok(t) => t.rootfs,
        Err(e) => panic!("the image tests make their images from the base template: {e}"),
    }
}
