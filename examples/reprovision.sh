#!/usr/bin/env bash
# A relaunch loop for spot machines: run on whatever machine this is, and on a preemption
# (spotguard exits 75) ask for a new one, until the job is completed. The store is the only
# thing the machines share.
#
#   JOB=llama-ft STORE=s3://bucket/jobs examples/reprovision.sh python train.py
set -uo pipefail
: "${JOB:?set JOB}" "${STORE:?set STORE}"

while :; do
    # Done already? (0 completed, 4 not yet, anything else: cannot tell, stop and look)
    spotguard status --store "$STORE" --job "$JOB" >/dev/null
    case $? in
        0) echo "job $JOB is completed"; exit 0 ;;
        4) ;;
        *) echo "cannot read the status of $JOB" >&2; exit 1 ;;
    esac

    # `spotguard run` restores the newest complete checkpoint itself; this only shows where
    # the job stands (0 restored, 3 nothing yet).
    if out=$(spotguard resume --store "$STORE" --job "$JOB" --print-env); then
        eval "$out"
        echo "resuming $JOB from checkpoint #$SPOTGUARD_RESUME_SEQ ($SPOTGUARD_RESUME_NAME)"
    elif [ $? -eq 3 ]; then
        echo "starting $JOB from scratch"
    fi

    spotguard run --store "$STORE" --job "$JOB" --restart on-failure --max-restarts 3 -- "$@"
    code=$?
    case $code in
        0) echo "job $JOB finished"; exit 0 ;;
        75) echo "preempted: the machine is going away; relaunch on a new one"
            # e.g. request a new spot machine here (aws ec2 run-instances ..., gcloud ...),
            # passing it this same script; this machine ends now.
            exit 75 ;;
        74) echo "the last checkpoint did not reach the store" >&2; exit 74 ;;
        *) echo "the job failed with $code" >&2; exit "$code" ;;
    esac
done
