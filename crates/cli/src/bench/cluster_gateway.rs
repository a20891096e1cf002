//! `kiln bench cluster`'s gateway part: one real `kiln node` and one `kiln control` of this
//! binary on a real etcd. A create through the control's E2B API (auth, quota, placement, the
//! node's internal API, the wait for the replica's view) against the same create sent straight
//! to the node's internal API; and one `commands.run`-equivalent envd call (a login shell
//! running `true`) through the control's gateway against the same call through a tunnel
//! straight into the node. The samples of both sides are interleaved. A second replica, run
//! with `--audit off`, serves the bare exec again: the hop without the audit tap.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kiln_cluster::control::{NodeClient, TunnelConnector};
use kiln_cluster::wire::{CreateDoc, Op};
use kiln_cluster::ClusterSecret;
use kiln_envd::EnvdClient;
use kiln_server::manager::CreateParams;

use super::cluster_proc::{envd_via_control, kiln, listen_addr, Live, Proc};
use super::served::exec;
use super::stats::{median_ci, percentiles, quantile, sorted, Percentiles};
use crate::drivers::BenchRuntime;

#[derive(Debug, Clone)]
pub(crate) struct GatewayReport {
    pub creates: usize,
    pub direct_create: Percentiles,
    pub gateway_create: Percentiles,
    /// A login shell running `true` (what `commands.run` starts).
    pub direct_exec: Percentiles,
    pub gateway_exec: Percentiles,
    /// The gateway's extra time per exec, pair by pair (each gateway sample less the direct
    /// one taken beside it).
    pub exec_hop: Hop,
    /// `/bin/true` started without a shell: the same envd call with far less time (and noise)
    /// in the sandbox, so its pairs resolve the hop.
    pub direct_bare: Percentiles,
    pub gateway_bare: Percentiles,
    pub bare_hop: Hop,
    /// The bare exec through the replica that records nothing (`--audit off`).
    pub quiet_bare: Percentiles,
    pub quiet_direct_bare: Percentiles,
    pub quiet_bare_hop: Hop,
    /// envd's `GET /health` (no process started): the hop alone.
    pub direct_health: Percentiles,
    pub gateway_health: Percentiles,
    pub health_hop: Hop,
}

/// The median of paired differences (ms) with its 95 % confidence interval: adjacent samples
/// share the host's state of the moment, so the pairs' differences keep the hop and shed most
/// of the noise the two sides share.
#[derive(Debug, Clone)]
pub(crate) struct Hop {
    pub n: usize,
    pub median_ms: f64,
    pub ci_ms: (f64, f64),
}

impl Hop {
    fn of(gateway: &[Duration], direct: &[Duration]) -> Self {
        let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
        let diffs: Vec<f64> = gateway
            .iter()
            .zip(direct)
            .map(|(g, d)| ms(g) - ms(d))
            .collect();
        let v = sorted(&diffs);
        Self {
            n: v.len(),
            median_ms: quantile(&v, 0.5),
            ci_ms: median_ci(&v),
        }
    }
}

pub(crate) struct GatewayOptions {
    pub template: String,
    pub creates: usize,
    pub execs: usize,
}

/// The node and the control replica, and the sandboxes made through either (killed at the
/// end on every path, before the processes stop).
pub(crate) struct Roles {
    pub node: Proc,
    pub control: Proc,
    /// A replica run with `--audit off`.
    pub quiet: Proc,
    node_addr: String,
    control_addr: std::net::SocketAddr,
    quiet_addr: std::net::SocketAddr,
    api_key: String,
    nodes: NodeClient,
    http: reqwest::Client,
    pub live: Live,
}

