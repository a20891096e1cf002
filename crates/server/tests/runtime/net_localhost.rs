//! A server bound to localhost inside a sandbox is reachable through kiln's port routing, as
//! on E2B (real gVisor sandbox with networking; needs root): the connection to the sandbox's
//! address is refused, so the agent connects to 127.0.0.1:port inside and relays.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use kiln_envd::RunOptions;
use kiln_gvisor::net_config::prefix_for_state;
use kiln_gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::driver::{Driver, DriverError};
use kiln_server::manager::CreateParams;
use kiln_server::templates::{from_dir, FixedTemplates};
use kiln_server::{LifecycleConfig, Manager};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get(driver: &dyn Driver, id: &str, port: u16) -> Result<String, DriverError> {
    let mut io = driver.connect(id, port).await?;
    io.write_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), io.read_to_end(&mut buf)).await;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_bound_to_localhost_is_reachable_through_port_routing() {
    if !common::sandboxes_run() {
        return;
    }
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = common::state_dir();
    let prefix = prefix_for_state(state.path());
    // A free range of this host (other test servers may be running).
    let range = kiln_net::range::pick_range(&prefix, None).await.unwrap();
    let mut settings = common::driver_config().gvisor;
    settings.network = Some(kiln_net::NetConfig {
        range,
        pool_size: 1,
        prefix,
        operator_allow: Vec::new(),
        dns_upstreams: Vec::new(),
        max_connections: 0,
        egress_mib_per_sec: 0,
        proxy_all_tcp: false,
    });
    let gvisor =
        Arc::new(GvisorDriver::new(GvisorConfig::from_settings(&settings, state.path())).unwrap());
    let driver: Arc<dyn Driver> = gvisor.clone();
    let cleanup = common::Cleanup::new(driver.clone());
    let m: Arc<Manager> = common::manager(
        state.path(),
        driver.clone(),
        Arc::new(FixedTemplates(vec![from_dir("t", tpl.path())])),
        LifecycleConfig {
            default_memory_mb: 256,
            ..LifecycleConfig::default()
        },
    );
    let id = m
        .create(CreateParams {
            template_id: "t".into(),
            timeout_secs: Some(600),
            secure: false,
            ..Default::default()
        })
        .await
        .expect("create")
        .id;
    cleanup.add(&id);

    // Nothing listens yet: a clear "nothing is listening", from the sandbox's address and the
    // agent's relay alike.
    match driver.connect(&id, 8000).await {
        Err(DriverError::Unreachable { reason, .. }) => {
            assert!(
                reason.contains("nothing is listening on port 8000"),
                "{reason}"
            )
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("port 8000 answered before any server started"),
    }

    // An HTTP server on 127.0.0.1:8000 only (the agent's code-interpreter API, which needs no
    // Python for /health).
    let out = m
        .agent(&id, None)
        .run(
            "kiln-agent interp --listen 127.0.0.1:8000 --no-warm --runtime-dir /tmp/ki \
             >/tmp/interp.log 2>&1 &",
            RunOptions {
                timeout: Some(Duration::from_secs(30)),
                ..Default::default()
            },
        )
        .await
        .expect("starting the server");
    assert_eq!(out.exit_code, 0, "{out:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let answer = loop {
        match get(driver.as_ref(), &id, 8000).await {
            Ok(a) if !a.is_empty() => break a,
            r => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the localhost server never answered through kiln: {:?}",
                    r.err()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert!(answer.starts_with("HTTP/1."), "{answer}");
    assert!(answer.contains(" 200 "), "{answer}");
    assert!(answer.contains("OK"), "{answer}");

    // Another port still says nothing listens there.
    match driver.connect(&id, 8001).await {
        Err(DriverError::Unreachable { reason, .. }) => {
            assert!(reason.contains("nothing is listening"), "{reason}")
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("port 8001 answered"),
    }

    m.kill(&id, "done").await.unwrap();
    gvisor.shutdown_network().await;
}
