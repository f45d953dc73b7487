//! Real S3-compatible servers for tests, on 127.0.0.1 only: `moto` (enforces conditional
//! writes, does not check signatures) and `s3s-fs` (checks signatures and conditional writes;
//! a key `a` and a key `a/b` cannot coexist). `scripts/test` installs both; a test that needs
//! one fails loudly when it is missing rather than skipping.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

/// How long a server may take to start.
const START_TIMEOUT: Duration = Duration::from_secs(30);

pub const ACCESS_KEY: &str = "spotguard-test-key";
pub const SECRET_KEY: &str = "spotguard-test-secret";
pub const BUCKET: &str = "spotguard-test";

/// Which server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Moto,
    S3sFs,
}

/// A running S3-compatible server with one bucket; killed on drop.
#[derive(Debug)]
pub struct S3Server {
    pub kind: Kind,
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl S3Server {
    pub fn start(kind: Kind) -> S3Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = S3Server {
            kind,
            child: None,
            port: 0,
            dir,
        };
        s.port = free_port();
        s.spawn();
        match kind {
            Kind::Moto => {
                let (status, body) = http(
                    &format!("127.0.0.1:{}", s.port),
                    "PUT",
                    &format!("/{BUCKET}"),
                    "",
                );
                assert!(status < 300, "moto: create bucket: {status} {body}");
            }
            Kind::S3sFs => {
                std::fs::create_dir_all(s.dir.path().join("root").join(BUCKET)).expect("bucket dir")
            }
        }
        s
    }

    pub fn moto() -> S3Server {
        S3Server::start(Kind::Moto)
    }

    pub fn s3s_fs() -> S3Server {
        S3Server::start(Kind::S3sFs)
    }

    fn spawn(&mut self) {
        let port = self.port.to_string();
        let (mut cmd, ready) = match self.kind {
            Kind::Moto => {
                let mut c = Command::new("python3");
                c.args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port]);
                (c, "Running on")
            }
            Kind::S3sFs => {
                let root = self.dir.path().join("root");
                std::fs::create_dir_all(&root).expect("s3s-fs root");
                let mut c = Command::new("s3s-fs");
                c.args([
                    "--host",
                    "127.0.0.1",
                    "--port",
                    &port,
                    "--access-key",
                    ACCESS_KEY,
                    "--secret-key",
                    SECRET_KEY,
                ])
                .arg(&root)
                .env("RUST_LOG", "info");
                (c, "server is running")
            }
        };
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {:?} ({e}); scripts/test installs it",
                    self.kind
                )
            });
        let (tx, rx) = mpsc::channel();
        for pipe in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let tx = tx.clone();
            thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    if line.contains(ready) {
                        let _ = tx.send(());
                    }
                }
            });
        }
        if rx.recv_timeout(START_TIMEOUT).is_err() {
            let _ = child.kill();
            panic!("{:?} did not start within {START_TIMEOUT:?}", self.kind);
        }
        self.child = Some(child);
    }

    /// Stops the server (a network failure, as seen from a client).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port. moto forgets everything; s3s-fs keeps its files.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
        if self.kind == Kind::Moto {
            let (status, body) = http(
                &format!("127.0.0.1:{}", self.port),
                "PUT",
                &format!("/{BUCKET}"),
                "",
            );
            assert!(status < 300, "moto: create bucket: {status} {body}");
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `s3://<bucket>/<prefix>`
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{BUCKET}/{prefix}")
    }

    /// `object_store` settings for this server.
    pub fn store_options(&self) -> Vec<(String, String)> {
        [
            ("aws_endpoint", self.endpoint()),
            ("aws_access_key_id", ACCESS_KEY.to_owned()),
            ("aws_secret_access_key", SECRET_KEY.to_owned()),
            ("aws_region", "us-east-1".to_owned()),
            ("allow_http", "true".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Environment variables that point the `spotguard` binary (and the AWS CLI) here.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.to_owned()),
            ("AWS_REGION", "us-east-1".to_owned()),
            // Never let a credential lookup reach a real instance metadata address.
            (
                "AWS_EC2_METADATA_SERVICE_ENDPOINT",
                "http://127.0.0.1:9".to_owned(),
            ),
            ("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9".to_owned()),
        ]
    }

    /// Where s3s-fs keeps the bucket's files.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A minimal unsigned HTTP/1.0 request to `addr` (`host:port`): the fake cloud's control
/// endpoints, and moto's bucket creation. Returns the status and the body.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
