use std::fmt;

use nix::sys::signal::Signal;

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEnd {
    /// It called `exit` with this code.
    Exited(i32),
    /// A signal killed it.
    Signalled { signal: Signal, core_dumped: bool },
}

impl ProcessEnd {
    /// The status a shell would report: the code itself, or 128 + the signal number.
    pub fn exit_code(self) -> u8 {
        match self {
            // exit(2) keeps only the low 8 bits, so this never truncates a real status.
            ProcessEnd::Exited(code) => (code & 0xff) as u8,
            ProcessEnd::Signalled { signal, .. } => 128u8.wrapping_add(signal as i32 as u8),
        }
    }

    /// True for `exit(0)`.
    pub fn success(self) -> bool {
        self == ProcessEnd::Exited(0)
    }
}

impl fmt::Display for ProcessEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProcessEnd::Exited(code) => write!(f, "exited with code {code}"),
            ProcessEnd::Signalled {
                signal,
                core_dumped: true,
            } => {
                write!(f, "killed by {signal} (core dumped)")
            }
            ProcessEnd::Signalled { signal, .. } => write!(f, "killed by {signal}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        assert_eq!(ProcessEnd::Exited(0).exit_code(), 0);
        assert_eq!(ProcessEnd::Exited(255).exit_code(), 255);
        let killed = ProcessEnd::Signalled {
            signal: Signal::SIGKILL,
            core_dumped: false,
        };
        assert_eq!(killed.exit_code(), 137);
        assert_eq!(killed.to_string(), "killed by SIGKILL");
        assert!(!killed.success());
        assert!(ProcessEnd::Exited(0).success());
    }
}
