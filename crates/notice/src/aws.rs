//! AWS EC2 through IMDSv2: spot interruptions, rebalance recommendations and scheduled
//! maintenance. https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use tokio::sync::mpsc;

use crate::imds::{AWS_TOKEN, Imds};
use crate::poll::{Check, poll};
use crate::time::{parse_aws_event_time, parse_utc};
use crate::{BoxFuture, Cloud, Error, Notice, NoticeSource, Source, WatchOptions};

const INSTANCE_ACTION: &str = "latest/meta-data/spot/instance-action";
const REBALANCE: &str = "latest/meta-data/events/recommendations/rebalance";
const SCHEDULED: &str = "latest/meta-data/events/maintenance/scheduled";

/// A scheduled stop or retirement becomes a Terminate notice this long before it is due;
/// before that it is a hint.
const MAINTENANCE_LEAD: Duration = Duration::from_secs(10 * 60);

const SOURCE: Source = Source::Cloud(Cloud::Aws);

/// True when `AWS_EC2_METADATA_DISABLED=true`, as the AWS SDKs honour it.
pub(crate) fn disabled_by_env() -> bool {
    std::env::var("AWS_EC2_METADATA_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
}

#[derive(Debug)]
pub(crate) struct Aws {
    imds: Imds,
    interval: Duration,
}

impl Aws {
    pub(crate) fn new(base: String, opts: &WatchOptions) -> Self {
        Aws {
            imds: Imds::new(base, Some(AWS_TOKEN), opts.imdsv1_fallback),
            interval: opts.poll_interval,
        }
    }
}

#[derive(Deserialize)]
struct InstanceAction {
    action: String,
    time: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Rebalance {
    notice_time: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ScheduledEvent {
    code: String,
    #[serde(default)]
    event_id: String,
    #[serde(default)]
    not_before: String,
    #[serde(default)]
    state: String,
}

fn body_error(url: String, e: serde_json::Error) -> Error {
    Error::Body {
        url,
        reason: e.to_string(),
    }
}

impl Check for Aws {
    async fn check(&self) -> Result<Vec<Notice>, Error> {
        let mut out = Vec::new();
        if let Some(body) = self.imds.get(INSTANCE_ACTION).await? {
            let a: InstanceAction = serde_json::from_str(&body)
                .map_err(|e| body_error(self.imds.url(INSTANCE_ACTION), e))?;
            let deadline = parse_utc(&a.time)
                .unwrap_or_else(|| SystemTime::now() + Cloud::Aws.default_warning());
            out.push(
                Notice::terminate(
                    SOURCE,
                    deadline,
                    format!("spot instance-action: {}", a.action),
                )
                .with_event_id(format!("instance-action:{}:{}", a.action, a.time)),
            );
        }
        if let Some(body) = self.imds.get(REBALANCE).await? {
            let r: Rebalance =
                serde_json::from_str(&body).map_err(|e| body_error(self.imds.url(REBALANCE), e))?;
            out.push(
                Notice::hint(
                    SOURCE,
                    format!("rebalance recommendation at {}", r.notice_time),
                )
                .with_event_id(format!("rebalance:{}", r.notice_time)),
            );
        }
        if let Some(body) = self.imds.get(SCHEDULED).await? {
            let events: Vec<ScheduledEvent> =
                serde_json::from_str(&body).map_err(|e| body_error(self.imds.url(SCHEDULED), e))?;
            out.extend(events.iter().filter_map(maintenance_notice));
        }
        Ok(out)
    }
}

/// A scheduled `instance-stop` or `instance-retirement` ends the machine; other codes
/// (reboots) do not take it away.
fn maintenance_notice(e: &ScheduledEvent) -> Option<Notice> {
    if !matches!(e.code.as_str(), "instance-stop" | "instance-retirement")
        || matches!(e.state.as_str(), "Completed" | "Canceled")
    {
        return None;
    }
    let at = parse_aws_event_time(&e.not_before)?;
    let detail = format!("scheduled {} at {}", e.code, e.not_before);
    let due_soon = at
        .duration_since(SystemTime::now())
        .map_or(true, |left| left <= MAINTENANCE_LEAD);
    Some(if due_soon {
        Notice::terminate(SOURCE, at, detail)
            .with_event_id(format!("maintenance:{}:terminate", e.event_id))
    } else {
        Notice::hint(SOURCE, detail).with_event_id(format!("maintenance:{}:hint", e.event_id))
    })
}

impl NoticeSource for Aws {
    fn source(&self) -> Source {
        SOURCE
    }

    fn identity(&self) -> BoxFuture<'_, crate::Identity> {
        Box::pin(async move {
            let get = |key: &'static str| self.imds.meta_value(key);
            let (instance_id, instance_type, zone, lifecycle) = tokio::join!(
                get("instance-id"),
                get("instance-type"),
                get("placement/availability-zone"),
                get("instance-life-cycle"),
            );
            crate::Identity {
                instance_id,
                instance_type,
                zone,
                // IMDS says `spot`, `on-demand` or `scheduled`.
                lifecycle,
            }
        })
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            match self.imds.fetch_token().await {
                Ok(_) => true,
                // IMDSv1-only instances: only when the user allowed reading without a token.
                Err(_) if self.imds_plain_allowed() => {
                    matches!(
                        self.imds.get("latest/meta-data/instance-id").await,
                        Ok(Some(_))
                    )
                }
                Err(_) => false,
            }
        })
    }

    fn watch(self: Arc<Self>, tx: mpsc::Sender<Notice>) -> BoxFuture<'static, ()> {
        let interval = self.interval;
        Box::pin(poll(self, SOURCE, interval, tx))
    }
}

impl Aws {
    fn imds_plain_allowed(&self) -> bool {
        self.imds.plain_allowed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(code: &str, not_before: SystemTime, state: &str) -> ScheduledEvent {
        ScheduledEvent {
            code: code.into(),
            event_id: "instance-event-1".into(),
            not_before: humantime::format_rfc3339_seconds(not_before).to_string(),
            state: state.into(),
        }
    }

    #[test]
    fn maintenance_far_away_is_a_hint_and_near_is_terminate() {
        let now = SystemTime::now();
        let far = maintenance_notice(&event(
            "instance-stop",
            now + Duration::from_secs(86_400),
            "active",
        ));
        assert_eq!(far.map(|n| n.kind), Some(crate::NoticeKind::Hint));
        let near = maintenance_notice(&event(
            "instance-retirement",
            now + Duration::from_secs(60),
            "active",
        ));
        assert_eq!(near.map(|n| n.kind), Some(crate::NoticeKind::Terminate));
        assert!(maintenance_notice(&event("system-reboot", now, "active")).is_none());
        assert!(maintenance_notice(&event("instance-stop", now, "Canceled")).is_none());
    }
}
