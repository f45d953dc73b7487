//! Finds every descendant of a process by walking `/proc`.
//!
//! Daemons leave the command's process group (`setsid`), so signalling the group is not
//! enough to stop everything the command started. As a subreaper every orphan in the tree is
//! re-parented to us, so the tree below our pid is exactly what the command left behind.

use std::collections::HashMap;
use std::fs;

use nix::unistd::Pid;

/// Every process in /proc: (pid, parent pid, state).
fn processes() -> Vec<(i32, i32, char)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<i32>().ok()?;
            // A process may exit between read_dir and this read: skip it.
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (ppid, state) = parse_stat(&stat)?;
            Some((pid, ppid, state))
        })
        .collect()
}

/// Every live descendant of `root` (not `root` itself), parents before children; spotguard's
/// own helpers and what they started are not the command's and are left out.
pub(crate) fn of(root: Pid) -> Vec<Pid> {
    let helpers = crate::helpers::registry().clone();
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (pid, ppid, state) in processes() {
        // Zombies are already dead: they only need reaping, not signals.
        if state != 'Z' && !helpers.contains(&pid) {
            children.entry(ppid).or_default().push(pid);
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

/// The direct children of `root`, zombies included (they are the ones to reap).
pub(crate) fn children(root: Pid) -> Vec<Pid> {
    processes()
        .into_iter()
        .filter(|&(_, ppid, _)| ppid == root.as_raw())
        .map(|(pid, _, _)| Pid::from_raw(pid))
        .collect()
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
