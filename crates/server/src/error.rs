//! The server's error type: what failed, typed, from the driver, the store, the templates and
//! the agent up to the manager. The API maps it to an HTTP status in one place
//! ([`crate::api::ApiError`]'s `From<Error>`), so a driver's "not implemented" reaches a client
//! as 501 and its "not found" as 404.

use crate::driver::DriverError;
use crate::store::StoreError;
use crate::templates::TemplateError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed or asks for something impossible (400).
    #[error("{0}")]
    BadRequest(String),
    #[error("sandbox \"{0}\" not found")]
    SandboxNotFound(String),
    /// Something else the request names does not exist (404).
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the sandbox's state (409).
    #[error("{0}")]
    Conflict(String),
    /// kiln is not able to take this right now (503).
    #[error("{0}")]
    Unavailable(String),
    /// A cap on what a team may hold, which waiting does not lift (429).
    #[error("{0}")]
    Limit(String),
    /// A create refused up front: a configured quota (429) or the host's capacity (503).
    #[error("cannot create another sandbox now: {limit}; retry in {retry_after_secs}s")]
    Capacity {
        limit: String,
        retry_after_secs: u64,
        quota: bool,
    },
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error("state database: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("the sandbox agent: {0}")]
    Agent(#[from] kiln_envd::EnvdError),
    /// A step of creating a sandbox failed; the status follows the cause.
    #[error("creating the sandbox failed while {stage}: {source}")]
    Create {
        stage: &'static str,
        #[source]
        source: Box<Error>,
    },
    #[error("{0}")]
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn bad_request(m: impl Into<String>) -> Self {
        Self::BadRequest(m.into())
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::Internal(m.into())
    }
    /// Wraps a failed create step.
    pub fn create(stage: &'static str) -> impl FnOnce(Error) -> Error {
        move |e| Error::Create {
            stage,
            source: Box::new(e),
        }
    }
    /// The root cause (through [`Error::Create`] wrappers).
    pub fn cause(&self) -> &Error {
        match self {
            Error::Create { source, .. } => source.cause(),
            e => e,
        }
    }
}

/// Replaces host paths in a message meant for an API client with `<host path>`: errors from
/// the driver and the store may name files on the host, which clients must not see (the
/// server log keeps the full text). A host path here is a token that starts with `/` and has
/// at least two components.
pub fn redact_host_paths(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(i) = rest.find('/') {
        let (before, from) = rest.split_at(i);
        out.push_str(before);
        let at_boundary = before
            .chars()
            .last()
            .is_none_or(|c| c.is_whitespace() || "\"'(=[{<,:".contains(c));
        let len = from
            .find(|c: char| c.is_whitespace() || "\"'()[]{}<>,;:".contains(c))
            .unwrap_or(from.len());
        let token = &from[..len];
        let components = token.split('/').filter(|p| !p.is_empty()).count();
        if at_boundary && components >= 2 {
            out.push_str("<host path>");
        } else {
            out.push_str(token);
        }
        rest = &from[len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_paths_are_redacted_and_the_rest_kept() {
        assert_eq!(
            redact_host_paths("mounting /var/lib/kiln/state/x/rootfs: EPERM"),
            "mounting <host path>: EPERM"
        );
        assert_eq!(
            redact_host_paths("creating \"/tmp/a b/c\" failed"),
            "creating \"<host path> b/c\" failed"
        );
        assert_eq!(redact_host_paths("ratio 1/2 and /x"), "ratio 1/2 and /x");
        assert_eq!(
            redact_host_paths("(at /root/.cache/kiln/templates/base)"),
            "(at <host path>)"
        );
        assert_eq!(redact_host_paths("no paths here"), "no paths here");
    }

    #[test]
    fn create_errors_keep_their_cause() {
        let e =
            Error::create("starting the sandbox")(Error::Driver(DriverError::NotImplemented("x")));
        assert!(matches!(
            e.cause(),
            Error::Driver(DriverError::NotImplemented(_))
        ));
        assert!(e.to_string().contains("starting the sandbox"), "{e}");
    }
}
