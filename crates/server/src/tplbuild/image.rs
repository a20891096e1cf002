//! Images a build starts `fromImage`: the kiln template `kiln template build --from-image`
//! makes of the image (one naming function, [`oci::template::image_template_name`], and one
//! template store, so the CLI's and the builds' are one; two images whose readable names are
//! one get two templates), pulled by the build itself when it is missing, was made from
//! another image, or the build is forced. A kiln template of that name not made from an image
//! (`base` for a Dockerfile's `FROM base`, a recipe's) is used as it is, never pulled. Pulls go
//! through the server's registry mirrors (`--registry-mirror`, `KILN_REGISTRY_MIRRORS`) with
//! the build's `fromImageRegistry` credentials; their progress goes to the build log (step
//! `base`). Two builds of one image at once pull once: the second waits on the first's lock,
//! then finds the template made.
//! A build with credentials asks the registry for the image's manifest even when its template
//! exists, so wrong credentials fail whatever was pulled before; so does a build without
//! credentials of an image that was pulled with some (it asks anonymously), so one team's
//! private image is no other team's through the shared template. A create that names such a
//! template itself is checked the same way ([`Builds::check_direct_create`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_template::oci::{self, Credentials, ImageSource, OciError, Progress, PullOptions};

use super::Builds;

/// The image name the SDK sends for `Template()` and `from_base_image()`: kiln's `base`.
pub(super) const E2B_BASE_IMAGE: &str = "e2bdev/base";

/// One lock per image template name.
#[derive(Default)]
pub(super) struct ImageLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl ImageLocks {
    fn of(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Locks nobody holds or waits on are dropped as others are taken.
        m.retain(|_, l| Arc::strong_count(l) > 1);
        m.entry(name.to_string()).or_default().clone()
    }
}

