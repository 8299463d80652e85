#!/usr/bin/env bash
# Runs every fuzz target (or the ones named as arguments) for FUZZ_SECONDS
# each, then prints a table of executions and results. Each target starts
# from its seeds in fuzz/corpus/<target>/ and adds what it finds there;
# crashes land in fuzz/artifacts/<target>/, logs in fuzz/logs/<target>.log.
#
#   FUZZ_SECONDS=600 fuzz/run.sh               # all targets, 10 min each
#   fuzz/run.sh dns_query hbone_connect        # just these
#   FUZZ_SANITIZER=address fuzz/run.sh         # with ASan (slower build and runs)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
# The targets are safe Rust: a panic is what they find, and a sanitizer
# costs build and run time for little more. ASan stays one variable away.
sanitizer="${FUZZ_SANITIZER:-none}"

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

# cargo-fuzz passes -Z flags: a nightly toolchain if rustup has one, else
# the stable one told to accept them.
toolchain=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    toolchain=(+nightly)
else
    export RUSTC_BOOTSTRAP=1
fi

# Start from the main crate's lock, so the fuzzed dependencies are the shipped ones.
[ -f fuzz/Cargo.lock ] || cp Cargo.lock fuzz/Cargo.lock

build=(--sanitizer "$sanitizer" --debug-assertions)
cargo "${toolchain[@]}" fuzz build "${build[@]}"

if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo "${toolchain[@]}" fuzz list)
fi

mkdir -p fuzz/logs
failed=0
rows=()
for t in "${targets[@]}"; do
    log="fuzz/logs/$t.log"
    mkdir -p "fuzz/corpus/$t"
    echo "== $t: ${seconds}s (log: $log)"
    if cargo "${toolchain[@]}" fuzz run "${build[@]}" "$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -timeout=25 -print_final_stats=1 >"$log" 2>&1; then
        result=ok
    else
        result="failed (exit $?)"
        failed=1
        crash=$(grep -ao 'Test unit written to .*' "$log" | tail -1 || true)
        [ -n "$crash" ] && result="crash: ${crash#Test unit written to }"
    fi
    # libFuzzer's closing stats; the last `#N DONE` line if they are missing.
    execs=$(grep -ao 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
    if [ -z "$execs" ]; then
        execs=$(grep -aoE '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 | grep -oE '[0-9]+' || true)
    fi
    rows+=("$(printf '%-16s %14s  %s' "$t" "${execs:-?}" "$result")")
done

echo
printf '%-16s %14s  %s\n' target executions result
printf '%s\n' "${rows[@]}"
exit "$failed"
