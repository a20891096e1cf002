//! Images a build starts `fromImage`: the kiln template `kiln template build --from-image`
//! makes of the image (same name, same template store, so the CLI's and the builds' are one),
//! pulled by the build itself when it is missing, was made from another image of the same
//! name, or the build is forced. A kiln template of that name not made from an image (`base`
//! for a Dockerfile's `FROM base`, a recipe's) is used as it is, never pulled. Pulls go through the server's registry mirrors
//! (`--registry-mirror`, `KILN_REGISTRY_MIRRORS`) with the build's `fromImageRegistry`
//! credentials; their progress goes to the build log (step `base`). Two builds of one image
//! at once pull once: the second waits on the first's lock, then finds the template made.
//! A build with credentials asks the registry for the image's manifest even when its template
//! exists, so wrong credentials fail whatever was pulled before; so does a build without
//! credentials of an image that was pulled with some (it asks anonymously), so one team's
//! private image is no other team's through the shared template.

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

/// The credentials of a `fromImageRegistry` `{type: "registry", username, password}`.
fn credentials(reg: Option<&serde_json::Value>) -> Option<Credentials> {
    let reg = reg?;
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

/// A failed pull as the build's reason: the image and the registry's answer, never a host
/// path (what is not the registry's answer goes to the server log).
fn reason(img: &str, e: kiln_template::Error) -> String {
    match e {
        kiln_template::Error::Oci(OciError::Auth {
            image,
            registry,
            user,
            answer,
        }) => format!(
            "{image}: registry {registry} refused {}: {answer}; check the username and password \
             given with the image (from_image(..., username=, password=))",
            user.map_or("anonymous access".to_string(), |u| format!(
                "the credentials of user {u:?}"
            ))
        ),
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
        let name = oci::reference::template_name_for(&resolved);
        let lock = self.image_locks.of(&name);
        let _held = lock.lock().await;
        let full = resolved.full.clone();
        if self.manager.template(&name).await.is_ok() {
            let n = name.clone();
            let made_from = tokio::task::spawn_blocking(move || {
                kiln_template::Store::open_default().and_then(|s| oci::template::image_of(&s, &n))
            })
            .await
            .map_err(|e| format!("image {img:?}: {e}"))?;
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
}
