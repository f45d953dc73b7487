//! Token-guarded metadata reads, shared by AWS IMDSv2 and Alibaba's hardened mode, which use
//! the same flow: `PUT /latest/api/token` with a TTL header, then the token in a header on
//! every GET, and 401 when it has expired.

use std::time::Duration;

use reqwest::{Client, StatusCode};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::debug;

use crate::{Error, http};

/// Token lifetime asked for: the maximum both clouds allow (6 hours).
const TOKEN_TTL_SECS: u64 = 21_600;
/// Renew this long before expiry, so a poll never carries a token about to lapse.
const RENEW_BEFORE: Duration = Duration::from_secs(300);
/// After a failed token request, read without one (where allowed) this long before asking again.
const RETRY_TOKEN_AFTER: Duration = Duration::from_secs(60);

/// The header names of one cloud's token flow.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenHeaders {
    pub ttl: &'static str,
    pub token: &'static str,
}

pub(crate) const AWS_TOKEN: TokenHeaders = TokenHeaders {
    ttl: "X-aws-ec2-metadata-token-ttl-seconds",
    token: "X-aws-ec2-metadata-token",
};

pub(crate) const ALIYUN_TOKEN: TokenHeaders = TokenHeaders {
    ttl: "X-aliyun-ecs-metadata-token-ttl-seconds",
    token: "X-aliyun-ecs-metadata-token",
};

#[derive(Debug)]
enum TokenState {
    None,
    Valid { token: String, renew_at: Instant },
    Failed { retry_at: Instant },
}

/// A metadata service, read with or without a session token.
#[derive(Debug)]
pub(crate) struct Imds {
    client: Client,
    base: String,
    headers: Option<TokenHeaders>,
    /// Whether a read may go ahead without a token when the token request fails.
    plain_allowed: bool,
    state: Mutex<TokenState>,
}

impl Imds {
    pub(crate) fn new(base: String, headers: Option<TokenHeaders>, plain_allowed: bool) -> Self {
        Imds {
            client: http::client(),
            base,
            headers,
            plain_allowed,
            state: Mutex::new(TokenState::None),
        }
    }

    pub(crate) fn plain_allowed(&self) -> bool {
        self.plain_allowed
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}/{}", self.base, path.trim_start_matches('/'))
    }

    /// Asks for a new token. The token itself is a secret: it is never logged.
    pub(crate) async fn fetch_token(&self) -> Result<String, Error> {
        let headers = self
            .headers
            .expect("only token-guarded services fetch tokens");
        let url = self.url("latest/api/token");
        let req = self
            .client
            .put(&url)
            .header(headers.ttl, TOKEN_TTL_SECS.to_string());
        let resp = http::send(req, &url).await.map_err(|e| match e {
            Error::Unreachable { url, reason } if self.headers.is_some_and(|h| h.ttl == AWS_TOKEN.ttl) => {
                Error::Unreachable {
                    url,
                    reason: format!(
                        "{reason} (in a container on EC2 the instance's metadata hop limit must be 2 or more)"
                    ),
                }
            }
            other => other,
        })?;
        match resp.status() {
            StatusCode::OK => {
                let token = http::text(resp, &url).await?.trim().to_owned();
                if token.is_empty() {
                    return Err(Error::Body {
                        url,
                        reason: "empty token".into(),
                    });
                }
                Ok(token)
            }
            s => Err(Error::Status {
                url,
                status: s.as_u16(),
                hint: match s.as_u16() {
                    403 => " (the instance metadata service is disabled)",
                    _ => "",
                },
            }),
        }
    }

    /// The current token, fetching one when needed; `None` to read without one.
    async fn token(&self) -> Result<Option<String>, Error> {
        if self.headers.is_none() {
            return Ok(None);
        }
        let mut state = self.state.lock().await;
        let now = Instant::now();
        match &*state {
            TokenState::Valid { token, renew_at } if *renew_at > now => {
                return Ok(Some(token.clone()));
            }
            TokenState::Failed { retry_at } if *retry_at > now && self.plain_allowed => {
                return Ok(None);
            }
            _ => {}
        }
        match self.fetch_token().await {
            Ok(token) => {
                let renew_at = now + Duration::from_secs(TOKEN_TTL_SECS) - RENEW_BEFORE;
                *state = TokenState::Valid {
                    token: token.clone(),
                    renew_at,
                };
                Ok(Some(token))
            }
            Err(e) if self.plain_allowed => {
                debug!(error = %e, "no metadata token; reading without one");
                *state = TokenState::Failed {
                    retry_at: now + RETRY_TOKEN_AFTER,
                };
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// `latest/meta-data/<key>`, trimmed; `None` when absent, empty or unreadable (identity
    /// is best effort).
    pub(crate) async fn meta_value(&self, key: &str) -> Option<String> {
        self.get(&format!("latest/meta-data/{key}"))
            .await
            .ok()
            .flatten()
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    /// GETs `path`: `Some(body)` on 200, `None` on 404 (nothing pending). A 401 means the token
    /// expired or is missing: renew it and retry once.
    pub(crate) async fn get(&self, path: &str) -> Result<Option<String>, Error> {
        let url = self.url(path);
        for attempt in 0..2 {
            let token = self.token().await?;
            let mut req = self.client.get(&url);
            if let (Some(h), Some(t)) = (self.headers, &token) {
                req = req.header(h.token, t);
            }
            let resp = http::send(req, &url).await?;
            match resp.status() {
                StatusCode::OK => return http::text(resp, &url).await.map(Some),
                StatusCode::NOT_FOUND => return Ok(None),
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
                    if attempt == 0 && self.headers.is_some() =>
                {
                    debug!(%url, status = resp.status().as_u16(), "metadata token refused; renewing it");
                    // Forget the token (or the failed attempt) so the next try asks anew.
                    *self.state.lock().await = TokenState::None;
                }
                s => {
                    return Err(Error::Status {
                        url,
                        status: s.as_u16(),
                        hint: "",
                    });
                }
            }
        }
        Err(Error::Status {
            url,
            status: 401,
            hint: " (a fresh token was refused too)",
        })
    }
}
