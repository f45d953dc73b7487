//! spotguard's own helper processes keep their exit status while the supervisor reaps
//! everything else with `waitpid`.

use std::process::Command;
use std::time::Duration;

use spotguard_supervise::{ProcessEnd, Supervisor, run_helper};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_leaves_helpers_to_their_owner() {
    // The command keeps exiting grandchildren (zombies to reap) while helpers come and go.
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "for i in 1 2 3 4 5 6 7 8 9 10; do sh -c 'exit 0' & sleep 0.05; done; wait; exit 3",
    ]);
    let mut sup = Supervisor::spawn(cmd).expect("spawn");
    let helpers = tokio::spawn(async {
        let mut codes = Vec::new();
        for i in 0..20 {
            let mut h = tokio::process::Command::new("sh");
            h.args(["-c", &format!("exit {}", 10 + i)]);
            let out = run_helper(h)
                .await
                .expect("the helper's status, not ECHILD");
            codes.push(out.status.code());
        }
        codes
    });
    let end = tokio::time::timeout(Duration::from_secs(20), sup.wait())
        .await
        .expect("the command ends");
    assert_eq!(end, ProcessEnd::Exited(3));
    let codes = tokio::time::timeout(Duration::from_secs(20), helpers)
        .await
        .expect("helpers end")
        .expect("no panic");
    assert_eq!(codes, (10..30).map(Some).collect::<Vec<_>>());
    sup.finish(nix::sys::signal::Signal::SIGTERM, Duration::from_secs(1))
        .await;
}
