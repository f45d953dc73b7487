//! The job's local state dir: what spotguard tells the command through files.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use spotguard_notice::Notice;

use crate::Error;

/// `<state root>/jobs/<job>/`, holding `notice.json`.
#[derive(Debug)]
pub struct StateDir {
    path: PathBuf,
}

impl StateDir {
    /// Creates the job's dir and removes a notice left by an earlier run, so the command never
    /// mistakes an old preemption for a new one.
    pub fn prepare(root: &Path, job: &str) -> Result<Self, Error> {
        let path = root.join("jobs").join(job);
        let err = |source| Error::StateDir {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(&path).map_err(err)?;
        match fs::remove_file(path.join("notice.json")) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        Ok(StateDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the command finds the notice (`SPOTGUARD_NOTICE_FILE`); absent until one comes.
    pub fn notice_file(&self) -> PathBuf {
        self.path.join("notice.json")
    }

    /// Writes `notice.json` atomically: the command never reads half a notice.
    pub fn write_notice(&self, notice: &Notice) -> io::Result<()> {
        let tmp = self.path.join(".notice.json.tmp");
        let mut f = fs::File::create(&tmp)?;
        let mut body = serde_json::to_vec_pretty(&notice.to_json()).map_err(io::Error::other)?;
        body.push(b'\n');
        f.write_all(&body)?;
        f.sync_all()?;
        fs::rename(&tmp, self.notice_file())
    }
}
