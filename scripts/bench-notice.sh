#!/usr/bin/env bash
# Notice -> committed: how long after a SIGTERM a 1 GiB checkpoint that was not yet uploaded
# is committed in the store (local s3s-fs on 127.0.0.1). With SHAPE=1gbit the server and
# spotguard run in a private network namespace whose loopback is shaped by a tbf qdisc
# (netem is absent from this kernel), to see the time over a 1 Gbit/s link.
# A benchmark, not a test: CI does not run it. Needs root for the namespace.
#
#   scripts/bench-notice.sh                 # unshaped loopback
#   SHAPE=1gbit scripts/bench-notice.sh
set -euo pipefail
cd "$(dirname "$0")/.."

SIZE_MIB=${SIZE_MIB:-1024}
SHAPE=${SHAPE:-}
WORK=${WORK:-/var/tmp/spotguard-notice}
PORT=${PORT:-18015}

command -v s3s-fs >/dev/null || cargo install s3s-fs --version 0.14.1 --features binary --locked
cargo build --release --locked --quiet
SG=$PWD/target/release/spotguard

run_in=()
if [ -n "$SHAPE" ]; then
    ns=spotguard-bench-$$
    ip netns add "$ns"
    trap 'ip netns del '"$ns"' 2>/dev/null || true' EXIT
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$SHAPE" burst 4mbit latency 100ms
    run_in=(ip netns exec "$ns")
fi

rm -rf "$WORK" && mkdir -p "$WORK/s3/bench" "$WORK/cd"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret AWS_REGION=us-east-1 \
       AWS_ENDPOINT_URL=http://127.0.0.1:$PORT AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:9 \
       AWS_METADATA_ENDPOINT=http://127.0.0.1:9 SPOTGUARD_STATE_DIR=$WORK/state SPOTGUARD_CLOUD=none
"${run_in[@]}" s3s-fs --host 127.0.0.1 --port "$PORT" --access-key bench --secret-key benchsecret "$WORK/s3" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; [ -n "${ns:-}" ] && ip netns del "$ns" 2>/dev/null || true' EXIT
for _ in $(seq 100); do "${run_in[@]}" bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT" 2>/dev/null && break; sleep 0.1; done

# The checkpoint exists on disk under a temporary name; the notice makes the command rename
# it into place, so none of it is uploaded before the notice.
mkdir -p "$WORK/cd/.big"
for i in 1 2 3 4; do head -c "$((SIZE_MIB / 4))M" /dev/urandom > "$WORK/cd/.big/shard-$i.bin"; done
sync

child='trap '"'"'mv "$SPOTGUARD_CHECKPOINT_DIR/.big" "$SPOTGUARD_CHECKPOINT_DIR/big"; exit 0'"'"' TERM; echo ready; while :; do sleep 1 & wait $!; done'
coproc SGRUN { "${run_in[@]}" "$SG" run --no-resume --grace 10m --store s3://bench/notice --job j \
    --checkpoint-dir "$WORK/cd" -- bash -c "$child" 2>"$WORK/log"; }
read -r line <&"${SGRUN[0]}"
[ "$line" = ready ] || { echo "unexpected: $line"; exit 1; }
start=$(date +%s.%N)
pkill -TERM -f -- "--job j --checkpoint-dir $WORK/cd" || kill -TERM "$SGRUN_PID"
wait "$SGRUN_PID" || true
end=$(date +%s.%N)
grep -E "stopped by a preemption notice|durable|NOT durable" "$WORK/log" || cat "$WORK/log"
awk -v a="$start" -v b="$end" -v s="$SIZE_MIB" -v shape="${SHAPE:-none}" \
    'BEGIN { printf "notice -> committed and exited: %.2f s for %d MiB (link shaping: %s)\n", b - a, s, shape }'
