#!/usr/bin/env python3
"""Regenerates link/hot-functions.txt: the functions Ambit's proxies run,
which build.rs hands to the linker so they lie together at the start of the
binary's code.

Why: the kernel maps 64 KiB around every page of code a process faults in,
so code that runs, scattered among code that does not, keeps several times
its size resident. Placed together it keeps about its own size.

How: runs the dataplane bench (root, as `cargo bench --bench dataplane`)
with AMBIT_TRACE_CODE_PAGES set, so each proxy, once ready, maps its code
one page per mapping (fault-around then stops at each page) after giving
start-up's pages back. While the bench runs, the proxies' /proc/<pid>/smaps
is read every half second; the last reading of each says which code pages
ran. Every function on such a page is listed, in address order.

Run from the repository root, then rebuild:
    python3 benches/hot-functions.py
A name the linker does not find (code changed, another toolchain) is
skipped, so a stale list costs memory, never correctness.
"""

import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "ambit")
OUT = os.path.join(ROOT, "link", "hot-functions.txt")
PAGE = 4096


def proxies():
    """Pids of running `ambit proxy` processes of this checkout's binary."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if exe == BINARY and len(cmd) > 1 and cmd[1] == b"proxy":
            yield pid


def run_bench():
    """Runs the bench; returns the last smaps read of every proxy."""
    env = dict(os.environ, AMBIT_TRACE_CODE_PAGES="1", AMBIT_BENCH_ROUNDS="1",
               AMBIT_BENCH_CC=os.environ.get("AMBIT_BENCH_CC", "cubic"))
    bench = subprocess.Popen(["cargo", "bench", "--bench", "dataplane"], cwd=ROOT,
                             env=env, stdout=sys.stderr)
    last = {}
    while bench.poll() is None:
        for pid in proxies():
            try:
                last[pid] = open(f"/proc/{pid}/smaps").read()
            except OSError:
                pass
        time.sleep(0.5)
    if bench.returncode != 0:
        sys.exit(f"bench failed: {bench.returncode}")
    return list(last.values())


def load_segments():
    """(file offset, vaddr, size) of the binary's loadable segments."""
    out = subprocess.run(["readelf", "-lW", BINARY], capture_output=True,
                         text=True, check=True).stdout
    segs = []
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "LOAD":
            segs.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
    return segs


def ran_pages(smaps_list, segs):
    """Virtual addresses (in the binary) of code pages resident in any
    reading: with one mapping per page, resident means it ran."""
    def vaddr(off):
        for o, v, size in segs:
            if o <= off < o + size:
                return v + off - o
        return None

    header = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) \S+ \S+\s+(\S*)")
    pages = set()
    for smaps in smaps_list:
        code = None
        for line in smaps.splitlines():
            m = header.match(line)
            if m:
                start, end = int(m[1], 16), int(m[2], 16)
                is_code = m[3] == "r-xp" and m[5] == BINARY
                code = (start, end, int(m[4], 16)) if is_code else None
            elif code and line.startswith("Rss:") and int(line.split()[1]) > 0:
                start, end, off = code
                for a in range(start, end, PAGE):
                    v = vaddr(off + a - start)
                    if v is not None:
                        pages.add(v & ~(PAGE - 1))
    return pages


def functions_on(pages):
    """Names of the functions that overlap `pages`, in address order."""
    out = subprocess.run(["nm", "-n", "-S", "--defined-only", BINARY],
                         capture_output=True, text=True, check=True).stdout
    names, seen, size = [], set(), 0
    for line in out.splitlines():
        f = line.split()
        if len(f) != 4 or f[2] not in "tTwW":
            continue
        addr, length, name = int(f[0], 16), int(f[1], 16), f[3]
        first, last = addr & ~(PAGE - 1), (addr + max(length, 1) - 1) & ~(PAGE - 1)
        if name not in seen and any(p in pages for p in range(first, last + 1, PAGE)):
            seen.add(name)
            names.append(name)
            size += length
    return names, size


def main():
    readings = run_bench()
    if not readings:
        sys.exit("no proxy was seen")
    pages = ran_pages(readings, load_segments())
    names, size = functions_on(pages)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("\n".join(names) + "\n")
    print(f"{len(readings)} proxies, {len(pages) * PAGE // 1024} kB of code ran; "
          f"{len(names)} functions ({size // 1024} kB) written to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
