#!/usr/bin/env python3
"""A fake cloud metadata service for spotguard's tests, speaking each cloud's wire protocol
as documented (see shared/PROTOCOLS.md): paths, headers, token flow, status codes, bodies and
GCP's hanging GET. One cloud per process, on 127.0.0.1 only.

    python3 fakecloud.py --cloud aws [--hardened] [--port 0]

prints `listening 127.0.0.1:PORT` once it serves. Tests drive it through /_fake/ endpoints:

    POST /_fake/preempt        {"time": "..."}    the cloud's termination notice
    POST /_fake/rebalance                          AWS rebalance recommendation
    POST /_fake/maintenance    {...}               AWS scheduled event / GCP maintenance value
    POST /_fake/event          {...}               Azure: add a scheduled event as given
    POST /_fake/expire-tokens                      AWS/Aliyun: every issued token now gets 401
    GET  /_fake/log                                every request seen, and protocol violations
"""
import argparse
import datetime as dt
import json
import secrets
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def utc(seconds_from_now, fmt="%Y-%m-%dT%H:%M:%SZ", offset_hours=0):
    t = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds_from_now, hours=offset_hours)
    return t.strftime(fmt)


class State:
    def __init__(self, cloud, hardened):
        self.cloud = cloud
        self.hardened = hardened
        self.lock = threading.Condition()
        self.tokens = set()
        self.log = []
        self.violations = []
        self.acked = []
        # AWS
        self.instance_action = None
        self.rebalance = None
        self.scheduled = []
        # GCP: value and etag per path; waiters are woken on every change
        self.gcp = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE",
                    "instance/machine-type": "projects/123456/machineTypes/a2-highgpu-1g",
                    "instance/zone": "projects/123456/zones/us-central1-a",
                    "instance/scheduling/preemptible": "TRUE"}
        self.gcp_etag = {k: uuid.uuid4().hex[:16] for k in self.gcp}
        # Azure
        self.incarnation = 1
        self.events = []
        # Aliyun, Tencent, Volcengine
        self.termination_time = None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fakecloud"

    def log_message(self, *args):  # quiet: the test reads /_fake/log instead
        pass

    @property
    def st(self):
        return self.server.state

    def body_json(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw.strip() else {}

    def reply(self, status, body="", headers=None, ctype="text/plain"):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        if self.entry is not None:
            with self.st.lock:
                self.entry["status"] = status

    def record(self):
        self.entry = None
        if self.path.startswith("/_fake/"):
            return  # control calls are not part of the protocol log
        self.entry = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "status": None,
        }
        with self.st.lock:
            self.st.log.append(self.entry)

    def violation(self, what):
        with self.st.lock:
            self.st.violations.append(f"{self.command} {self.path}: {what}")

    # --- dispatch -------------------------------------------------------------------------

    def do_GET(self):
        self.handle_any()

    def do_PUT(self):
        self.handle_any()

    def do_POST(self):
        self.handle_any()

    def handle_any(self):
        self.record()
        url = urlsplit(self.path)
        if url.path.startswith("/_fake/"):
            return self.control(url.path[len("/_fake/"):])
        getattr(self, "cloud_" + self.st.cloud)(url.path, parse_qs(url.query))

    def control(self, what):
        st = self.st
        if what == "log" and self.command == "GET":
            with st.lock:
                body = json.dumps({"requests": st.log, "violations": st.violations, "acked": st.acked})
            self.send_response(200)
            data = body.encode()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        args = self.body_json()
        with st.lock:
            if what == "preempt":
                if st.cloud == "aws":
                    st.instance_action = {"action": args.get("action", "terminate"), "time": args.get("time", utc(120))}
                elif st.cloud == "gcp":
                    self.gcp_set("instance/preempted", "TRUE")
                elif st.cloud == "azure":
                    st.events.append({
                        "EventId": args.get("id", str(uuid.uuid4()).upper()),
                        "EventStatus": "Scheduled",
                        "EventType": args.get("type", "Preempt"),
                        "ResourceType": "VirtualMachine",
                        "Resources": args.get("resources", ["vm-spot"]),
                        "NotBefore": args.get("not_before", utc(30, "%a, %d %b %Y %H:%M:%S GMT")),
                        "Description": "",
                        "EventSource": "Platform",
                        "DurationInSeconds": -1,
                    })
                    st.incarnation += 1
                elif st.cloud == "tencent":
                    st.termination_time = args.get("time", utc(120, "%Y-%m-%d %H:%M:%S", offset_hours=8))
                else:
                    st.termination_time = args.get("time", utc(300))
            elif what == "rebalance":
                st.rebalance = {"noticeTime": args.get("time", utc(0))}
            elif what == "maintenance":
                if st.cloud == "gcp":
                    self.gcp_set("instance/maintenance-event", args.get("value", "TERMINATE_ON_HOST_MAINTENANCE"))
                else:
                    st.scheduled.append(args)
            elif what == "event":
                st.events.append(args)
                st.incarnation += 1
            elif what == "expire-tokens":
                st.tokens.clear()
            else:
                return self.reply(404, "no such control")
            st.lock.notify_all()
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def gcp_set(self, path, value):
        self.st.gcp[path] = value
        self.st.gcp_etag[path] = uuid.uuid4().hex[:16]

    # --- token flow shared by AWS IMDSv2 and Alibaba's hardened mode -----------------------

    def issue_token(self, ttl_header):
        ttl = self.headers.get(ttl_header)
        if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return self.reply(400, "bad ttl")
        if self.headers.get("X-Forwarded-For"):
            return self.reply(403, "forwarded token requests are refused")
        token = secrets.token_urlsafe(24)
        with self.st.lock:
            self.st.tokens.add(token)
        self.reply(200, token, {ttl_header: ttl})

    def token_ok(self, header):
        with self.st.lock:
            return self.headers.get(header) in self.st.tokens

    # --- AWS EC2 IMDSv2 --------------------------------------------------------------------

    def cloud_aws(self, path, _query):
        st = self.st
        if path == "/latest/api/token":
            if self.command != "PUT":
                return self.reply(405, "")
            return self.issue_token("X-aws-ec2-metadata-token-ttl-seconds")
        if self.command != "GET":
            return self.reply(405, "")
        if not self.token_ok("X-aws-ec2-metadata-token"):
            if "X-aws-ec2-metadata-token" not in self.headers:
                self.violation("GET without an IMDSv2 token")
            return self.reply(401, "")
        meta = path[len("/latest/meta-data/"):] if path.startswith("/latest/meta-data/") else None
        with st.lock:
            if meta == "instance-id":
                return self.reply(200, "i-0123456789abcdef0")
            identity = {"instance-type": "g5.xlarge", "placement/availability-zone": "us-east-1a",
                        "instance-life-cycle": "spot"}
            if meta in identity:
                return self.reply(200, identity[meta])
            if meta == "spot/instance-action" and st.instance_action:
                return self.reply(200, json.dumps(st.instance_action), ctype="application/json")
            if meta == "spot/termination-time" and st.instance_action:
                return self.reply(200, st.instance_action["time"])
            if meta == "events/recommendations/rebalance" and st.rebalance:
                return self.reply(200, json.dumps(st.rebalance), ctype="application/json")
            if meta == "events/maintenance/scheduled":
                return self.reply(200, json.dumps(st.scheduled), ctype="application/json")
        self.reply(404, "")

    # --- GCP -------------------------------------------------------------------------------

    def cloud_gcp(self, path, query):
        st = self.st
        if self.headers.get("Metadata-Flavor") != "Google" or self.headers.get("X-Forwarded-For"):
            return self.reply(403, "Missing Metadata-Flavor:Google header.")
        flavor = {"Metadata-Flavor": "Google"}
        prefix = "/computeMetadata/v1/"
        if not path.startswith(prefix) or self.command != "GET":
            return self.reply(404, "", flavor)
        key = path[len(prefix):]
        if key == "instance/id":
            return self.reply(200, "4567890123", flavor)
        if key not in st.gcp:
            return self.reply(404, "", flavor)
        wait = query.get("wait_for_change", ["false"])[0] == "true"
        last = query.get("last_etag", [None])[0]
        timeout = float(query.get("timeout_sec", ["300"])[0])
        with st.lock:
            if wait and (last is None or last == st.gcp_etag[key]):
                st.lock.wait_for(lambda: st.gcp_etag[key] != last if last else False, timeout)
            value, etag = st.gcp[key], st.gcp_etag[key]
        self.reply(200, value, dict(flavor, ETag=etag))

    # --- Azure Scheduled Events ------------------------------------------------------------

    def cloud_azure(self, path, query):
        st = self.st
        if self.headers.get("Metadata") != "true":
            return self.reply(400, json.dumps({"error": "Bad request. Required metadata header not specified"}))
        if "api-version" not in query:
            return self.reply(400, json.dumps({"error": "Bad request. api-version was not specified"}))
        if path == "/metadata/instance":
            return self.reply(200, json.dumps({"compute": {
                "name": "vm-spot", "vmId": "0000", "vmSize": "Standard_NC6s_v3",
                "location": "eastus", "zone": "1", "priority": "Spot"}}), ctype="application/json")
        if path == "/metadata/instance/compute/name":
            return self.reply(200, "vm-spot")
        if path != "/metadata/scheduledevents":
            return self.reply(404, "")
        if self.command == "POST":
            body = self.body_json()
            ids = [r.get("EventId") for r in body.get("StartRequests", [])]
            with st.lock:
                known = {e["EventId"] for e in st.events}
                if not ids or any(i not in known for i in ids):
                    return self.reply(400, "unknown EventId")
                st.acked.extend(ids)
                for e in st.events:
                    if e["EventId"] in ids:
                        e["EventStatus"], e["NotBefore"] = "Started", ""
                st.incarnation += 1
            return self.reply(200, "")
        with st.lock:
            doc = {"DocumentIncarnation": st.incarnation, "Events": st.events}
        self.reply(200, json.dumps(doc), ctype="application/json")

    # --- Alibaba, Tencent, Volcengine ------------------------------------------------------

    def termination(self, path, token_header=None):
        st = self.st
        if token_header and st.hardened and not self.token_ok(token_header):
            if token_header not in self.headers:
                self.violation("GET without a token in hardened mode")
            return self.reply(403, "")
        if path == "/latest/meta-data/instance-id":
            return self.reply(200, "i-fake")
        identity = {
            "aliyun": {"/latest/meta-data/instance/instance-type": "ecs.gn7i-c8g1.2xlarge",
                       "/latest/meta-data/zone-id": "cn-hangzhou-i"},
            "tencent": {"/latest/meta-data/placement/zone": "ap-guangzhou-3",
                        "/latest/meta-data/payment/charge-type": "SPOTPAID"},
        }.get(st.cloud, {})
        if path in identity:
            return self.reply(200, identity[path])
        with st.lock:
            t = st.termination_time
        if t is None:
            return self.reply(404, "")
        self.reply(200, t)

    def cloud_aliyun(self, path, _query):
        if path == "/latest/api/token" and self.command == "PUT":
            if not self.st.hardened:
                return self.reply(404, "")
            return self.issue_token("X-aliyun-ecs-metadata-token-ttl-seconds")
        if path in ("/latest/meta-data/instance-id", "/latest/meta-data/instance/spot/termination-time",
                    "/latest/meta-data/instance/instance-type", "/latest/meta-data/zone-id"):
            return self.termination(path, "X-aliyun-ecs-metadata-token")
        self.reply(404, "")

    def cloud_tencent(self, path, _query):
        if path in ("/latest/meta-data/instance-id", "/latest/meta-data/spot/termination-time",
                    "/latest/meta-data/placement/zone", "/latest/meta-data/payment/charge-type"):
            return self.termination(path)
        self.reply(404, "")

    def cloud_volcengine(self, path, _query):
        if path == "/latest/spot_instance_termination_time":
            return self.termination(path)
        self.reply(404, "")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cloud", required=True, choices=["aws", "gcp", "azure", "aliyun", "tencent", "volcengine"])
    p.add_argument("--hardened", action="store_true", help="Alibaba: require the metadata token")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    server.daemon_threads = True
    server.state = State(a.cloud, a.hardened)
    print(f"listening 127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
