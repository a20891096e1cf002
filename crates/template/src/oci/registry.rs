//! Pulling an image from a registry (OCI distribution spec, through the `oci-client` crate):
//! anonymous bearer tokens or Basic credentials, manifest lists / OCI indexes (linux/amd64 is
//! chosen), Docker schema 2 and OCI manifests; the config and every layer's digest are checked
//! and layers land in the shared blob cache, fetched in parallel (a cached layer is not fetched
//! again), with progress bars on a terminal and log lines elsewhere.

use std::io::Write;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::{OciDescriptor, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, RegistryOperation};

use super::blobs::Blobs;
use super::image::{pair_layers, parse_config, Image, Layer};
use super::reference::{resolve, ImageName, Mirrors};
use super::OciError;

/// Environment variables with registry credentials (used when no option gives them).
pub const USER_ENV: &str = "KILN_REGISTRY_USER";
pub const PASSWORD_ENV: &str = "KILN_REGISTRY_PASSWORD";

/// Registry user name and password (Basic auth, or to get a bearer token).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({:?}, <password>)", self.user)
    }
}

impl Credentials {
    /// From [`USER_ENV`] and [`PASSWORD_ENV`], when both are set.
    pub fn from_env() -> Option<Credentials> {
        Some(Credentials {
            user: std::env::var(USER_ENV).ok().filter(|s| !s.is_empty())?,
            password: std::env::var(PASSWORD_ENV).ok()?,
        })
    }
}

/// Where progress lines go besides the terminal (e.g. a server's build log).
#[derive(Clone)]
pub struct Progress(pub std::sync::Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

/// How to pull.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    pub mirrors: Mirrors,
    pub credentials: Option<Credentials>,
    /// No progress output on the terminal.
    pub quiet: bool,
    /// Layers fetched at once (default 3).
    pub parallel: usize,
    /// Receives every progress line (quiet or not).
    pub progress: Option<Progress>,
}

/// A client for `img`'s registry and the auth `opts` give.
fn client_for(img: &ImageName, opts: &PullOptions) -> (Client, RegistryAuth) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Client::new(ClientConfig {
        protocol: if img.plain_http {
            ClientProtocol::HttpsExcept(vec![img.host().to_string()])
        } else {
            ClientProtocol::Https
        },
        platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
        connect_timeout: Some(Duration::from_secs(20)),
        read_timeout: Some(Duration::from_secs(120)),
        user_agent: concat!("kiln/", env!("CARGO_PKG_VERSION")),
        ..Default::default()
    });
    let auth = match &opts.credentials {
        Some(c) => RegistryAuth::Basic(c.user.clone(), c.password.clone()),
        None => RegistryAuth::Anonymous,
    };
    (client, auth)
}

/// The digest of `name`'s linux/amd64 manifest as the registry serves it now (what
/// [`Image::digest`] of a pull is), with `opts`' credentials: a check that the registry still
/// grants access and whether an image pulled before is current.
pub async fn manifest_digest(name: &str, opts: &PullOptions) -> Result<String, OciError> {
    let img = resolve(name, &opts.mirrors)?;
    let (client, auth) = client_for(&img, opts);
    let (_, digest) = manifest_of(&img, &client, &auth, opts).await?;
    Ok(digest)
}

/// Signs in for pulling `img` and fetches its linux/amd64 manifest and that manifest's digest.
async fn manifest_of(
    img: &ImageName,
    client: &Client,
    auth: &RegistryAuth,
    opts: &PullOptions,
) -> Result<(OciImageManifest, String), OciError> {
    let fail = |e: OciDistributionError| registry_error(img, opts.credentials.as_ref(), e);
    client
        .auth(&img.pull, auth, RegistryOperation::Pull)
        .await
        .map_err(fail)?;
    client
        .pull_image_manifest(&img.pull, auth)
        .await
        .map_err(fail)
}

