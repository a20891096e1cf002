//! `filesystem.Filesystem` Connect handlers.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use kiln_proto::connect::Code;
use kiln_proto::filesystem as fspb;

use crate::rpc::{self, Body, Codec, RpcError};
use crate::state::Agent;
use crate::users::{with_fs_identity, User};

/// Run a filesystem operation on a blocking thread with the caller's filesystem identity.
pub async fn as_user<T: Send + 'static>(
    user: &User,
    f: impl FnOnce() -> Result<T, RpcError> + Send + 'static,
) -> Result<T, RpcError> {
    let u = user.clone();
    tokio::task::spawn_blocking(move || with_fs_identity(&u, f))
        .await
        .map_err(|e| RpcError::internal(format!("filesystem task failed: {e}")))?
}

pub async fn unary(
    agent: Arc<Agent>,
    codec: Codec,
    user: User,
    method: &str,
    body: &[u8],
) -> Response<Body> {
    macro_rules! call {
        ($req:ty, $f:expr) => {{
            match rpc::decode::<$req>(codec, body) {
                Ok(r) => rpc::unary_response(codec, $f(r).await),
                Err(e) => rpc::error_response(&e),
            }
        }};
    }
    let u = user.clone();
    match method {
        "Stat" => call!(fspb::StatRequest, |r: fspb::StatRequest| async move {
            let p = crate::fs::resolve(&r.path, &u)?;
            let entry = as_user(&u, move || crate::fs::stat(&p)).await?;
            Ok(fspb::StatResponse { entry: Some(entry) })
        }),
        "MakeDir" => call!(fspb::MakeDirRequest, |r: fspb::MakeDirRequest| async move {
            let p = crate::fs::resolve(&r.path, &u)?;
            let u2 = u.clone();
            let entry = as_user(&u, move || crate::fs::make_dir(&p, &u2)).await?;
            Ok(fspb::MakeDirResponse { entry: Some(entry) })
        }),
        "Move" => call!(fspb::MoveRequest, |r: fspb::MoveRequest| async move {
            let s = crate::fs::resolve(&r.source, &u)?;
            let d = crate::fs::resolve(&r.destination, &u)?;
            let u2 = u.clone();
            let (s2, d2) = (s.clone(), d.clone());
            as_user(&u, move || crate::fs::move_entry(&s2, &d2, &u2)).await?;
            // The metadata the agent keeps moves along; the entry is read with it.
            let store = crate::metastore::store();
            tokio::task::spawn_blocking({
                let (s, d) = (s.clone(), d.clone());
                move || store.rename(&s, &d)
            })
            .await
            .map_err(|e| RpcError::internal(format!("filesystem task failed: {e}")))?;
            let entry = as_user(&u, move || crate::fs::stat(&d)).await?;
            Ok(fspb::MoveResponse { entry: Some(entry) })
        }),
        "ListDir" => call!(fspb::ListDirRequest, |r: fspb::ListDirRequest| async move {
            let p = crate::fs::resolve(&r.path, &u)?;
            let entries = as_user(&u, move || crate::fs::list_dir(&p, r.depth)).await?;
            Ok(fspb::ListDirResponse { entries })
        }),
        "Remove" => call!(fspb::RemoveRequest, |r: fspb::RemoveRequest| async move {
            let p = crate::fs::resolve(&r.path, &u)?;
            let p2 = p.clone();
            as_user(&u, move || crate::fs::remove(&p2)).await?;
            let store = crate::metastore::store();
            tokio::task::spawn_blocking(move || store.remove(&p))
                .await
                .map_err(|e| RpcError::internal(format!("filesystem task failed: {e}")))?;
            Ok(fspb::RemoveResponse {})
        }),
        "CreateWatcher" => call!(
            fspb::CreateWatcherRequest,
            |r: fspb::CreateWatcherRequest| async move {
                let p = crate::fs::resolve(&r.path, &u)?;
                let p2 = p.clone();
                as_user(&u, move || check_dir(&p2)).await?;
                let w = crate::watch::start(p, r.recursive, r.include_entry)?;
                Ok(fspb::CreateWatcherResponse {
                    watcher_id: agent.add_watcher(w),
                })
            }
        ),
        "GetWatcherEvents" => call!(
            fspb::GetWatcherEventsRequest,
            |r: fspb::GetWatcherEventsRequest| async move {
                let events = agent.take_watcher_events(&r.watcher_id).ok_or_else(|| {
                    RpcError::not_found(format!("watcher {:?} not found", r.watcher_id))
                })?;
                Ok(fspb::GetWatcherEventsResponse { events })
            }
        ),
        "RemoveWatcher" => call!(
            fspb::RemoveWatcherRequest,
            |r: fspb::RemoveWatcherRequest| async move {
                if agent.remove_watcher(&r.watcher_id) {
                    Ok(fspb::RemoveWatcherResponse {})
                } else {
                    Err(RpcError::not_found(format!(
                        "watcher {:?} not found",
                        r.watcher_id
                    )))
                }
            }
        ),
        other => rpc::error_response(&RpcError::new(
            Code::Unimplemented,
            format!("unknown RPC filesystem.Filesystem/{other}"),
        )),
    }
}

/// The caller must be able to read the directory it watches.
fn check_dir(p: &std::path::Path) -> Result<(), RpcError> {
    std::fs::read_dir(p)
        .map(|_| ())
        .map_err(|e| RpcError::io(&format!("watch {}", p.display()), &e))
}

pub async fn watch_stream(
    _agent: Arc<Agent>,
    codec: Codec,
    user: User,
    r: fspb::WatchDirRequest,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
) -> Response<Body> {
    let p = match crate::fs::resolve(&r.path, &user) {
        Ok(p) => p,
        Err(e) => return rpc::stream_error(codec, e),
    };
    let p2 = p.clone();
    if let Err(e) = as_user(&user, move || check_dir(&p2)).await {
        return rpc::stream_error(codec, e);
    }
    let mut watch = match crate::watch::start(p, r.recursive, r.include_entry) {
        Ok(w) => w,
        Err(e) => return rpc::stream_error(codec, e),
    };
    let (resp, w) = rpc::stream_response(codec);
    tokio::spawn(async move {
        use fspb::watch_dir_response::Event as E;
        if !w
            .send(&fspb::WatchDirResponse {
                event: Some(E::Start(fspb::watch_dir_response::StartEvent {})),
            })
            .await
        {
            return;
        }
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        let dl = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(dl);
        loop {
            tokio::select! {
                ev = watch.events.recv() => match ev {
                    Some(ev) => {
                        if !w.send(&fspb::WatchDirResponse { event: Some(E::Filesystem(ev)) }).await {
                            return;
                        }
                    }
                    None => {
                        w.finish(Some(RpcError::internal("watch ended: the directory is gone or inotify failed"))).await;
                        return;
                    }
                },
                _ = tick.tick() => {
                    if !w.send(&fspb::WatchDirResponse { event: Some(E::Keepalive(fspb::watch_dir_response::KeepAlive {})) }).await {
                        return;
                    }
                }
                _ = &mut dl => {
                    w.finish(Some(RpcError::new(Code::DeadlineExceeded, "the request deadline (connect-timeout-ms) passed"))).await;
                    return;
                }
                _ = w.closed() => return,
            }
        }
    });
    resp
}
