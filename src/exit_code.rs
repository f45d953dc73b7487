//! Every exit status spotguard itself chooses, in one place. Anything else is the command's
//! own status passed through (128 + N when a signal N killed it).

/// Bad usage: an unknown flag, a bad value, no command.
pub const USAGE: u8 = 2;
/// `spotguard resume`: the job has no committed checkpoint yet (start fresh).
pub const NOTHING_TO_RESUME: u8 = 3;
/// `spotguard status`: the job is not completed yet (relaunch it).
pub const NOT_COMPLETED: u8 = 4;
/// spotguard could not set itself up (state dir, store, signal handlers).
pub const SETUP_FAILED: u8 = 70;
/// The final upload or commit failed: the newest checkpoint is not durable.
pub const UPLOAD_FAILED: u8 = 74;
/// A preemption notice (a cloud's, or SIGTERM/SIGINT to spotguard) stopped the command.
/// Relaunch on a new machine: the work resumes from the last checkpoint.
pub const PREEMPTED: u8 = 75;
/// The command exists but could not be executed (as in a shell).
pub const NOT_EXECUTABLE: u8 = 126;
/// The command was not found (as in a shell).
pub const NOT_FOUND: u8 = 127;

/// The table `--help` and README show.
pub const HELP: &str = "\
Exit status:
  N     the command's own exit status (0-255), passed through
  128+N the command was killed by signal N
  2     bad usage (unknown flag, bad value, no command)
  3     spotguard resume: the job has no checkpoint yet
  4     spotguard status: the job is not completed yet
  70    spotguard could not set itself up (state dir, store unreachable)
  74    the newest checkpoint could not be uploaded and committed
  75    a preemption notice stopped the command (relaunch to resume)
  126   the command could not be executed
  127   the command was not found";
