//! What the API shows about sandboxes and templates: metrics, logs, template views.

use super::Manager;
pub use crate::obs::ring::MetricSample;

use crate::error::{Error, Result};
use crate::store::{Event, TemplateRecord};
use crate::templates::TemplateInfo;

/// A sandbox's logs: its lifecycle events, and while it lives its console output.
#[derive(Debug, Clone)]
pub struct Logs {
    pub events: Vec<Event>,
    pub console: Option<String>,
}

/// A template as the API shows it: what was built, plus spawn statistics and defaults.
#[derive(Debug, Clone)]
pub struct TemplateView {
    pub info: TemplateInfo,
    pub record: Option<TemplateRecord>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_mb: u64,
}

/// Console output shown by the logs endpoints: at most this many bytes from its end.
const CONSOLE_TAIL: usize = 64 * 1024;

impl Manager {
    /// The logs of sandbox `id` (running or ended) of `team`.
    pub async fn logs(&self, id: &str, team: &str) -> Result<Logs> {
        let rec = self
            .store
            .get_sandbox(id)
            .await?
            .filter(|r| r.team == team)
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
        let events = self.store.events(id).await?;
        let console = if rec.state.is_live() {
            self.driver.console_log(id, CONSOLE_TAIL).await.ok()
        } else {
            None
        };
        Ok(Logs { events, console })
    }

    async fn view(&self, info: TemplateInfo) -> TemplateView {
        let record = self.store.get_template(&info.name).await.ok().flatten();
        TemplateView {
            disk_mb: (info.size_bytes >> 20).max(u64::from(self.cfg.default_disk_mb)),
            cpu_count: self.cfg.default_cpu_count,
            memory_mb: info.memory_mb.unwrap_or(self.cfg.default_memory_mb),
            info,
            record,
        }
    }

    /// Every built template.
    pub async fn templates(&self) -> Result<Vec<TemplateView>> {
        let t = self.templates.clone();
        let list = tokio::task::spawn_blocking(move || t.list())
            .await
            .map_err(|e| Error::internal(format!("template listing task: {e}")))??;
        let mut out = Vec::with_capacity(list.len());
        for info in list {
            out.push(self.view(info).await);
        }
        Ok(out)
    }

    /// The template `name`.
    pub async fn template(&self, name: &str) -> Result<TemplateView> {
        let info = self.lookup_template(name).await?;
        Ok(self.view(info).await)
    }
}
