//! The command line: bad input gets one clear line and the usage code; help lists exit codes;
//! logs are spotguard's own lines, human or JSON.

mod support;

use support::run_to_end;

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    let state = tempfile::tempdir().expect("tempdir");
    let cases: &[(&[&str], &str)] = &[
        (&["run"], "<CMD>"),
        (&["run", "--"], "<CMD>"),
        (&["run", "--no-such-flag", "--", "true"], "--no-such-flag"),
        (&["run", "--cloud", "mars", "--", "true"], "mars"),
        (&["run", "--grace", "3x", "--", "true"], "--grace"),
        (
            &["run", "--simulate-preemption", "soon", "--", "true"],
            "--simulate-preemption",
        ),
        (
            &["run", "--stop-signal", "KILL", "--", "true"],
            "SIGKILL cannot be caught",
        ),
        (&["run", "--job", "../etc", "--", "true"], "--job"),
        (
            &[
                "run",
                "--metadata-endpoint",
                "http://127.0.0.1:1",
                "--",
                "true",
            ],
            "--metadata-endpoint",
        ),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, names) in cases {
        let f = run_to_end(state.path(), args);
        assert_eq!(f.code(), 2, "{args:?}: {}", f.stderr);
        assert_eq!(
            f.stderr.lines().count(),
            1,
            "{args:?} gave more than one line:\n{}",
            f.stderr
        );
        assert!(
            f.stderr.contains(names),
            "{args:?}: the error does not name {names:?}: {}",
            f.stderr
        );
        assert!(f.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn help_lists_exit_codes_and_the_grace_default() {
    let state = tempfile::tempdir().expect("tempdir");
    let f = run_to_end(state.path(), &["--help"]);
    assert_eq!(f.code(), 0);
    for code in ["75", "126", "127", "128+N", "74"] {
        assert!(
            f.stdout.contains(code),
            "--help lacks exit code {code}:\n{}",
            f.stdout
        );
    }
    let f = run_to_end(state.path(), &["run", "--help"]);
    assert_eq!(f.code(), 0);
    assert!(f.stdout.contains("[default: 30s]"), "{}", f.stdout);
    assert!(f.stdout.contains("SPOTGUARD_NOTICE_FILE"), "{}", f.stdout);
}

#[test]
fn json_logs_are_one_object_per_line() {
    let state = tempfile::tempdir().expect("tempdir");
    let f = run_to_end(
        state.path(),
        &[
            "--log-format",
            "json",
            "run",
            "--",
            "sh",
            "-c",
            "echo out; exit 0",
        ],
    );
    assert_eq!(f.code(), 0);
    assert_eq!(f.stdout, "out");
    let lines: Vec<&str> = f.stderr.lines().collect();
    assert!(!lines.is_empty());
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
        assert!(
            v["target"]
                .as_str()
                .is_some_and(|t| t.starts_with("spotguard")),
            "{line}"
        );
    }
}

#[test]
fn human_logs_are_prefixed_and_quiet_silences_them() {
    let state = tempfile::tempdir().expect("tempdir");
    let f = run_to_end(state.path(), &["run", "--", "true"]);
    assert!(!f.stderr.is_empty());
    assert!(
        f.stderr.lines().all(|l| l.starts_with("[spotguard ")),
        "{}",
        f.stderr
    );
    let f = run_to_end(state.path(), &["-q", "run", "--", "true"]);
    assert_eq!(f.stderr, "", "-q leaves only warnings and errors");
}

#[test]
fn the_command_sees_its_environment_contract() {
    let state = tempfile::tempdir().expect("tempdir");
    let f = run_to_end(
        state.path(),
        &[
            "run",
            "--job",
            "llama-ft",
            "--",
            "sh",
            "-c",
            "echo $SPOTGUARD_JOB; echo $SPOTGUARD_NOTICE_FILE; echo $SPOTGUARD_STATE_DIR",
        ],
    );
    assert_eq!(f.code(), 0);
    let dir = state.path().join("jobs/llama-ft");
    let expected = format!(
        "llama-ft\n{}\n{}",
        dir.join("notice.json").display(),
        dir.display()
    );
    assert_eq!(f.stdout, expected);
}
