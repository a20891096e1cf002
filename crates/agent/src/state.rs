//! The agent's shared state: settings from `/init`, the process table and buffered watchers.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};

use kiln_proto::connect::Code;
use kiln_proto::filesystem as fspb;

use crate::process::Table;
use crate::rpc::RpcError;
use crate::users::{self, User};

/// Settings applied by `POST /init`.
#[derive(Debug, Default, Clone)]
pub struct InitState {
    pub env_vars: HashMap<String, String>,
    pub access_token: Option<String>,
    pub default_user: Option<String>,
    pub default_workdir: Option<String>,
}

/// Shared state of one agent.
pub struct Agent {
    pub init: RwLock<InitState>,
    pub procs: Arc<Table>,
    watchers: Mutex<HashMap<String, Arc<BufferedWatcher>>>,
}

struct BufferedWatcher {
    events: Arc<Mutex<VecDeque<fspb::FilesystemEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Default for Agent {
    fn default() -> Self {
        Agent {
            init: RwLock::new(InitState::default()),
            procs: Arc::new(Table::default()),
            watchers: Mutex::new(HashMap::new()),
        }
    }
}

impl Agent {
    pub fn new() -> Arc<Self> {
        Arc::new(Agent::default())
    }

    pub(crate) fn init_state(&self) -> InitState {
        self.init.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Resolve the user of a request: explicit name, else the default user, else the user the
    /// agent runs as.
    pub fn resolve_user(&self, name: Option<&str>) -> Result<User, RpcError> {
        let name = match name.filter(|n| !n.is_empty()) {
            Some(n) => n.to_string(),
            None => match self.init_state().default_user {
                Some(u) if !u.is_empty() => u,
                _ => {
                    // SAFETY: geteuid has no preconditions and cannot fail.
                    let euid = unsafe { libc::geteuid() };
                    return users::lookup_uid(euid)
                        .map_err(|e| RpcError::new(Code::Internal, e.to_string()));
                }
            },
        };
        users::lookup(&name).map_err(|e| match e {
            users::UserError::NotFound(_) => {
                RpcError::new(Code::Unauthenticated, format!("invalid user: {e}"))
            }
            other => RpcError::internal(other.to_string()),
        })
    }

    /// Working directory for `user` when the request names none.
    pub fn default_cwd(&self, user: &User) -> String {
        match self.init_state().default_workdir {
            Some(w) if !w.is_empty() => w,
            _ => user.home.to_string_lossy().into_owned(),
        }
    }
}

/// Watchers created with CreateWatcher (polled with GetWatcherEvents).
impl Agent {
    pub fn add_watcher(&self, mut watch: crate::watch::Watch) -> String {
        let id = format!("{:016x}", rand::random::<u64>());
        let events: Arc<Mutex<VecDeque<fspb::FilesystemEvent>>> =
            Arc::new(Mutex::new(Default::default()));
        let sink = events.clone();
        let task = tokio::spawn(async move {
            while let Some(ev) = watch.events.recv().await {
                let mut q = sink.lock().unwrap_or_else(|p| p.into_inner());
                if q.len() >= crate::watch::MAX_BUFFERED {
                    q.pop_front();
                }
                q.push_back(ev);
            }
        });
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), Arc::new(BufferedWatcher { events, task }));
        id
    }

    pub fn take_watcher_events(&self, id: &str) -> Option<Vec<fspb::FilesystemEvent>> {
        let w = self
            .watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()?;
        let mut q = w.events.lock().unwrap_or_else(|p| p.into_inner());
        Some(q.drain(..).collect())
    }

    pub fn remove_watcher(&self, id: &str) -> bool {
        match self
            .watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)
        {
            Some(w) => {
                w.task.abort();
                true
            }
            None => false,
        }
    }
}
