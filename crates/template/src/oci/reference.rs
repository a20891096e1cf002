//! Image names: Docker Hub normalisation (`python:3.12` → `docker.io/library/python:3.12`),
//! registry mirrors (`docker.io=http://127.0.0.1:5000`) and which registries speak plain HTTP.

use std::collections::BTreeMap;

use oci_client::Reference;

use super::OciError;

/// Environment variable with mirrors, comma-separated (`docker.io=URL,ghcr.io=URL`); the
/// `--registry-mirror` options add to it.
pub const MIRRORS_ENV: &str = "KILN_REGISTRY_MIRRORS";

/// One registry's mirror: the host (`host[:port]`) answering in its place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror {
    pub host: String,
    /// The mirror was given as `http://…`.
    pub plain_http: bool,
}

/// Registry → mirror, from `--registry-mirror REGISTRY=URL` options and [`MIRRORS_ENV`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mirrors {
    map: BTreeMap<String, Mirror>,
}

impl Mirrors {
    /// Parses `REGISTRY=URL` specs (`URL`: `http://host:port`, `https://host` or a bare host,
    /// which means HTTPS). Later specs for the same registry win.
    pub fn parse<S: AsRef<str>>(specs: &[S]) -> Result<Mirrors, OciError> {
        let mut map = BTreeMap::new();
        for spec in specs {
            let spec = spec.as_ref().trim();
            if spec.is_empty() {
                continue;
            }
            let bad = |why: &str| {
                OciError::BadName {
                name: spec.to_string(),
                why: format!("{why}; a mirror is given as REGISTRY=URL, e.g. docker.io=http://127.0.0.1:5000"),
            }
            };
            let (registry, url) = spec.split_once('=').ok_or_else(|| bad("no '='"))?;
            let (plain_http, rest) = if let Some(r) = url.strip_prefix("http://") {
                (true, r)
            } else if let Some(r) = url.strip_prefix("https://") {
                (false, r)
            } else {
                (false, url)
            };
            let host = rest.trim_end_matches('/');
            let host_ok = !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b));
            if registry.is_empty() || !host_ok {
                return Err(bad(
                    "the registry or the mirror's host is missing or has a path",
                ));
            }
            map.insert(
                canonical_registry(registry).to_string(),
                Mirror {
                    host: host.to_string(),
                    plain_http,
                },
            );
        }
        Ok(Mirrors { map })
    }

    /// Mirrors from [`MIRRORS_ENV`] followed by `specs` (so options override the environment).
    pub fn from_env_and<S: AsRef<str>>(specs: &[S]) -> Result<Mirrors, OciError> {
        let env = std::env::var(MIRRORS_ENV).unwrap_or_default();
        let mut all: Vec<String> = env.split(',').map(str::to_string).collect();
        all.extend(specs.iter().map(|s| s.as_ref().to_string()));
        Mirrors::parse(&all)
    }

    pub fn get(&self, registry: &str) -> Option<&Mirror> {
        self.map.get(canonical_registry(registry))
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Docker Hub's other names all mean `docker.io`.
fn canonical_registry(r: &str) -> &str {
    match r {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => "docker.io",
        other => other,
    }
}

/// A parsed image name and where it is pulled from.
#[derive(Debug, Clone)]
pub struct ImageName {
    /// The full name (`docker.io/library/python:3.12`), as messages and metadata show it.
    pub full: String,
    /// The registry the name belongs to (`docker.io`).
    pub registry: String,
    /// The reference actually pulled (registry replaced by its mirror, if any).
    pub pull: Reference,
    /// The host answering (`pull`'s registry) speaks plain HTTP.
    pub plain_http: bool,
}

impl ImageName {
    /// The host that answers for this image (the mirror's, if one is set).
    pub fn host(&self) -> &str {
        self.pull.registry()
    }
}

/// Loopback registries speak plain HTTP (as Docker treats them as insecure registries).
fn is_loopback(host: &str) -> bool {
    let h = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) && !h.ends_with(':') {
            h
        } else {
            host
        }
    });
    h == "localhost" || h.starts_with("127.") || h == "[::1]"
}

