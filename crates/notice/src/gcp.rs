//! Google Compute Engine: `instance/preempted` and `instance/maintenance-event`, each watched
//! with a hanging GET (`wait_for_change` + `last_etag`), so a change is seen at once and never
//! missed between two requests.
//! https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::{Client, StatusCode};
use tokio::sync::mpsc;
use tracing::debug;

use crate::poll::{Dedup, FailureLog};
use crate::{BoxFuture, Cloud, Error, Notice, NoticeSource, Source, http};

const SOURCE: Source = Source::Cloud(Cloud::Gcp);
/// How long one hanging GET waits for a change before the server answers anyway.
const WAIT_SECS: u64 = 60;
/// Maintenance-event terminations come with a 60 s notice.
const MAINTENANCE_WARNING: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub(crate) struct Gcp {
    client: Client,
    base: String,
}

impl Gcp {
    pub(crate) fn new(base: String) -> Self {
        Gcp {
            client: http::client(),
            base: format!("{base}/computeMetadata/v1"),
        }
    }

    /// One GET; `last_etag` makes it hang until the value differs from that version.
    async fn get(
        &self,
        path: &str,
        last_etag: Option<&str>,
    ) -> Result<(StatusCode, String, Option<String>), Error> {
        let mut url = format!("{}/{path}", self.base);
        if let Some(etag) = last_etag {
            // ETags are hex digits; anything else is dropped rather than sent unescaped.
            let etag: String = etag.chars().filter(char::is_ascii_alphanumeric).collect();
            url = format!("{url}?wait_for_change=true&timeout_sec={WAIT_SECS}&last_etag={etag}");
        }
        let mut req = self.client.get(&url).header("Metadata-Flavor", "Google");
        if last_etag.is_some() {
            req = req.timeout(Duration::from_secs(WAIT_SECS) + http::REQUEST_TIMEOUT);
        }
        let resp = http::send(req, &url).await?;
        let status = resp.status();
        let etag = resp
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = http::text(resp, &url).await?;
        Ok((status, body, etag))
    }

    /// Follows one metadata value, sending what `interpret` makes of each new version.
    async fn follow(
        &self,
        path: &str,
        interpret: fn(&str) -> Option<Notice>,
        tx: &mpsc::Sender<Notice>,
    ) {
        let mut etag: Option<String> = None;
        let mut dedup = Dedup::default();
        let mut log = FailureLog::new(SOURCE);
        loop {
            let pause = match self.get(path, etag.as_deref()).await {
                Ok((StatusCode::OK, body, new_etag)) => {
                    log.ok();
                    let value = body.trim();
                    debug!(path, value, "metadata value");
                    if let Some(n) = interpret(value) {
                        let n = n.with_event_id(format!(
                            "{path}={value}@{}",
                            new_etag.as_deref().unwrap_or("")
                        ));
                        if !dedup.send(tx, n).await {
                            return;
                        }
                    }
                    // Without an ETag the server cannot hang: poll instead of spinning.
                    let pause = if new_etag.is_none() {
                        Duration::from_secs(1)
                    } else {
                        Duration::ZERO
                    };
                    etag = new_etag;
                    pause
                }
                Ok((status, _, _)) => {
                    // 503 is documented during maintenance: retry.
                    log.failed(&Error::Status {
                        url: format!("{}/{path}", self.base),
                        status: status.as_u16(),
                        hint: "",
                    });
                    Duration::from_secs(1)
                }
                Err(e) => {
                    log.failed(&e);
                    Duration::from_secs(1)
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = tx.closed() => return,
            }
        }
    }
}

fn preempted(value: &str) -> Option<Notice> {
    (value == "TRUE").then(|| {
        Notice::terminate(
            SOURCE,
            SystemTime::now() + Cloud::Gcp.default_warning(),
            "instance/preempted = TRUE",
        )
    })
}

fn maintenance(value: &str) -> Option<Notice> {
    (value == "TERMINATE_ON_HOST_MAINTENANCE").then(|| {
        Notice::terminate(
            SOURCE,
            SystemTime::now() + MAINTENANCE_WARNING,
            format!("maintenance-event = {value}"),
        )
    })
}

impl NoticeSource for Gcp {
    fn source(&self) -> Source {
        SOURCE
    }

    fn identity(&self) -> BoxFuture<'_, crate::Identity> {
        Box::pin(async move {
            let get = |p: &'static str| async move {
                match self.get(p, None).await {
                    Ok((StatusCode::OK, body, _)) => Some(body.trim().to_owned()),
                    _ => None,
                }
            };
            let (id, machine, zone, preemptible, model) = tokio::join!(
                get("instance/id"),
                get("instance/machine-type"),
                get("instance/zone"),
                get("instance/scheduling/preemptible"),
                get("instance/scheduling/provisioning-model"),
            );
            let spot = preemptible.as_deref() == Some("TRUE") || model.as_deref() == Some("SPOT");
            crate::Identity {
                instance_id: id,
                instance_type: machine.as_deref().and_then(crate::last_segment),
                zone: zone.as_deref().and_then(crate::last_segment),
                lifecycle: (preemptible.is_some() || model.is_some())
                    .then(|| if spot { "spot" } else { "on-demand" }.to_owned()),
            }
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            let url = format!("{}/instance/id", self.base);
            let req = self.client.get(&url).header("Metadata-Flavor", "Google");
            match http::send(req, &url).await {
                // The real server echoes the flavor header; anything else is not GCE.
                Ok(resp) => {
                    resp.status() == StatusCode::OK
                        && resp
                            .headers()
                            .get("metadata-flavor")
                            .is_some_and(|v| v == "Google")
                }
                Err(_) => false,
            }
        })
    }

    fn watch(self: Arc<Self>, tx: mpsc::Sender<Notice>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            tokio::join!(
                self.follow("instance/preempted", preempted, &tx),
                self.follow("instance/maintenance-event", maintenance, &tx),
            );
        })
    }
}
