//! `kiln bench net`'s in-sandbox interception rows: HTTPS GETs made from inside a sandbox to a
//! host of the bench's own test internet (a namespace `kbnrules` joined to the host by a veth
//! pair, the host side on 198.51.100.249, the HTTPS server on 198.51.100.250 with a certificate
//! of a CA made here, for two names), on kept-alive connections: one name has a header rule
//! (the egress proxy intercepts it, injecting a secret), the other, the same server, has none
//! (the egress proxy splices it). The requests alternate in one run, each timed inside the
//! sandbox. Nothing leaves this machine.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use base64::Engine;
use kiln_net::intercept::{bench, Interceptor};
use kiln_net::EgressPolicy;

use super::audit_egress::ip;
use super::side::{params, Side};

const NS: &str = "kbnrules";
const HOST_DEV: &str = "kbnrules0";
const HOST_SIDE: &str = "198.51.100.249";
const SERVER: &str = "198.51.100.250";
/// The name with a rule, and another name of the same server without one.
const RULE_NAME: &str = "rule.bench.test";
const PLAIN_NAME: &str = "plain.bench.test";

/// Keep-alive GETs to both names, alternating; prints `{"rule": [s…], "plain": [s…]}`.
const CLIENT: &str = r#"
import http.client, json, socket, ssl, sys, time
ip, n, rule, plain = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ctx = ssl.create_default_context(cafile="/tmp/kiln-bench-ca.pem")
class C(http.client.HTTPSConnection):
    def connect(self):
        s = socket.create_connection((ip, 443), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = ctx.wrap_socket(s, server_hostname=self.host)
conns = {rule: C(rule), plain: C(plain)}
want = {rule: b"A", plain: b"-"}
times = {rule: [], plain: []}
for i in range(n + 5):
    for name, c in conns.items():
        t = time.perf_counter()
        c.request("GET", "/small")
        body = c.getresponse().read()
        dt = time.perf_counter() - t
        if body[:1] != want[name]:
            sys.exit(f"{name}: unexpected answer {body[:40]!r}")
        if i >= 5:
            times[name].append(dt)
print(json.dumps({"rule": times[rule], "plain": times[plain]}))
"#;

/// The test internet's namespace and veth pair; removed when dropped.
struct TestNet;

impl TestNet {
    fn up() -> anyhow::Result<Self> {
        Self::remove();
        let net = TestNet;
        ip(&["netns", "add", NS])?;
        ip(&[
            "link", "add", HOST_DEV, "type", "veth", "peer", "name", "eth0", "netns", NS,
        ])?;
        ip(&["addr", "add", &format!("{HOST_SIDE}/29"), "dev", HOST_DEV])?;
        ip(&["link", "set", HOST_DEV, "up"])?;
        ip(&[
            "-n",
            NS,
            "addr",
            "add",
            &format!("{SERVER}/29"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", NS, "link", "set", "eth0", "up"])?;
        ip(&["-n", NS, "link", "set", "lo", "up"])?;
        ip(&["-n", NS, "route", "add", "default", "via", HOST_SIDE])?;
        Ok(net)
    }

    fn remove() {
        let _ = ip(&["netns", "del", NS]);
        let _ = ip(&["link", "del", HOST_DEV]);
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        Self::remove();
    }
}

/// The request times from inside a sandbox of `side`: (with a rule, without one).
pub(crate) async fn measure(
    side: &Side,
    template: &str,
    requests: usize,
    work_root: &Path,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let _net = TestNet::up().context("the bench's test internet")?;
    let dir = tempfile::tempdir_in(work_root).context("a directory for the bench's CAs")?;
    let l = kiln_net::netns::in_netns(Path::new(&format!("/var/run/netns/{NS}")), || {
        let l = std::net::TcpListener::bind((SERVER, 443))?;
        l.set_nonblocking(true)?;
        Ok(l)
    })
    .await?;
    let l = tokio::net::TcpListener::from_std(l)?;
    bench::serve_upstream(dir.path(), l, &[RULE_NAME, PLAIN_NAME])
        .map_err(|e| anyhow!("the test host: {e}"))?;
    let upstream_ca = dir.path().join("upstream-ca.pem");
    let interceptor = Arc::new(Interceptor::open(
        &dir.path().join("kiln"),
        std::slice::from_ref(&upstream_ca),
    )?);
    let rule = bench::rule_for(RULE_NAME, interceptor.clone()).map_err(|e| anyhow!("{e}"))?;
    let policy = EgressPolicy {
        transforms: Some(Arc::new(rule)),
        ..Default::default()
    };

    let rec = side.manager.create(params(template)).await?;
    let id = rec.id.clone();
    let r = async {
        side.manager.set_network(&id, policy).await?;
        let bundle = format!(
            "{}\n{}",
            interceptor.ca.cert_pem(),
            std::fs::read_to_string(&upstream_ca)?
        );
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let cmd = format!(
            "echo {} | base64 -d > /tmp/kiln-bench-ca.pem && echo {} | base64 -d > \
             /tmp/kiln-bench.py && python3 /tmp/kiln-bench.py {SERVER} {requests} {RULE_NAME} \
             {PLAIN_NAME}",
            b64(&bundle),
            b64(CLIENT)
        );
        let out = side
            .manager
            .agent(&id, None)
            .run(
                &cmd,
                kiln_envd::RunOptions {
                    timeout: Some(Duration::from_secs(120 + requests as u64 / 10)),
                    ..Default::default()
                },
            )
            .await?;
        if out.exit_code != 0 {
            bail!(
                "the in-sandbox client: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("reading the in-sandbox client's times")?;
        let times = |k: &str| -> Vec<Duration> {
            v[k].as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_f64())
                        .map(Duration::from_secs_f64)
                        .collect()
                })
                .unwrap_or_default()
        };
        Ok((times("rule"), times("plain")))
    }
    .await;
    let _ = side.manager.kill(&id, "bench").await;
    r
}

/// Prints the in-sandbox rows: p50/p90/p99 of each side and the p50 ratio.
pub(crate) fn print_rows(rule: &[Duration], plain: &[Duration]) {
    let pct = |d: &[Duration]| {
        let v = super::stats::sorted(&d.iter().map(|x| x.as_secs_f64() * 1e3).collect::<Vec<_>>());
        let at = |q: f64| {
            let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1)) - 1;
            v.get(i).copied().unwrap_or(f64::NAN)
        };
        (v.len(), at(0.5), at(0.9), at(0.99))
    };
    let (p, r) = (pct(plain), pct(rule));
    for (name, (n, p50, p90, p99)) in [
        ("HTTPS GET from a sandbox, no rule", p),
        ("HTTPS GET from a sandbox, rule", r),
    ] {
        println!("  {name:<40} n={n:<4} p50 {p50:>8.3} ms   p90 {p90:>8.3} ms   p99 {p99:>8.3} ms");
    }
    println!(
        "  in a sandbox, interception p50 vs the same request without a rule: {:.2}x \
         (p90 {:.2}x, p99 {:.2}x; target: at most 1.3x)",
        r.1 / p.1,
        r.2 / p.2,
        r.3 / p.3
    );
}
