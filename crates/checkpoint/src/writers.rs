//! Which files are open for writing, from `/proc/<pid>/fd` and `fdinfo` (proc(5)): a file
//! still open for writing is not finished, whatever its name or age says.

use std::collections::HashSet;
use std::fs;
use std::path::Path;

/// The direct entries of `dir` under which some process has a file open for writing.
/// Processes this user cannot inspect are not seen.
pub fn entries_open_for_write(dir: &Path) -> HashSet<String> {
    let mut out = HashSet::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let name = p.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = fs::read_link(fd.path()) else {
                continue;
            };
            let Some(entry) = entry_of(dir, &target) else {
                continue;
            };
            if out.contains(&entry) {
                continue;
            }
            let info = fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ));
            if info.is_ok_and(|i| writable(&i)) {
                out.insert(entry);
            }
        }
    }
    out
}

/// The first component of `target` under `dir`.
fn entry_of(dir: &Path, target: &Path) -> Option<String> {
    let rel = target.strip_prefix(dir).ok()?;
    rel.components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
}

/// `flags:` in fdinfo is octal; the access mode is its low two bits (O_WRONLY 1, O_RDWR 2).
fn writable(fdinfo: &str) -> bool {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
        .is_some_and(|flags| flags & 0o3 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn sees_our_own_open_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("step-1")).expect("mkdir");
        let mut f = std::fs::File::create(dir.path().join("step-1/w.bin")).expect("create");
        f.write_all(b"x").expect("write");
        let root = dir.path().canonicalize().expect("canonical");
        assert!(entries_open_for_write(&root).contains("step-1"));
        drop(f);
        let _reader = std::fs::File::open(dir.path().join("step-1/w.bin")).expect("open");
        assert!(
            !entries_open_for_write(&root).contains("step-1"),
            "read-only opens do not count"
        );
    }

    #[test]
    fn fdinfo_flags() {
        assert!(writable("pos:\t0\nflags:\t0100001\n"));
        assert!(writable("flags:\t02\n"));
        assert!(!writable("flags:\t0100000\n"));
    }
}
