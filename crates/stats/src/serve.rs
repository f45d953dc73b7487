//! The metrics endpoint: a tiny HTTP/1.1 server that answers every GET with the metrics.
//! No framework: one request per connection, `Connection: close`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::{debug, info};

use crate::Stats;

/// Binds `addr` now (so a port in use is reported at start) and serves in the background.
pub async fn serve(addr: SocketAddr, stats: Arc<Stats>) -> std::io::Result<JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    info!(
        "metrics at http://{}/metrics",
        listener.local_addr().unwrap_or(addr)
    );
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut conn, peer)) = listener.accept().await else {
                continue;
            };
            let stats = stats.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut len = 0;
                // Read the request head (a scraper sends no body); give up on a slow client.
                let read = tokio::time::timeout(Duration::from_secs(5), async {
                    while len < buf.len() {
                        let n = conn.read(&mut buf[len..]).await?;
                        if n == 0 {
                            break;
                        }
                        len += n;
                        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                    Ok::<_, std::io::Error>(())
                })
                .await;
                if !matches!(read, Ok(Ok(()))) {
                    return;
                }
                let head = String::from_utf8_lossy(&buf[..len]);
                let mut parts = head.split_whitespace();
                let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                debug!(%peer, method, path, "metrics request");
                let (status, ctype, body) = match (method, path.split('?').next()) {
                    ("GET" | "HEAD", Some("/metrics" | "/")) => (
                        "200 OK",
                        "text/plain; version=0.0.4; charset=utf-8",
                        stats.render(),
                    ),
                    ("GET" | "HEAD", _) => ("404 Not Found", "text/plain", "not found\n".into()),
                    _ => ("405 Method Not Allowed", "text/plain", "only GET\n".into()),
                };
                let mut resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                if method != "HEAD" {
                    resp.push_str(&body);
                }
                let _ = conn.write_all(resp.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    }))
}
