//! Webhook delivery: a worker turns new lifecycle events into queued deliveries (persisted, so
//! they survive a restart), POSTs each one signed (see [`super::sign`]), and retries failures
//! with exponential backoff until `max_attempts`. Every attempt is recorded (the delivery log).
//!
//! Destinations are filtered against SSRF: unless the operator sets `allow_private`
//! (`kiln serve --webhook-allow-private`), a webhook whose host is, or resolves to, a loopback,
//! link-local, private or otherwise reserved address, or one in the server's own sandbox slot
//! range, is refused at registration ([`Webhooks::check_destination`]), and deliveries resolve
//! names through a filter that drops such addresses (so a name re-pointed later, DNS
//! rebinding, reaches nothing internal either).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;

use super::sign::{sign, SIGNATURE_HEADER};
use super::Telemetry;
use crate::store::{now_ms, Attempt, DeliveryRecord, EventStore, WebhookRecord};

/// Delivery settings.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Delay before the first retry; each further retry waits twice as long.
    pub retry_base: Duration,
    /// Longest wait between two attempts.
    pub retry_max: Duration,
    /// Attempts before a delivery is marked failed.
    pub max_attempts: u32,
    /// Time limit of one attempt.
    pub attempt_timeout: Duration,
    /// How often the queue is checked when nothing wakes the worker.
    pub poll: Duration,
    /// Allow destinations on loopback, link-local and private addresses (an operator's
    /// choice, e.g. a receiver on the same host; off by default).
    pub allow_private: bool,
    /// The server's sandbox slot ranges, refused as destinations unless `allow_private`.
    pub sandbox_ranges: Vec<kiln_net::Cidr>,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(600),
            max_attempts: 10,
            attempt_timeout: Duration::from_secs(10),
            poll: Duration::from_millis(500),
            allow_private: false,
            sandbox_ranges: Vec::new(),
        }
    }
}

impl WebhookConfig {
    /// The wait after the `attempts`-th failed attempt (1-based), or None once they are used up.
    pub fn backoff(&self, attempts: u32) -> Option<Duration> {
        if attempts >= self.max_attempts {
            return None;
        }
        let factor = 2u32.saturating_pow(attempts.saturating_sub(1));
        Some(self.retry_base.saturating_mul(factor).min(self.retry_max))
    }
}

/// Error messages longer than this are cut in the delivery log.
const MAX_ERROR_LEN: usize = 300;

/// The webhook delivery service (one per server).
pub struct Webhooks {
    store: Arc<dyn EventStore>,
    telemetry: Arc<Telemetry>,
    cfg: WebhookConfig,
    client: reqwest::Client,
    wake: Notify,
}

impl Webhooks {
    pub fn new(store: Arc<dyn EventStore>, telemetry: Arc<Telemetry>, cfg: WebhookConfig) -> Self {
        let mut builder = reqwest::Client::builder()
            .timeout(cfg.attempt_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("kiln-webhooks/", env!("CARGO_PKG_VERSION")));
        if !cfg.allow_private {
            builder =
                builder.dns_resolver(Arc::new(PublicOnly(Arc::new(cfg.sandbox_ranges.clone()))));
        }
        let client = builder.build().unwrap_or_default();
        Self {
            store,
            telemetry,
            cfg,
            client,
            wake: Notify::new(),
        }
    }

    /// Makes the worker look at the queue now.
    pub fn nudge(&self) {
        self.wake.notify_one();
    }