/// Starts the node (state in `<dir>/node`) and the control replica.
pub(crate) async fn start(
    etcd: &str,
    dir: &Path,
    runtime: &BenchRuntime,
    secret: &str,
) -> anyhow::Result<Roles> {
    let prefix = "/kiln-bench-gateway";
    let mut cmd = kiln("node", etcd, prefix, secret)?;
    cmd.args(["--name", "bench-node", "--no-prepare", "--pool-off"])
        .arg("--state-dir")
        .arg(dir.join("node"))
        .args(runtime.serve_flags());
    let mut node = Proc::spawn("node", cmd, dir)?;
    let line = node
        .wait_for("listening on http://", Duration::from_secs(120))
        .await?;
    let node_addr = listen_addr(&line)?.to_string();
    let mut cmd = kiln("control", etcd, prefix, secret)?;
    cmd.args(["--replica", "bench-control"]);
    let mut control = Proc::spawn("control", cmd, dir)?;
    let line = control
        .wait_for("listening on http://", Duration::from_secs(60))
        .await?;
    let control_addr = listen_addr(&line)?;
    let api_key = control
        .wait_for("store it now):", Duration::from_secs(10))
        .await?;
    let mut cmd = kiln("control", etcd, prefix, secret)?;
    cmd.args(["--replica", "bench-control-quiet", "--audit", "off"]);
    let mut quiet = Proc::spawn("control-quiet", cmd, dir)?;
    let line = quiet
        .wait_for("listening on http://", Duration::from_secs(60))
        .await?;
    let quiet_addr = listen_addr(&line)?;
    Ok(Roles {
        node,
        control,
        quiet,
        node_addr,
        control_addr,
        quiet_addr,
        api_key,
        nodes: NodeClient::new(ClusterSecret::new(secret).context("the cluster secret")?),
        http: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(120))
            .build()?,
        live: Default::default(),
    })
}

impl Roles {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.control_addr)
    }

    /// A create through the control's E2B API: the sandbox id and its envd token.
    async fn create_via_control(&self, template: &str) -> anyhow::Result<(String, String)> {
        let body = serde_json::json!({"templateID": template, "timeout": 300, "secure": true});
        let r = self
            .http
            .post(self.url("/sandboxes"))
            .header("X-API-Key", &self.api_key)
            .json(&body)
            .send()
            .await?;
        let status = r.status();
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        if !status.is_success() {
            bail!("create through the control: {status} {v}");
        }
        let id = v["sandboxID"].as_str().context("no sandboxID")?.to_string();
        self.live.add(&id);
        let token = v["envdAccessToken"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok((id, token))
    }

    /// The same create on the node's internal API, as the control forwards it.
    async fn create_direct(&self, template: &str) -> anyhow::Result<String> {
        let p = CreateParams {
            template_id: template.to_string(),
            timeout_secs: Some(300),
            secure: true,
            team: kiln_server::tenancy::DEFAULT_TEAM.to_string(),
            ..Default::default()
        };
        let doc = CreateDoc::of(&p)?;
        let (rec, _) = self.nodes.create(&self.node_addr, &doc).await?;
        self.live.add(&rec.id);
        Ok(rec.id)
    }

    /// Kills `id` on its node (the way both kinds of create are undone).
    pub async fn kill(&self, id: &str) -> anyhow::Result<()> {
        let op = Op::Kill {
            reason: "bench".into(),
        };
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            self.nodes.op(&self.node_addr, id, &op),
        )
        .await;
        self.live.remove(id);
        match r {
            Ok(Ok(_)) | Ok(Err(kiln_server::Error::SandboxNotFound(_))) => Ok(()),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => bail!("killing {id} took over a minute"),
        }
    }

    /// Kills every sandbox made and not killed yet (errors are reported, not returned).
    pub async fn kill_all(&self) {
        self.live.kill_all(async |id| self.kill(id).await).await;
    }

    fn envd_via_control(&self, id: &str, token: &str) -> EnvdClient {
        envd_via_control(self.control_addr, id, token)
    }

    fn envd_direct(&self, id: &str, token: &str) -> EnvdClient {
        EnvdClient::new(Arc::new(TunnelConnector {
            addr: self.node_addr.clone(),
            id: id.to_string(),
            port: kiln_proto::envd::ENVD_PORT,
            secret: self.nodes.secret().clone(),
        }))
        .with_access_token(Some(token.to_string()))
    }
}