/// Pulls `name` (its linux/amd64 image) into `blobs`.
pub async fn pull(blobs: &Blobs, name: &str, opts: &PullOptions) -> Result<Image, OciError> {
    let img = resolve(name, &opts.mirrors)?;
    let (client, auth) = client_for(&img, opts);
    let fail = |e: OciDistributionError| registry_error(&img, opts.credentials.as_ref(), e);
    let (manifest, digest) = manifest_of(&img, &client, &auth, opts).await?;
    let mut config = Vec::new();
    client
        .pull_blob(&img.pull, &manifest.config, &mut config)
        .await
        .map_err(fail)?;
    let parsed = parse_config(&config, &img.full)?;
    let layers = pair_layers(
        manifest
            .layers
            .iter()
            .map(|l| (l.digest.clone(), l.media_type.clone(), l.size.max(0) as u64))
            .collect(),
        &parsed.diff_ids,
        &img.full,
    )?;
    if let Some(foreign) = manifest
        .layers
        .iter()
        .find(|l| l.urls.as_ref().is_some_and(|u| !u.is_empty()))
    {
        return Err(OciError::Invalid(format!(
            "{}: layer {} is a foreign layer (fetched from other URLs); kiln does not fetch those",
            img.full, foreign.digest
        )));
    }

    let ui = Bars::new(opts.quiet, opts.progress.clone());
    ui.line(&format!(
        "pulling {} from {} ({} layers, manifest {})",
        img.full,
        img.host(),
        layers.len(),
        short(&digest)
    ));
    let started = Instant::now();
    let parallel = if opts.parallel == 0 { 3 } else { opts.parallel };
    let fetched: Vec<u64> = futures::stream::iter(layers.iter().zip(&manifest.layers))
        .map(|(layer, desc)| fetch_layer(&client, &img, blobs, layer, desc, &ui))
        .buffer_unordered(parallel)
        .try_collect()
        .await
        .map_err(|e| match e {
            Fetch::Registry(e) => fail(e),
            Fetch::Local(e) => e,
        })?;
    let bytes: u64 = fetched.iter().sum();
    let secs = started.elapsed().as_secs_f64();
    ui.line(&format!(
        "pulled {}: {} of {} layers fetched ({}, {:.1}s{}), the rest cached",
        img.full,
        fetched.iter().filter(|b| **b > 0).count(),
        layers.len(),
        mib(bytes),
        secs,
        if bytes > 0 && secs > 0.0 {
            format!(", {:.0} MiB/s", bytes as f64 / secs / 1048576.0)
        } else {
            String::new()
        }
    ));
    Ok(Image {
        source: img.full.clone(),
        digest,
        config_digest: manifest.config.digest.clone(),
        layers,
        config: parsed.run,
        with_credentials: opts.credentials.is_some(),
    })
}

enum Fetch {
    Registry(OciDistributionError),
    Local(OciError),
}

/// Fetches one layer into the cache unless it is there; returns the bytes fetched.
async fn fetch_layer(
    client: &Client,
    img: &ImageName,
    blobs: &Blobs,
    layer: &Layer,
    desc: &OciDescriptor,
    ui: &Bars,
) -> Result<u64, Fetch> {
    if blobs.has(&layer.digest) {
        ui.line(&format!("  layer {} cached", short(&layer.digest)));
        return Ok(0);
    }
    let bar = ui.layer(&layer.digest, layer.size);
    let mut stream = client
        .pull_blob_stream(&img.pull, desc)
        .await
        .map_err(Fetch::Registry)?;
    let mut w = blobs.writer().map_err(Fetch::Local)?;
    let started = Instant::now();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            Fetch::Local(OciError::Registry {
                image: img.full.clone(),
                registry: img.host().to_string(),
                msg: format!("fetching layer {}: {e}", layer.digest),
            })
        })?;
        w.write_all(&chunk)
            .map_err(|e| Fetch::Local(OciError::io("writing a layer to the cache", e)))?;
        bar.inc(chunk.len() as u64);
    }
    let n = w.len();
    w.commit(blobs, &layer.digest).map_err(Fetch::Local)?;
    bar.finish(&format!(
        "  layer {} fetched ({} in {:.1}s)",
        short(&layer.digest),
        mib(n),
        started.elapsed().as_secs_f64()
    ));
    Ok(n.max(1))
}

/// A registry's error as kiln says it: naming the image, the registry and its answer.
fn registry_error(
    img: &ImageName,
    creds: Option<&Credentials>,
    e: OciDistributionError,
) -> OciError {
    let registry = img.host().to_string();
    let image = img.full.clone();
    match e {
        OciDistributionError::AuthenticationFailure(answer) => OciError::Auth {
            image,
            registry,
            user: creds.map(|c| c.user.clone()),
            answer: answer.trim().chars().take(300).collect(),
        },
        OciDistributionError::UnauthorizedError { .. } => OciError::Auth {
            image,
            registry,
            user: creds.map(|c| c.user.clone()),
            answer: "401 Unauthorized".into(),
        },
        OciDistributionError::RegistryError { envelope, .. } => {
            let answer = envelope
                .errors
                .iter()
                .map(|e| format!("{:?}: {}", e.code, e.message).to_uppercase_code())
                .collect::<Vec<_>>()
                .join("; ");
            let denied = envelope.errors.iter().any(|e| {
                matches!(
                    e.code,
                    oci_client::errors::OciErrorCode::Unauthorized
                        | oci_client::errors::OciErrorCode::Denied
                )
            });
            if denied {
                OciError::Auth {
                    image,
                    registry,
                    user: creds.map(|c| c.user.clone()),
                    answer,
                }
            } else {
                OciError::NotFound {
                    image,
                    registry,
                    answer,
                }
            }
        }
        OciDistributionError::ImageManifestNotFoundError(m) => OciError::NotFound {
            image,
            registry,
            answer: m,
        },
        OciDistributionError::ServerError { code, message, .. } => OciError::Registry {
            image,
            registry,
            msg: format!("HTTP {code}: {}", message.trim().chars().take(300).collect::<String>()),
        },
        OciDistributionError::DigestError(d) => OciError::Invalid(format!(
            "{image}: content from {registry} does not match its digest: {d}"
        )),
        OciDistributionError::UnsupportedSchemaVersionError(v) => OciError::Invalid(format!(
            "{image}: manifest schema version {v} is not supported (kiln reads schema 2: Docker v2 and OCI)"
        )),
        OciDistributionError::UnsupportedMediaTypeError(t) => OciError::Invalid(format!(
            "{image}: manifest media type {t} is not supported"
        )),
        OciDistributionError::RequestError(r) => OciError::Registry {
            image,
            registry,
            msg: error_chain(&r),
        },
        other => OciError::Registry {
            image,
            registry,
            msg: other.to_string(),
        },
    }
}

