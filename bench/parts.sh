# Sourced by bench/single_gpu.sh and bench/eight_gpu.sh (they set $OUT): run one part of a GPU
# session with its own time limit, log it to $OUT/NAME.log and its exit status and last lines to
# $OUT/summary.txt, so that one slow part cannot take the others' results with it.
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))" | tee -a "$OUT/summary.txt"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $? ($(date +%T))" >> "$OUT/summary.txt"
    grep -v "^\s*$" "$OUT/$name.log" | tail -n "${PART_TAIL:-12}" | tee -a "$OUT/summary.txt"
}
