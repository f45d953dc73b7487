#!/usr/bin/env bash
# Task-queue throughput: N trivial shards (`true`), W concurrent `spotguard run --queue`
# workers on this machine, against a local S3-compatible server on 127.0.0.1 (moto by
# default; SERVER=s3s-fs is faster but does not evaluate conditional writes atomically, so
# two workers may then run one shard) or the local-dir store (SERVER=local). Prints the drain
# time and shards (claims) per second. A benchmark, not a test.
#
# Each shard's command appends its id to a file, so runs of one shard by two workers (a
# double claim) are counted.
#
# With a server, everything runs in a private network namespace (unshare -n) whose loopback
# route has `quickack`: s3s-fs writes response headers and body in two segments without
# TCP_NODELAY, and the client's delayed ACK then holds every GET back ~40 ms (Nagle vs
# delayed ACK) -- a loopback artefact, not something a real S3 endpoint does.
#
#   SERVER=s3s-fs scripts/bench-queue.sh              # 10,000 shards, 64 workers
#   SHARDS=2000 WORKERS=64 SERVER=moto scripts/bench-queue.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${SERVER:-moto}" != local ] && [ -z "${IN_NETNS:-}" ] && unshare -n true 2>/dev/null; then
    cargo build --release --locked --quiet
    exec env IN_NETNS=1 unshare -n "$0" "$@"
fi
if [ -n "${IN_NETNS:-}" ]; then
    ip link set lo up
    ip route replace local 127.0.0.1 dev lo table local proto kernel scope host src 127.0.0.1 quickack 1
fi

SHARDS=${SHARDS:-10000}
WORKERS=${WORKERS:-64}
SERVER=${SERVER:-moto}
WORK=${WORK:-/var/tmp/spotguard-bench-queue}
PORT=${PORT:-18016}

cargo build --release --locked --quiet
SG=$PWD/target/release/spotguard
rm -rf "$WORK" && mkdir -p "$WORK"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret AWS_REGION=us-east-1 \
       AWS_ENDPOINT_URL=http://127.0.0.1:$PORT AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:9 \
       AWS_METADATA_ENDPOINT=http://127.0.0.1:9 SPOTGUARD_CLOUD=none
case $SERVER in
    moto)   python3 -m moto.server -H 127.0.0.1 -p "$PORT" >/dev/null 2>&1 & SRV=$!; STORE=s3://bench/q ;;
    s3s-fs) mkdir -p "$WORK/s3/bench"
            s3s-fs --host 127.0.0.1 --port "$PORT" --access-key bench --secret-key benchsecret "$WORK/s3" >/dev/null 2>&1 & SRV=$!
            STORE=s3://bench/q ;;
    local)  SRV=; STORE=$WORK/store ;;
esac
trap '[ -n "$SRV" ] && kill $SRV 2>/dev/null; true' EXIT
if [ -n "$SRV" ]; then
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
    if [ "$SERVER" = moto ]; then curl -s -X PUT "http://127.0.0.1:$PORT/bench" >/dev/null; fi
fi

SPOTGUARD_STATE_DIR=$WORK/setup "$SG" -q queue create --store "$STORE" --range "1..=$SHARDS" >/dev/null
start=$(date +%s.%N)
pids=()
for w in $(seq "$WORKERS"); do
    SPOTGUARD_STATE_DIR=$WORK/w$w "$SG" -q run --queue --no-resume --store "$STORE" -- \
        sh -c 'echo "$SPOTGUARD_SHARD_ID" >> "$0"' "$WORK/ran" &
    pids+=($!)
done
wait "${pids[@]}"     # the workers, not the server
end=$(date +%s.%N)
SPOTGUARD_STATE_DIR=$WORK/setup "$SG" queue status --store "$STORE" | head -1
runs=$(wc -l < "$WORK/ran"); unique=$(sort -u "$WORK/ran" | wc -l)
echo "shard runs: $runs, distinct shards run: $unique, double claims: $((runs - unique))"
awk -v a="$start" -v b="$end" -v n="$SHARDS" -v w="$WORKERS" -v s="$SERVER" \
    'BEGIN { printf "%d shards, %d workers, %s: drained in %.1f s, %.1f shards (claims) per second\n", n, w, s, b - a, n / (b - a) }'
