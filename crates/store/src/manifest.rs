//! The manifest: the one object whose presence makes a checkpoint committed.

use serde::{Deserialize, Serialize};

/// Manifest format version; readers refuse newer ones rather than misread them.
pub const FORMAT: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A directory checkpoint (`checkpoint-500/`).
    Dir,
    /// A single-file checkpoint (`epoch=3.ckpt`).
    File,
}

/// Who committed a checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub hostname: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// Machine type (`g5.xlarge`, `a2-highgpu-1g`, `Standard_NC6s_v3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// `spot` or `on-demand`, when the metadata service says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<String>,
}

/// One file of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path inside the checkpoint, `/`-separated; empty for a single-file checkpoint.
    pub path: String,
    pub size: u64,
    /// Modification time, nanoseconds since the epoch (to find unchanged files).
    pub mtime_ns: i128,
    /// CRC-64/NVME of the content, 16 hex digits.
    pub crc64nvme: String,
    /// Where the bytes are, relative to the job prefix. An unchanged file points at the
    /// object an earlier checkpoint uploaded; retention keeps it while any manifest does.
    pub key: String,
}

/// A committed checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub job: String,
    pub seq: u64,
    /// The entry's name in the checkpoint dir.
    pub name: String,
    pub kind: EntryKind,
    /// The completion rule that judged it complete (see the checkpoint crate's rules).
    pub rule: String,
    /// Commit time, RFC 3339 UTC.
    pub created: String,
    pub instance: Instance,
    pub total_bytes: u64,
    pub files: Vec<FileEntry>,
}

impl Manifest {
    pub fn file_count(&self) -> usize {
        self.files.len()
    }
}
