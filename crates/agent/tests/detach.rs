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