trait UpperCode {
    fn to_uppercase_code(self) -> String;
}

impl UpperCode for String {
    /// `ManifestUnknown: …` → `MANIFEST_UNKNOWN: …` (the registry's own spelling).
    fn to_uppercase_code(self) -> String {
        let Some((code, msg)) = self.split_once(": ") else {
            return self;
        };
        let mut out = String::new();
        for (i, c) in code.chars().enumerate() {
            if c.is_ascii_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_uppercase());
        }
        format!("{out}: {msg}")
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn short(digest: &str) -> &str {
    let end = digest.len().min("sha256:".len() + 12);
    &digest[..end]
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / 1048576.0)
}

/// Progress: one bar per fetched layer on a terminal, log lines otherwise.
struct Bars {
    multi: Option<MultiProgress>,
    quiet: bool,
    sink: Option<Progress>,
}

struct LayerBar {
    bar: Option<ProgressBar>,
    quiet: bool,
    sink: Option<Progress>,
    /// For the sink: the layer, its size, bytes so far and when they were last reported.
    label: String,
    size: u64,
    seen: std::sync::Mutex<(u64, Instant)>,
}

/// How often a layer's progress goes to the sink while it is fetched.
const SINK_EVERY: Duration = Duration::from_secs(2);

impl Bars {
    fn new(quiet: bool, sink: Option<Progress>) -> Bars {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        Bars {
            multi: (!quiet && tty).then(MultiProgress::new),
            quiet,
            sink,
        }
    }

    fn line(&self, s: &str) {
        tracing::info!("{}", s.trim());
        if let Some(p) = &self.sink {
            (p.0)(s.trim());
        }
        if self.quiet {
            return;
        }
        match &self.multi {
            Some(m) => {
                let _ = m.println(s);
            }
            None => eprintln!("{s}"),
        }
    }

    fn layer(&self, digest: &str, size: u64) -> LayerBar {
        let bar = self.multi.as_ref().map(|m| {
            let b = m.add(ProgressBar::new(size));
            b.set_style(
                ProgressStyle::with_template(
                    "  {prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            b.set_prefix(short(digest).to_string());
            b
        });
        if bar.is_none() {
            self.line(&format!(
                "  layer {} fetching ({})",
                short(digest),
                mib(size)
            ));
        }
        LayerBar {
            bar,
            quiet: self.quiet,
            sink: self.sink.clone(),
            label: short(digest).to_string(),
            size,
            seen: std::sync::Mutex::new((0, Instant::now())),
        }
    }
}

impl LayerBar {
    fn inc(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.inc(n);
        }
        if let Some(p) = &self.sink {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.0 += n;
            if seen.1.elapsed() >= SINK_EVERY {
                seen.1 = Instant::now();
                (p.0)(&format!(
                    "layer {}: {} of {}",
                    self.label,
                    mib(seen.0),
                    mib(self.size)
                ));
            }
        }
    }

    fn finish(&self, line: &str) {
        tracing::info!("{}", line.trim());
        if let Some(p) = &self.sink {
            (p.0)(line.trim());
        }
        match &self.bar {
            Some(b) => b.finish_with_message(line.to_string()),
            None if !self.quiet => eprintln!("{line}"),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_codes_read_as_the_registry_spells_them() {
        assert_eq!(
            "ManifestUnknown: manifest unknown"
                .to_string()
                .to_uppercase_code(),
            "MANIFEST_UNKNOWN: manifest unknown"
        );
        assert_eq!(short("sha256:0123456789abcdef"), "sha256:0123456789ab");
        let c = Credentials {
            user: "u".into(),
            password: "secret".into(),
        };
        assert!(!format!("{c:?}").contains("secret"));
    }
}
