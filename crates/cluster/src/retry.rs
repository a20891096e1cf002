//! Which failed etcd requests are tried again. A cluster that lost a member routes some
//! requests to it for a while, and one that lost its leader refuses requests until it has
//! elected another: those requests are tried again, for a bounded time. A read is always safe
//! to repeat; a write only when it certainly never reached a member (the connection was
//! refused), since etcd may have applied a write whose answer was lost.

use std::future::Future;
use std::time::{Duration, Instant};

use etcd_client::{Client, Error};

/// How long a request is tried before its last error is returned.
pub const RETRY_FOR: Duration = Duration::from_secs(10);
const PAUSE: Duration = Duration::from_millis(50);

/// Whether a request is a read (safe to repeat) or a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
}

/// Runs `op` on (a clone of) `client`, again while its error is one [`Kind`] allows.
pub async fn run<T, F, Fut>(client: &Client, kind: Kind, mut op: F) -> Result<T, Error>
where
    F: FnMut(Client) -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let start = Instant::now();
    loop {
        match op(client.clone()).await {
            Err(e) if again(&e, kind) && start.elapsed() < RETRY_FOR => {
                tracing::debug!(error = %e, ?kind, "etcd request failed; trying again");
                tokio::time::sleep(PAUSE).await;
            }
            other => return other,
        }
    }
}

fn again(e: &Error, kind: Kind) -> bool {
    match e {
        Error::TransportError(_) => kind == Kind::Read || never_sent(e),
        Error::GRpcStatus(s) if s.code() == tonic::Code::Unavailable => {
            kind == Kind::Read || never_sent(s)
        }
        _ => false,
    }
}

/// Whether the error chain says the connection was never made.
fn never_sent(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let text = format!("{err:?}");
        if text.contains("ConnectError") || text.contains("Connection refused") {
            return true;
        }
        cur = err.source();
    }
    false
}
