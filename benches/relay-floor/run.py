#!/usr/bin/env python3
"""What the kernel lets any relay in a proxy's place reach.

Builds two network namespaces joined by a veth pair, `rf-cli` (an iperf3
client and a relay, as an application and its pod's proxy share a pod) and
`rf-srv` (an iperf3 server), and runs one iperf3 stream per path in
interleaved rounds:

  direct   client -> server
  copy     client -> relay -> server, the relay read(2)s and write(2)s
  splice   the same, the relay splice(2)s through a pipe
  zerocopy the same as copy, with MSG_ZEROCOPY sends (and how many the
           kernel completed by copying after all)
  sockmap  the same, the kernel moves the bytes (a BPF sk_skb program)
  shortcut the same, the client's sends reach the relay's socket and the
           relay's reach the client's without TCP (BPF sock_ops + sk_msg);
           the relay copies to and from the server

for each congestion control given (every netns of the run uses it). The CPU
per byte is the whole machine's busy time over the run (user, system, irq,
softirq: the sockmap relay's bytes move in softirq and kernel workers, which
no process's own time shows), so run it on an otherwise idle machine.

Usage (as root): benches/relay-floor/run.py [ROUNDS] [SECONDS] [CC...]
Builds relay.c and verdict.bpf.c first (gcc, clang, libbpf-dev).
"""
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = "/tmp/relay-floor"
# `RELAY_PATHS=direct,copy,zerocopy` runs some of them (direct and copy are
# what the others are compared with).
PATHS = os.environ.get("RELAY_PATHS", "direct,copy,splice,zerocopy,sockmap,shortcut").split(",")


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=True, check=True, **kw)


def build():
    os.makedirs(OUT, exist_ok=True)
    for prog in ("verdict", "shortcut"):
        sh(f"clang -O2 -g -target bpf -I/usr/include/{os.uname().machine}-linux-gnu "
           f"-c {HERE}/{prog}.bpf.c -o {OUT}/{prog}.bpf.o")
    sh(f"gcc -O2 -Wall -o {OUT}/relay {HERE}/relay.c -lbpf -lpthread")


def lab(cc):
    sh("ip netns del rf-cli 2>/dev/null; ip netns del rf-srv 2>/dev/null; true")
    allowed = open("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read().split()
    if cc not in allowed:
        sh(f"sysctl -qw net.ipv4.tcp_allowed_congestion_control='{' '.join(allowed + [cc])}'")
    sh("ip netns add rf-cli && ip netns add rf-srv && "
       "ip link add rfc type veth peer name rfs && "
       "ip link set rfc netns rf-cli && ip link set rfs netns rf-srv && "
       "ip -n rf-cli addr add 10.77.0.1/24 dev rfc && ip -n rf-srv addr add 10.77.0.2/24 dev rfs && "
       "ip -n rf-cli link set lo up && ip -n rf-srv link set lo up && "
       "ip -n rf-cli link set rfc up && ip -n rf-srv link set rfs up")
    for ns in ("rf-cli", "rf-srv"):
        sh(f"ip netns exec {ns} sysctl -qw net.ipv4.tcp_congestion_control={cc}")


def busy():
    f = open("/proc/stat").readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, f[:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def one(path, secs):
    sh("ip netns exec rf-srv iperf3 -s -D -1 -p 5201 >/dev/null 2>&1")
    time.sleep(0.3)
    relay = None
    target = "10.77.0.2 -p 5201"
    if path != "direct":
        relay = subprocess.Popen(
            # nsenter, not `ip netns exec`: the shortcut relay attaches to the
            # cgroup v2 root, which `ip netns exec`'s own /sys hides.
            ["nsenter", "--net=/run/netns/rf-cli", f"{OUT}/relay", path, "10.77.0.1:7000",
             "10.77.0.2:5201"],
            stdout=subprocess.PIPE, text=True)
        assert relay.stdout.readline().strip() == "ready"
        target = "10.77.0.1 -p 7000"
    before = busy()
    out = subprocess.run(f"ip netns exec rf-cli iperf3 -J -t {secs} -c {target}",
                         shell=True, capture_output=True, text=True, timeout=secs + 30)
    spent = busy() - before
    if relay:
        relay.terminate()
        said, _ = relay.communicate(timeout=10)
        for line in said.splitlines():
            if line.startswith("zerocopy"):
                print(f"{path}: {line}", flush=True)
    subprocess.run(["pkill", "-x", "iperf3"])
    d = json.loads(out.stdout)
    if "error" in d:
        # A relay that breaks the application's connection is a result too.
        print(f"{path}: iperf3: {d['error']}", flush=True)
        return None
    gbits = d["end"]["sum_received"]["bits_per_second"] / 1e9
    return gbits, spent / (gbits * d["end"]["sum_received"]["seconds"])


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    secs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    ccs = sys.argv[3:] or ["cubic"]
    build()
    for cc in ccs:
        lab(cc)
        got = {p: [] for p in PATHS}
        for r in range(rounds):
            for p in PATHS:
                result = one(p, secs)
                if result is None:
                    continue
                got[p].append(result)
                print(f"{cc} round {r + 1} {p}: {result[0]:.2f} Gbit/s, "
                      f"{result[1]:.3f} cpu-s/Gbit", flush=True)
        med = {p: (statistics.median(g for g, _ in v), statistics.median(c for _, c in v))
               for p, v in got.items() if v}
        print(f"\n{cc}, medians of {rounds} rounds of {secs} s:")
        print("| path | Gbit/s | ÷ direct | ÷ copy | machine cpu-s per Gbit | ÷ copy |")
        print("|---|---|---|---|---|---|")
        for p in PATHS:
            if p not in med:
                print(f"| {p} | failed in every round | | | | |")
                continue
            g, c = med[p]
            print(f"| {p} ({len(got[p])} of {rounds} rounds) | {g:.2f} | {g / med['direct'][0]:.2f}× | {g / med['copy'][0]:.2f}× "
                  f"| {c:.3f} | {c / med['copy'][1]:.2f}× |")
        print()
    sh("ip netns del rf-cli; ip netns del rf-srv")


if __name__ == "__main__":
    main()
