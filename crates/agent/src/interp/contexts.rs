//! Execution contexts: each one a kernel (Python), a persistent shell (bash) or a persistent
//! node (JavaScript) with its own
//! state and working directory. One default context per language is created on first use.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value};
use tokio::sync::{mpsc, Mutex};

use super::bash::Bash;
use super::js::Js;
use super::kernel::{env_code, Kernel, KernelSpec};
use super::output::Event;

/// Languages we can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Language {
    Python,
    Bash,
    JavaScript,
}

impl Language {
    /// Parse a client's language name (None/empty: python).
    pub fn parse(s: Option<&str>) -> Option<Language> {
        match s.map(str::to_ascii_lowercase).as_deref() {
            None | Some("") | Some("python") | Some("python3") => Some(Language::Python),
            Some("bash") | Some("sh") | Some("shell") => Some(Language::Bash),
            Some("javascript") | Some("js") | Some("node") => Some(Language::JavaScript),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
            Language::JavaScript => "javascript",
        }
    }
}

enum Backend {
    Python(Kernel),
    Bash(Bash),
    Js(Js),
}

impl Backend {
    async fn start(cfg: &Config, lang: Language, cwd: &Path) -> anyhow::Result<Backend> {
        Ok(match lang {
            Language::Python => Backend::Python(Kernel::start(&cfg.kernel, cwd).await?),
            Language::Bash => {
                Backend::Bash(Bash::start(cwd, &cfg.kernel.runtime_dir.join("bash")).await?)
            }
            Language::JavaScript => Backend::Js(Js::start(&cfg.node, cwd).await?),
        })
    }

    async fn shutdown(self) {
        match self {
            Backend::Python(k) => k.shutdown().await,
            Backend::Bash(b) => b.shutdown().await,
            Backend::Js(j) => j.shutdown().await,
        }
    }
}

/// A context as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Info {
    pub id: String,
    pub language: String,
    pub cwd: String,
}

/// One context.
pub struct Context {
    pub info: Info,
    lang: Language,
    backend: Mutex<Option<Backend>>,
}

/// Service configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub kernel: KernelSpec,
    /// Working directory of contexts created without one.
    pub default_cwd: PathBuf,
    /// Node.js, for JavaScript contexts.
    pub node: PathBuf,
}

/// All contexts.
pub struct Contexts {
    cfg: Config,
    all: Mutex<HashMap<String, Arc<Context>>>,
    defaults: Mutex<HashMap<Language, String>>,
}

impl Contexts {
    pub fn new(cfg: Config) -> Arc<Contexts> {
        Arc::new(Contexts {
            cfg,
            all: Mutex::default(),
            defaults: Mutex::default(),
        })
    }

    /// Start a new context.
    pub async fn create(&self, lang: Language, cwd: Option<&str>) -> anyhow::Result<Arc<Context>> {
        let cwd = cwd
            .filter(|c| !c.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| self.cfg.default_cwd.clone());
        let backend = Backend::start(&self.cfg, lang, &cwd).await?;
        let ctx = Arc::new(Context {
            info: Info {
                id: super::new_id(),
                language: lang.name().into(),
                cwd: cwd.to_string_lossy().into_owned(),
            },
            lang,
            backend: Mutex::new(Some(backend)),
        });
        self.all
            .lock()
            .await
            .insert(ctx.info.id.clone(), ctx.clone());
        Ok(ctx)
    }

    /// The default context of `lang`, started if needed.
    pub async fn default_for(&self, lang: Language) -> anyhow::Result<Arc<Context>> {
        let mut defaults = self.defaults.lock().await;
        if let Some(id) = defaults.get(&lang) {
            if let Some(c) = self.get(id).await {
                return Ok(c);
            }
        }
        let c = self.create(lang, None).await?;
        defaults.insert(lang, c.info.id.clone());
        Ok(c)
    }

    pub async fn get(&self, id: &str) -> Option<Arc<Context>> {
        self.all.lock().await.get(id).cloned()
    }

    pub async fn list(&self) -> Vec<Info> {
        let mut v: Vec<Info> = self
            .all
            .lock()
            .await
            .values()
            .map(|c| c.info.clone())
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Stop and forget a context (false: no such context).
    pub async fn remove(&self, id: &str) -> bool {
        let Some(c) = self.all.lock().await.remove(id) else {
            return false;
        };
        self.defaults.lock().await.retain(|_, v| v != id);
        if let Some(b) = c.backend.lock().await.take() {
            b.shutdown().await;
        }
        true
    }

    /// Replace a context's kernel with a fresh one (state is lost, id and cwd are kept).
    pub async fn restart(&self, c: &Context) -> anyhow::Result<()> {
        let mut guard = c.backend.lock().await;
        if let Some(b) = guard.take() {
            b.shutdown().await;
        }
        *guard = Some(Backend::start(&self.cfg, c.lang, Path::new(&c.info.cwd)).await?);
        Ok(())
    }
}

impl Context {
    /// Run `code` with `env` set for this execution; outputs go to `out`, then the count.
    pub async fn execute(&self, code: &str, env: &Map<String, Value>, out: mpsc::Sender<Event>) {
        let mut guard = self.backend.lock().await;
        tracing::debug!(context = %self.info.id, "execute");
        let Some(backend) = guard.as_mut() else {
            let _ = out.send(Event::Internal("context removed".into())).await;
            return;
        };
        let res = match backend {
            Backend::Python(k) => {
                let (set, restore) = env_code(env);
                let mut r = Ok(());
                if !env.is_empty() {
                    r = k.run_silent(&set).await;
                }
                match r {
                    Ok(()) => {
                        let res = k.execute(code, false, out.clone()).await;
                        if !env.is_empty() {
                            let _ = k.run_silent(&restore).await;
                        }
                        res
                    }
                    Err(e) => Err(e),
                }
            }
            Backend::Bash(b) => b.execute(code, env, out.clone()).await,
            Backend::Js(j) => j.execute(code, env, out.clone()).await,
        };
        tracing::debug!(context = %self.info.id, ok = res.is_ok(), closed = out.is_closed(), "executed");
        match res {
            Ok(Some(n)) => {
                let _ = out.send(Event::Count(n)).await;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("context {}: {e:#}", self.info.id);
                let _ = out.send(Event::Internal(format!("{e:#}"))).await;
            }
        }
    }
}
