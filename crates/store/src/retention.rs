//! Retention: keep the newest N committed checkpoints, delete the rest, and the data nothing
//! references any more (including what crashed uploads left).

use std::collections::HashSet;

use futures::TryStreamExt;
use object_store::ObjectStoreExt;
use tracing::debug;

use crate::{Error, JobStore};

/// What retention deleted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionReport {
    pub deleted_checkpoints: Vec<u64>,
    pub deleted_objects: usize,
}

impl JobStore {
    /// Keeps the newest `keep` committed checkpoints (never fewer than one).
    ///
    /// Manifests go first, so no reader ever finds a manifest whose data is gone; then every
    /// data object that no kept manifest references, up to the newest committed sequence
    /// number (anything newer may be an upload in progress).
    pub async fn retain(&self, keep: usize) -> Result<RetentionReport, Error> {
        let committed = self.committed().await?;
        let Some(newest) = committed.last().map(|m| m.seq) else {
            return Ok(RetentionReport::default());
        };
        let cut = committed.len().saturating_sub(keep.max(1));
        let (old, kept) = committed.split_at(cut);
        let mut report = RetentionReport::default();
        for m in old {
            match self.inner().delete(&self.layout().manifest(m.seq)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                    report.deleted_checkpoints.push(m.seq)
                }
                Err(e) => return Err(self.error(&e)),
            }
        }
        let referenced: HashSet<&str> = kept
            .iter()
            .flat_map(|m| m.files.iter().map(|f| f.key.as_str()))
            .collect();
        let data: Vec<_> = self
            .inner()
            .list(Some(&self.layout().data()))
            .try_collect()
            .await
            .map_err(|e| self.error(&e))?;
        for meta in data {
            let rel = self.layout().relative(&meta.location);
            let settled = self
                .layout()
                .data_seq(&meta.location)
                .is_some_and(|s| s <= newest);
            if settled && !referenced.contains(rel.as_str()) {
                debug!(key = %meta.location, "deleting unreferenced data");
                match self.inner().delete(&meta.location).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                        report.deleted_objects += 1
                    }
                    Err(e) => return Err(self.error(&e)),
                }
            }
        }
        Ok(report)
    }
}