/// The credentials of a `fromImageRegistry`: `{type: "registry", username, password}`, or
/// `{type: "gcp", serviceAccountJson}` as Google's registries take a service account key in a
/// registry login (user `_json_key`, the key's JSON as the password).
fn credentials(reg: Option<&serde_json::Value>) -> Option<Credentials> {
    let reg = reg?;
    if reg.get("type").and_then(|t| t.as_str()) == Some("gcp") {
        let key = match reg.get("serviceAccountJson")? {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        return (!key.is_empty()).then(|| Credentials {
            user: GCP_KEY_USER.into(),
            password: key,
        });
    }
    let user = reg.get("username")?.as_str()?.to_string();
    if user.is_empty() {
        return None;
    }
    Some(Credentials {
        user,
        password: reg
            .get("password")
            .and_then(|p| p.as_str())
            .unwrap_or_default()
            .to_string(),
    })
}

/// The registry user a Google service account key logs in as.
const GCP_KEY_USER: &str = "_json_key";

/// A failed pull as the build's reason: the image and the registry's answer, never a host
/// path (what is not the registry's answer goes to the server log).
fn reason(img: &str, e: kiln_template::Error) -> String {
    match e {
        kiln_template::Error::Oci(OciError::Auth {
            image,
            registry,
            user,
            answer,
        }) => {
            let check = if user.as_deref() == Some(GCP_KEY_USER) {
                "check the service account key given with the image (from_gcp_registry)"
            } else {
                "check the username and password given with the image (from_image(..., \
                 username=, password=))"
            };
            format!(
                "{image}: registry {registry} refused {}: {answer}; {check}",
                user.map_or("anonymous access".to_string(), |u| format!(
                    "the credentials of user {u:?}"
                ))
            )
        }
        kiln_template::Error::Oci(
            e @ (OciError::NotFound { .. }
            | OciError::Registry { .. }
            | OciError::BadName { .. }
            | OciError::Invalid(_)
            | OciError::DigestMismatch { .. }
            | OciError::Unsafe { .. }),
        ) => e.to_string(),
        other => {
            tracing::warn!(image = img, error = %other, "making a template of an image");
            format!(
                "image {img:?}: making a kiln template of it failed on the server (its log has \
                 the details)"
            )
        }
    }
}

impl Builds {
    /// The kiln template `img` stands for, made from the registry's image first when needed
    /// (see the module's text). Errors are the build's reason.
    pub(super) async fn image_template(
        &self,
        build: &str,
        img: &str,
        registry: Option<&serde_json::Value>,
        force: bool,
    ) -> Result<String, String> {
        let (repo, _) = img
            .rsplit_once(':')
            .filter(|(r, t)| !t.contains('/') && !r.is_empty())
            .unwrap_or((img, ""));
        if repo == E2B_BASE_IMAGE || repo == format!("docker.io/{E2B_BASE_IMAGE}") {
            return Ok("base".into());
        }
        let resolved = oci::reference::resolve(img, &self.config.registry_mirrors)
            .map_err(|e| format!("image {img:?}: {e}"))?;
        // One lock per readable name: two images of one readable name are named one after
        // the other.
        let lock = self
            .image_locks
            .of(&oci::reference::template_name_for(&resolved));
        let _held = lock.lock().await;
        let full = resolved.full.clone();
        let r = resolved.clone();
        let (name, made_from) = tokio::task::spawn_blocking(move || {
            let s = kiln_template::Store::open_default()?;
            let name = oci::template::image_template_name(&s, &r)?;
            let made_from = oci::template::image_of(&s, &name);
            Ok::<_, kiln_template::Error>((name, made_from))
        })
        .await
        .map_err(|e| format!("image {img:?}: {e}"))?
        .map_err(|e| reason(img, e))?;
        if self.manager.template(&name).await.is_ok() {
            match made_from {
                // A kiln template of that name not made from an image (`FROM base`, a recipe,
                // a `--template-dir`): the image name means it, and nothing is pulled.
                Ok(None) => return Ok(name),
                Ok(Some(made)) if made.source == full && !force => {
                    let creds = credentials(registry);
                    if creds.is_none() && !made.with_credentials {
                        // A public image's template, made before: used as it is (offline too).
                        return Ok(name);
                    }
                    // With credentials, or for an image somebody pulled with theirs (another
                    // team's private image), the registry decides whether this build may read
                    // it (and whether the one made before is still its current version).
                    let opts = PullOptions {
                        mirrors: self.config.registry_mirrors.clone(),
                        credentials: creds,
                        quiet: true,
                        ..Default::default()
                    };
                    let now = oci::registry::manifest_digest(img, &opts)
                        .await
                        .map_err(|e| reason(img, e.into()))?;
                    if now == made.digest {
                        return Ok(name);
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(reason(img, e)),
            }
        }
        self.log(
            build,
            "info",
            Some("base"),
            format!("Pulling image {full} from {}", resolved.host()),
        )
        .await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let opts = oci::ImageBuildOptions {
            agent: None,
            force,
            quiet: true,
            pull: PullOptions {
                mirrors: self.config.registry_mirrors.clone(),
                credentials: credentials(registry),
                quiet: true,
                parallel: 0,
                progress: Some(Progress(Arc::new(move |line: &str| {
                    let _ = tx.send(line.to_string());
                }))),
            },
        };
        let (source, n) = (ImageSource::Registry(img.to_string()), name.clone());
        let _store = self.store_lock.read().await;
        // Pulling and unpacking block: a thread of their own, off the runtime's core threads.
        let mut job = tokio::task::spawn_blocking(move || {
            let store = kiln_template::Store::open_default()?;
            oci::build_from_image(&store, &source, Some(&n), &opts)
        });
        let done = loop {
            tokio::select! {
                Some(line) = rx.recv() => self.log(build, "info", Some("base"), line).await,
                r = &mut job => break r,
            }
        };
        while let Ok(line) = rx.try_recv() {
            self.log(build, "info", Some("base"), line).await;
        }
        let out = done
            .map_err(|e| format!("image {img:?}: the pull stopped: {e}"))?
            .map_err(|e| reason(img, e))?;
        self.log(
            build,
            "info",
            Some("base"),
            format!(
                "Image {full} is kiln template {name} ({:.1}s)",
                out.elapsed.as_secs_f64()
            ),
        )
        .await;
        Ok(name)
    }
}

impl Builds {
    /// A create whose `templateID` names a kiln template itself rather than a build of the
    /// caller's team: refused (404) when the template was made from an image pulled with
    /// registry credentials and the registry refuses the image to an anonymous request. A
    /// create carries no credentials, so a private image's template is reached only through
    /// the name a team's build (which gave the registry its credentials) gave it.
    pub async fn check_direct_create(&self, template_id: &str) -> crate::error::Result<()> {
        let name = template_id
            .split_once(':')
            .map_or(template_id, |(n, _)| n)
            .to_string();
        if crate::templates::check_name(&name).is_err() {
            return Ok(());
        }
        let n = name.clone();
        let made = tokio::task::spawn_blocking(move || {
            kiln_template::Store::open_default().and_then(|s| oci::template::image_of(&s, &n))
        })
        .await
        .map_err(|e| crate::error::Error::internal(format!("template lookup task: {e}")))?;
        // (An unreadable store is the create's own lookup to report.)
        let Ok(Some(made)) = made else {
            return Ok(());
        };
        if !made.with_credentials {
            return Ok(());
        }
        let opts = PullOptions {
            mirrors: self.config.registry_mirrors.clone(),
            quiet: true,
            ..Default::default()
        };
        match oci::registry::manifest_digest(&made.source, &opts).await {
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::info!(template = name, error = %e, "a create named a private image's template");
                Err(crate::error::Error::NotFound(format!(
                    "template {name:?} not found; a template made from a private image is \
                     created by the name of your team's Template build from it"
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_credentials_and_reasons() {
        let reg = serde_json::json!({"type": "registry", "username": "u", "password": "p"});
        assert_eq!(
            credentials(Some(&reg)),
            Some(Credentials {
                user: "u".into(),
                password: "p".into()
            })
        );
        assert_eq!(credentials(None), None);
        let e = kiln_template::Error::Oci(OciError::Auth {
            image: "docker.io/library/x:1".into(),
            registry: "127.0.0.1:5000".into(),
            user: Some("u".into()),
            answer: "401 Unauthorized".into(),
        });
        let r = reason("x:1", e);
        assert!(
            r.contains("docker.io/library/x:1") && r.contains("\"u\""),
            "{r}"
        );
        assert!(!r.contains("--registry-user"), "{r}");
        let e = kiln_template::Error::Io {
            what: "writing /var/lib/kiln/cache/x".into(),
            source: std::io::Error::other("disk full"),
        };
        assert!(!reason("x:1", e).contains("/var/lib"));
    }

    #[test]
    fn registry_and_gcp_credentials() {
        let c = credentials(Some(&serde_json::json!(
            {"type": "registry", "username": "u", "password": "p"}
        )))
        .unwrap();
        assert_eq!((c.user.as_str(), c.password.as_str()), ("u", "p"));
        assert!(credentials(Some(
            &serde_json::json!({"type": "registry", "username": ""})
        ))
        .is_none());
        let key = r#"{"type":"service_account","project_id":"p"}"#;
        let c = credentials(Some(&serde_json::json!(
            {"type": "gcp", "serviceAccountJson": key}
        )))
        .unwrap();
        assert_eq!((c.user.as_str(), c.password.as_str()), ("_json_key", key));
        let c = credentials(Some(&serde_json::json!(
            {"type": "gcp", "serviceAccountJson": {"type": "service_account"}}
        )))
        .unwrap();
        assert_eq!(c.password, r#"{"type":"service_account"}"#);
        assert!(credentials(Some(&serde_json::json!({"type": "gcp"}))).is_none());
    }
}