/// Waits until the control places creates (its view has the node), with one create that is
/// not counted.
async fn warm_up(r: &Roles, template: &str) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        match r.create_via_control(template).await {
            Ok((id, _)) => return r.kill(&id).await,
            Err(e) if t.elapsed() > Duration::from_secs(60) => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

/// Runs the gateway part on started roles.
pub(crate) async fn run(r: &Roles, o: &GatewayOptions) -> anyhow::Result<GatewayReport> {
    warm_up(r, &o.template).await?;
    r.kill(&r.create_direct(&o.template).await?).await?;
    eprintln!(
        "gateway: {} creates through the control and {} straight to the node, interleaved …",
        o.creates, o.creates
    );
    let (mut direct, mut gateway) = (Vec::new(), Vec::new());
    for i in 0..2 * o.creates {
        let t = Instant::now();
        // Alternating which side goes first, so neither always follows the other's kill.
        let id = if (i + i / 2) % 2 == 0 {
            let id = r.create_direct(&o.template).await?;
            direct.push(t.elapsed());
            id
        } else {
            let (id, _) = r.create_via_control(&o.template).await?;
            gateway.push(t.elapsed());
            id
        };
        r.kill(&id).await?;
    }
    eprintln!(
        "gateway: {} envd calls (`bash -l -c true`) each way, interleaved …",
        o.execs
    );
    let (id, token) = r.create_via_control(&o.template).await?;
    let (via, straight) = (r.envd_via_control(&id, &token), r.envd_direct(&id, &token));
    let quiet = envd_via_control(r.quiet_addr, &id, &token);
    let login = async |c: &EnvdClient| exec(c, "/bin/bash", &["-l", "-c", "true"]).await;
    let bare = async |c: &EnvdClient| exec(c, "/bin/true", &[]).await;
    let health = async |c: &EnvdClient| {
        let t = Instant::now();
        c.health().await?;
        Ok(t.elapsed())
    };
    interleaved(5, &via, &straight, login).await?;
    let (gx, dx) = interleaved(o.execs, &via, &straight, login).await?;
    let (gb, db) = interleaved(o.execs, &via, &straight, bare).await?;
    let (qb, qdb) = interleaved(o.execs, &quiet, &straight, bare).await?;
    let (gh, dh) = interleaved(o.execs, &via, &straight, health).await?;
    r.kill(&id).await?;
    Ok(GatewayReport {
        creates: o.creates,
        direct_create: percentiles(&direct),
        gateway_create: percentiles(&gateway),
        direct_exec: percentiles(&dx),
        gateway_exec: percentiles(&gx),
        exec_hop: Hop::of(&gx, &dx),
        direct_bare: percentiles(&db),
        gateway_bare: percentiles(&gb),
        bare_hop: Hop::of(&gb, &db),
        quiet_bare: percentiles(&qb),
        quiet_direct_bare: percentiles(&qdb),
        quiet_bare_hop: Hop::of(&qb, &qdb),
        direct_health: percentiles(&dh),
        gateway_health: percentiles(&gh),
        health_hop: Hop::of(&gh, &dh),
    })
}

/// `n` samples of `call` through the gateway (`via`) and straight to the node, taken in
/// pairs whose order alternates, so neither side always runs right after the other.
async fn interleaved(
    n: usize,
    via: &EnvdClient,
    straight: &EnvdClient,
    call: impl AsyncFn(&EnvdClient) -> anyhow::Result<Duration>,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let (mut g, mut d) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        if i % 2 == 0 {
            g.push(call(via).await?);
            d.push(call(straight).await?);
        } else {
            d.push(call(straight).await?);
            g.push(call(via).await?);
        }
    }
    Ok((g, d))
}
