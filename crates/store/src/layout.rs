//! Where things live in the store, under `<prefix>/<job>/` (see PROTOCOL.md):
//!
//! ```text
//! manifests/00000000000000000007.json       the commit point of checkpoint 7
//! data/00000000000000000007-<nonce>/<name>/<path>   its files, uploaded before the manifest
//! ```
//!
//! Manifests and data never share a key prefix with an object, so stores that map keys to
//! files (a key `a` and a key `a/b` cannot coexist there) hold the layout too.

use object_store::path::Path;

#[derive(Clone, Debug)]
pub struct Layout {
    job: Path,
}

const SEQ_WIDTH: usize = 20;

impl Layout {
    pub fn new(root: Path, job: &str) -> Self {
        Layout {
            job: root.join(job),
        }
    }

    /// `<prefix>/<job>`
    pub fn job(&self) -> &Path {
        &self.job
    }

    pub fn manifests(&self) -> Path {
        self.job.clone().join("manifests")
    }

    pub fn data(&self) -> Path {
        self.job.clone().join("data")
    }

    pub fn manifest(&self, seq: u64) -> Path {
        self.manifests().join(format!("{seq:0SEQ_WIDTH$}.json"))
    }

    /// The folder one upload's data goes to.
    pub fn data_dir(&self, seq: u64, nonce: &str) -> Path {
        self.data().join(format!("{seq:0SEQ_WIDTH$}-{nonce}"))
    }

    /// A key relative to the job prefix, as manifests record it.
    pub fn relative(&self, key: &Path) -> String {
        key.prefix_match(&self.job)
            .map(|parts| {
                parts
                    .map(|p| p.as_ref().to_owned())
                    .collect::<Vec<_>>()
                    .join("/")
            })
            .unwrap_or_else(|| key.to_string())
    }

    /// The full key of a relative one from a manifest.
    pub fn absolute(&self, relative: &str) -> Path {
        let mut p = self.job.clone();
        for part in relative.split('/') {
            p = p.join(part);
        }
        p
    }

    /// The sequence number of `manifests/<seq>.json`.
    pub fn manifest_seq(&self, key: &Path) -> Option<u64> {
        let name = key.filename()?;
        let under = key.prefix_match(&self.manifests())?.count() == 1;
        let digits = name.strip_suffix(".json")?;
        (under && digits.len() == SEQ_WIDTH)
            .then(|| digits.parse().ok())
            .flatten()
    }

    /// The sequence number of `data/<seq>-<nonce>` (or any key under it).
    pub fn data_seq(&self, key: &Path) -> Option<u64> {
        let first = key.prefix_match(&self.data())?.next()?;
        first.as_ref().split_once('-')?.0.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        let l = Layout::new(Path::from("jobs"), "llama");
        assert_eq!(
            l.manifest(7).to_string(),
            "jobs/llama/manifests/00000000000000000007.json"
        );
        assert_eq!(l.manifest_seq(&l.manifest(7)), Some(7));
        let d = l.data_dir(7, "ab12").join("step-1").join("w.bin");
        assert_eq!(l.data_seq(&d), Some(7));
        assert_eq!(
            l.relative(&d),
            "data/00000000000000000007-ab12/step-1/w.bin"
        );
        assert_eq!(l.absolute(&l.relative(&d)), d);
        assert_eq!(
            l.manifest_seq(&Path::from("jobs/llama/manifests/x.json")),
            None
        );
    }
}