    /// Why webhooks may not be sent to `url`: its host is (or resolves only to) an address
    /// refused without `allow_private`. A name that does not resolve now is accepted (deliveries
    /// resolve it again, through the same filter).
    pub async fn check_destination(&self, url: &reqwest::Url) -> Result<(), String> {
        if self.cfg.allow_private {
            return Ok(());
        }
        let refused = |ip: IpAddr| {
            format!(
                "webhook destination {ip} is a loopback, link-local, private or sandbox address; \
                 the server's operator can allow those with --webhook-allow-private"
            )
        };
        let Some(host) = url.host_str() else {
            return Err("the webhook url has no host".into());
        };
        let addrs: Vec<IpAddr> = match literal_ip(host) {
            Some(ip) => vec![ip],
            None => {
                let lookup = tokio::net::lookup_host((host, 0));
                match tokio::time::timeout(Duration::from_secs(5), lookup).await {
                    Ok(Ok(it)) => it.map(|a| a.ip()).collect(),
                    _ => Vec::new(),
                }
            }
        };
        match addrs
            .into_iter()
            .find(|ip| is_refused(*ip, &self.cfg.sandbox_ranges))
        {
            Some(ip) => Err(refused(ip)),
            None => Ok(()),
        }
    }

    /// POSTs one delivery once.
    async fn attempt(&self, d: &DeliveryRecord, w: &WebhookRecord) -> Attempt {
        let now = now_ms();
        if let Ok(u) = reqwest::Url::parse(&w.url) {
            if let Err(e) = self.check_ip_literal(&u) {
                return self.failed(d, now, e);
            }
        }
        let sig = sign(&w.secret, now.div_euclid(1000), d.payload.as_bytes());
        let r = self
            .client
            .post(&w.url)
            .header("content-type", "application/json")
            .header(SIGNATURE_HEADER, sig)
            .header("kiln-webhook-id", &w.id)
            .header("kiln-delivery-id", d.id.to_string())
            .header("kiln-event", &d.kind)
            .body(d.payload.clone())
            .send()
            .await;
        let (code, error) = match r {
            Ok(resp) if resp.status().is_success() => (Some(resp.status().as_u16()), None),
            Ok(resp) => {
                let code = resp.status().as_u16();
                (Some(code), Some(format!("answered {code}")))
            }
            Err(e) => {
                // reqwest's own text is generic ("error sending request"): add the causes
                // (e.g. the resolver refusing a private address).
                let mut msg = e.to_string();
                let mut cause = std::error::Error::source(&e);
                while let Some(c) = cause {
                    msg.push_str(&format!(": {c}"));
                    cause = c.source();
                }
                let mut end = msg.len().min(MAX_ERROR_LEN);
                while !msg.is_char_boundary(end) {
                    end -= 1;
                }
                msg.truncate(end);
                (None, Some(msg))
            }
        };
        self.outcome(d, now, code, error)
    }

    /// An IP-literal destination refused now (the setting may have changed since it was
    /// registered); names are filtered by the client's resolver.
    fn check_ip_literal(&self, u: &reqwest::Url) -> Result<(), String> {
        let Some(ip) = u.host_str().and_then(literal_ip) else {
            return Ok(());
        };
        if !self.cfg.allow_private && is_refused(ip, &self.cfg.sandbox_ranges) {
            return Err(format!("destination {ip} refused (private address)"));
        }
        Ok(())
    }

    fn failed(&self, d: &DeliveryRecord, now: i64, error: String) -> Attempt {
        self.outcome(d, now, None, Some(error))
    }

    fn outcome(
        &self,
        d: &DeliveryRecord,
        now: i64,
        code: Option<u16>,
        error: Option<String>,
    ) -> Attempt {
        let delivered = error.is_none();
        let retry_at_ms = if delivered {
            None
        } else {
            Telemetry::add(&self.telemetry.webhook_failed_attempts, 1);
            self.cfg
                .backoff(d.attempts + 1)
                .map(|b| now_ms() + b.as_millis() as i64)
        };
        if delivered {
            Telemetry::add(&self.telemetry.webhook_delivered, 1);
        }
        Attempt {
            at_ms: now,
            status_code: code,
            error,
            delivered,
            retry_at_ms,
        }
    }

