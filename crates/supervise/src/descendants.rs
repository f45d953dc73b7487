//! Finds every descendant of a process by walking `/proc`.
//!
//! Daemons leave the command's process group (`setsid`), so signalling the group is not
//! enough to stop everything the command started. As a subreaper every orphan in the tree is
//! re-parented to us, so the tree below our pid is exactly what the command left behind.

use std::collections::HashMap;
use std::fs;

use nix::unistd::Pid;

/// Every live descendant of `root` (not `root` itself), parents before children.
pub(crate) fn of(root: Pid) -> Vec<Pid> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // A process may exit between read_dir and this read: skip it.
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some((ppid, state)) = parse_stat(&stat) {
            // Zombies are already dead: they only need reaping, not signals.
            if state != 'Z' {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut out = Vec::new();
    let mut queue = vec![root.as_raw()];
    while let Some(parent) = queue.pop() {
        for &child in children.get(&parent).map(Vec::as_slice).unwrap_or_default() {
            out.push(Pid::from_raw(child));
            queue.push(child);
        }
    }
    out
}

/// The fields of `/proc/PID/stat` after the command name (proc(5)), state first. The name is
/// in parentheses and may itself contain spaces and parentheses, so fields are counted after
/// the last `)`.
fn stat_fields(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(stat[stat.rfind(')')? + 1..].split_whitespace())
}

/// Parent pid and state.
fn parse_stat(stat: &str) -> Option<(i32, char)> {
    let mut fields = stat_fields(stat)?;
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((ppid, state))
}

/// CPU clock ticks used by `pid`: user and system, its own and its waited-for children's
/// (utime, stime, cutime, cstime: the 12th to 15th fields after the name).
pub(crate) fn cpu_ticks(pid: Pid) -> u64 {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    stat_fields(&stat)
        .map(|f| {
            f.skip(11)
                .take(4)
                .filter_map(|v| v.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_command_names() {
        assert_eq!(parse_stat("42 (a) b) S 7 42 42 0"), Some((7, 'S')));
        assert_eq!(parse_stat("42 (sleep) Z 1 42 42 0"), Some((1, 'Z')));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn finds_own_children() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let found = of(nix::unistd::getpid());
        let pid = Pid::from_raw(child.id() as i32);
        child.kill().expect("kill sleep");
        child.wait().expect("wait sleep");
        assert!(found.contains(&pid), "{found:?} lacks {pid}");
    }
}
