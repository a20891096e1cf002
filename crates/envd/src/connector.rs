//! How the client reaches envd: anything that yields a fresh byte stream per request.

use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::io::{AsyncRead, AsyncWrite};

/// A bidirectional byte stream an HTTP/1.1 connection can run over.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A boxed [`Io`].
pub type BoxIo = Box<dyn Io>;

/// Opens connections to one envd. Implement it for any transport (a host Unix socket, TCP, a
/// vsock CONNECT handshake, a port inside a network namespace).
#[async_trait::async_trait]
pub trait Connector: Send + Sync + 'static {
    /// A fresh connection.
    async fn connect(&self) -> std::io::Result<BoxIo>;
    /// For logs only (may contain host paths; never shown to API clients).
    fn describe(&self) -> String;
}

/// envd behind a Unix socket.
#[derive(Debug, Clone)]
pub struct UnixConnector(pub PathBuf);

#[async_trait::async_trait]
impl Connector for UnixConnector {
    async fn connect(&self) -> std::io::Result<BoxIo> {
        let s = tokio::net::UnixStream::connect(&self.0).await?;
        Ok(Box::new(s))
    }

    fn describe(&self) -> String {
        format!("unix:{}", self.0.display())
    }
}

/// envd (or kiln's proxy in front of it) over TCP, with Nagle's algorithm off.
#[derive(Debug, Clone)]
pub struct TcpConnector(pub SocketAddr);

#[async_trait::async_trait]
impl Connector for TcpConnector {
    async fn connect(&self) -> std::io::Result<BoxIo> {
        let s = tokio::net::TcpStream::connect(self.0).await?;
        s.set_nodelay(true)?;
        Ok(Box::new(s))
    }

    fn describe(&self) -> String {
        format!("tcp:{}", self.0)
    }
}
