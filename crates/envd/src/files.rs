//! envd's `/files` endpoint: upload (octet-stream, whole or streamed) and download.

use bytes::Bytes;
use http::{header, Method};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use crate::{empty, EnvdClient, EnvdError};

impl EnvdClient {
    /// `POST /files` (application/octet-stream), creating parent directories.
    pub async fn write_file(
        &self,
        path: &str,
        data: Vec<u8>,
        user: Option<&str>,
    ) -> Result<(), EnvdError> {
        self.write_file_body(path, Full::new(Bytes::from(data)), user)
            .await
    }

    /// Streamed `POST /files` from any body (used for large uploads).
    pub async fn write_file_body<B>(
        &self,
        path: &str,
        body: B,
        user: Option<&str>,
    ) -> Result<(), EnvdError>
    where
        B: http_body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let r = self
            .builder(Method::POST, &files_uri(path, user), user, None)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(body)?;
        Self::expect_ok(self.send(r).await?).await.map(|_| ())
    }

    /// `GET /files`: the whole file in memory.
    pub async fn read_file(&self, path: &str, user: Option<&str>) -> Result<Vec<u8>, EnvdError> {
        let body = self.read_file_stream(path, user).await?;
        Ok(body.collect().await?.to_bytes().to_vec())
    }

    /// `GET /files` returning the streaming body (for large downloads).
    pub async fn read_file_stream(
        &self,
        path: &str,
        user: Option<&str>,
    ) -> Result<Incoming, EnvdError> {
        let r = self
            .builder(Method::GET, &files_uri(path, user), user, None)
            .body(empty())?;
        Self::expect_ok_stream(self.send(r).await?).await
    }
}

fn files_uri(path: &str, user: Option<&str>) -> String {
    let mut uri = format!("/files?path={}", urlencode(path));
    if let Some(u) = user {
        uri.push_str("&username=");
        uri.push_str(&urlencode(u));
    }
    uri
}

/// Percent-encodes a query component (keeping `/` and the unreserved characters).
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_components_are_percent_encoded() {
        assert_eq!(urlencode("/a b/c&d"), "/a%20b/c%26d");
        assert_eq!(urlencode("ü"), "%C3%BC");
        assert_eq!(
            files_uri("/tmp/x y", Some("us er")),
            "/files?path=/tmp/x%20y&username=us%20er"
        );
    }
}