    /// One pass: queue new events, attempt every due delivery.
    pub async fn run_once(&self) {
        if let Err(e) = self.store.queue_deliveries(now_ms(), 500).await {
            tracing::warn!(error = %e, "queueing webhook deliveries");
        }
        let due = match self.store.due_deliveries(now_ms(), 64).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "reading due webhook deliveries");
                return;
            }
        };
        futures::stream::iter(due)
            .for_each_concurrent(8, |(d, w)| async move {
                let a = self.attempt(&d, &w).await;
                if let Some(err) = &a.error {
                    tracing::info!(webhook = %w.id, delivery = d.id, attempt = d.attempts + 1,
                        "webhook delivery failed: {err}");
                }
                if let Err(e) = self.store.record_attempt(d.id, &a).await {
                    tracing::warn!(error = %e, "recording a webhook delivery attempt");
                }
            })
            .await;
    }

    /// Runs the worker forever, woken by lifecycle events, nudges and its poll interval.
    pub fn spawn(
        self: &Arc<Self>,
        mut events: tokio::sync::broadcast::Receiver<crate::LifecycleEvent>,
    ) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                me.run_once().await;
                tokio::select! {
                    _ = me.wake.notified() => {}
                    r = events.recv() => {
                        if let Err(tokio::sync::broadcast::error::RecvError::Closed) = r {
                            tokio::time::sleep(me.cfg.poll).await;
                        }
                    }
                    _ = tokio::time::sleep(me.cfg.poll) => {}
                }
            }
        })
    }
}

/// The address of a URL host that is an IP literal (`[…]` for IPv6).
fn literal_ip(host: &str) -> Option<IpAddr> {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// Whether a webhook may not reach `ip` without `allow_private`: the ranges no sandbox may
/// reach either (loopback, RFC 1918, CGNAT, link-local, multicast, reserved), the server's
/// sandbox slot ranges, and IPv6 loopback, unspecified, link-local, unique-local and multicast
/// (IPv4-mapped addresses are judged as IPv4).
pub fn is_refused(ip: IpAddr, sandbox_ranges: &[kiln_net::Cidr]) -> bool {
    let v4 = match ip {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4,
            None => {
                let seg0 = v6.segments()[0];
                return v6.is_loopback()
                    || v6.is_unspecified()
                    || v6.is_multicast()
                    || (seg0 & 0xffc0) == 0xfe80
                    || (seg0 & 0xfe00) == 0xfc00;
            }
        },
    };
    kiln_net::addr::always_denied()
        .iter()
        .chain(sandbox_ranges)
        .any(|c| c.contains(v4))
        || v4.is_broadcast()
}

/// The delivery client's resolver: a name's addresses less the refused ones (an error when
/// none is left), so a name cannot be pointed at an internal address after registration.
struct PublicOnly(Arc<Vec<kiln_net::Cidr>>);

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let ranges = self.0.clone();
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0))
                .await?
                .filter(|a| !is_refused(a.ip(), &ranges))
                .collect();
            if found.is_empty() {
                return Err(format!(
                    "{} resolves only to private addresses (refused without --webhook-allow-private)",
                    name.as_str()
                )
                .into());
            }
            let addrs: reqwest::dns::Addrs = Box::new(found.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_destinations_are_refused() {
        let slots: Vec<kiln_net::Cidr> = vec!["198.51.100.0/24".parse().unwrap()];
        for bad in [
            "127.0.0.1",
            "127.1.2.3",
            "0.0.0.0",
            "169.254.169.254",
            "10.200.0.1",
            "192.168.1.1",
            "172.16.0.1",
            "198.51.100.7",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
        ] {
            assert!(is_refused(bad.parse().unwrap(), &slots), "{bad}");
        }
        for good in ["203.0.113.5", "8.8.8.8", "2001:db8::1", "198.51.101.1"] {
            assert!(!is_refused(good.parse().unwrap(), &slots), "{good}");
        }
    }

    #[test]
    fn backoff_doubles_caps_and_gives_up() {
        let c = WebhookConfig {
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(5),
            max_attempts: 5,
            ..WebhookConfig::default()
        };
        let waits: Vec<Option<u64>> = (1..=6).map(|n| c.backoff(n).map(|d| d.as_secs())).collect();
        assert_eq!(waits, vec![Some(1), Some(2), Some(4), Some(5), None, None]);
    }
}
