//! Azure Scheduled Events: `Preempt` (spot eviction) and `Terminate`, with the early
//! acknowledgement that lets the platform go ahead once the work is safe.
//! https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::{Client, StatusCode};
use serde::Deserialize;
use tokio::sync::{OnceCell, mpsc};
use tracing::debug;

use crate::poll::{Check, poll};
use crate::time::parse_http_date;
use crate::{
    BoxFuture, Cloud, Error, Notice, NoticeKind, NoticeSource, Source, WatchOptions, http,
};

const SOURCE: Source = Source::Cloud(Cloud::Azure);
const EVENTS_PATH: &str = "metadata/scheduledevents?api-version=2020-07-01";
const NAME_PATH: &str = "metadata/instance/compute/name?api-version=2021-02-01&format=text";
const INSTANCE_PATH: &str = "metadata/instance?api-version=2021-02-01";

#[derive(Debug)]
pub(crate) struct Azure {
    client: Client,
    base: String,
    interval: Duration,
    /// This VM's name: events list the VMs they affect, and an availability set shares events.
    name: OnceCell<Option<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Document {
    #[serde(default)]
    events: Vec<Event>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Event {
    event_id: String,
    event_type: String,
    #[serde(default)]
    event_status: String,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    not_before: String,
}

impl Azure {
    pub(crate) fn new(base: String, opts: &WatchOptions) -> Self {
        Azure {
            client: http::client(),
            base,
            interval: opts.poll_interval,
            name: OnceCell::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}/{path}", self.base)
    }

    async fn get(&self, path: &str) -> Result<reqwest::Response, Error> {
        let url = self.url(path);
        // Without `Metadata: true` the service answers 400.
        http::send(self.client.get(&url).header("Metadata", "true"), &url).await
    }

    async fn vm_name(&self) -> Option<&str> {
        self.name
            .get_or_init(|| async {
                let resp = self.get(NAME_PATH).await.ok()?;
                if resp.status() != StatusCode::OK {
                    return None;
                }
                let name = resp.text().await.ok()?.trim().to_owned();
                (!name.is_empty()).then_some(name)
            })
            .await
            .as_deref()
    }
}

impl Check for Azure {
    async fn check(&self) -> Result<Vec<Notice>, Error> {
        let url = self.url(EVENTS_PATH);
        let resp = self.get(EVENTS_PATH).await?;
        if resp.status() != StatusCode::OK {
            return Err(Error::Status {
                url,
                status: resp.status().as_u16(),
                hint: "",
            });
        }
        let body = http::text(resp, &url).await?;
        let doc: Document = serde_json::from_str(&body).map_err(|e| Error::Body {
            url,
            reason: e.to_string(),
        })?;
        let mut out = Vec::new();
        for e in doc.events {
            let kind = match e.event_type.as_str() {
                "Preempt" | "Terminate" => NoticeKind::Terminate,
                // The VM restarts or moves: processes die, so save now, but it comes back.
                "Reboot" | "Redeploy" => NoticeKind::Hint,
                _ => continue,
            };
            if !e.resources.is_empty()
                && let Some(name) = self.vm_name().await
                && !e.resources.iter().any(|r| r.eq_ignore_ascii_case(name))
            {
                debug!(event = %e.event_id, resources = ?e.resources, "scheduled event for another VM");
                continue;
            }
            let detail = format!("scheduled event {} ({})", e.event_type, e.event_status);
            let n = match kind {
                NoticeKind::Terminate => {
                    // NotBefore is blank once the event has Started.
                    let deadline = parse_http_date(&e.not_before)
                        .unwrap_or_else(|| SystemTime::now() + Cloud::Azure.default_warning());
                    Notice::terminate(SOURCE, deadline, detail)
                }
                NoticeKind::Hint => Notice::hint(SOURCE, detail),
            };
            out.push(n.with_event_id(e.event_id));
        }
        Ok(out)
    }
}

impl NoticeSource for Azure {
    fn source(&self) -> Source {
        SOURCE
    }

    fn identity(&self) -> BoxFuture<'_, crate::Identity> {
        Box::pin(async {
            let Ok(resp) = self.get(INSTANCE_PATH).await else {
                return crate::Identity::default();
            };
            let doc: serde_json::Value = resp.json().await.unwrap_or_default();
            let c = &doc["compute"];
            let text = |k: &str| c[k].as_str().filter(|v| !v.is_empty()).map(str::to_owned);
            let zone = match (text("location"), text("zone")) {
                (Some(l), Some(z)) => Some(format!("{l}-{z}")),
                (l, z) => z.or(l),
            };
            crate::Identity {
                instance_id: text("vmId"),
                instance_type: text("vmSize"),
                zone,
                // `Spot`, `Regular` or `Low`.
                lifecycle: text("priority").map(|p| {
                    if p.eq_ignore_ascii_case("regular") {
                        "on-demand"
                    } else {
                        "spot"
                    }
                    .to_owned()
                }),
            }
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            let Ok(resp) = self.get(INSTANCE_PATH).await else {
                return false;
            };
            resp.status() == StatusCode::OK
                && resp
                    .json::<serde_json::Value>()
                    .await
                    .is_ok_and(|v| v.get("compute").is_some())
        })
    }

    fn watch(self: Arc<Self>, tx: mpsc::Sender<Notice>) -> BoxFuture<'static, ()> {
        let interval = self.interval;
        Box::pin(poll(self, SOURCE, interval, tx))
    }

    fn acknowledge<'a>(&'a self, notice: &'a Notice) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let Some(id) = notice.event_id.as_deref() else {
                return Ok(());
            };
            let url = self.url(EVENTS_PATH);
            let body = serde_json::json!({ "StartRequests": [{ "EventId": id }] });
            let req = self
                .client
                .post(&url)
                .header("Metadata", "true")
                .json(&body);
            let resp = http::send(req, &url).await?;
            match resp.status() {
                StatusCode::OK => Ok(()),
                s => Err(Error::Status {
                    url,
                    status: s.as_u16(),
                    hint: "",
                }),
            }
        })
    }
}
