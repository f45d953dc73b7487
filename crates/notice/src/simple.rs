//! The clouds that publish one termination time: Alibaba Cloud ECS, Tencent Cloud CVM and
//! Volcengine. Each answers 404 (or an empty body) while nothing is pending.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;

use crate::imds::{ALIYUN_TOKEN, Imds};
use crate::poll::{Check, poll};
use crate::time::{parse_utc, parse_utc8};
use crate::{BoxFuture, Cloud, Error, Notice, NoticeSource, Source, WatchOptions};

#[derive(Debug)]
pub(crate) struct TerminationTime {
    cloud: Cloud,
    imds: Imds,
    path: &'static str,
    parse: fn(&str) -> Option<SystemTime>,
    interval: Duration,
}

impl TerminationTime {
    pub(crate) fn new(cloud: Cloud, base: String, opts: &WatchOptions) -> Self {
        let (path, parse, imds): (_, fn(&str) -> Option<SystemTime>, _) = match cloud {
            // Hardened mode needs a token; plain mode works without: try the token, fall back.
            Cloud::Aliyun => (
                "latest/meta-data/instance/spot/termination-time",
                parse_utc,
                Imds::new(base, Some(ALIYUN_TOKEN), true),
            ),
            // Beijing time, not ISO 8601.
            Cloud::Tencent => (
                "latest/meta-data/spot/termination-time",
                parse_utc8,
                Imds::new(base, None, true),
            ),
            Cloud::Volcengine => (
                "latest/spot_instance_termination_time",
                parse_utc,
                Imds::new(base, None, true),
            ),
            other => unreachable!("{other} has a source of its own"),
        };
        TerminationTime {
            cloud,
            imds,
            path,
            parse,
            interval: opts.poll_interval,
        }
    }
}

impl Check for TerminationTime {
    async fn check(&self) -> Result<Vec<Notice>, Error> {
        let Some(body) = self.imds.get(self.path).await? else {
            return Ok(Vec::new());
        };
        let body = body.trim();
        if body.is_empty() {
            return Ok(Vec::new());
        }
        let deadline = (self.parse)(body).ok_or_else(|| Error::Body {
            url: self.imds.url(self.path),
            reason: format!("not a time: {body:?}"),
        })?;
        Ok(vec![
            Notice::terminate(
                Source::Cloud(self.cloud),
                deadline,
                format!("termination time {body}"),
            )
            .with_event_id(body.to_owned()),
        ])
    }
}

impl NoticeSource for TerminationTime {
    fn source(&self) -> Source {
        Source::Cloud(self.cloud)
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            match self.cloud {
                // Volcengine documents no identity path: any answer from its address will do.
                Cloud::Volcengine => self.imds.get(self.path).await.is_ok(),
                _ => matches!(
                    self.imds.get("latest/meta-data/instance-id").await,
                    Ok(Some(_))
                ),
            }
        })
    }

    fn identity(&self) -> BoxFuture<'_, crate::Identity> {
        Box::pin(async move {
            let get = |key: &'static str| self.imds.meta_value(key);
            match self.cloud {
                Cloud::Aliyun => {
                    let (instance_id, instance_type, zone) = tokio::join!(
                        get("instance-id"),
                        get("instance/instance-type"),
                        get("zone-id"),
                    );
                    crate::Identity {
                        instance_id,
                        instance_type,
                        zone,
                        lifecycle: None,
                    }
                }
                Cloud::Tencent => {
                    let (instance_id, zone, charge) = tokio::join!(
                        get("instance-id"),
                        get("placement/zone"),
                        get("payment/charge-type"),
                    );
                    crate::Identity {
                        instance_id,
                        instance_type: None,
                        zone,
                        // SPOTPAID, POSTPAID_BY_HOUR, PREPAID.
                        lifecycle: charge
                            .map(|c| if c == "SPOTPAID" { "spot" } else { "on-demand" }.to_owned()),
                    }
                }
                _ => crate::Identity::default(),
            }
        })
    }

    fn watch(self: Arc<Self>, tx: mpsc::Sender<Notice>) -> BoxFuture<'static, ()> {
        let interval = self.interval;
        let source = self.source();
        Box::pin(poll(self, source, interval, tx))
    }
}
