# Sourced by the prepared GPU scripts: `step NAME LIMIT_S COMMAND...` runs a step under the time left before
# $DEADLINE (counted from $START), appends its JSON lines to $JSONL tagged with the step, logs to $LOG, and
# sets status=1 when a step fails. Steps not named in $STEPS are skipped.
status=0
step() {
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local left=$((DEADLINE - ($(date +%s) - START)))
    if ((left < 30)); then
        echo "== $name: skipped (${left} s left before the deadline)" | tee -a "$LOG"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
    local t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.out" 2>>"$LOG"
    local rc=$?
    cat "$OUT/$name.out" | tee -a "$LOG"
    grep '^{' "$OUT/$name.out" | sed "s/^{/{\"step\": \"$name\", /" >>"$JSONL"
    echo "== $name: rc=$rc in $(($(date +%s) - t0)) s" | tee -a "$LOG"
    rm -f "$OUT/$name.out"
    ((rc == 0)) || status=1
}
