//! SIGUSR1 detaches the agent from its sockets (what gVisor needs before a checkpoint) and
//! SIGUSR2 attaches it again; its state (running processes, /init identity) is kept.

mod common;

use std::time::Duration;

use kiln_envd::EnvdClient;

fn signal(a: &common::Agent, sig: libc::c_int) {
    // SAFETY: kill takes plain integers; the pid is our own child's.
    let rc = unsafe { libc::kill(a.child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0);
}

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn detach_and_attach_keep_state() {
    let (a, c) = common::start().await;
    let init = kiln_proto::envd::InitRequest {
        env_vars: Some([("KEPT".to_string(), "yes".to_string())].into()),
        ..Default::default()
    };
    c.init(&init).await.unwrap();
    let marker = a.dir.path().join("agent.sock.detached");
    let tcp = EnvdClient::tcp(([127, 0, 0, 1], a.port).into());
    assert!(tcp.health().await.is_ok());

    signal(&a, libc::SIGUSR1);
    wait_for("the detached marker", || marker.exists()).await;
    assert!(!a.sock.exists(), "the socket file is removed");
    assert!(c.health().await.is_err(), "nothing answers on the socket");
    assert!(tcp.health().await.is_err(), "nothing answers on TCP");
    // A second detach is harmless.
    signal(&a, libc::SIGUSR1);

    signal(&a, libc::SIGUSR2);
    c.wait_ready(Duration::from_secs(10))
        .await
        .expect("attached again");
    wait_for("the marker to go", || !marker.exists()).await;
    assert!(tcp.health().await.is_ok());
    let out = c.run("echo $KEPT", common::opts()).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "yes\n",
        "init state kept"
    );
    // A second attach is harmless too.
    signal(&a, libc::SIGUSR2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(c.health().await.is_ok());
}

/// The server's way: `POST /kiln/detach` over the socket detaches the agent (no signal), and
/// removing the `.detached` marker has it attach again, its state kept.
#[tokio::test]
async fn detach_by_request_and_attach_by_marker() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (a, c) = common::start().await;
    let init = kiln_proto::envd::InitRequest {
        env_vars: Some([("KEPT".to_string(), "still".to_string())].into()),
        ..Default::default()
    };
    c.init(&init).await.unwrap();
    let marker = a.dir.path().join("agent.sock.detached");

    // Only POST detaches.
    let mut s = tokio::net::UnixStream::connect(&a.sock).await.unwrap();
    s.write_all(b"GET /kiln/detach HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    assert!(c.health().await.is_ok(), "a GET leaves the agent attached");

    let mut s = tokio::net::UnixStream::connect(&a.sock).await.unwrap();
    s.write_all(
        b"POST /kiln/detach HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 202"),
        "{answer}"
    );
    wait_for("the detached marker", || marker.exists()).await;
    assert!(!a.sock.exists(), "the socket file is removed");
    assert!(c.health().await.is_err(), "nothing answers while detached");
    // Detached, it stays so while the marker is there.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(c.health().await.is_err());

    std::fs::remove_file(&marker).unwrap();
    c.wait_ready(Duration::from_secs(10))
        .await
        .expect("attached again once the marker is gone");
    let out = c.run("echo $KEPT", common::opts()).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "still\n");
}
