//! A real S3 server for tests: moto's server mode (PyPI `moto[server]`, installed into the test
//! venv from tests/sdk/requirements.txt) on a free 127.0.0.1 port, killed when dropped (and,
//! through `PR_SET_PDEATHSIG`, when the test process dies).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_cluster::objects::S3Config;

/// The Python with moto: `$KILN_PYTHON`, else `python3`; None when `test` is skipped (the
/// skip policy of [`kiln_testkit`]).
fn moto_python(test: &str) -> Option<PathBuf> {
    let python = std::env::var_os("KILN_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("python3"));
    kiln_testkit::needs()
        .python_modules(
            &python,
            &["moto.server", "flask"],
            "an S3 server: moto[server] from tests/sdk/requirements.txt in the venv at \
             $KILN_PYTHON, which scripts/test.sh makes",
        )
        .ok_as(test)
        .then_some(python)
}

/// A running moto server on 127.0.0.1.
pub struct Moto {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Moto {
    /// Starts moto and waits until it answers; None when skipped (see [`moto_python`]).
    pub fn start(test: &str) -> Option<Moto> {
        let python = moto_python(test)?;
        let dir = tempfile::tempdir().unwrap();
        let port = kiln_testkit::host::free_port();
        let log = std::fs::File::create(dir.path().join("moto.log")).unwrap();
        let mut cmd = Command::new(&python);
        cmd.args([
            "-m",
            "moto.server",
            "-H",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("HOME", dir.path());
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2),
        // which is async-signal-safe; it touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("starting moto");
        let mut moto = Moto {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while moto.http("GET", "/").is_none() {
            if let Ok(Some(status)) = moto.child.try_wait() {
                panic!("moto exited ({status}): {}", moto.log());
            }
            assert!(
                Instant::now() < deadline,
                "moto did not answer: {}",
                moto.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(moto)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("moto.log")).unwrap_or_default()
    }

    /// One plain HTTP/1.1 request to moto (which checks no signatures); the status code.
    fn http(&self, method: &str, path: &str) -> Option<u16> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        let host = format!("127.0.0.1:{}", self.port);
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).ok()?;
        answer.split_whitespace().nth(1)?.parse().ok()
    }

    /// Creates `bucket` and returns the settings of a client for it.
    pub fn bucket(&self, bucket: &str) -> S3Config {
        let status = self.http("PUT", &format!("/{bucket}"));
        assert_eq!(
            status,
            Some(200),
            "creating bucket {bucket}: {}",
            self.log()
        );
        S3Config {
            endpoint: format!("http://127.0.0.1:{}", self.port),
            bucket: bucket.to_string(),
            region: "us-east-1".into(),
            access_key_id: "kiln-test".into(),
            secret_access_key: "kiln-test-secret".into(),
            path_style: true,
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
