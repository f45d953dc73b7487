//! The one HTTP client every metadata source uses.

use std::error::Error as _;
use std::time::Duration;

use reqwest::{Client, RequestBuilder, Response};

use crate::Error;

/// Metadata services are link-local and answer in milliseconds; anything slower is absent.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// A client that never goes through a proxy: `HTTP_PROXY` is for the outside world, and a
/// proxy answering for 169.254.169.254 would fake a cloud.
pub(crate) fn client() -> Client {
    Client::builder()
        .no_proxy()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("a plain HTTP client always builds")
}

/// Sends `req`, turning transport failures into [`Error::Unreachable`] naming `url`.
pub(crate) async fn send(req: RequestBuilder, url: &str) -> Result<Response, Error> {
    req.send().await.map_err(|e| unreachable(url, &e))
}

/// The body as text.
pub(crate) async fn text(resp: Response, url: &str) -> Result<String, Error> {
    resp.text().await.map_err(|e| unreachable(url, &e))
}

pub(crate) fn unreachable(url: &str, e: &reqwest::Error) -> Error {
    let mut reason = if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_connect() {
        "connection failed".to_owned()
    } else {
        "request failed".to_owned()
    };
    // The innermost cause says what really happened ("Connection refused").
    let mut source = e.source();
    let mut last = None;
    while let Some(s) = source {
        last = Some(s.to_string());
        source = s.source();
    }
    if let Some(last) = last {
        reason = format!("{reason}: {last}");
    }
    Error::Unreachable {
        url: url.to_owned(),
        reason,
    }
}