/// Parses `name` (`[host[:port]/]path[:tag][@sha256:…]`; no tag means `latest`) and applies
/// the mirrors.
pub fn resolve(name: &str, mirrors: &Mirrors) -> Result<ImageName, OciError> {
    let r: Reference = name.trim().parse().map_err(|e| OciError::BadName {
        name: name.to_string(),
        why: format!("{e}"),
    })?;
    let registry = canonical_registry(r.registry()).to_string();
    let full = Reference::with_tag(
        registry.clone(),
        r.repository().to_string(),
        r.tag().unwrap_or("latest").to_string(),
    );
    let full = match r.digest() {
        Some(d) if r.tag().is_none() => format!("{}/{}@{d}", full.registry(), full.repository()),
        Some(d) => format!("{}@{d}", full.whole()),
        None => full.whole(),
    };
    let (host, plain_http) = match mirrors.get(&registry) {
        Some(m) => (m.host.clone(), m.plain_http),
        None => (r.registry().to_string(), is_loopback(r.registry())),
    };
    let repo = r.repository().to_string();
    let pull = match (r.tag(), r.digest()) {
        (Some(t), Some(d)) => {
            Reference::with_tag_and_digest(host, repo, t.to_string(), d.to_string())
        }
        (None, Some(d)) => Reference::with_digest(host, repo, d.to_string()),
        (t, None) => Reference::with_tag(host, repo, t.unwrap_or("latest").to_string()),
    };
    Ok(ImageName {
        full,
        registry,
        pull,
        plain_http,
    })
}

/// A template name derived from an image name: `docker.io/library/python:3.12` → `python-3-12`.
pub fn template_name_for(image: &ImageName) -> String {
    let repo = image.pull.repository();
    let last = repo.rsplit('/').next().unwrap_or(repo);
    let tag = image.pull.tag().unwrap_or("latest");
    let raw = if tag == "latest" {
        last.to_string()
    } else {
        format!("{last}-{tag}")
    };
    let mut out = String::new();
    for c in raw.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let out = out.trim_matches('-');
    let out = &out[..out.len().min(64)];
    if out.is_empty() {
        "image".to_string()
    } else {
        out.trim_end_matches('-').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_hub_names_are_normalised() {
        let none = Mirrors::default();
        let n = resolve("python:3.12", &none).unwrap();
        assert_eq!(n.full, "docker.io/library/python:3.12");
        assert_eq!(n.registry, "docker.io");
        assert!(!n.plain_http);
        assert_eq!(
            resolve("ubuntu", &none).unwrap().full,
            "docker.io/library/ubuntu:latest"
        );
        assert_eq!(
            resolve("e2bdev/base", &none).unwrap().full,
            "docker.io/e2bdev/base:latest"
        );
        let g = resolve("ghcr.io/org/img:1", &none).unwrap();
        assert_eq!((g.registry.as_str(), g.host()), ("ghcr.io", "ghcr.io"));
        let l = resolve("127.0.0.1:5000/test/img:v1", &none).unwrap();
        assert!(l.plain_http, "loopback registries speak HTTP");
        assert_eq!(l.host(), "127.0.0.1:5000");
        let d = resolve(&format!("alpine@sha256:{}", "a".repeat(64)), &none).unwrap();
        assert_eq!(
            d.full,
            format!("docker.io/library/alpine@sha256:{}", "a".repeat(64))
        );
        assert!(resolve("Bad Name", &none).is_err());
    }

    #[test]
    fn mirrors_replace_the_registry() {
        let m = Mirrors::parse(&[
            "docker.io=http://127.0.0.1:5999/",
            "ghcr.io=mirror.example:443",
        ])
        .unwrap();
        let n = resolve("python:3.12", &m).unwrap();
        assert_eq!(n.full, "docker.io/library/python:3.12");
        assert_eq!(n.host(), "127.0.0.1:5999");
        assert_eq!(n.pull.repository(), "library/python");
        assert!(n.plain_http);
        let g = resolve("ghcr.io/a/b", &m).unwrap();
        assert_eq!(g.host(), "mirror.example:443");
        assert!(!g.plain_http);
        // Docker Hub's aliases use the docker.io mirror.
        let m2 = Mirrors::parse(&["index.docker.io=http://127.0.0.1:1"]).unwrap();
        assert_eq!(resolve("busybox", &m2).unwrap().host(), "127.0.0.1:1");
        for bad in [
            "docker.io",
            "=http://x",
            "docker.io=",
            "docker.io=http://h/path",
        ] {
            let e = Mirrors::parse(&[bad]).unwrap_err().to_string();
            assert!(e.contains("REGISTRY=URL"), "{bad}: {e}");
        }
    }

    #[test]
    fn template_names_from_images() {
        let none = Mirrors::default();
        let t = |n: &str| template_name_for(&resolve(n, &none).unwrap());
        assert_eq!(t("python:3.12"), "python-3-12");
        assert_eq!(t("ubuntu"), "ubuntu");
        assert_eq!(t("ghcr.io/org/my_img:V1.0"), "my-img-v1-0");
    }
}
